"""What should become of an item after one request: the answer stored, the item retried,
released or failed. Pure: no I/O, only the lease, the error and the worker's policy."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import structlog

from orchestrator.errors import InferenceError, PermanentError, TransientError
from orchestrator.inference.completions import Completion
from orchestrator.items import error_classes as ec
from orchestrator.items import structured
from orchestrator.items.answer import ANSWER_FIELDS
from orchestrator.items.quality import INVALID_JSON, MAX_TOKENS_REDUCED, TOOL_MISMATCH
from orchestrator.store import Failure, Lease, Output
from orchestrator.store import waste as wasted
from orchestrator.store.datasets import DatasetInfo
from orchestrator.store.spend import bill_of
from orchestrator.store.waste import Waste
from orchestrator.worker import overflow
from orchestrator.worker.config import WorkerConfig, backoff_delay
from orchestrator.worker.outcomes import Advance, Done, Failed, Outcome, Release, Retry

log = structlog.get_logger("orchestrator.worker")

#: Failures that may mean the server itself died mid-request; ``/health`` tells.
MAYBE_DOWN = frozenset({ec.DISCONNECT, ec.TIMEOUT, ec.STREAM_IDLE})


def where(lease: Lease) -> str:
    """Names the turn in a multi-turn item's error (requeue resumes it there)."""
    return f"turn {lease.turn + 1} of {lease.turns}: " if lease.turns > 1 else ""


def retry_or_fail(
    lease: Lease,
    exc: InferenceError,
    retry_after: float | None,
    config: WorkerConfig,
    *,
    server: str | None = None,
    waste: Waste | None = None,
) -> Retry | Release | Failed:
    """A retryable failure at ``server``: retried after a backoff, or failed once attempts
    are spent. A rate limit is released until its Retry-After (or a backoff), costing no
    attempt: the provider's budget, not the item, is at fault, and a long rate limit
    must not use up the items' attempts. ``waste``: the work the attempt threw away,
    counted with the transition. No server's Retry-After holds an item longer than the
    backoff cap: a ``1e308`` or a date in 9999 would otherwise keep it, and a run waiting
    for it, for ever."""
    failure = Failure(exc.error_class, where(lease) + str(exc), server, waste)
    if exc.error_class == ec.RATE_LIMITED:
        delay = backoff_delay(
            1, base=config.backoff_base, cap=config.backoff_cap, retry_after=retry_after
        )
        if retry_after is not None and retry_after > config.backoff_cap:
            log.warning(
                "retry_after_capped",
                **lease.log_fields,
                server=server,
                retry_after_s=round(retry_after, 3) if math.isfinite(retry_after) else "inf",
                wait_s=round(delay, 2),
                error_class=exc.error_class,
            )
        return Release(lease, failure, time.time() + delay)
    if lease.attempt >= config.max_attempts:
        message = f"{where(lease)}gave up after {lease.attempt} attempts: {exc}"
        return Failed(lease, Failure(exc.error_class, message, server, waste))
    delay = backoff_delay(
        lease.attempt, base=config.backoff_base, cap=config.backoff_cap, retry_after=retry_after
    )
    log.warning(
        "item_retry",
        **lease.log_fields,
        attempt=lease.attempt,
        error_class=exc.error_class,
        delay_s=round(delay, 2),
        error=str(exc)[:300],
    )
    return Retry(lease, failure, time.time() + delay)


def crashed(
    lease: Lease, exc: Exception, config: WorkerConfig, *, server: str | None = None
) -> Retry | Release | Failed:
    """An error no rule expects (a bug in the client, in an answer's check): the item is
    retried as ``internal``, and failed once its attempts are spent, never left held."""
    if not isinstance(exc, InferenceError):
        log.error(
            "item_crashed",
            **lease.log_fields,
            server=server,
            error_type=type(exc).__name__,
            exc_info=exc,
        )
        exc = InferenceError(f"{type(exc).__name__}: {exc}"[:2000], error_class=ec.INTERNAL)
    return retry_or_fail(lease, exc, None, config, server=server)


def answered(
    lease: Lease,
    info: DatasetInfo,
    body: dict[str, Any],
    completion: Completion,
    config: WorkerConfig,
) -> Output | Retry | Release | Failed:
    """An answer to store, or, cut at ``max_tokens`` or not the JSON asked for, what the
    dataset's ``on_truncated`` or ``on_invalid`` says to do with it."""
    if completion.finish_reason == "length" and info.on_truncated != "keep":
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        truncated = TransientError(
            f"the answer was cut at max_tokens={limit}", error_class=ec.TRUNCATED
        )
        thrown = Waste(wasted.TRUNCATED, completion_tokens(completion.usage), bill_of(completion))
        return _act(lease, info.on_truncated, truncated, completion.server, config, thrown)
    result = output(completion, info.params_hash)
    fmt = structured.expected_format(body)
    if fmt is None or completion.tool_calls:
        return result  # a tool call answers in its arguments, not in JSON content
    checked = structured.check(completion.content, fmt)
    if not checked.flags:
        return result
    if info.on_invalid == "keep":
        return dataclasses.replace(result, flags=result.flags | checked.flags)
    error_class = ec.INVALID_JSON if checked.flags & INVALID_JSON else ec.SCHEMA_MISMATCH
    invalid = TransientError(checked.reason, error_class=error_class)
    thrown = Waste(wasted.INVALID, completion_tokens(completion.usage), bill_of(completion))
    return _act(lease, info.on_invalid, invalid, completion.server, config, thrown)


def _act(
    lease: Lease,
    policy: str,
    exc: TransientError,
    server: str | None,
    config: WorkerConfig,
    thrown: Waste,
) -> Retry | Release | Failed:
    """A usable answer refused by the dataset's policy: the item fails, or is retried;
    either way the answer's tokens are thrown away."""
    if policy == "fail":
        return Failed(lease, Failure(exc.error_class, where(lease) + str(exc), server, thrown))
    return retry_or_fail(lease, exc, None, config, server=server, waste=thrown)


def overflowed(exc: Exception, body: dict[str, Any], limit: int | None) -> overflow.Overflow | None:
    """What a refusal said of the context, when it is a context-length refusal."""
    if not isinstance(exc, PermanentError) or exc.error_class not in ("http_400", "http_413"):
        return None
    return overflow.parse(str(exc), limit=limit)


def sent_max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def fitted(
    info: DatasetInfo, body: dict[str, Any], said: overflow.Overflow
) -> dict[str, Any] | None:
    """The request again with ``max_tokens`` lowered to what the context leaves after the
    prompt (``on_overflow = "fit"``); None when that cannot help: the dataset fails such
    items, the prompt alone fills the context, or the prompt's length is not known."""
    if info.on_overflow != "fit":
        return None
    asked = sent_max_tokens(body)
    prompt = said.prompt_tokens(asked)
    if prompt is None or prompt >= said.limit:
        return None
    room = said.limit - prompt
    if asked is not None and room >= asked:
        return None  # the server's count is not ours: lowering by nothing would loop
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return {**body, key: room}


def overflow_failed(
    lease: Lease, body: dict[str, Any], said: overflow.Overflow, server: str, reason: str
) -> Failed:
    """An item whose request does not fit the server's context: the numbers, then the
    server's own words."""
    numbers = said.describe(sent_max_tokens(body))
    message = f"{where(lease)}the request does not fit the server's context: {numbers} ({reason})"
    return Failed(lease, Failure(ec.CONTEXT_OVERFLOW, message, server))


def reduced(result: Output, lease: Lease, body: dict[str, Any]) -> Output:
    """An answer asked with ``max_tokens`` lowered to fit the context: flagged."""
    log.info(
        "max_tokens_reduced",
        **lease.log_fields,
        turn=lease.turn,
        max_tokens=sent_max_tokens(body),
    )
    return dataclasses.replace(result, flags=result.flags | MAX_TOKENS_REDUCED)


def completion_tokens(usage: Any) -> int | None:
    """The completion tokens a usage object says, when it says."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if type(tokens) is int and 0 <= tokens <= wasted.MOST_TOKENS else None


#: Errors after which the server's answer came but was unusable: its tokens are wasted.
UNUSABLE = frozenset({ec.BAD_RESPONSE, ec.STREAM_CUT})


def failed_answer(exc: InferenceError) -> Waste | None:
    """What a failed request threw away: an unusable answer's tokens (when its body said
    them), nothing known for the rest."""
    if exc.error_class not in UNUSABLE:
        return None
    return Waste(wasted.BAD_RESPONSE, getattr(exc, "generated_tokens", None))


def output(c: Completion, params_hash: str) -> Output:
    """The answer as the store keeps it."""
    fields = {name: getattr(c, name) for name in ANSWER_FIELDS}
    return Output(**fields, params_hash=params_hash, tokens=c.tokens)


def stopped(lease: Lease, result: Output) -> Output:
    """The last turn of a conversation that cannot go on: the model's tool calls went
    another way than the original's, whose results would answer calls never made."""
    log.info(
        "conversation_stopped",
        **lease.log_fields,
        turn=lease.turn,
        turns=lease.turns,
        reason="tool_mismatch",
    )
    return dataclasses.replace(result, flags=result.flags | TOOL_MISMATCH)


def next_turn(lease: Lease, result: Output) -> Lease:
    """The lease of a multi-turn item moved past the turn just answered."""
    return dataclasses.replace(
        lease,
        turn=lease.turn + 1,
        attempt=1,
        generated=(*lease.generated, result.message),
        generated_tokens=lease.generated_tokens
        + ((result.usage or {}).get("completion_tokens") or 0),
        generated_flags=lease.generated_flags | result.flags,
        generated_latency=lease.generated_latency + result.latency,
        last_failure=None,  # the error it was put back with was an earlier turn's
    )


def unstorable(entry: Outcome, reason: str, config: WorkerConfig) -> Outcome | None:
    """What to write for an outcome the database refused: an answer becomes a
    ``bad_response`` attempt (retried, or failed once attempts are spent); a failure
    is written with its message left out. None: nothing more to try."""
    lease = entry.lease
    if isinstance(entry, Done | Advance):
        error = TransientError(
            f"the answer could not be stored: {reason}", error_class=ec.BAD_RESPONSE
        )
        output = entry.output
        thrown = Waste(wasted.BAD_RESPONSE, completion_tokens(output.usage), bill_of(output))
        return retry_or_fail(lease, error, None, config, server=entry.output.server, waste=thrown)
    assert isinstance(entry, Retry | Release | Failed)
    failure = entry.failure
    if failure.message.startswith("(unstorable)"):
        return None
    plain = Failure(failure.error_class[:64], f"(unstorable) {reason}"[:4000], failure.server)
    return dataclasses.replace(entry, failure=plain, failures=0)
