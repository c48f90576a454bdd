"""A lean HTTP/1.1 client for the worker's chat requests to plain ``http://`` servers.

aiohttp's client path costs more CPU per request than everything else the worker does
for an item (benchmarks/HISTORY.md, figure 1): a request object, a response object, a stream
reader, timers and trace hooks, for a POST whose answer is read whole. Here one
:class:`asyncio.Protocol` per keep-alive connection writes the request in one buffer and
feeds the answer to llhttp (``httptools``, the parser uvicorn uses), which handles
``Content-Length``, chunked bodies and keep-alive rules. It knows nothing of inference:
:class:`orchestrator.inference.client.InferenceClient` chooses it for non-streamed requests over
plain HTTP and turns its exceptions into the classified errors; TLS, streams, Basic
credentials and the looks beside the requests stay on aiohttp.

A pooled connection that is lost before any byte of its answer arrived had been closed
by the server while idle (:class:`Stale`): the caller sends again on a new connection,
which is closed after its answer, as aiohttp's resend does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httptools
from multidict import CIMultiDict

#: How much of an error answer's body is kept: enough for its reason.
ERROR_PREFIX = 2**16


class HttpFailure(Exception):
    """A request that got no usable answer; the subclass says why."""


class ConnectFailed(HttpFailure):
    """No connection: refused, unreachable, a name that does not resolve."""


class ConnectTimedOut(HttpFailure):
    """No connection within the connect timeout."""


class TimedOut(HttpFailure):
    """No whole answer by the request's deadline."""


class Stale(HttpFailure):
    """A pooled connection lost before any byte of answer: closed by the server while idle."""


class Disconnected(HttpFailure):
    """The connection was lost mid-request or mid-answer."""


class BadHttp(HttpFailure):
    """Bytes that are not an HTTP/1.1 answer."""


class TooLarge(HttpFailure):
    """An answer over the caller's limit; ``detail`` says whether declared or received."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclass(slots=True)
class Response:
    """An answer read whole (an error answer's first :data:`ERROR_PREFIX` bytes)."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed as it comes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.reused = False
        self.limit = 0
        self._start()

    def _start(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.received = 0
        self.any_byte = False
        self.headed = False
        self.complete = False
        self.keep_alive = False
        self.cut = False  # an error body cut at its prefix: the connection is not reused

    async def exchange(self, request: bytes, limit: int, deadline: float) -> Response:
        """Send ``request`` and return its answer by ``deadline`` (the loop's clock);
        raises :class:`HttpFailure`. The deadline is one timer of the loop's, not an
        ``asyncio.timeout`` (its context manager costs a few µs more a request)."""
        assert self.transport is not None
        if not self.open:
            # Lost between the connect and now (a reset right after the accept): a write
            # would vanish and the answer never come.
            raise (Stale if self.reused else Disconnected)("the connection was closed")
        self._start()
        self.limit = limit
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        timer = loop.call_at(deadline, self._expired)
        self.transport.write(request)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None
        return Response(self.status, CIMultiDict(self.headers), b"".join(self.chunks))

    @property
    def open(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.cut and self.open

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self.any_byte = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadHttp("the server asked to switch protocols"))
        except httptools.HttpParserError as exc:
            self._fail(BadHttp(f"not an HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is None or self.waiter.done():
            return
        if self.headed and self._until_close():
            self._finish()  # a body delimited by the connection's end, now ended
        elif not self.any_byte and self.reused:
            self._fail(Stale("the pooled connection was closed"))
        else:
            self._fail(Disconnected(str(exc) if exc else "the server closed the connection"))

    # llhttp's callbacks

    def on_message_begin(self) -> None:
        if self.complete or self.cut:
            # A second answer to one request: the line is out of step; it is dropped
            # before any of it is taken for the next request's answer.
            raise BadHttp("an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headed = True
        if self.status != 200:
            return
        declared = self._header("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            self._fail(TooLarge(f"{int(declared):,} bytes declared"))

    def on_body(self, body: bytes) -> None:
        if self.cut or self.waiter is None or self.waiter.done():
            return
        self.received += len(body)
        if self.status != 200 and self.received >= ERROR_PREFIX:
            self.chunks.append(body)
            self.cut = True
            self._finish()
        elif self.received > self.limit:
            self._fail(TooLarge("the body kept coming"))
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp knows it only here
        self._finish()

    # helpers

    def _header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def _until_close(self) -> bool:
        encoding = (self._header("transfer-encoding") or "").lower()
        return self._header("content-length") is None and "chunked" not in encoding

    def _finish(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _expired(self) -> None:
        self._fail(TimedOut("no answer by the deadline"))

    def _fail(self, exc: HttpFailure) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()


def _header_lines(headers: dict[str, str]) -> str:
    """``Name: value`` lines; a line break or NUL inside would write a header of its own
    (a key read from a file with one in it), so it is refused, as aiohttp refuses it."""
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0") or ":" in name:
            raise ValueError(f"the {name!r} header holds a line break or NUL character")
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items())


class Http1Pool:
    """Keep-alive connections by ``(host, port)``, unlimited in number like the worker's
    aiohttp connector; ``stale_resends`` counts requests sent again after a :class:`Stale`.
    """

    def __init__(self, headers: dict[str, str]):
        self._head = _header_lines(headers)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self.stale_resends = 0

    async def post(
        self,
        host: str,
        port: int,
        target: str,
        body: bytes,
        *,
        connect_timeout: float,
        deadline: float,
        limit: int,
    ) -> Response:
        """POST ``body`` to ``target`` (path and query) with the pool's headers, and read
        the answer whole by ``deadline`` (the loop's clock: :class:`TimedOut` after it)."""
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        request = (
            f"POST {target} HTTP/1.1\r\nHost: {authority}\r\n{self._head}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        key = (host, port)
        conn = self._pooled(key)
        if conn is None:
            conn = await self._connect(key, connect_timeout, deadline)
        try:
            return await self._exchange(key, conn, request, limit, deadline, pool=True)
        except Stale:
            self.stale_resends += 1
        conn = await self._connect(key, connect_timeout, deadline)
        return await self._exchange(key, conn, request, limit, deadline, pool=False)

    async def _exchange(
        self,
        key: tuple[str, int],
        conn: _Connection,
        request: bytes,
        limit: int,
        deadline: float,
        *,
        pool: bool,
    ) -> Response:
        try:
            response = await conn.exchange(request, limit, deadline)
        except BaseException:
            conn.close()  # a cancelled or failed request leaves no answer on the line
            raise
        if pool and conn.reusable:
            conn.reused = True
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()
        return response

    def _pooled(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.open:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], seconds: float, deadline: float) -> _Connection:
        """A new connection within ``seconds``, and by the request's ``deadline``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                try:
                    async with asyncio.timeout(seconds):
                        _, conn = await loop.create_connection(_Connection, *key)
                except TimeoutError as exc:
                    raise ConnectTimedOut(f"no connection within {seconds:g}s") from exc
        except TimeoutError as exc:  # the deadline's, which came first
            raise TimedOut("no answer by the deadline") from exc
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        return conn

    def close(self) -> None:
        """Close every idle connection (requests in flight close their own)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
