"""The inference servers a worker sends to: each with its own concurrency cap and health.

A request goes to the least-loaded healthy server, load being its requests in flight over
its cap, so a slow server fills its own slots and the others keep going. A server that
refuses connections, or fails several requests in a row while another one answers, is
taken out of rotation and probed on ``/health`` until it answers again.

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

import asyncio
import contextlib
import dataclasses
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

import orjson
import structlog

from orchestrator._util.urls import mask, split_on_space, take_userinfo, with_userinfo
from orchestrator.errors import ConfigError
from orchestrator.inference.autoconcurrency import Sample
from orchestrator.items import error_classes as ec
from orchestrator.settings import checks
from orchestrator.settings.prices import Prices

if TYPE_CHECKING:
    from orchestrator.inference.autoconcurrency import Controller
    from orchestrator.inference.client import InferenceClient, RateLimits

log = structlog.get_logger("orchestrator.inference.servers")

#: Seconds between two reports of a server that stays unreachable.
REPORT_EVERY = 60.0

#: How long the tuner's look at a server's ``/metrics`` may take. A server busy with our
#: own requests can leave it queued behind them for many seconds (llama.cpp serves one
#: connection per HTTP thread); a look still running holds the server's cap meanwhile.
METRICS_TIMEOUT = 30.0
#: Looks at ``/metrics`` failed in a row, with none ever answered, after which a server
#: is taken to have none and is tuned on the worker's own tokens per second instead.
METRICS_TRIES = 3

#: A server's cap: a number of requests, or ``"auto"`` (adapted to what the server takes).
Cap = int | Literal["auto"]

#: Failures that say something about the server rather than the request: enough of them
#: in a row take a server out of rotation while another one answers.
SERVER_FAULTS = frozenset(
    {ec.DISCONNECT, ec.TIMEOUT, ec.STREAM_IDLE, ec.STREAM_CUT, ec.BAD_RESPONSE, ec.ABORTED}
)


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


def parse_per_minute(name: str, text: str) -> int:
    """A ``rpm``/``tpm`` value: a whole number, at least 1."""
    from orchestrator.settings.checks import RUN, problem

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
    import shlex

    from orchestrator.inference.launch.spec import check_command

    rest = _LAUNCH.sub("", line, count=1).strip()
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} (quote the launch command as one word)") from None
    if not words:
        raise ConfigError(f'{where}: launch = "COMMAND --port {{port}}" expected')
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
        if key not in keys or not sep:
            prices = ", ".join(f"{k}=USD" for k in PRICE_OPTIONS)
            expected = (
                f"concurrency=N, concurrency=auto, rpm=N, tpm=N or a price ({prices})"
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


def _clock(epoch: float | None) -> str | None:
    """An ISO local time for logs ("since when")."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


#: Characters of prompt per block the prefix index remembers (a block is kept whole or
#: not at all, as a server's radix cache keeps pages).
PREFIX_BLOCK = 256
#: Blocks remembered per server, least recently used forgotten first: about 25 MB of
#: prompt text each, more than a server's KV cache holds.
PREFIX_BLOCKS = 100_000
#: Share of a prompt's blocks a server must hold for it to be sent there (SGLang's
#: router's ``cache_threshold``); below it the prompt goes to the least-loaded server.
CACHE_THRESHOLD = 0.5
#: How much busier (in-flight over cap) the server holding the prefix may be than the
#: least-loaded one and still get it: past that, the load is balanced instead (SGLang's
#: ``balance_abs_threshold``, as a share of the cap since caps differ per server).
BALANCE_THRESHOLD = 0.5


def prefix_blocks(text: str) -> list[int]:
    """Chained hashes of ``text``'s whole blocks: block ``i``'s hash stands for the
    prompt up to its end, so two prompts share hashes exactly as long as they share
    a prefix."""
    hashes: list[int] = []
    last = 0
    for start in range(0, len(text) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        last = hash((last, text[start : start + PREFIX_BLOCK]))
        hashes.append(last)
    return hashes


class PrefixIndex:
    """Which prompt prefixes each server has been sent lately: a model of the servers'
    prefix caches, so a prompt goes where its prefix is cached (a conversation's next
    turn, a retry, items sharing a system prompt) and is not computed again."""

    def __init__(self, servers: Iterable[str], limit: int = PREFIX_BLOCKS):
        self.limit = limit
        self.blocks: dict[str, OrderedDict[int, None]] = {s: OrderedDict() for s in servers}

    def matched(self, server: str, hashes: list[int]) -> int:
        """Blocks of the prompt, from its start, that ``server`` holds."""
        held = self.blocks[server]
        count = 0
        for value in hashes:
            if value not in held:
                break
            count += 1
        return count

    def add(self, server: str, hashes: list[int]) -> None:
        held = self.blocks[server]
        for value in hashes:
            held[value] = None
            held.move_to_end(value)
        while len(held) > self.limit:
            held.popitem(last=False)

    def forget(self, server: str) -> None:
        """A server that went down comes back with its cache empty."""
        self.blocks[server].clear()


def _same(url: str) -> str:
    return url.strip().rstrip("/").removesuffix("/v1").lower()


# ------------------------------------------------------------------------ pacing
# A hosted API limits requests and tokens per minute, not a GPU: a request it has no
# budget for comes back as a 429, which the provider counts against the key. Each server
# has a pacer that holds a request before it is sent until both budgets have room.

#: Seconds of budget a cap given as ``--rpm``/``--tpm`` may be spent in at once: small,
#: since the provider's own burst is unknown; its headers, once seen, tell it.
CAP_BURST_SECONDS = 1.0
#: Longest the first request to a server is waited for, alone, before the others go
#: unpaced: its headers say whether the server paces (a hosted API), and a self-hosted
#: server that says nothing loses no more than this at the start of a run.
LEARN_SECONDS = 2.0
#: Share of a provider's bucket (as its headers say) kept back, and one request at least.
HEADROOM = 0.02
#: Backoff after a 429 that says no ``Retry-After``: doubles from the first, up to the last.
LIMITED_BACKOFF = (1.0, 60.0)
#: Seconds between two warnings about a server that still answers only 429.
LIMITED_REPORT_EVERY = 60.0


def request_tokens(body: Mapping[str, object]) -> int:
    """A request's tokens as a provider counts them before it answers: its prompt
    (about four characters a token, as OpenAI's guide says) plus ``max_tokens``."""
    prompt = body.get("messages") or body.get("prompt") or ""
    text = prompt if isinstance(prompt, str) else orjson.dumps(prompt)
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    return len(text) // 4 + 1 + (limit if isinstance(limit, int) else 0)


class _Bucket:
    """One budget (requests or tokens): ``rate`` a second, at most ``size`` at once;
    ``level`` may go below zero, a debt paid off before the next request goes."""

    __slots__ = ("given", "level", "rate", "size", "stamp")

    def __init__(self, per_minute: float | None, clock: float) -> None:
        self.given = bool(per_minute)  # a cap given: the headers' limit does not replace it
        self.rate = per_minute / 60 if per_minute else None
        self.size = max(1.0, self.rate * CAP_BURST_SECONDS) if self.rate else 0.0
        self.level = self.size
        self.stamp = clock

    def refill(self, now: float) -> None:
        if self.rate is not None:
            self.level = min(self.size, self.level + self.rate * (now - self.stamp))
        self.stamp = now

    def wait(self, need: float) -> float:
        """Seconds until ``need`` (no more than the whole bucket) is there."""
        if self.rate is None:
            return 0.0
        short = min(need, self.size) - self.level
        return max(0.0, short / self.rate)

    def learn(
        self, limit: int | None, remaining: int | None, reset: float | None, since: float
    ) -> None:
        """The provider's account: its limit a minute, what is left, and the seconds
        until its bucket is full again; ``since``: what is in flight beside it."""
        if limit and not self.given:
            self.rate = limit / 60
        if self.rate is None or remaining is None:
            return
        full = remaining + self.rate * reset if reset is not None else remaining
        self.size = max(self.size, 1.0, full)
        # A little is kept back: requests reach the provider in another order, and a
        # moment later or earlier, than they were sent.
        reserve = max(1.0, HEADROOM * self.size)
        self.level = min(self.size, remaining - since - reserve)


class Pacer:
    """Holds a server's requests until its request and token budgets have room.

    The budgets are the caps given (``rpm``, ``tpm``), else learned from the server's
    ``x-ratelimit-*`` headers: its first request goes alone, up to ``LEARN_SECONDS``,
    and a server that sends none is not paced. A request is counted with its estimated
    tokens when it is sent, corrected by the usage its answer reports. What a header
    says is left is taken less every other request still in flight, which it may not
    have counted yet. A 429 pauses every request to a paced server until its
    ``Retry-After`` (or a backoff).
    """

    def __init__(self, rpm: int | None = None, tpm: int | None = None) -> None:
        now = time.monotonic()
        self.requests = _Bucket(rpm, now)
        self.tokens = _Bucket(tpm, now)
        self.learning = not (rpm or tpm)
        self.paused_until = 0.0
        self.backoff = LIMITED_BACKOFF[0]
        self.sent = 0  # requests sent so far: the ticket of the next one
        self._flying: dict[int, int] = {}  # ticket -> estimated tokens, until it ends
        self._flying_tokens = 0
        self._applied = -1  # the newest ticket whose headers were applied
        self._lock = asyncio.Lock()
        self._learned = asyncio.Event()
        self._probing = False

    @property
    def unpaced(self) -> bool:
        """No budget given or learned, and nothing left to learn: every request goes at
        once (a self-hosted server), without the lock and the clock reads."""
        return not self.learning and self.requests.rate is None and self.tokens.rate is None

    async def acquire(self, tokens: int) -> int:
        """Wait until a request of ``tokens`` estimated tokens may go; its ticket."""
        if self.unpaced and not self._lock.locked():
            return self._take(tokens)
        async with self._lock:
            while self.learning and self._probing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._learned.wait(), LEARN_SECONDS)
                if not self._learned.is_set():
                    self.learning = False  # it says nothing in time: not paced
            # The budgets refill with time, not on an event: sleep until there is room.
            while (wait := self._wait(tokens)) > 0:  # noqa: ASYNC110
                await asyncio.sleep(wait)
            self._probing = self.learning
            return self._take(tokens)

    def _take(self, tokens: int) -> int:
        """Count a request that goes now against the budgets; its ticket."""
        self.requests.level -= 1
        self.tokens.level -= tokens
        ticket = self.sent
        self.sent += 1
        self._flying[ticket] = tokens
        self._flying_tokens += tokens
        return ticket

    def _wait(self, tokens: int) -> float:
        now = time.monotonic()
        self.requests.refill(now)
        self.tokens.refill(now)
        paused = self.paused_until - now
        return max(paused, self.requests.wait(1), self.tokens.wait(tokens))

    def answered(self, ticket: int, limits: RateLimits | None, used: int | None) -> None:
        """An answer: its headers teach the budgets, its usage corrects the estimate."""
        estimate = self._landed(ticket)
        if used is not None and self.tokens.rate is not None:
            self.tokens.level += estimate - used
        self.backoff = LIMITED_BACKOFF[0]
        self._heard(ticket, limits)

    def failed(self, ticket: int, limits: RateLimits | None) -> None:
        """A request that got no answer (not a 429): nothing was learned of its tokens."""
        self._landed(ticket)
        self._heard(ticket, limits)

    def limited(self, ticket: int, retry_after: float | None, limits: RateLimits | None) -> float:
        """A 429: every request waits until ``retry_after`` or the backoff; the wait.
        Only a paced server (its budget given or learned) is paused so: from another,
        a 429 is a single request's (a proxy's, a fault's), and its item waits alone."""
        self._landed(ticket)
        self._heard(ticket, limits)
        if self.requests.rate is None and self.tokens.rate is None:
            return retry_after or 0.0
        if retry_after is None:
            retry_after = self.backoff
            self.backoff = min(self.backoff * 2, LIMITED_BACKOFF[1])
        self.paused_until = max(self.paused_until, time.monotonic() + retry_after)
        self.requests.level = min(self.requests.level, 0.0)
        return retry_after

    def _landed(self, ticket: int) -> int:
        """The request is no longer in flight: its estimated tokens."""
        estimate = self._flying.pop(ticket, 0)
        self._flying_tokens -= estimate
        return estimate

    def _heard(self, ticket: int, limits: RateLimits | None) -> None:
        """What the server's headers said, when newer than what was applied before."""
        if self.learning:
            self.learning = self._probing = False
            self._learned.set()
        if limits is None or ticket <= self._applied:
            return
        self._applied = ticket
        now = time.monotonic()
        self.requests.refill(now)
        self.tokens.refill(now)
        self.requests.learn(
            limits.limit_requests,
            limits.remaining_requests,
            limits.reset_requests,
            len(self._flying),
        )
        self.tokens.learn(
            limits.limit_tokens,
            limits.remaining_tokens,
            limits.reset_tokens,
            self._flying_tokens,
        )


class PoolSettings(Protocol):
    """What the pool reads of the worker's configuration."""

    @property
    def probe_min(self) -> float: ...
    @property
    def probe_max(self) -> float: ...
    @property
    def failure_limit(self) -> int: ...
    @property
    def rate_limited_warn_after(self) -> float: ...


@dataclass(slots=True)
class ServerState:
    """One server as the worker sees it."""

    url: str
    cap: int
    controller: Controller | None = None  # set when the cap adapts
    healthy: bool = False
    in_flight: int = 0
    failures: int = 0  # times taken out since it last answered: paces the probes
    errors: int = 0  # server-side request failures in a row
    down_reason: str | None = None
    down_since: float | None = None  # wall clock of the failure that took it out
    vetted: bool = False  # its /v1/models looked at, once, before its first request
    probe: asyncio.Task[None] | None = None
    # Answers since the tuner last looked: how many, their tokens and summed latency.
    answers: int = 0
    tokens: int = 0
    latency: float = 0.0
    # The tuner's looks at its /metrics: the one running, seconds since its controller
    # last had a sample, failed looks in a row, whether any ever answered.
    scrape: asyncio.Task[dict[str, float | None]] | None = None
    unsampled: float = 0.0
    metrics_misses: int = 0
    metrics_seen: bool = False
    # A launched server's deaths (orchestrator.inference.launch): a request that ends in another
    # epoch than it began died with the server, and costs its item no attempt.
    epoch: int = 0
    retired: bool = False  # a launched server given up on: never probed again
    pacer: Pacer = dataclasses.field(default_factory=Pacer)
    # 429s since its last answer: since when (wall clock), how many, how many since the
    # last warning, and when the next warning may be said (monotonic; None: none said).
    limited_since: float | None = None
    limited_count: int = 0
    limited_unsaid: int = 0
    limited_report_at: float | None = None

    @property
    def blind(self) -> bool:
        """Never served metrics, and failed every look: tuned without them."""
        return not self.metrics_seen and self.metrics_misses >= METRICS_TRIES

    @property
    def load(self) -> float:
        return self.in_flight / self.cap


class ServerPool:
    """The servers a worker may use: least-loaded healthy one first, the rest probed.

    It keeps each server's accounting (requests in flight, health, failures in a row,
    the answers the tuner looks at): the worker tells it what happened through its
    methods and reads ``states`` only.
    """

    def __init__(
        self,
        caps: Mapping[str, int],
        client: InferenceClient,
        config: PoolSettings,
        *,
        controllers: Mapping[str, Controller] | None = None,
        budgets: Mapping[str, tuple[int | None, int | None]] | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        self.client = client
        self.config = config
        controllers = controllers or {}
        budgets = budgets or {}
        self.states = {
            url: ServerState(
                url,
                cap,
                controller=controllers.get(url),
                pacer=Pacer(*budgets.get(url, (None, None))),
            )
            for url, cap in caps.items()
        }
        self.prefixes = PrefixIndex(self.states)
        self.available = asyncio.Event()
        self._on_change = on_change or (lambda: None)
        #: Looks at a server once, when it first answers, before any request goes to it;
        #: False keeps it out (the worker is stopping).
        self.vet: Callable[[str], Awaitable[bool]] | None = None

    def start(self) -> None:
        for server in self.states:
            self.mark_down(server, "not probed yet", quiet=True)

    def healthy(self) -> list[str]:
        return [s for s, st in self.states.items() if st.healthy]

    def capacity(self) -> int:
        """Requests the healthy servers take at once: what the worker keeps in flight."""
        return sum(st.cap for st in self.states.values() if st.healthy)

    def widest(self) -> int:
        """The most sequences one request may ask of one server (``n`` samples): the
        largest cap of a healthy server. llama.cpp refuses an ``n`` above its slots."""
        return max((st.cap for st in self.states.values() if st.healthy), default=0)

    def pick(
        self, prompt: object = None, previous: str | None = None, width: int = 1
    ) -> str | None:
        """The server for a request: the one holding most of ``prompt``'s prefix when it
        holds at least ``CACHE_THRESHOLD`` of it and is not much busier than the
        least-loaded one (``BALANCE_THRESHOLD``), else the healthy server with the lowest
        in-flight/cap (the first listed on a tie). The prompt is then taken as cached
        on the server picked. ``prompt`` is its text, or the request's messages, made
        text only when there is a choice of server (one server has nothing to choose);
        ``previous``, the server that answered the conversation's turn before, takes it
        while it has a slot free (see :meth:`_holder`); ``width``: the sequences the
        request asks for (``n``), which the server holding the prefix must have room for
        (the samples of a prompt asked side by side go to another server when its holder
        is full, as a busy holder's do)."""
        best: ServerState | None = None
        load = math.inf
        for state in self.states.values():
            if state.healthy and state.load < load:
                best, load = state, state.load
        if best is None or not prompt or len(self.states) < 2:
            return None if best is None else best.url
        text = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        hashes = prefix_blocks(text)
        if hashes:
            best = self._holder(hashes, load, previous, width) or best
            self.prefixes.add(best.url, hashes)
        return best.url

    def _holder(
        self, hashes: list[int], lowest: float, previous: str | None = None, width: int = 1
    ) -> ServerState | None:
        """The healthy server holding most of the prompt, if enough and not too busy.

        ``previous`` answered the conversation's turn before this one, and kept its slot
        for this turn while that answer was written: it holds the whole prompt but the
        new user message, the answer included, which the index (fed the prompts sent)
        does not know of. It takes the turn whenever it has a slot free."""
        if previous is not None:
            state = self.states.get(previous)
            if state is not None and state.healthy and state.in_flight < state.cap:
                return state
        holder: ServerState | None = None
        most = 0
        for state in self.states.values():
            if state.healthy and (n := self.prefixes.matched(state.url, hashes)) > most:
                holder, most = state, n
        if holder is None or most < CACHE_THRESHOLD * len(hashes):
            return None
        if holder.load - lowest > BALANCE_THRESHOLD or holder.in_flight + width > holder.cap:
            return None
        return holder

    def set_cap(self, server: str, cap: int) -> None:
        self.states[server].cap = cap
        self._on_change()

    def mark_down(self, server: str, reason: str, *, quiet: bool = False) -> None:
        state = self.states[server]
        if state.retired or (state.probe is not None and not state.probe.done()):
            return
        state.healthy = False
        self.prefixes.forget(server)
        state.failures += 1
        state.errors = 0
        state.down_reason = reason
        if not quiet:
            log.warning("server_down", server=server, reason=reason)
        if not self.healthy():
            self.available.clear()
        state.probe = asyncio.create_task(self._probe(server), name=f"probe {server}")
        state.probe.add_done_callback(lambda task: self._probe_ended(server, task))
        self._on_change()

    def server_died(self, server: str, reason: str) -> None:
        """A launched server's process died or was found wedged: out of rotation at
        once, and its requests in flight are known to have died with it."""
        self.states[server].epoch += 1
        self.mark_down(server, reason)

    def retire(self, server: str, reason: str) -> None:
        """A launched server given up on: out for good, no longer probed."""
        state = self.states[server]
        state.retired = True
        state.healthy = False
        state.down_reason = reason
        if state.probe is not None:
            state.probe.cancel()
        if not self.healthy():
            self.available.clear()
        self._on_change()

    def all_retired(self) -> bool:
        return all(st.retired for st in self.states.values())

    def _probe_ended(self, server: str, task: asyncio.Task[None]) -> None:
        """A prober that died would leave its server out for good and the worker waiting
        in silence: say why, and probe again (paced as after any failure)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error(
            "probe_crashed", server=server, error=f"{type(exc).__name__}: {exc}", exc_info=exc
        )
        if self.states[server].probe is task:
            self.mark_down(server, f"the health probe failed: {type(exc).__name__}: {exc}")

    async def _probe(self, server: str) -> None:
        """Poll ``/health`` until the server answers. Why it does not is said at once, then
        every ``REPORT_EVERY`` seconds and whenever the reason changes, with since when."""
        from orchestrator.inference import client as inference

        state = self.states[server]
        delay = self.config.probe_min * min(2 ** max(state.failures - 2, 0), 8)
        started = time.monotonic()
        state.down_since = state.down_since or time.time()
        reported: tuple[str, float] | None = None
        initial = state.down_reason == "not probed yet"
        while True:
            await asyncio.sleep(delay)
            result = await inference.probe(
                self.client.session, server, self.client.config.health_timeout
            )
            if result.ok:
                break
            state.down_reason = result.reason
            now = time.monotonic()
            if reported is None or reported[0] != result.reason or now >= reported[1]:
                log.warning(
                    "server_unreachable",
                    server=server,
                    reason=result.reason,
                    since=_clock(state.down_since),
                    waited_s=round(now - started),
                )
                reported = (result.reason, now + REPORT_EVERY)
            delay = min(delay * 2, self.config.probe_max)
        if not state.vetted:
            state.vetted = True
            if result.reason:
                log.info("server_health_note", server=server, note=result.reason)
            if self.vet is not None and not await self.vet(server):
                return  # the worker is stopping: this server is wrong for the run
        state.healthy = True
        state.down_reason = None
        state.down_since = None
        self.available.set()
        if not initial or reported is not None:
            log.info("server_up", server=server, down_for_s=round(time.monotonic() - started, 1))
        if initial:
            state.failures = 0
        self._on_change()

    def unreachable(self) -> list[tuple[str, str, float | None]]:
        """Each server that is down: its URL, why, and since when (epoch seconds)."""
        return [
            (url, st.down_reason or "not reachable", st.down_since)
            for url, st in self.states.items()
            if not st.healthy
        ]

    def request_started(self, server: str, sequences: int = 1) -> None:
        """A request went to ``server``: it counts towards its load until it ends, as
        many slots as it asks sequences of (``n`` samples take ``n`` slots)."""
        self.states[server].in_flight += sequences

    def request_ended(self, server: str, sequences: int = 1) -> None:
        self.states[server].in_flight -= sequences

    def succeeded(self, server: str, tokens: int = 0, latency: float = 0.0) -> None:
        """An answer: the server is well, and the tuner's figures grow."""
        state = self.states[server]
        state.failures = 0
        state.errors = 0
        state.answers += 1
        state.tokens += tokens
        state.latency += latency

    def failed(self, server: str, error_class: str) -> None:
        """A request failed; several server-side failures in a row take the server out
        while another one answers (with no other, pausing would gain nothing)."""
        state = self.states[server]
        if error_class not in SERVER_FAULTS and not error_class.startswith("http_5"):
            return
        state.errors += 1
        others = any(s.healthy for s in self.states.values() if s is not state)
        if state.errors >= self.config.failure_limit and state.healthy and others:
            self.mark_down(server, f"{state.errors} failures in a row ({error_class})")

    async def pace(self, server: str, tokens: int) -> int:
        """Wait until the server's budgets take a request of ``tokens`` estimated tokens;
        its ticket, for :meth:`paced`."""
        return await self.states[server].pacer.acquire(tokens)

    def paced(self, server: str, ticket: int, outcome: object) -> float | None:
        """How a paced request went (a ``Completion`` or the exception): its headers and
        usage teach the server's pacer. For a 429, the seconds the server has answered
        nothing but 429 when that is past ``rate_limited_warn_after``, else None."""
        state = self.states[server]
        limits = getattr(outcome, "rate_limits", None)
        if isinstance(outcome, BaseException):
            if getattr(outcome, "error_class", None) != ec.RATE_LIMITED:
                state.pacer.failed(ticket, limits)
                return None
            wait = state.pacer.limited(ticket, getattr(outcome, "retry_after", None), limits)
            return self._limited(state, wait)
        usage = getattr(outcome, "usage", None) or {}
        used = usage.get("total_tokens")
        if used is None and "completion_tokens" in usage:
            used = (usage.get("prompt_tokens") or 0) + usage["completion_tokens"]
        state.pacer.answered(ticket, limits, used)
        if state.limited_report_at is not None:
            assert state.limited_since is not None
            log.info(
                "server_rate_limit_lifted",
                server=server,
                limited_for_s=round(time.time() - state.limited_since),
                rate_limited=state.limited_count,
            )
        state.limited_since, state.limited_count, state.limited_report_at = None, 0, None
        return None

    def _limited(self, state: ServerState, wait: float) -> float | None:
        """Count a 429; past ``rate_limited_warn_after`` without an answer, say so: one
        warning, then one every ``LIMITED_REPORT_EVERY`` summing up those between."""
        now = time.time()
        state.limited_since = state.limited_since or now
        state.limited_count += 1
        state.limited_unsaid += 1
        elapsed = now - state.limited_since
        if elapsed < self.config.rate_limited_warn_after:
            return None
        tick = time.monotonic()
        if state.limited_report_at is None or tick >= state.limited_report_at:
            log.warning(
                "server_rate_limited",
                server=state.url,
                limited_for_s=round(elapsed),
                since=_clock(state.limited_since),
                rate_limited=state.limited_count,
                since_last_warning=state.limited_unsaid,
                retry_in_s=round(wait, 2),
                hint="every answer is a 429: check the key's quota and --rpm/--tpm",
            )
            state.limited_unsaid = 0
            state.limited_report_at = tick + LIMITED_REPORT_EVERY
        return elapsed

    def tuned(self) -> list[ServerState]:
        """The servers whose cap adapts (``concurrency=auto``)."""
        return [st for st in self.states.values() if st.controller is not None]

    async def tune(self, elapsed: float) -> None:
        """Look at each healthy adapted server (its answers over the last ``elapsed``
        seconds and its ``/metrics``) and set its cap as its controller says.

        A look at ``/metrics`` is waited for up to ``probe_max`` seconds, then left to
        run (up to ``METRICS_TIMEOUT``) while the server's cap holds: a slow or failed
        look is no reason to tune a server blind, which would ramp up a server already
        too busy to answer. Only a server that never answered one is tuned without."""
        tuned = [st for st in self.tuned() if st.healthy]
        for state in tuned:
            state.unsampled += elapsed
            if state.scrape is None:
                state.scrape = asyncio.create_task(
                    self.metrics(state.url), name=f"metrics {state.url}"
                )
                # Read even when the server goes down before the look is used.
                state.scrape.add_done_callback(lambda t: t.cancelled() or t.exception())
        waiting = {st.scrape for st in tuned if st.scrape is not None and not st.blind}
        if waiting:
            await asyncio.wait(waiting, timeout=self.config.probe_max)
        for state in tuned:
            ready, view = self._looked(state)
            if ready:
                self._update(state, view)

    def _looked(self, state: ServerState) -> tuple[bool, dict[str, float | None] | None]:
        """What the last look at the server's ``/metrics`` gave: (False, None) when its
        controller gets no sample this time, else (True, its figures or None)."""
        from orchestrator.inference.client import RequestFailed

        task = state.scrape
        if task is None or not task.done():
            return state.blind, None
        state.scrape = None
        try:
            view = task.result()
        except RequestFailed as exc:
            state.metrics_misses += 1
            if state.metrics_misses == METRICS_TRIES:
                seen = state.metrics_seen
                event = "server_metrics_unreadable" if seen else "server_metrics_unavailable"
                log.info(event, server=state.url, reason=str(exc), looks=METRICS_TRIES)
            return state.blind, None
        if state.metrics_misses >= METRICS_TRIES:
            log.info("server_metrics_available", server=state.url)
        state.metrics_seen = True
        state.metrics_misses = 0
        return True, view

    def _update(self, state: ServerState, view: dict[str, float | None] | None) -> None:
        """Give the server's controller its sample; a change of cap is logged."""
        assert state.controller is not None
        change = state.controller.update(self._sample(state, state.unsampled, view))
        state.unsampled = 0.0
        if change is not None:
            log.info(
                "concurrency_changed",
                server=state.url,
                old=change.old,
                new=change.new,
                reason=change.reason,
            )
            self.set_cap(state.url, change.new)

    @staticmethod
    def _sample(state: ServerState, elapsed: float, view: dict[str, float | None] | None) -> Sample:
        """The server's figures since the last look, which start again from zero."""
        sample = Sample(
            elapsed=elapsed,
            in_flight=state.in_flight,
            tokens_per_s=state.tokens / elapsed if elapsed > 0 else None,
            latency=state.latency / state.answers if state.answers else None,
            **(view or {}),
        )
        state.answers = state.tokens = 0
        state.latency = 0.0
        return sample

    async def metrics(self, server: str) -> dict[str, float | None]:
        """The server's queue, running requests, KV-cache usage and retractions (or
        preemptions) from its ``/metrics``; ``RequestFailed`` when it gives none we know."""
        from orchestrator.inference import client as inference
        from orchestrator.inference import server_metrics

        text = await inference.metrics_text(self.client.session, server, METRICS_TIMEOUT)
        view = server_metrics.tuning_view(text)
        if view is None:
            raise inference.RequestFailed("no SGLang, vLLM or llama.cpp figures in /metrics")
        return view

    async def close(self) -> None:
        running = [task for st in self.states.values() for task in (st.probe, st.scrape)]
        tasks = [task for task in running if task is not None and not task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
