"""Server URLs with credentials in them (``http://user:secret@host:port``).

Such a URL is taken apart where it comes in: the worker, its logs, the database, the
metrics and every view know the server by its URL without the credentials (the display
form), and the client sends them as HTTP Basic auth, kept apart by server. A password in
a URL would otherwise be written wherever the server is named: log lines, each output's
``server``, ``export --provenance``, ``status``, Prometheus labels, a unit file.

Any ``@`` after the scheme ends the userinfo. Parsers disagree on a raw ``/``, ``?``,
``#`` or ``@`` inside it (to urllib, ``http://alice:S3/CRET@host`` is host ``alice``), so
such a URL is refused rather than guessed at, and in every message a URL is shown with
everything up to its last ``@`` masked, whatever it holds.

``--basic-auth-file`` keeps them out of the process arguments as well (anyone on the
machine can read those): a file holding ``USER:PASSWORD``, sent to every server. API keys
and that file are read here too, so that each source of credentials refuses what an HTTP
header cannot carry, naming where it came from.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path

import aiohttp

from orchestrator.errors import ConfigError

#: Characters that end the userinfo for some URL parser: one of them raw in a user name
#: or password makes parsers disagree on where the host starts (``http://u:a/b@h`` is
#: host ``u``, port ``a`` to urllib), and the rest of the password ends up shown.
_NOT_IN_USERINFO = frozenset("/?#@[]")

ENCODE_ADVICE = (
    "the part before its last '@' is taken as USER:PASSWORD, and it holds a character a "
    "URL cannot carry there as it is: percent-encode it in the user name and password "
    "('/' as %2F, '@' as %40, ':' as %3A, '#' as %23, '?' as %3F; python3 -c 'import sys, "
    'urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))\' PASSWORD prints it '
    "so), or give the URL without them and USER:PASSWORD in a file named by --basic-auth-file"
)


def mask(url: str) -> str:
    """The URL fit for a message: everything from the scheme to its last ``@`` (whatever
    may be credentials, however malformed) shown as ``***``."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    if "@" not in rest:
        return url
    return f"{head}{sep}***@{rest.rpartition('@')[2]}"


def split_on_space(text: str, source: str) -> list[str]:
    """The white-space separated pieces of ``text`` (servers, or a URL and its options);
    a piece after the first holding an ``@`` but no scheme is taken as the rest of a URL
    whose credentials held white space, and refused masked: shown piece by piece, the
    first half of the password would be."""
    pieces = text.split()
    if any("@" in piece and "://" not in piece for piece in pieces[1:]):
        raise ConfigError(
            f"{source}: {mask(text)!r}: a piece holding an '@' but no scheme follows white "
            "space, as when a URL's USER:PASSWORD holds white space: percent-encode it there "
            "as %20 (or put USER:PASSWORD in --basic-auth-file), and give every server URL "
            "its http:// or https://"
        )
    return pieces


def take_userinfo(url: str, source: str) -> tuple[str, str | None]:
    """The URL without its userinfo, and the userinfo (None: none).

    Any ``@`` after the scheme is taken as ending the userinfo, even one that would be
    legal in a path or query: a password holding a raw ``/`` or ``@`` cannot be told
    from one, so a URL whose userinfo holds such a character is refused (masked), never
    guessed at.
    """
    text = url.strip()
    head, sep, rest = text.partition("://")
    if not sep or "@" not in rest:
        return text, None
    userinfo, _, after = rest.rpartition("@")
    if any(c in _NOT_IN_USERINFO or c.isspace() or not c.isprintable() for c in userinfo):
        raise ConfigError(f"{source}: {mask(text)!r} is not a server URL: {ENCODE_ADVICE}")
    return f"{head}{sep}{after}", userinfo


def with_userinfo(url: str, userinfo: str | None) -> str:
    """``url`` with ``userinfo`` put back after its scheme (the inverse of take_userinfo)."""
    if userinfo is None:
        return url
    head, sep, rest = url.partition("://")
    return f"{head}{sep}{userinfo}@{rest}"


def split(url: str, source: str = "server URL") -> tuple[str, aiohttp.BasicAuth | None]:
    """The display form and the Basic credentials the URL held (None: none); a URL whose
    credentials cannot be told apart from the rest is refused, naming ``source``."""
    clean, userinfo = take_userinfo(url, source)
    if userinfo is None:
        return clean, None
    user, _, password = userinfo.partition(":")
    try:
        auth = aiohttp.BasicAuth(
            urllib.parse.unquote(user), urllib.parse.unquote(password), encoding="utf-8"
        )
    except ValueError:  # a ':' in the user name: Basic auth cannot send it (RFC 7617)
        raise ConfigError(
            f"{source}: {mask(url.strip())!r}: the user name holds a ':', which HTTP Basic "
            "auth cannot send"
        ) from None
    return clean, auth


BASIC_AUTH_FILE = (
    "give a file holding one line USER:PASSWORD, the servers' HTTP Basic "
    "credentials (an API key goes in --api-key-file instead)"
)
API_KEY_FILE = "give a file holding the servers' API key alone"


def read_secret_file(path: Path, source: str, holds: str) -> str:
    """A credentials file's text without the white space around it (the newline an
    editor or ``echo`` leaves); what is wrong with it named by ``source`` and what the
    file must hold (``holds``)."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{source} {path}: {exc.strerror or exc}: {holds}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source} {path}: not UTF-8 text: {holds}") from None


def api_key(text: str | None, source: str) -> str | None:
    """An API key as given (a file's text, ORCHESTRATOR_API_KEY, ``api_key=``), without
    the white space around it; None when there is none.

    White space or a control character inside is refused here, naming ``source``: sent
    as it is, the HTTP library refuses the header, and every request fails as if no
    server answered.
    """
    key = (text or "").strip()
    if not key:
        return None
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ConfigError(
            f"{source}: the API key holds white space or a control character inside it; "
            "give the key alone, on one line"
        )
    return key


def read_api_key(path: Path, source: str = "--api-key-file") -> str:
    """The API key a file holds; an empty file is refused (no key would be sent)."""
    key = api_key(read_secret_file(path, source, API_KEY_FILE), f"{source} {path}")
    if key is None:
        raise ConfigError(f"{source} {path}: the file is empty: {API_KEY_FILE}")
    return key


def read_basic_auth(path: Path, source: str = "--basic-auth-file") -> aiohttp.BasicAuth:
    """``USER:PASSWORD`` from a file (surrounding white space dropped)."""
    text = read_secret_file(path, source, BASIC_AUTH_FILE)
    user, colon, password = text.partition(":")
    if not colon or not user:
        raise ConfigError(f"{source} {path}: no USER:PASSWORD in it: {BASIC_AUTH_FILE}")
    if any(not c.isprintable() for c in text):
        raise ConfigError(
            f"{source} {path}: a line break or control character inside USER:PASSWORD: "
            f"{BASIC_AUTH_FILE}"
        )
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


def credentials_sent(server: str, api_key: str | None, basic: Mapping[str, object]) -> str:
    """Which credentials go to ``server``: ``basic``, ``api_key`` or ``none``."""
    if server in basic:
        return "basic"
    return "api_key" if api_key else "none"


_REFUSED = {
    "basic": "check the HTTP Basic credentials (the USER:PASSWORD in --basic-auth-file, "
    "ORCHESTRATOR_BASIC_AUTH_FILE or the server URL)",
    "api_key": "check the API key (--api-key-file, or env ORCHESTRATOR_API_KEY)",
    "none": "no credentials were sent: give the server's API key (--api-key-file, or env "
    "ORCHESTRATOR_API_KEY) or its HTTP Basic USER:PASSWORD (--basic-auth-file)",
}


def refused_advice(sent: str, status: int = 401) -> str:
    """What to check when a server answers 401 or 403: the credentials that were sent
    (``credentials_sent``), so that refused Basic credentials get no API-key advice."""
    advice = _REFUSED.get(sent, _REFUSED["api_key"])
    if status == 403 and sent != "none":
        advice += " and what they are allowed to use"
    return advice
