"""How a request to an inference server fails: each failure as one error class.

The client (``orchestrator.inference.client``) sends; this says what went wrong, in the
words an operator acts on, as one of the errors in ``orchestrator.errors`` with a stable
``error_class``. Kept apart from the sending so that both transports (aiohttp and the lean
``http1``) classify alike, and the rate-limit headers are read once:

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

The answer-level classes (``bad_response``, ``stream_cut``, ``empty_content``,
``aborted``) are raised where answers are read (``orchestrator.inference.completions``,
``orchestrator.inference.streaming``). A hosted provider's ``x-ratelimit-*`` headers
(:class:`RateLimits`) are read from every answer and from a 429: the server pool's
pacers learn the provider's limits from them (``orchestrator.inference.pool``).
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson

from orchestrator.errors import InferenceError, PermanentError, ServerUnavailable, TransientError
from orchestrator.items import error_classes as ec

_UNAVAILABLE = {502, 503, 504}
_RETRYABLE_4XX = {408, 409, 425}


@dataclass(frozen=True, slots=True)
class Allowance:
    """What a provider said of one of its budgets: the limit a minute, what is left of
    it, and seconds until it is whole again. None: that header was absent or unreadable."""

    limit: int | None = None
    remaining: int | None = None
    reset: float | None = None


@dataclass(frozen=True, slots=True)
class RateLimits:
    """What a provider's ``x-ratelimit-*`` headers said (OpenAI's names, which many
    providers copy), of its request budget and of its token budget."""

    requests: Allowance = Allowance()
    tokens: Allowance = Allowance()


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
    found = RateLimits(_allowance(headers, "requests"), _allowance(headers, "tokens"))
    return None if found == _NO_LIMITS else found


def _allowance(headers: Any, kind: str) -> Allowance:
    return Allowance(
        limit=_count(headers.get(f"x-ratelimit-limit-{kind}")),
        remaining=_count(headers.get(f"x-ratelimit-remaining-{kind}")),
        reset=parse_duration(headers.get(f"x-ratelimit-reset-{kind}")),
    )


_NO_LIMITS = RateLimits()


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


def raise_for_status(status: int, body: bytes, headers: Any) -> None:
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


def too_large(limit: int, detail: str) -> PermanentError:
    return PermanentError(
        f"the answer is over {limit:,} bytes ({detail}); raise --max-response-mb if such "
        "answers are meant",
        error_class=ec.RESPONSE_TOO_LARGE,
    )


def transport_error(
    kind: str, server: str, exc: BaseException, *, request_timeout: float, idle_timeout: float
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
            f"no answer from {server} within {request_timeout:g}s",
            error_class=ec.TIMEOUT,
        )
    if kind == "idle":
        return TransientError(
            f"no data from {server} for {idle_timeout:g}s",
            error_class=ec.STREAM_IDLE,
        )
    if kind == "closed":
        return TransientError(
            f"{server} closed the connection mid-request: {exc}", error_class=ec.DISCONNECT
        )
    return TransientError(f"{server} connection error: {exc}", error_class=ec.DISCONNECT)


class RequestFailed(Exception):
    """A GET that got no answer; the message says why."""
