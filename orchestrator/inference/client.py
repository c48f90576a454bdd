"""The OpenAI-compatible inference client: send a chat request, classify what comes back.

Every HTTP request to an inference server is made here: the chat requests, and the
looks beside them (``/health``, ``/v1/models``, ``/metrics``) that the pool's prober,
the run guard, ``doctor``, ``status --server`` and the tuner make. It knows nothing of
the queue. Every failure leaves as one of the errors in
``orchestrator.errors`` with a stable ``error_class``:

    ServerUnavailable  connect       connection refused, DNS failure, connect timeout
                       http_502/503/504   a restarting or overloaded server
    TransientError     timeout       no answer within the request timeout
                       stream_idle   a stream that stopped sending
                       disconnect    connection reset or closed mid-request
                       rate_limited  429 (``retry_after`` from ``retry-after-ms`` or
                                     ``Retry-After``; ``rate_limits`` from its
                                     ``x-ratelimit-*`` headers)
                       http_5xx      other server errors
                       bad_response  unparsable body, wrong content type, no choices
                       stream_cut    a stream that ended without a finish_reason (after
                                     one, no ``[DONE]`` is needed)
                       empty_content a 200 with nothing in it: no content, reasoning or
                                     tool calls
                       aborted       finish_reason "abort" (the server dropped it)
    PermanentError     http_4xx      400/401/403/404/422 and other client errors: the
                                     server's reason is kept
                       redirect      a 3xx: not followed (a POST would lose its body, an
                                     answer from elsewhere be credited to this server);
                                     the reason names the Location
                       response_too_large  a body over ``max_response_bytes``

A request whose pooled keep-alive connection turns out to have been closed by the server
while it sat idle (llama.cpp's server closes after every streamed answer although its
headers say keep-alive) fails before any byte of answer arrives: it is sent again at once
on a new connection, as urllib3 and httpx do, and is no error at all.

Non-streamed requests over plain HTTP (a worker's usual traffic to its own servers) go
by :mod:`orchestrator.inference.http1`, a lean HTTP/1.1 transport that costs a fraction of the
CPU of aiohttp's client path; its failures are classified here exactly as aiohttp's are.
Streams, TLS, Basic credentials and the looks beside the requests go by aiohttp.

A hosted provider's ``x-ratelimit-*`` headers (:class:`RateLimits`) are read from every
answer, streamed or not, and from a 429: the server pool's pacers learn the provider's
limits from them (``orchestrator.inference.pool``).

An answer that is usable but poor (cut by ``max_tokens``, reasoning without an answer) is
not an error: it is returned with its quality flags (``orchestrator.items.quality``), and what to
do with it is the caller's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import email.utils
import math
import re
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import structlog
import yarl

from orchestrator.errors import InferenceError, PermanentError, ServerUnavailable, TransientError
from orchestrator.inference import http1
from orchestrator.items import error_classes as ec
from orchestrator.items.answer import Answer
from orchestrator.items.quality import UNCLOSED_THINK, flags_of, split_think
from orchestrator.items.samples import choice_usages
from orchestrator.items.tokens import BadTokens, Collector, Tokens

log = structlog.get_logger(__name__)

_UNAVAILABLE = {502, 503, 504}
_RETRYABLE_4XX = {408, 409, 425}


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


@dataclass(frozen=True, slots=True)
class RateLimits:
    """What a provider's ``x-ratelimit-*`` headers said (OpenAI's names, which many
    providers copy): per minute limits, what is left of them, and seconds until they are
    whole again. None: that header was absent or unreadable."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


#: One term of a Go-style duration as providers send it: ``6m0s``, ``1.5s``, ``120ms``.
_DURATION_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str | None) -> float | None:
    """Seconds of a reset header: ``1s``, ``6m0s``, ``120ms``, ``1h2m3.5s``, or plain
    seconds (``0.5``); None when absent, negative or unreadable."""
    if text is None:
        return None
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    if not value:
        return None
    total, at = 0.0, 0
    for term in _DURATION_TERM.finditer(value):
        if term.start() != at:
            return None
        total += float(term.group(1)) * _DURATION_UNITS[term.group(2)]
        at = term.end()
    return total if at == len(value) and math.isfinite(total) else None


def _count(text: str | None) -> int | None:
    """A limit's or remainder's whole count; None when absent, negative or unreadable."""
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 else None


def rate_limits(headers: Any) -> RateLimits | None:
    """The ``x-ratelimit-*`` headers of an answer or a 429; None when it sent none."""
    found = RateLimits(
        limit_requests=_count(headers.get("x-ratelimit-limit-requests")),
        remaining_requests=_count(headers.get("x-ratelimit-remaining-requests")),
        reset_requests=parse_duration(headers.get("x-ratelimit-reset-requests")),
        limit_tokens=_count(headers.get("x-ratelimit-limit-tokens")),
        remaining_tokens=_count(headers.get("x-ratelimit-remaining-tokens")),
        reset_tokens=parse_duration(headers.get("x-ratelimit-reset-tokens")),
    )
    return None if found == _NO_LIMITS else found


_NO_LIMITS = RateLimits()


@dataclass(frozen=True, slots=True)
class Completion(Answer):
    """One answer from a server (``orchestrator.items.answer.Answer``'s fields), the token ids
    and logprobs it came with (``orchestrator.items.tokens``; None: the server gave none), and
    the rate limits its headers said (not stored: the pacer's)."""

    tokens: Tokens | None = None
    rate_limits: RateLimits | None = None

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return self.message.get("tool_calls")

    @property
    def unclosed_think(self) -> bool:
        """The answer opened a ``<think>`` block and was cut before closing it."""
        return bool(self.flags & UNCLOSED_THINK)


def base_url(server: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all name the same server."""
    url = server.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def _error_reason(status: int, body: bytes) -> str:
    text = body[:2000].decode("utf-8", "replace").strip()
    try:
        doc = orjson.loads(body)
        if isinstance(doc, dict):
            err = doc.get("error", doc)
            if isinstance(err, dict) and err.get("message"):
                text = str(err["message"])
            elif isinstance(doc.get("message"), str):
                text = doc["message"]
            elif isinstance(doc.get("detail"), str):
                text = doc["detail"]
            elif isinstance(doc.get("detail"), list):
                text = _validation_errors(doc["detail"]) or text
    except orjson.JSONDecodeError:
        pass
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def _validation_errors(detail: list[Any]) -> str:
    """FastAPI's validation errors (a 422's ``detail``), each as ``loc: msg``: without
    the ``input`` each one echoes, which is the request's own body."""
    said = []
    for error in detail[:10]:
        if isinstance(error, dict) and isinstance(error.get("msg"), str):
            loc = error.get("loc")
            where = ".".join(str(part) for part in loc) if isinstance(loc, list) else ""
            said.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(said)


def _retry_after(headers: Any, now: float | None = None) -> float | None:
    """Seconds to wait from a 429's or 503's headers: ``retry-after-ms`` (milliseconds, as
    OpenAI's API sends beside it) if readable, else ``Retry-After`` as delay-seconds or an
    HTTP date (RFC 9110 10.2.3). A negative value, like a date gone by, means now; a
    ``nan`` or unreadable one counts as none.
    The value may be huge (``1e308``, ``inf``, a date in 9999): the longest wait is the
    worker's policy (``orchestrator.worker.config.backoff_delay``), not the server's."""
    with contextlib.suppress(TypeError, ValueError):
        millis = float(headers.get("retry-after-ms"))
        if not math.isnan(millis):
            return max(0.0, millis / 1000)
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return None if math.isnan(seconds) else max(0.0, seconds)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an obsolete date form without a zone: GMT, says the RFC
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _raise_for_status(status: int, body: bytes, headers: Any) -> None:
    if 300 <= status < 400:
        raise _redirected(status, headers)
    reason = _error_reason(status, body)
    if status == 429:
        limited = TransientError(
            reason, error_class=ec.RATE_LIMITED, retry_after=_retry_after(headers)
        )
        limited.rate_limits = rate_limits(headers)
        raise limited
    if status in _UNAVAILABLE:
        raise ServerUnavailable(
            reason, error_class=f"http_{status}", retry_after=_retry_after(headers)
        )
    if status >= 500 or status in _RETRYABLE_4XX:
        raise TransientError(reason, error_class=f"http_{status}")
    raise PermanentError(reason, error_class=f"http_{status}")


def _redirected(status: int, headers: Any) -> PermanentError:
    """Redirects are not followed: a POST turned into a GET by a 301/302 loses its body,
    and an answer from elsewhere would be credited to the server named. A redirect says
    the server URL is wrong."""
    location = headers.get("Location") or "(no Location header)"
    return PermanentError(
        f"HTTP {status} redirect to {location}: redirects are not followed; give the "
        "server's own URL (--server / --servers-file)",
        error_class=ec.REDIRECT,
    )


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or ``response_too_large`` once it passes ``limit`` bytes."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit, f"{declared:,} bytes declared")
    chunks: list[bytes] = []
    received = 0
    while chunk := await resp.content.read(2**20):
        received += len(chunk)
        if received > limit:
            raise _too_large(limit, "the body kept coming")
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


def _too_large(limit: int, detail: str) -> PermanentError:
    return PermanentError(
        f"the answer is over {limit:,} bytes ({detail}); raise --max-response-mb if such "
        "answers are meant",
        error_class=ec.RESPONSE_TOO_LARGE,
    )


def _reasoning_of(obj: dict[str, Any]) -> str | None:
    # SGLang and older vLLM say reasoning_content; newer vLLM says reasoning.
    value = obj.get("reasoning_content")
    if value is None:
        value = obj.get("reasoning")
    return value if isinstance(value, str) else None


def _check_finished(
    content: str | None, reasoning: str | None, tool_calls: Any, finish_reason: str | None
) -> None:
    if finish_reason == "abort":
        raise TransientError("the server aborted the request", error_class=ec.ABORTED)
    if not content and not reasoning and not tool_calls:
        raise TransientError(
            f"the answer has no content (finish_reason={finish_reason!r})",
            error_class=ec.EMPTY_CONTENT,
        )


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

    async def chat(
        self,
        server: str,
        body: dict[str, Any],
        progress: Streamed | None = None,
        *,
        endpoint: str = "chat",
    ) -> Completion:
        """POST one chat completion (``endpoint="completions"``: one raw completion of
        ``body["prompt"]``) and return it, or raise a classified error."""
        return (await self.chat_choices(server, body, progress, endpoint=endpoint))[0]

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
                    _raise_for_status(resp.status, await _read_prefix(resp), resp.headers)
                if stream:
                    choices = await self._read_stream(resp, server, started, progress, raw=raw)
                else:
                    body_bytes = await _read_capped(resp, limit)
                    choices = self._parse(body_bytes, resp.headers, server, started, raw=raw)
                return _with_limits(choices, resp.headers)
        except aiohttp.ClientConnectorError as exc:
            raise _transport_error("connect", server, exc, self.config) from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise _transport_error("connect_timeout", server, exc, self.config) from exc
        except aiohttp.SocketTimeoutError as exc:
            kind = "idle" if stream else "timeout"
            raise _transport_error(kind, server, exc, self.config) from exc
        except TimeoutError as exc:
            raise _transport_error("timeout", server, exc, self.config) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            raise _transport_error("closed", server, exc, self.config) from exc
        except (aiohttp.ClientOSError, aiohttp.ClientResponseError) as exc:
            raise _transport_error("broken", server, exc, self.config) from exc

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
            raise _too_large(self.config.max_response_bytes, exc.detail) from exc
        except http1.HttpFailure as exc:
            kind = _LEAN_FAILURES.get(type(exc), "broken")
            raise _transport_error(kind, server, exc, self.config) from exc
        if resp.status != 200:
            _raise_for_status(resp.status, resp.body, resp.headers)
        return _with_limits(
            self._parse(resp.body, resp.headers, server, started, raw=raw), resp.headers
        )

    def _parse(
        self,
        body: bytes,
        headers: Any,
        server: str,
        started: float,
        *,
        raw: bool = False,
    ) -> list[Completion]:
        latency = time.monotonic() - started
        ctype = headers.get("Content-Type", "")
        if "json" not in ctype:
            raise TransientError(
                f"expected a JSON answer, got content type {ctype!r}", error_class=ec.BAD_RESPONSE
            )
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise TransientError(f"unparsable answer: {exc}", error_class=ec.BAD_RESPONSE) from exc
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if not choices or not all(isinstance(c, dict) for c in choices):
            raise TransientError("the answer has no choices", error_class=ec.BAD_RESPONSE)
        ordered = sorted(choices, key=_index)
        messages = []
        for choice in ordered:
            message = {"content": choice.get("text")} if raw else choice.get("message")
            if not isinstance(message, dict):
                raise TransientError(
                    "the answer's choice has no message", error_class=ec.BAD_RESPONSE
                )
            messages.append(message)
        tokens = [_tokens_of([choice]) for choice in ordered]
        usages = choice_usages(
            with_cached(doc.get("usage"), doc.get("timings")),
            [len(t) if t else None for t in tokens],
            [_size(m.get("content"), _reasoning_of(m), m.get("tool_calls")) for m in messages],
        )
        return [
            _counted(
                usage,
                message.get("content"),
                _reasoning_of(message),
                message.get("tool_calls") or None,
                choice.get("finish_reason"),
                usage=usage,
                latency=latency,
                server=server,
                model=doc.get("model"),
                response_id=doc.get("id"),
                tokens=tokens_,
                raw=raw,
            )
            for choice, message, tokens_, usage in zip(
                ordered, messages, tokens, usages, strict=True
            )
        ]

    async def _data_events(self, resp: aiohttp.ClientResponse, server: str) -> AsyncIterator[bytes]:
        """The payloads of a stream's ``data:`` events, each within ``stream_idle_timeout``
        of the one before: comments (``: ping``) and blank lines are not progress."""
        idle = self.config.stream_idle_timeout
        lines = _sse_lines(resp.content, self.config.max_response_bytes)
        while True:
            quiet = asyncio.timeout(idle)
            try:
                async with quiet:
                    while True:
                        raw_line = await anext(lines, None)
                        if raw_line is None:
                            return
                        line = raw_line.strip()
                        if line.startswith(b"data:"):
                            break
            except TimeoutError:
                if not quiet.expired():
                    raise  # the whole request's bound, not silence
                raise TransientError(
                    f"no data from {server} for {idle:g}s", error_class=ec.STREAM_IDLE
                ) from None
            yield line[5:].strip()

    async def _read_stream(
        self,
        resp: aiohttp.ClientResponse,
        server: str,
        started: float,
        progress: Streamed | None = None,
        *,
        raw: bool = False,
    ) -> list[Completion]:
        """A streamed answer, complete once its ``finish_reason`` has come: what follows
        (the usage chunk, ``[DONE]``) is read when the server sends it, but a stream that
        ends after the finish reason without them, closed, broken or silent, still
        answered in full. Without a finish reason it was cut: ``stream_cut``."""
        ctype = resp.headers.get("Content-Type", "")
        if "event-stream" not in ctype:
            raise TransientError(
                f"expected an event stream, got content type {ctype!r}",
                error_class=ec.BAD_RESPONSE,
            )
        got = _Streamed(raw=raw)
        try:
            async for data in self._data_events(resp, server):
                if data == b"[DONE]":
                    break
                got.add(data)
                if progress is not None and isinstance(got.usage, dict):
                    progress.said(got.usage.get("completion_tokens"))
        except (*_STREAM_BROKEN, TransientError) as exc:
            ended = not isinstance(exc, TransientError) or exc.error_class == ec.STREAM_IDLE
            if not got.finished or not ended:
                raise
            log.debug(
                "stream_ended_after_finish",
                server=server,
                usage=got.usage is not None,
                error=str(exc) or type(exc).__name__,
            )
        if not got.finished:
            raise TransientError(
                "the stream ended before the answer was complete", error_class=ec.STREAM_CUT
            )
        ordered = [c for _, c in sorted(got.choices.items())]
        tokens = [_tokens_of(c.token_parts) for c in ordered]
        usages = choice_usages(
            with_cached(got.usage, got.timings),
            [len(t) if t else c.said for c, t in zip(ordered, tokens, strict=True)],
            [_size(c.content, c.reasoning, list(c.tool_calls.values())) for c in ordered],
        )
        return [
            _counted(
                usage,
                "".join(c.content),
                "".join(c.reasoning) or None,
                [c.tool_calls[i] for i in sorted(c.tool_calls)] or None,
                c.finish_reason,
                usage=usage,
                latency=time.monotonic() - started,
                server=server,
                model=got.model,
                response_id=got.response_id,
                tokens=tokens_,
                raw=raw,
            )
            for c, tokens_, usage in zip(ordered, tokens, usages, strict=True)
        ]


@dataclass(slots=True)
class Streamed:
    """The completion tokens a request's stream has said so far (None: none said)."""

    tokens: int | None = None

    def said(self, tokens: Any) -> None:
        if type(tokens) is int and 0 <= tokens <= _MAX_TOKENS:
            self.tokens = tokens


def _tokens_of(choices: list[dict[str, Any]]) -> Tokens | None:
    """The tokens the choices say (a streamed answer's in order), or ``bad_response``."""
    collector = Collector()
    try:
        for choice in choices:
            collector.add(choice)
        return collector.result()
    except BadTokens as exc:
        raise _bad(f"unreadable logprobs or token ids: {exc}") from exc


#: How a stream can end other than by ``[DONE]`` or a clean close: the connection broken
#: (a chunked body left unterminated, a reset) or silent past the idle timeout.
_STREAM_BROKEN = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.SocketTimeoutError,
)


async def _sse_lines(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The lines of an event stream, each whole however long, until the body has passed
    ``limit`` bytes (``response_too_large``). Split here rather than by aiohttp's
    ``readline``, which refuses a line over 512 KiB with an exception of its own. A last
    line the body ends inside is not given: an event ends with its line."""
    pending = bytearray()
    received = 0
    while chunk := await content.readany():
        received += len(chunk)
        if received > limit:
            raise _too_large(limit, "the stream kept coming")
        scan, start = len(pending), 0
        pending += chunk
        end = pending.find(b"\n", scan)
        while end != -1:
            yield bytes(pending[start:end])
            start = end + 1
            end = pending.find(b"\n", start)
        del pending[:start]


@dataclass(slots=True)
class _StreamedChoice:
    """What a stream's chunks have said so far of one choice."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: Any = None
    #: Its chunks that carry logprobs or token ids, in order.
    token_parts: list[dict[str, Any]] = field(default_factory=list)
    #: Its completion tokens so far, as a chunk of this choice alone said in its usage
    #: (vLLM's ``continuous_usage_stats`` counts each choice apart).
    said: Any = None


@dataclass(slots=True)
class _Streamed:
    """What a stream's chunks have said so far: each choice's part, by its index."""

    choices: dict[int, _StreamedChoice] = field(default_factory=dict)
    usage: Any = None
    timings: Any = None
    model: Any = None
    response_id: Any = None
    #: A raw completion's stream (``text`` in each choice, not a ``delta``).
    raw: bool = False

    def add(self, data: bytes) -> None:
        """One ``data:`` payload: a chunk object, or ``bad_response``."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise TransientError(
                f"unparsable stream chunk: {exc}", error_class=ec.BAD_RESPONSE
            ) from exc
        if not isinstance(chunk, dict):
            raise TransientError("stream chunk is not an object", error_class=ec.BAD_RESPONSE)
        self.model = chunk.get("model") or self.model
        self.response_id = chunk.get("id") or self.response_id
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        alone = isinstance(chunk.get("usage"), dict) and len(chunk.get("choices") or ()) == 1
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                raise TransientError(
                    "a stream choice is not an object", error_class=ec.BAD_RESPONSE
                )
            got = self.choices.setdefault(_index(choice), _StreamedChoice())
            if alone:
                got.said = chunk["usage"].get("completion_tokens")
            if choice.get("logprobs") or _TOKEN_IDS.intersection(choice):
                got.token_parts.append(choice)
            delta = {"content": choice.get("text")} if self.raw else choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                got.content.append(delta["content"])
            piece = _reasoning_of(delta)
            if piece:
                got.reasoning.append(piece)
            for call in delta.get("tool_calls") or []:
                _merge_tool_call(got.tool_calls, call)
            if choice.get("finish_reason"):
                got.finish_reason = choice["finish_reason"]

    @property
    def finished(self) -> bool:
        """Every choice begun has its finish reason."""
        return bool(self.choices) and all(
            c.finish_reason is not None for c in self.choices.values()
        )


def _with_limits(choices: list[Completion], headers: Any) -> list[Completion]:
    """The choices, with the rate limits the answer's headers said (if any)."""
    limits = rate_limits(headers)
    if limits is None:
        return choices
    return [dataclasses.replace(c, rate_limits=limits) for c in choices]


#: The lean transport's failures by the kind ``_transport_error`` words them as.
_LEAN_FAILURES: dict[type[http1.HttpFailure], str] = {
    http1.ConnectFailed: "connect",
    http1.ConnectTimedOut: "connect_timeout",
    http1.Disconnected: "closed",
    http1.TimedOut: "timeout",
}


def _transport_error(
    kind: str, server: str, exc: BaseException, config: ClientConfig
) -> InferenceError:
    """A request's failure below HTTP, from either transport, classified and worded once:
    ``connect``, ``connect_timeout``, ``timeout``, ``idle`` (a stream's gap), ``closed``
    (mid-request) or ``broken`` (anything else on the connection)."""
    if kind == "connect":
        return ServerUnavailable(f"cannot connect to {server}: {exc}", error_class=ec.CONNECT)
    if kind == "connect_timeout":
        return ServerUnavailable(f"connect to {server} timed out", error_class=ec.CONNECT)
    if kind == "timeout":
        return TransientError(
            f"no answer from {server} within {config.request_timeout:g}s",
            error_class=ec.TIMEOUT,
        )
    if kind == "idle":
        return TransientError(
            f"no data from {server} for {config.stream_idle_timeout:g}s",
            error_class=ec.STREAM_IDLE,
        )
    if kind == "closed":
        return TransientError(
            f"{server} closed the connection mid-request: {exc}", error_class=ec.DISCONNECT
        )
    return TransientError(f"{server} connection error: {exc}", error_class=ec.DISCONNECT)


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def _size(content: Any, reasoning: Any, tool_calls: Any) -> int:
    """How much text a choice holds (its parts as received): what a request's completion
    tokens are shared by (``draws.choice_usages``)."""
    size = 0
    for part in (content, reasoning):
        if isinstance(part, str):
            size += len(part)
        elif isinstance(part, list):  # a stream's pieces
            size += sum(len(p) for p in part if isinstance(p, str))
    if tool_calls:
        size += len(orjson.dumps(tool_calls, default=str, option=orjson.OPT_NON_STR_KEYS))
    return size


def _counted(said: Any, *args: Any, **kwargs: Any) -> Completion:
    """:func:`_completion`; an answer it refuses keeps the completion tokens its usage
    said (``generated_tokens``), the work thrown away with it."""
    try:
        return _completion(*args, **kwargs)
    except InferenceError as exc:
        tokens = said.get("completion_tokens") if isinstance(said, dict) else None
        if type(tokens) is int and 0 <= tokens <= _MAX_TOKENS:
            exc.generated_tokens = tokens
        raise


_TOKEN_IDS = frozenset(("token_ids", "response_token_ids"))


def _completion(
    content: Any,
    reasoning: str | None,
    tool_calls: Any,
    finish_reason: Any,
    *,
    usage: Any,
    latency: float,
    server: str,
    model: Any,
    response_id: Any,
    tokens: Tokens | None = None,
    raw: bool = False,
) -> Completion:
    """Check a received answer and build its Completion, the same for both transports.

    Fields of the wrong type are refused as ``bad_response`` (see :func:`_checked_answer`):
    what is stored becomes training data, and a malformed field in it either poisons the
    data or cannot be stored at all. Reasoning is split out of the content only when the
    server sent none apart: a server
    without a reasoning parser leaves the model's think tags in the content. A tool-call
    answer with empty content says ``None``, as a non-streaming server does. A raw
    completion (``raw``) is the text as generated: nothing is split out of it.
    """
    content, tool_calls, finish_reason = _checked_answer(content, tool_calls, finish_reason)
    usage = _checked_usage(usage)
    model, response_id = _identifier(model, "model"), _identifier(response_id, "id")
    unclosed = False
    if reasoning is None and isinstance(content, str) and not raw:
        reasoning, content, unclosed = split_think(content)
    if tool_calls and content == "":
        content = None
    _check_finished(content, reasoning, tool_calls, finish_reason)
    return Completion(
        message=_assistant_message(content, reasoning, tool_calls),
        content=content,
        reasoning=reasoning,
        finish_reason=finish_reason,
        usage=usage,
        latency=latency,
        server=server,
        model=model,
        response_id=response_id,
        flags=flags_of(
            content=content,
            reasoning=reasoning,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            unclosed_think=unclosed,
        ),
        tokens=tokens,
    )


# Most tokens a usage count may say: the columns are 32-bit, and no answer comes near.
_MAX_TOKENS = 2**31 - 1
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def with_cached(usage: Any, timings: Any) -> Any:
    """``usage`` with ``cached_tokens``: the prompt tokens the server took from its
    prefix cache rather than computing them, when it says.

    SGLang and vLLM say it in ``usage.prompt_tokens_details.cached_tokens``; llama.cpp's
    ``llama-server`` in ``timings.cache_n`` (its ``prompt_n`` being those it computed).
    A server that says neither leaves ``usage`` as it was: no count is not zero.
    """
    if not isinstance(usage, dict) or "cached_tokens" in usage:
        return usage
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None and isinstance(timings, dict):
        cached = timings.get("cache_n")
    if cached is None:
        return usage
    return {**usage, "cached_tokens": cached}


def _bad(message: str) -> TransientError:
    return TransientError(message, error_class=ec.BAD_RESPONSE)


def _checked_answer(
    content: Any, tool_calls: Any, finish_reason: Any
) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """The answer's content, tool calls and finish_reason, or ``bad_response``.

    A ``finish_reason`` given as an object (``{"type": "length", ...}``, as SGLang's
    native API does) is read as its type; an answer without one may have been cut short.
    """
    if content is not None and not isinstance(content, str):
        raise _bad(f"the answer's content is a {type(content).__name__}, not a string")
    if isinstance(finish_reason, dict) and isinstance(finish_reason.get("type"), str):
        finish_reason = finish_reason["type"]
    if finish_reason is None:
        raise _bad("the answer has no finish_reason: it may have been cut short")
    if not isinstance(finish_reason, str):
        raise _bad(f"finish_reason is a {type(finish_reason).__name__}, not a string")
    if tool_calls is not None:
        if not isinstance(tool_calls, list) or not all(_is_tool_call(c) for c in tool_calls):
            raise _bad(f"malformed tool_calls: {str(tool_calls)[:200]}")
        tool_calls = tool_calls or None
    return content, tool_calls, finish_reason


def _is_tool_call(call: Any) -> bool:
    """An OpenAI tool call: a function with a name and arguments (JSON text or object)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return False
    fn = call["function"]
    return (
        isinstance(fn.get("name"), str)
        and isinstance(fn.get("arguments", ""), str | dict)
        and isinstance(call.get("id", ""), str)
        and isinstance(call.get("type", ""), str)
    )


def _checked_usage(usage: Any) -> dict[str, Any] | None:
    """``usage`` with whole, plausible token counts, or ``bad_response``."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise _bad(f"usage is a {type(usage).__name__}, not an object")
    for name in _USAGE_COUNTS:
        if name not in usage:
            continue
        value = usage[name]
        if type(value) is not int or not 0 <= value <= _MAX_TOKENS:
            raise _bad(f"usage.{name} is {str(value)[:40]!r}, not a token count")
    return usage


def _identifier(value: Any, name: str) -> str | None:
    """A response's ``model`` or ``id``: text (a number is written as text), or None."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is int or type(value) is float:
        return str(value)
    raise _bad(f"the answer's {name} is a {type(value).__name__}, not a string")


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Add one streamed tool-call delta: the first of an index names the call (id, name),
    the rest carry pieces of its arguments. Keys keep the order of a non-streamed call."""
    index = int(delta.get("index", len(calls)))
    fn = delta.get("function") or {}
    call = calls.get(index)
    if call is None:
        call = calls[index] = {}
        if delta.get("id"):
            call["id"] = delta["id"]
        call["type"] = delta.get("type") or "function"
        call["function"] = {"name": fn["name"]} if fn.get("name") else {}
        call["function"]["arguments"] = ""
    elif delta.get("id"):
        call["id"] = delta["id"]
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def _assistant_message(
    content: str | None, reasoning: str | None, tool_calls: Any
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


# ------------------------------------------------------------------------ other looks
# What a server says beside the requests: whether it is up and why not (the pool's
# prober, ``doctor``), what it serves (the run guard, ``doctor``), its ``/metrics`` (the
# tuner, ``status --server``, the run's samples). Each takes the session to use.


@dataclass(frozen=True, slots=True)
class Probe:
    """One look at ``/health``: up, or the reason it is not."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Models:
    """What ``/v1/models`` said: the model names served, or a status and the reason."""

    status: int | None
    names: tuple[str, ...] = ()
    reason: str = ""
    #: Model name -> its context length, where the server says (vLLM's ``max_model_len``).
    contexts: dict[str, int] = field(default_factory=dict)


def _connect_reason(server: str, exc: aiohttp.ClientConnectorError) -> str:
    """Connection failures in the words an operator acts on."""
    where = f"{exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"DNS lookup of {exc.host!r} failed ({exc.os_error}): check the host name"
    if isinstance(exc, aiohttp.ClientSSLError) or isinstance(exc.os_error, ssl.SSLError):
        hint = (
            "; the port may speak plain HTTP: try http://" if server.startswith("https://") else ""
        )
        return f"TLS handshake with {where} failed ({exc.os_error}){hint}"
    if isinstance(exc.os_error, ConnectionRefusedError):
        return f"connection refused by {where}: nothing listens there (is the server up?)"
    return f"cannot connect to {where}: {exc.os_error or exc}"


async def probe(session: aiohttp.ClientSession, server: str, seconds: float) -> Probe:
    """``/health`` answers 200; else why not. A server without ``/health`` (a proxy, a
    hosted API) counts as up when its ``/v1/models`` answers, and one that refuses the
    credentials (401, 403) as up too: it is there, and the run guard judges the refusal."""
    base = base_url(server)
    limit = aiohttp.ClientTimeout(total=seconds)
    try:
        async with session.get(base + "/health", timeout=limit) as resp:
            await resp.read()
            if resp.status == 200:
                return Probe(True)
            status = resp.status
        if status == 404:
            async with session.get(base + "/v1/models", timeout=limit) as resp:
                await resp.read()
                if resp.status == 200:
                    return Probe(True, "no /health; /v1/models answers")
            return Probe(
                False,
                f"HTTP 404 on {base}/health and {base}/v1/models: the URL's path is wrong; "
                "give the server's base URL (scheme://host:port, and a proxy's path prefix "
                "if it has one)",
            )
        if status == 503:
            return Probe(False, f"{base}/health answers 503: the server is starting or stopping")
        if status in (401, 403):
            # It answers, and refuses the credentials (a proxy's Basic auth guards every
            # path): the look at /v1/models that follows says so and stops the run, where
            # waiting for a "health" that never comes would hang it.
            return Probe(True, f"{base}/health answers HTTP {status}: credentials refused")
        return Probe(False, f"{base}/health answers HTTP {status}")
    except aiohttp.ClientConnectorError as exc:
        return Probe(False, _connect_reason(server, exc))
    except TimeoutError:
        return Probe(False, f"no answer from {base}/health within {seconds:g}s")
    except aiohttp.ServerDisconnectedError:
        return Probe(False, f"{base} closed the connection without answering (TLS expected?)")
    except (aiohttp.ClientError, OSError) as exc:
        return Probe(False, f"{base}/health failed: {type(exc).__name__}: {exc}")


async def models(session: aiohttp.ClientSession, server: str, seconds: float) -> Models:
    """The names ``/v1/models`` lists, or its status and the server's reason."""
    url = base_url(server) + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            body = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Models(None, reason=f"{type(exc).__name__}: {exc}")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if status != 200:
        return Models(status, reason=_models_reason(doc, body))
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return Models(status, reason="no model list in the answer")
    names = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    return Models(status, names, contexts=_contexts(data))


def _contexts(data: list[Any]) -> dict[str, int]:
    """``max_model_len`` of each listed model that has a usable one (vLLM lists it)."""
    found: dict[str, int] = {}
    for entry in data:
        if not isinstance(entry, dict) or "id" not in entry:
            continue
        length = entry.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            found[str(entry["id"])] = length
    return found


async def context_length(session: aiohttp.ClientSession, server: str, seconds: float) -> int | None:
    """The longest request the server takes, in tokens, where it says: ``max_model_len``
    in ``/v1/models`` (vLLM, SGLang), else llama.cpp's ``/props`` (its
    ``n_ctx`` is per slot: ``-c`` over ``-np``); None when neither does."""
    base = base_url(server)
    for path, read in (("/v1/models", _max_model_len), ("/props", _props_n_ctx)):
        try:
            reply = await get(session, base + path, seconds)
            doc = orjson.loads(reply.body) if reply.status == 200 else None
        except (RequestFailed, orjson.JSONDecodeError):
            continue
        found = read(doc)
        if isinstance(found, int) and not isinstance(found, bool) and found > 0:
            return found
    return None


def _max_model_len(doc: Any) -> Any:
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    return first.get("max_model_len") if isinstance(first, dict) else None


def _props_n_ctx(doc: Any) -> Any:
    settings = doc.get("default_generation_settings") if isinstance(doc, dict) else None
    return settings.get("n_ctx") if isinstance(settings, dict) else None


def _models_reason(doc: object, body: bytes) -> str:
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(doc.get("detail"), str):
            return doc["detail"]
    return body[:300].decode("utf-8", "replace").strip()


async def metrics_text(session: aiohttp.ClientSession, server: str, seconds: float) -> str:
    """The server's Prometheus ``/metrics`` text; ``RequestFailed`` says why not."""
    url = base_url(server) + "/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            if resp.status != 200:
                raise RequestFailed(f"{url} answers HTTP {resp.status}")
            return await resp.text()
    except TimeoutError as exc:
        raise RequestFailed(f"no answer from {url} within {seconds:g}s") from exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise RequestFailed(f"{url}: {type(exc).__name__}: {exc}") from exc


def read_metrics(url: str, timeout: float, authorization: str | None = None) -> str:
    """``/metrics`` at ``url`` without an event loop (``status`` stays a quick read);
    raises ``OSError`` (``urllib.error.URLError``) or ``ValueError`` when it cannot."""
    request = urllib.request.Request(url)
    if authorization:
        request.add_header("Authorization", authorization)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Reply:
    """A plain GET's answer, read whole."""

    status: int
    body: bytes
    date: str | None  # the server's Date header


class RequestFailed(Exception):
    """A GET that got no answer; the message says why."""


def plain_session(
    user_agent: str, api_key: str | None, basic_auth: dict[str, aiohttp.BasicAuth]
) -> aiohttp.ClientSession:
    """A session for a few plain GETs, with the worker's credentials."""
    headers = {"User-Agent": user_agent}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    middlewares = (basic_auth_middleware(basic_auth),) if basic_auth else ()
    return aiohttp.ClientSession(headers=headers, middlewares=middlewares)


async def get(session: aiohttp.ClientSession, url: str, seconds: float) -> Reply:
    """GET ``url`` within ``seconds``; ``RequestFailed`` when nothing answered."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
            body = await resp.read()
            return Reply(resp.status, body, resp.headers.get("Date"))
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise RequestFailed(str(exc) or type(exc).__name__) from exc
