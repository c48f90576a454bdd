"""The OpenAI-compatible inference client: send a chat request, classify what comes back.

Every request for an answer from an inference server is made here (the looks beside them,
``/health``, ``/v1/models``, ``/metrics``, are ``orchestrator.inference.probes``). It knows
nothing of the queue. Every failure leaves as one of the errors in ``orchestrator.errors``
with a stable ``error_class`` (the table is in ``orchestrator.inference.failures``); an
answer is checked as ``orchestrator.inference.completions`` says, a stream read as
``orchestrator.inference.streaming`` says.

A request whose pooled keep-alive connection turns out to have been closed by the server
while it sat idle (llama.cpp's server closes after every streamed answer although its
headers say keep-alive) fails before any byte of answer arrives: it is sent again at once
on a new connection, as urllib3 and httpx do, and is no error at all.

Non-streamed requests over plain HTTP (a worker's usual traffic to its own servers) go
by :mod:`orchestrator.inference.http1`, a lean HTTP/1.1 transport that costs a fraction of the
CPU of aiohttp's client path; its failures are classified exactly as aiohttp's are.
Streams, TLS, Basic credentials and the looks beside the requests go by aiohttp.

A hosted provider's ``x-ratelimit-*`` headers (``orchestrator.inference.failures.RateLimits``)
are read from every answer, streamed or not, and from a 429: the server pool's pacers learn
the provider's limits from them (``orchestrator.inference.pool``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import structlog
import yarl

from orchestrator.errors import InferenceError, PermanentError
from orchestrator.inference import http1
from orchestrator.inference.completions import Completion, parse_answer, with_limits
from orchestrator.inference.failures import raise_for_status, too_large, transport_error
from orchestrator.inference.streaming import Streamed, read_stream

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Timeouts and credentials.

    ``request_timeout`` bounds a whole request: it must exceed the longest answer (16k
    tokens at a few tokens/s per request is over an hour), because a client that gives
    up throws away every token generated so far. Streaming requests are also bounded by
    ``stream_idle_timeout`` between ``data:`` events, which catches a stalled server in
    minutes without cutting long answers; SSE comments (``: ping``, which gateways send
    to keep a connection open) are not progress and do not reset it.
    """

    request_timeout: float = 3600.0
    connect_timeout: float = 10.0
    stream: bool = False
    stream_idle_timeout: float = 120.0
    #: Ask streams for usage in every chunk (``continuous_usage_stats``, vLLM's and
    #: SGLang's): a request cut mid-way then says what it had generated.
    stream_usage: bool = False
    api_key: str | None = field(default=None, repr=False)
    health_timeout: float = 5.0
    #: Most bytes of one answer's body: a server gone wrong can send without end, and
    #: every byte is held in memory and then stored. Over it: ``response_too_large``.
    max_response_bytes: int = 64 * 2**20
    #: HTTP Basic credentials by server URL (as the worker names it: without them), sent
    #: with every request to that server, whoever makes it (see ``orchestrator._util.urls``).
    basic_auth: dict[str, aiohttp.BasicAuth] = field(default_factory=dict, repr=False)


def base_url(server: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all name the same server."""
    url = server.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or ``response_too_large`` once it passes ``limit`` bytes."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise too_large(limit, f"{declared:,} bytes declared")
    chunks: list[bytes] = []
    received = 0
    while chunk := await resp.content.read(2**20):
        received += len(chunk)
        if received > limit:
            raise too_large(limit, "the body kept coming")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_prefix(resp: aiohttp.ClientResponse, size: int = http1.ERROR_PREFIX) -> bytes:
    """The start of an error body: enough for its reason, whatever its length."""
    chunks: list[bytes] = []
    received = 0
    while received < size and (chunk := await resp.content.read(size - received)):
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


_redirects_logged: set[tuple[str, str]] = set()


def _log_redirect(server: str, status: int, headers: Any) -> None:
    """A ``/health`` that redirects keeps the server out of rotation: say so, once."""
    location = headers.get("Location") or ""
    if (server, location) not in _redirects_logged:
        _redirects_logged.add((server, location))
        log.error(
            "server_redirects",
            server=server,
            status=status,
            location=location,
            reason="redirects are not followed; give the server's own URL",
        )


def basic_auth_middleware(by_server: dict[str, aiohttp.BasicAuth]) -> Any:
    """A session middleware adding each server's own Basic credentials to the requests
    sent to it (and to no other origin)."""
    prefixes = [
        (str(yarl.URL(base_url(server))).lower() + "/", auth.encode())
        for server, auth in by_server.items()
    ]

    async def add(
        req: aiohttp.ClientRequest, handler: Callable[[aiohttp.ClientRequest], Awaitable[Any]]
    ) -> Any:
        url = str(req.url).lower()
        for prefix, header in prefixes:
            if url.startswith(prefix):
                req.headers["Authorization"] = header
                break
        return await handler(req)

    return add


class _Sent:
    """Filled in by the session's trace hooks: was the request's connection a pooled one?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(_session: Any, ctx: Any, _params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, _Sent):
        ctx.trace_request_ctx.reused = True


def _trace_reuse() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


class InferenceClient:
    """One aiohttp session shared by every request of a worker.

    ``stale_resends`` counts requests sent again because their pooled connection had
    been closed by the server: a figure for benchmarks and tests, not an error.

    A server that closed a pooled connection under a streamed request (llama.cpp closes
    after every streamed answer) gets its streamed requests on new connections for the
    next ``UNPOOLED_SECONDS``, then pooling is tried again: one resend a period instead
    of one every other request.
    """

    UNPOOLED_SECONDS = 60.0

    def __init__(self, config: ClientConfig | None = None):
        self.config = config or ClientConfig()
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._stale_resends = 0
        self._lean: http1.Http1Pool | None = None
        self._targets: dict[str, tuple[str, int, str]] = {}
        self._unpooled: dict[str, float] = {}  # server -> until when its streams go fresh

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _new_session(self, *, fresh: bool) -> aiohttp.ClientSession:
        headers = {"User-Agent": "orchestrator"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, force_close=fresh),
            json_serialize=lambda obj: orjson.dumps(obj).decode(),
            trace_configs=None if fresh else [_trace_reuse()],
            middlewares=(basic_auth_middleware(self.config.basic_auth),)
            if self.config.basic_auth
            else (),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._new_session(fresh=False)
        return self._session

    @property
    def fresh_session(self) -> aiohttp.ClientSession:
        """A session whose every request opens a new connection: for resends."""
        if self._fresh is None or self._fresh.closed:
            self._fresh = self._new_session(fresh=True)
        return self._fresh

    @property
    def stale_resends(self) -> int:
        return self._stale_resends + (self._lean.stale_resends if self._lean else 0)

    async def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
            self._stale_resends += self._lean.stale_resends
            self._lean = None
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def _send(
        self, method: str, url: str, *, stream_of: str | None = None, **kwargs: Any
    ) -> aiohttp.ClientResponse:
        """The response, its headers read. A pooled connection that fails before any byte
        of answer arrived had been closed by the server while idle: the request never
        reached it as a request to answer, so it goes again at once, on a new connection,
        with no attempt charged and no backoff. A new connection that fails is an error.
        ``stream_of`` names the server of a streamed request."""
        if stream_of is not None and self._unpooled.get(stream_of, 0.0) > time.monotonic():
            return await self.fresh_session.request(method, url, **kwargs)
        sent = _Sent()
        try:
            return await self.session.request(method, url, trace_request_ctx=sent, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not sent.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            self._stale_resends += 1
            if stream_of is not None:
                self._unpooled[stream_of] = time.monotonic() + self.UNPOOLED_SECONDS
            log.debug("stale_connection_resend", url=url, error=str(exc) or type(exc).__name__)
        return await self.fresh_session.request(method, url, **kwargs)

    async def health(self, server: str) -> bool:
        """True when the server's ``/health`` answers 200."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            async with await self._send(
                "GET",
                base_url(server) + "/health",
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                await _read_capped(resp, 2**20)
                if 300 <= resp.status < 400:
                    _log_redirect(server, resp.status, resp.headers)
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError, PermanentError):
            return False

    async def chat_choices(
        self,
        server: str,
        body: dict[str, Any],
        progress: Streamed | None = None,
        *,
        endpoint: str = "chat",
    ) -> list[Completion]:
        """POST one chat completion (or raw completion) and return each of its choices, in
        index order (a request with ``n`` has several; a server that ignores ``n`` sends
        fewer). Each choice's usage says the prompt's tokens, and its own completion
        tokens: counted from what the server said of it alone, or its share of the
        request's total, marked ``usage_split`` (``draws.choice_usages``).

        ``progress`` hears the completion tokens a stream's chunks say as they come (in
        every chunk with ``stream_usage``): what a request cut mid-way had generated."""
        raw = endpoint == "completions"
        url = base_url(server) + ("/v1/completions" if raw else "/v1/chat/completions")
        stream = self.config.stream
        body = self._prepared(body)
        started = time.monotonic()
        if not stream and self._lean_to(url):
            return await self._lean_chat(url, server, orjson.dumps(body), started, raw=raw)
        timeout = self._timeout()
        try:
            resp = await self._send(
                "POST",
                url,
                stream_of=base_url(server) if stream else None,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=timeout,
                allow_redirects=False,
            )
            async with resp:
                limit = self.config.max_response_bytes
                if resp.status != 200:
                    raise_for_status(resp.status, await _read_prefix(resp), resp.headers)
                if stream:
                    choices = await read_stream(
                        resp,
                        server,
                        started,
                        progress,
                        idle=self.config.stream_idle_timeout,
                        limit=limit,
                        raw=raw,
                    )
                else:
                    body_bytes = await _read_capped(resp, limit)
                    choices = parse_answer(body_bytes, resp.headers, server, started, raw=raw)
                return with_limits(choices, resp.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = _transport_kind(exc, stream=stream)
            if kind is None:
                raise
            raise self._failure(kind, server, exc) from exc

    async def api_call(
        self,
        method: str,
        server: str,
        path: str,
        *,
        limit: int,
        seconds: float | None = None,
        **kwargs: Any,
    ) -> bytes:
        """A request to a server's API beside its answers (the Batch API's files and
        batches): the body of a 2xx answer, at most ``limit`` bytes, or the error it
        means, classified as an answer's would be (``seconds``: the whole request's bound,
        the client's request timeout when None)."""
        total = seconds if seconds is not None else self.config.request_timeout
        client_timeout = aiohttp.ClientTimeout(total=total, connect=self.config.connect_timeout)
        try:
            resp = await self._send(
                method, base_url(server) + path, timeout=client_timeout, allow_redirects=False,
                **kwargs,
            )  # fmt: skip
            async with resp:
                if not 200 <= resp.status < 300:
                    raise_for_status(resp.status, await _read_prefix(resp), resp.headers)
                return await _read_capped(resp, limit)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = _transport_kind(exc, stream=False)
            if kind is None:
                raise
            raise self._failure(kind, server, exc) from exc

    def _failure(self, kind: str, server: str, exc: BaseException) -> InferenceError:
        """A failure below HTTP, classified (``failures.transport_error``)."""
        return transport_error(
            kind,
            server,
            exc,
            request_timeout=self.config.request_timeout,
            idle_timeout=self.config.stream_idle_timeout,
        )

    def _prepared(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body as sent: streamed or not, with usage asked of a stream."""
        body = dict(body)
        body["stream"] = self.config.stream
        if not self.config.stream:
            body.pop("stream_options", None)
            return body
        body["stream_options"] = {"include_usage": True}
        if self.config.stream_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        return body

    def _timeout(self) -> aiohttp.ClientTimeout:
        """An aiohttp request's timeouts: a stream's idle gap is bounded, not only the
        whole request."""
        if not self.config.stream:
            return aiohttp.ClientTimeout(
                total=self.config.request_timeout, connect=self.config.connect_timeout
            )
        return aiohttp.ClientTimeout(
            total=self.config.request_timeout,
            connect=self.config.connect_timeout,
            sock_read=self.config.stream_idle_timeout,
        )

    def _lean_to(self, url: str) -> bool:
        """Whether a request goes by the lean HTTP/1.1 path (``orchestrator.inference.http1``):
        plain HTTP, and no Basic credentials, which only the aiohttp session adds."""
        return url.startswith("http://") and not self.config.basic_auth

    @property
    def lean(self) -> http1.Http1Pool:
        if self._lean is None:
            headers = {"User-Agent": "orchestrator", "Content-Type": "application/json"}
            if self.config.api_key:
                headers["Authorization"] = f"Bearer {self.config.api_key}"
            self._lean = http1.Http1Pool(headers)
        return self._lean

    def _target(self, url: str) -> tuple[str, int, str]:
        """Host, port and path of a request URL, parsed once per URL."""
        target = self._targets.get(url)
        if target is None:
            parsed = yarl.URL(url)
            target = (parsed.raw_host or "", parsed.port or 80, parsed.raw_path_qs)
            self._targets[url] = target
        return target

    async def _lean_chat(
        self, url: str, server: str, data: bytes, started: float, *, raw: bool
    ) -> list[Completion]:
        """A non-streamed request by the lean path, its failures classified as the aiohttp
        path classifies them."""
        host, port, path = self._target(url)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        try:
            resp = await self.lean.post(
                host,
                port,
                path,
                data,
                connect_timeout=self.config.connect_timeout,
                deadline=deadline,
                limit=self.config.max_response_bytes,
            )
        except http1.TooLarge as exc:
            raise too_large(self.config.max_response_bytes, exc.detail) from exc
        except http1.HttpFailure as exc:
            kind = _LEAN_FAILURES.get(type(exc), "broken")
            raise self._failure(kind, server, exc) from exc
        if resp.status != 200:
            raise_for_status(resp.status, resp.body, resp.headers)
        return with_limits(
            parse_answer(resp.body, resp.headers, server, started, raw=raw), resp.headers
        )


def _transport_kind(exc: BaseException, *, stream: bool) -> str | None:
    """The kind ``transport_error`` words an aiohttp failure as (None: not one of them)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "idle" if stream else "timeout"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return "closed"
    if isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientResponseError):
        return "broken"
    return None


#: The lean transport's failures by the kind ``transport_error`` words them as.
_LEAN_FAILURES: dict[type[http1.HttpFailure], str] = {
    http1.ConnectFailed: "connect",
    http1.ConnectTimedOut: "connect_timeout",
    http1.Disconnected: "closed",
    http1.TimedOut: "timeout",
}
