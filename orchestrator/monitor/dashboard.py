"""``orchestrator dashboard`` and ``orchestrator report``: the run in a browser.

One self-contained page (``static/dashboard.html``: inline CSS and JS, charts drawn as
SVG, nothing fetched from elsewhere) shows the status document (``docs/STATUS.md``:
progress, rates, ETA, errors, workers, servers), the run's history from the samples
the workers write (``store.samples``) and the completion lengths. The dashboard serves
it with three JSON endpoints the page polls; the report is the same page with the data
embedded, one file to keep or share.

Read-only: an SQLite file is read through the store's sqlite3 adapter (``query_only``,
a WAL reader, so workers writing meanwhile are neither blocked nor disturbed); any other
database through the store's engine, without creating or upgrading anything
(``store.access`` chooses; the queries are the same either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterable
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson
import structlog
from aiohttp import web

from orchestrator._util import atomicfile
from orchestrator.errors import ConfigError, SchemaError
from orchestrator.inference.server_metrics import scrape
from orchestrator.monitor import status as status_view
from orchestrator.settings import checks
from orchestrator.settings.prices import Prices, RunPrices, run_prices, status_cost
from orchestrator.store import access, open_database, samples
from orchestrator.store.migrate import check_sqlite
from orchestrator.store.reader import sqlite_path
from orchestrator.store.stats import WINDOW_SECONDS

if TYPE_CHECKING:
    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

log = structlog.get_logger("orchestrator.dashboard")

T = TypeVar("T")
_EMBED_MARK = '<script id="embedded" type="application/json">null</script>'
# The servers' /metrics are scraped at most this often, however many pages poll.
_SCRAPE_EVERY = 5.0


def page_html() -> str:
    return (files("orchestrator.monitor") / "static" / "dashboard.html").read_text("utf-8")


def embed(data: dict[str, Any]) -> str:
    """The page with ``data`` in it instead of polling: the static report."""
    # "<" escaped, so that no string in the data can close the script element.
    text = orjson.dumps(data).decode().replace("<", "\\u003c")
    html = page_html()
    if _EMBED_MARK not in html:
        raise AssertionError("dashboard.html lost its embedded-data element")
    filled = f'<script id="embedded" type="application/json">{text}</script>'
    return html.replace(_EMBED_MARK, filled)


# ------------------------------------------------------------------ sources


class Source(Protocol):
    """Where the figures come from; every call is one consistent read."""

    async def status(self, window: float) -> dict[str, Any]: ...
    async def history(self, since: float) -> dict[str, Any]: ...
    async def lengths(self) -> dict[str, Any]: ...
    async def close(self) -> None: ...


class SqliteSource:
    """An SQLite file, each request in its own read transaction on a worker thread."""

    def __init__(self, path: str):
        self.path = path

    def check(self) -> None:
        """The checks of every read-only command (``migrate.check_sqlite``), then a read."""
        check_sqlite(self.path, "read")
        reader = access.fast_reader(self.path)
        if reader is None:
            raise SchemaError(f"{self.path}: cannot be read as a current database")
        reader.close()

    async def _read(self, fn: Callable[[Rows], T]) -> T:
        def run() -> T:
            reader = access.fast_reader(self.path, check_same_thread=False)
            if reader is None:
                raise SchemaError(f"{self.path}: cannot be read as a current database")
            with reader:
                return fn(reader)

        return await asyncio.to_thread(run)

    async def status(self, window: float) -> dict[str, Any]:
        return await self._read(lambda r: status_view.read(r, window=window))

    async def history(self, since: float) -> dict[str, Any]:
        return await self._read(lambda r: samples.read_history(r, since=since))

    async def lengths(self) -> dict[str, Any]:
        return await self._read(samples.read_lengths)

    async def close(self) -> None:
        return None


class EngineSource:
    """Any other database (PostgreSQL), through the store's engine; never upgraded."""

    def __init__(self, database: Database):
        self.database = database

    @classmethod
    async def open(cls, db: str) -> EngineSource:
        """Opened as every read-only command opens a database (``mode="read"``)."""
        return cls(await open_database(db, mode="read"))

    async def status(self, window: float) -> dict[str, Any]:
        return await status_view.snapshot(self.database, window=window)

    async def history(self, since: float) -> dict[str, Any]:
        return await samples.history(self.database, since=since)

    async def lengths(self) -> dict[str, Any]:
        return await samples.lengths(self.database)

    async def close(self) -> None:
        await self.database.close()


async def open_source(db: str | None) -> Source:
    """The database named by ``--db``, checked to be readable now, with a clear error."""
    path = sqlite_path(db)
    if path is not None:
        source = SqliteSource(path)
        source.check()
        return source
    return await EngineSource.open(db or "")


# ------------------------------------------------------------------ servers


class ServerViews:
    """Each ``--server``'s own view (``server_metrics.scrape``), refreshed at most every
    few seconds and never on the event loop (the scrape is synchronous)."""

    def __init__(self, servers: tuple[str, ...]):
        self.servers = servers
        self._views: list[dict[str, Any]] = []
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self) -> list[dict[str, Any]]:
        if not self.servers:
            return []
        async with self._lock:
            if time.monotonic() - self._at >= _SCRAPE_EVERY:
                self._views = list(
                    await asyncio.gather(*(asyncio.to_thread(scrape, s) for s in self.servers))
                )
                self._at = time.monotonic()
        return self._views


# ------------------------------------------------------------------ the app

_UNIX_TIME = checks.Number()
_SOURCE = web.AppKey("source", Source)
_SERVERS = web.AppKey("servers", ServerViews)
_WINDOW = web.AppKey("window", float)
_PRICES = web.AppKey("prices", RunPrices)


def make_app(
    source: Source,
    *,
    servers: tuple[str, ...] = (),
    window: float = WINDOW_SECONDS,
    hosts: Iterable[str] = (),
    prices: RunPrices | None = None,
) -> web.Application:
    """``hosts``: names (besides loopback and IP addresses) the Host header may give;
    ``prices``: the run's, for the status's ``cost`` (none: no cost shown)."""
    app = web.Application(middlewares=[_host_check(hosts), _errors])
    app[_SOURCE] = source
    app[_SERVERS] = ServerViews(servers)
    app[_WINDOW] = window
    app[_PRICES] = prices or run_prices(Prices())
    app.router.add_get("/", _page)
    app.router.add_get("/api/status", _status)
    app.router.add_get("/api/samples", _samples)
    app.router.add_get("/api/lengths", _lengths)
    # Browsers ask for it; a 404 would show as an error in the page's console.
    app.router.add_get("/favicon.ico", _no_content)
    return app


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """Is ``Host: header`` one this dashboard answers? An IP address, ``localhost`` (and
    its subdomains) or one of ``names``: a page from another site that points its own name
    at this address (DNS rebinding) sends that name, and is refused."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    else:
        name, colon, port = host.rpartition(":")
        if colon and port.isdigit():
            host = name
    host = host.rstrip(".")
    if host == "localhost" or host.endswith(".localhost") or host in names:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_check(hosts: Iterable[str]) -> Any:
    names = frozenset(h.strip().lower().strip("[]").rstrip(".") for h in hosts if h.strip())

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        header = request.headers.get("Host")
        if header is not None and not host_allowed(header, names):
            log.warning("dashboard_host_refused", host=header[:200], path=request.path)
            return web.Response(
                status=421,
                text=f"this dashboard does not answer to the name {header[:200]!r} "
                "(dashboard --allow-host NAME adds one)\n",
            )
        return await handler(request)

    return check


def _number(request: web.Request, name: str, default: float, rule: checks.Rule) -> float:
    """A query number by the rule the same value has everywhere (``orchestrator.settings.checks``):
    NaN and infinities are no numbers of seconds, nor is a window of -5."""
    raw = request.query.get(name)
    if raw is None:
        return default
    value: object = raw
    with contextlib.suppress(ValueError):
        value = float(raw)
    want = rule.expected(value)
    if want:
        given = raw[:40] if raw.strip() else repr(raw)
        raise web.HTTPBadRequest(text=f"{name} must be {want}, got {given}")
    return value  # type: ignore[return-value]


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """A failed read is a 503 with the reason (the page shows it), not a traceback."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.warning("dashboard_read_failed", path=request.path, error=str(exc))
        return _json({"error": f"{type(exc).__name__}: {exc}"}, status=503)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data),
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _no_content(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def _page(request: web.Request) -> web.Response:
    return web.Response(
        text=page_html(), content_type="text/html", headers={"Cache-Control": "no-store"}
    )


async def _status(request: web.Request) -> web.Response:
    window = _number(request, "window", request.app[_WINDOW], checks.WINDOW)
    snap = priced(await request.app[_SOURCE].status(window), request.app[_PRICES])
    snap["servers"] = await request.app[_SERVERS].get()
    return _json(snap)


def priced(snap: dict[str, Any], prices: RunPrices | None) -> dict[str, Any]:
    """The status document with its ``cost`` at ``prices`` (as ``status`` has it)."""
    cost = status_cost(snap, prices) if prices is not None else None
    if cost is not None:
        snap["cost"] = cost
    return snap


async def _samples(request: web.Request) -> web.Response:
    since = _number(request, "since", 0.0, _UNIX_TIME)
    return _json(await request.app[_SOURCE].history(since))


async def _lengths(request: web.Request) -> web.Response:
    return _json(await request.app[_SOURCE].lengths())


async def serve(
    db: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    servers: tuple[str, ...] = (),
    window: float = WINDOW_SECONDS,
    ready: Callable[[str], None] | None = None,
    allow_hosts: tuple[str, ...] = (),
    prices: RunPrices | None = None,
) -> None:
    """Serve the dashboard until cancelled. It answers to loopback names, IP addresses,
    ``host`` and ``allow_hosts`` (and this machine's names when bound to all addresses)."""
    source = await open_source(db)
    hosts = [host, *allow_hosts]
    if host in ("", "0.0.0.0", "::"):
        hosts += [socket.gethostname(), socket.getfqdn()]
    app = make_app(source, servers=servers, window=window, hosts=hosts, prices=prices)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}/"
        log.info("dashboard_listening", url=url)
        if ready is not None:
            ready(url)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await source.close()


# ------------------------------------------------------------------ the report


async def gather_report(
    db: str | None,
    *,
    servers: tuple[str, ...] = (),
    window: float = WINDOW_SECONDS,
    prices: RunPrices | None = None,
) -> dict[str, Any]:
    """Everything the page shows, read once (its cost at ``prices``, when given)."""
    source = await open_source(db)
    try:
        status = priced(await source.status(window), prices)
        status["servers"] = await ServerViews(servers).get()
        return {
            "status": status,
            "history": await source.history(0.0),
            "lengths": await source.lengths(),
        }
    finally:
        await source.close()


def write_report(out: Path, data: dict[str, Any]) -> None:
    """Written to a temporary file beside ``out`` and renamed: all or nothing. A stream (a
    FIFO, ``>(cmd)``, /dev/stdout: ``atomicfile.open_stream``) is written in place."""
    try:
        stream = atomicfile.open_stream(out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write there ({exc.strerror or exc})") from exc
    if stream is not None:
        with os.fdopen(stream, "w", encoding="utf-8") as fh:
            fh.write(embed(data))
        return
    folder = out.resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"{out}: directory {folder} does not exist")
    if out.is_dir():
        raise ConfigError(f"{out}: is a directory")
    try:
        # The umask's mode for a new file, the old mode for a replaced one; links followed.
        fd, tmp = atomicfile.open_temp(out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write there ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(embed(data))
        atomicfile.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"{out}: cannot write the report ({exc.strerror or exc})") from exc
