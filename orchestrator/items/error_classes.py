"""The error classes an item's failure is stored under: one name per kind of failure.

They are what ``status`` counts and what ``requeue --error-class`` selects, so the names
are stable. ``http_NNN`` stands for the HTTP status a server answered (``http_500``,
``http_400``, ...). docs/OPERATIONS.md lists the same names (a test holds them equal).
"""

from __future__ import annotations

CONNECT = "connect"
HTTP = "http_NNN"
RATE_LIMITED = "rate_limited"
REDIRECT = "redirect"
TIMEOUT = "timeout"
STREAM_IDLE = "stream_idle"
DISCONNECT = "disconnect"
STREAM_CUT = "stream_cut"
BAD_RESPONSE = "bad_response"
EMPTY_CONTENT = "empty_content"
ABORTED = "aborted"
RESPONSE_TOO_LARGE = "response_too_large"
TRUNCATED = "truncated"
CONTEXT_OVERFLOW = "context_overflow"
INVALID_JSON = "invalid_json"
SCHEMA_MISMATCH = "schema_mismatch"
CONVERSATION = "conversation"
UNAVAILABLE = "unavailable"
SHUTDOWN = "shutdown"
LEASE_LOST = "lease_lost"
INTERNAL = "internal"
BATCH_UNANSWERED = "batch_unanswered"

#: Every class, with what it means.
ERROR_CLASSES: dict[str, str] = {
    CONNECT: "connection refused, DNS failure or connect timeout: the server is marked down",
    HTTP: "the server answered HTTP status NNN: 502/503/504 mark it down, other 5xx "
    "and 408/409/425 are retried, other 4xx fail at once",
    RATE_LIMITED: "HTTP 429: retried after its Retry-After (at most 5 minutes) or a backoff, "
    "no attempt spent; the server's requests are paused meanwhile",
    REDIRECT: "a 3xx answer: redirects are not followed, the server URL is wrong",
    TIMEOUT: "no answer within the request timeout",
    STREAM_IDLE: "a stream that sent no data for the stream idle timeout",
    DISCONNECT: "the connection was reset or closed mid-request",
    STREAM_CUT: "a stream that ended without a finish_reason (one that ended after it, "
    "without [DONE], is an answer)",
    BAD_RESPONSE: "an answer that cannot be read or stored: wrong content type, "
    "unparsable, no choices, a field of the wrong type",
    EMPTY_CONTENT: "a 200 with no content, reasoning or tool calls",
    ABORTED: "finish_reason abort: the server dropped the request",
    RESPONSE_TOO_LARGE: "an answer over --max-response-mb",
    TRUNCATED: "an answer cut at max_tokens, with the dataset's on_truncated not keep",
    CONTEXT_OVERFLOW: "the prompt and max_tokens are longer than the server's context: "
    "failed at once (on_overflow fail), or, with fit, a prompt longer than the context alone",
    INVALID_JSON: "structured output that is not JSON, with the dataset's on_invalid not keep",
    SCHEMA_MISMATCH: "structured output that does not match its JSON schema, with the "
    "dataset's on_invalid not keep",
    CONVERSATION: "a multi-turn item whose stored conversation cannot be replayed",
    UNAVAILABLE: "no server reachable, or the server went away mid-request: released",
    SHUTDOWN: "released when the worker stopped before the answer came",
    LEASE_LOST: "taken back from a worker that died or stopped renewing its lease",
    INTERNAL: "an unexpected error in the worker itself, retried",
    BATCH_UNANSWERED: "a provider's batch ended (expired, cancelled, failed, lost, its "
    "output cut short) without answering the request: released, asked again in another "
    "batch",
}


def limited_message(seconds: float, message: str) -> str:
    """A 429's message once its server has answered nothing but 429 for longer than
    ``--rate-limited-warn-after``: ``status`` reads the seconds back (:func:`limited_for`)
    from the newest such attempt of each server."""
    return f"rate limited for {round(seconds)} s: {message}"


def limited_for(message: str | None) -> int | None:
    """The seconds a message of :func:`limited_message` says; None for any other."""
    prefix = "rate limited for "
    if not message or not message.startswith(prefix):
        return None
    number, _, rest = message[len(prefix) :].partition(" s: ")
    return int(number) if number.isdigit() and rest else None


def is_known(name: str) -> bool:
    """Whether ``name`` is a class an item can fail with: one of the list, or ``http_``
    and a three-digit status."""
    if name in ERROR_CLASSES and name != HTTP:
        return True
    status = name.removeprefix("http_")
    return status != name and len(status) == 3 and status.isdigit()


def unknown(given: str) -> str:
    """Why ``given`` selects nothing, with every class it could have been."""
    listed = ", ".join(
        f"{HTTP} (http_500, http_400, ...)" if name == HTTP else name for name in ERROR_CLASSES
    )
    return f"unknown error class {given!r}: the classes are {listed}"
