"""The servers a run sends to, as given: ``--server`` URLs and the servers file, parsed
and checked once.

Servers come from ``--server`` (repeatable) and from a servers file, one per line::

    # comments and blank lines are ignored
    http://gpu-1:30000
    http://gpu-2:30000  concurrency=128   # this one takes more
    http://gpu-3:30000  concurrency=auto  # this one adapts (inference.autoconcurrency)
    https://api.example.com  rpm=500 tpm=200000  # a hosted API's limits a minute

A server without ``concurrency=`` gets the worker's ``--concurrency``, one without
``rpm=``/``tpm=`` the worker's ``--rpm``/``--tpm`` (and, without those, the limits its
``x-ratelimit-*`` headers say: see :class:`Pacer`). A ``launch`` line is a server the
run starts itself (orchestrator.inference.launch), on a port it picks::

    launch = "llama-server -m /models/m.gguf --port {port} --metrics"  concurrency=8
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import structlog

from orchestrator._util.urls import mask, split_on_space, take_userinfo, with_userinfo
from orchestrator.errors import ConfigError
from orchestrator.settings import checks
from orchestrator.settings.checks import problem
from orchestrator.settings.prices import Prices
from orchestrator.settings.run import RUN

if TYPE_CHECKING:
    pass

log = structlog.get_logger("orchestrator.inference.servers_file")


#: The placeholder a launch command must hold: the port picked for the server.
PORT = "{port}"

#: A server's cap: a number of requests, or ``"auto"`` (adapted to what the server takes).
Cap = int | Literal["auto"]


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One server, its cap (None: the worker's ``--concurrency``) and its requests and
    tokens a minute (None: the worker's ``--rpm``/``--tpm``)."""

    url: str
    concurrency: Cap | None = None
    rpm: int | None = None
    tpm: int | None = None
    #: Its own prices (``gpu_hour_cost=``, ``price_input=``, ``price_output=``), for the
    #: run's cost (``orchestrator.settings.prices``); none given: the options' prices.
    prices: Prices = field(default_factory=lambda: Prices())
    #: Whether its requests go through its Batch API (``batch_api=yes|no``); None: as
    #: the run's ``--batch-api`` says.
    batch_api: bool | None = None


def parse_per_minute(name: str, text: str) -> int:
    """A ``rpm``/``tpm`` value: a whole number, at least 1."""
    try:
        value: object = int(text.strip())
    except ValueError:
        value = text
    found = problem(name, value, RUN[name])
    if found:
        raise ValueError(found)
    assert isinstance(value, int)
    return value


def parse_cap(text: str) -> Cap:
    """``auto`` or a whole number of requests, at least 1."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"concurrency must be a whole number or 'auto', got {text!r}") from None
    if number < 1:
        raise ValueError(f"concurrency must be at least 1, got {number}")
    return number


#: A comment starts with ``#`` at the start of a line or after white space: a ``#`` inside
#: a URL (a password's, say) is the URL's, refused with it rather than cut off and shown.
_COMMENT = re.compile(r"(?:^|(?<=\s))#")


@dataclass(frozen=True, slots=True)
class LaunchLine:
    """A servers file's ``launch = "CMD"`` line: a command with ``{port}``, its cap, and
    the port it must have (``port=N``; by default a free one is picked)."""

    command: str
    concurrency: Cap | None = None
    port: int | None = None


def parse_servers_file(path: Path) -> list[ServerSpec]:
    """The servers a servers file lists (its ``launch`` lines aside)."""
    return read_servers_file(path)[0]


def read_servers_file(path: Path) -> tuple[list[ServerSpec], list[LaunchLine]]:
    """Read a servers file; a bad line stops it with ``FILE:LINE: what is wrong``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    specs: list[ServerSpec] = []
    launches: list[LaunchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _COMMENT.split(raw, 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        if _LAUNCH.match(line):
            launches.append(_launch_line(line, where))
            continue
        raw_url, *options = split_on_space(line, where)
        url, note = check_server_url(raw_url, where)
        if note:
            log.info("server_url_corrected", source=where, note=note)
        given = _server_options(options, where)
        key = _same(url)
        if key in seen:
            raise ConfigError(f"{where}: {mask(url)} is already listed on line {seen[key]}")
        seen[key] = number
        specs.append(ServerSpec(url, **given))
    if not specs and not launches:
        raise ConfigError(f"{path}: no server listed")
    return specs, launches


_LAUNCH = re.compile(r"launch\s*=")


def _options_cap(options: list[str], where: str) -> Cap | None:
    """A launch line's ``concurrency=N|auto``, read by the servers lines' own rule
    (:func:`_server_options`); the other options of a URL line are refused there."""
    given = _server_options(options, where, keys=("concurrency",))
    return given.get("concurrency")


def _launch_line(line: str, where: str) -> LaunchLine:
    """``launch = "CMD --port {port}" [concurrency=N] [port=N]``: the command quoted as
    one word."""

    rest = _LAUNCH.sub("", line, count=1).strip()
    hint = ' (launch = "COMMAND --port {port}", the command quoted as one word)'
    words = _shell_words(rest, where, "the launch line", hint)
    options, port = [], None
    for option in words[1:]:
        key, _, value = option.partition("=")
        if key != "port":
            options.append(option)
        elif not value.isdigit() or not 0 < int(value) < 65536:
            raise ConfigError(
                f"{where}: port must be a whole number from 1 to 65535, not {value!r}"
            )
        else:
            port = int(value)
    return LaunchLine(check_command(words[0], where), _options_cap(options, where), port)


#: A URL line's options, besides its prices.
_URL_KEYS = ("concurrency", "rpm", "tpm")


def _server_options(
    options: list[str], where: str, keys: tuple[str, ...] = _URL_KEYS
) -> dict[str, Any]:
    """A servers file line's ``concurrency=``, ``rpm=``, ``tpm=`` and prices, as
    :class:`ServerSpec`'s fields; ``keys`` narrows them (a launch line: concurrency,
    beside its ``port=``)."""
    given: dict[str, Any] = {}
    priced: dict[str, float] = {}
    url_line = keys == _URL_KEYS
    for option in options:
        key, sep, value = option.partition("=")
        if url_line and key in PRICE_OPTIONS and sep:
            priced[key] = _price(value, key, where)
            continue
        if url_line and key == "batch_api" and sep:
            given[key] = _yes_no(value, key, where)
            continue
        if key not in keys or not sep:
            prices = ", ".join(f"{k}=USD" for k in PRICE_OPTIONS)
            expected = (
                f"concurrency=N, concurrency=auto, rpm=N, tpm=N, batch_api=yes|no or a price "
                f"({prices})"
                if url_line
                else "concurrency=N or concurrency=auto (or port=N on a launch line)"
            )
            raise ConfigError(f"{where}: unknown option {mask(option)!r}; expected {expected}")
        try:
            given[key] = parse_cap(value) if key == "concurrency" else parse_per_minute(key, value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if priced:
        given["prices"] = Prices(**priced)
    return given


#: A server's own prices in a servers file: ``orchestrator.settings.prices.Prices``' fields.
PRICE_OPTIONS = tuple(checks.PRICES)


def _yes_no(text: str, key: str, where: str) -> bool:
    said = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}
    if text.lower() not in said:
        raise ConfigError(f"{where}: {key}={mask(text)!r}: expected yes or no")
    return said[text.lower()]


def _price(text: str, key: str, where: str) -> float:
    """A price option's value, by the rule every price follows (``checks.PRICE``)."""
    try:
        value = float(text)
    except ValueError:
        value = text  # type: ignore[assignment]  # refused below, in the rule's words
    found = checks.problem(key, value, checks.PRICE)
    if found:
        raise ConfigError(f"{where}: {found}")
    return value


#: Endpoint paths pasted after a base URL: the client adds them itself.
_ENDPOINTS = ("/chat/completions", "/completions", "/models", "/health", "/generate", "/metrics")


def check_server_url(url: str, source: str) -> tuple[str, str | None]:
    """A server URL as the worker uses it (``scheme://host:port[/prefix]``), and a note
    when it was corrected; a URL that can never work is refused naming ``source``.

    The one check for ``--server``, ``ORCHESTRATOR_SERVERS``, a servers file and the
    Python API's ``servers=``, so each refuses the same URLs with the same words; any
    credentials in it are kept (the client sends them) but never shown: whatever may be
    credentials, up to the last ``@``, is masked in every message.
    """
    given = url.strip()
    text = given if "://" in given else "http://" + given
    problem = f"{source}: {mask(given)!r} is not a server URL"
    bare, userinfo = take_userinfo(text, source)
    try:
        parts = urlsplit(bare)
        port = parts.port
    except ValueError as exc:
        why = "the port must be a whole number from 1 to 65535" if "ort" in str(exc) else exc
        raise ConfigError(f"{problem}: {why} (expected http://HOST:PORT)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ConfigError(f"{problem}: the scheme must be http:// or https://, not {scheme}://")
    if not parts.hostname:
        raise ConfigError(f"{problem}: it names no host (expected http://HOST:PORT)")
    if port == 0:
        raise ConfigError(f"{problem}: port 0 is not a port a server listens on")
    if parts.query or parts.fragment:
        raise ConfigError(f"{problem}: a server URL has no ?query or #fragment")
    path = parts.path.rstrip("/")
    prefix = path.removesuffix("/v1")
    fixed = with_userinfo(urlunsplit((scheme, parts.netloc, prefix, "", "")), userinfo)
    for endpoint in _ENDPOINTS:
        if path.endswith(endpoint):
            trimmed = path[: -len(endpoint)].removesuffix("/v1")
            base = urlunsplit((scheme, parts.netloc, trimmed, "", ""))
            raise ConfigError(
                f"{problem}: give the server's base URL, without the endpoint path "
                f"{endpoint!r} (the client adds it): {base}"
            )
    if fixed == given:
        return fixed, None
    shown = mask(fixed)
    note = f"{mask(given)} taken as {shown} (the client adds /v1 and the endpoints)"
    return fixed, note


def merge_servers(urls: Iterable[str], specs: Iterable[ServerSpec]) -> list[ServerSpec]:
    """``--server`` URLs and a file's servers, each once (the file's cap wins)."""
    merged: dict[str, ServerSpec] = {}
    for url in urls:
        merged.setdefault(_same(url), ServerSpec(url))
    for spec in specs:
        merged[_same(spec.url)] = spec
    return list(merged.values())


def _same(url: str) -> str:
    return url.strip().rstrip("/").removesuffix("/v1").lower()


def _shell_words(text: str, where: str, what: str, hint: str = "") -> list[str]:
    """``text`` split as a shell would split it, or a ``ConfigError`` naming ``where``: a
    command a shell cannot split, or an empty one, cannot be started."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot split {what} {text!r}: {exc}{hint}") from None
    if not words:
        raise ConfigError(f"{where}: {what} is empty{hint}")
    return words


def check_command(command: str, source: str) -> str:
    """A launch command as given, refused naming ``source`` when it cannot work."""
    text = command.strip()
    _shell_words(text, source, "the launch command")
    if PORT not in text:
        raise ConfigError(
            f"{source}: the launch command {text!r} has no {PORT}: the server must listen on "
            "the port the worker picks (e.g. --port {port})"
        )
    return text
