"""Server URLs with credentials in them (``http://user:secret@host:port``).

Such a URL is taken apart where it comes in: the worker, its logs, the database, the
metrics and every view know the server by its URL without the credentials (the display
form), and the client sends them as HTTP Basic auth, kept apart by server. A password in
a URL would otherwise be written wherever the server is named: log lines, each output's
``server``, ``export --provenance``, ``status``, Prometheus labels, a unit file.

``--basic-auth-file`` keeps them out of the process arguments as well (anyone on the
machine can read those): a file holding ``USER:PASSWORD``, sent to every server.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from pathlib import Path

import aiohttp

from orchestrator.errors import ConfigError


def display(url: str) -> str:
    """The URL without its userinfo: the form to show, log and store."""
    return split(url)[0]


def split(url: str) -> tuple[str, aiohttp.BasicAuth | None]:
    """The display form and the Basic credentials the URL held (None: none)."""
    text = url.strip()
    parts = urllib.parse.urlsplit(text)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return text, None
    clean = urllib.parse.urlunsplit(parts._replace(netloc=hostport))
    user, _, password = userinfo.partition(":")
    auth = aiohttp.BasicAuth(
        urllib.parse.unquote(user), urllib.parse.unquote(password), encoding="utf-8"
    )
    return clean, auth


def read_basic_auth(path: Path) -> aiohttp.BasicAuth:
    """``USER:PASSWORD`` from a file (surrounding white space dropped)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    user, colon, password = text.partition(":")
    if not colon or not user or "\n" in text:
        raise ConfigError(f"{path}: expected one line USER:PASSWORD")
    return aiohttp.BasicAuth(user, password, encoding="utf-8")


def server_credentials(
    urls: Iterable[str], *, api_key: str | None, shared: aiohttp.BasicAuth | None
) -> tuple[list[str], dict[str, aiohttp.BasicAuth]]:
    """The servers' display URLs and each one's Basic credentials (its URL's, else the
    shared file's).

    An API key is sent as ``Authorization: Bearer``, Basic credentials as ``Authorization:
    Basic``: a request carries one, so both given is refused here rather than found out by
    every request (aiohttp refuses such a request before sending it).
    """
    clean: list[str] = []
    auth: dict[str, aiohttp.BasicAuth] = {}
    for url in urls:
        shown, own = split(url)
        clean.append(shown)
        if own is not None or shared is not None:
            auth[shown] = own or shared  # type: ignore[assignment]
    if api_key and auth:
        named = ", ".join(sorted(auth))
        raise ConfigError(
            f"an API key (ORCHESTRATOR_API_KEY / --api-key-file) and HTTP Basic credentials "
            f"(in the URL of {named}, or --basic-auth-file) both set the Authorization "
            "header: give one of them"
        )
    return clean, auth
