"""One item's call: its request, each of its turns, and what the answer or error means.

The server pool picks the server and hears how each request went; the client does the
HTTP; ``classify`` turns the answer or the error into an outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from orchestrator.errors import (
    BatchUnanswered,
    InferenceError,
    PermanentError,
    ServerUnavailable,
    TransientError,
)
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.completions import Completion
from orchestrator.inference.pacing import request_tokens
from orchestrator.inference.pool import ServerPool
from orchestrator.inference.streaming import Streamed
from orchestrator.inference.tokenize import PromptTokenizer
from orchestrator.items import error_classes as ec
from orchestrator.items.conversation import stops_after, turn_messages
from orchestrator.items.params import item_body
from orchestrator.items.samples import as_choice, seed_of
from orchestrator.logs import debug_enabled
from orchestrator.store import Failure, Lease, Output
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker import classify
from orchestrator.worker.batches import Batches
from orchestrator.worker.claim import Claimed
from orchestrator.worker.classify import where
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.outcomes import (
    Advance,
    Done,
    Failed,
    Outcome,
    Rejected,
    Release,
    Retry,
)

log = structlog.get_logger("orchestrator.worker")


@dataclass(slots=True)
class Caller:
    """Calls a server for one item; ``submit`` queues a finished turn's write."""

    pool: ServerPool
    client: InferenceClient
    config: WorkerConfig
    submit: Callable[[Outcome], None]
    #: The context length a server said a model has (``/v1/models``), or None.
    context_of: Callable[[str, Any], int | None] = lambda server, model: None
    #: Called once a server is found to ignore ``n`` for a dataset (its id): the
    #: dataset's samples are asked for one request each from then on.
    ignores_n: Callable[[int], Awaitable[None]] | None = None
    #: The batch servers' requests (``worker.batches``); None: no server is one.
    batches: Batches | None = None
    _fell_back: set[int] = field(default_factory=set)
    _tokenizer: PromptTokenizer | None = None

    @property
    def tokenizer(self) -> PromptTokenizer:
        """Asks a server for the prompt ids its answer left out (``--token-ids``)."""
        if self._tokenizer is None:
            self._tokenizer = PromptTokenizer(self.client)
        return self._tokenizer

    async def item(self, held: Claimed, info: DatasetInfo) -> Outcome | None:
        """Call a server for one item (each of its turns, for a multi-turn item); say
        what should become of it. None: the lease went while a turn was being written."""
        lease = held.lease
        previous: str | None = None
        while True:
            held.streamed = Streamed()
            result = await self.turn(lease, info, held.streamed, previous)
            if not isinstance(result, Output):
                return result
            if lease.turn + 1 >= lease.turns:
                return Done(lease, result)
            if stops_after(lease.request["messages"], lease.turn, result.message):
                return Done(lease, classify.stopped(lease, result))
            landed = asyncio.get_running_loop().create_future()
            self.submit(Advance(lease, result, landed))
            if not await self._holding(result.server, landed):
                return None
            lease = held.lease = classify.next_turn(lease, result)
            previous = result.server

    async def _holding(self, server: str | None, landed: asyncio.Future[bool]) -> bool:
        """Wait for a turn's write with its server's slot kept: the next turn goes where
        the conversation's prefix is cached, and a new item must not take that slot."""
        if server not in self.pool.states:
            return await landed
        self.pool.request_started(server)
        try:
            return await landed
        finally:
            self.pool.request_ended(server)

    async def turn(
        self,
        lease: Lease,
        info: DatasetInfo,
        streamed: Streamed | None = None,
        previous: str | None = None,
    ) -> Outcome | Output:
        """One request: its answer, or what should become of the item (``streamed``
        hears the tokens its stream says as they come; ``previous`` answered the turn
        before, in this lease: its cache holds the conversation so far)."""
        request = lease.request
        if lease.turns > 1 or info.regenerate == "all":
            # Every turn of such an item, its only one too, is asked without its original
            # answer, which the stored conversation still holds.
            try:
                turn = turn_messages(request["messages"], lease.turn, lease.generated)
            except ValueError as exc:
                return Failed(lease, Failure(ec.CONVERSATION, where(lease) + str(exc)))
            request = {**request, "messages": turn}
        body = item_body(info.settings, request, seed(lease, info))
        # The prompt as text picks the server holding its prefix (the previous turn's,
        # a retry's, another item's with the same system prompt) in its cache.
        server = self.pool.pick(body.get("messages") or body.get("prompt"), previous)
        if server is None:
            return Release(lease, Failure(ec.UNAVAILABLE, "no server reachable"), time.time())
        epoch = self.pool.states[server].epoch
        asked, sent = await self._fitting(server, info, body, streamed, lease)
        if not isinstance(sent, list):
            if self.pool.states[server].epoch != epoch and not isinstance(sent[0], PermanentError):
                # A launched server died under the request: an outage, not the item's.
                reason = f"the server died during the request: {sent[0]}"
                return Release(lease, Failure(ec.UNAVAILABLE, reason, server), time.time())
            return await self._failed(lease, info, server, asked, *sent)
        completion = sent[0]
        usage = completion.usage or {}
        self.pool.succeeded(server, usage.get("completion_tokens") or 0, completion.latency)
        if debug_enabled():  # per request: not even built at the usual levels
            log.debug(
                "answered",
                **lease.log_fields,
                dataset=info.name,
                turn=lease.turn,
                server=server,
                latency_s=round(completion.latency, 3),
                completion_tokens=usage.get("completion_tokens"),
                finish_reason=completion.finish_reason,
            )
        result = classify.answered(lease, info, asked, completion, self.config)
        if asked is not body and isinstance(result, Output):
            result = classify.reduced(result, lease, asked)
        return result

    async def _fitting(
        self,
        server: str,
        info: DatasetInfo,
        body: dict[str, Any],
        streamed: Streamed | None,
        lease: Lease,
    ) -> tuple[dict[str, Any], list[Completion] | tuple[Exception, float | None]]:
        """The body last sent, and what :meth:`_send` made of it: with ``on_overflow =
        "fit"``, a request the server refused as longer than its context is sent again at
        once, with ``max_tokens`` lowered to what fits. It is the same attempt, and no
        failure of the server's: neither the item's attempts nor the breaker hear of the
        refusal."""
        sent = await self._send(server, body, streamed, info.endpoint, lease)
        if isinstance(sent, list) or not isinstance(sent[0], PermanentError):
            return body, sent
        said = classify.overflowed(sent[0], body, self.context_of(server, body.get("model")))
        smaller = classify.fitted(info, body, said) if said is not None else None
        if smaller is None:
            return body, sent
        return smaller, await self._send(server, smaller, streamed, info.endpoint, lease)

    async def _send(
        self,
        server: str,
        body: dict[str, Any],
        streamed: Streamed | None,
        endpoint: str,
        lease: Lease,
    ) -> list[Completion] | tuple[Exception, float | None]:
        """The request, once the server's pacer lets it go: the answer (each of its
        choices), or the error and the seconds the server has answered nothing but 429
        (past the warning's time). It holds a slot of the server per choice asked. A
        batch server's request goes in its next batch (``worker.batches``) instead."""
        n = body.get("n")
        sequences = n if isinstance(n, int) and n > 1 else 1
        self.pool.request_started(server, sequences)
        try:
            if self.batches is not None and self.batches.serves(server):
                try:
                    completion = await self.batches.ask(server, lease, body, endpoint)
                except Exception as exc:
                    return exc, None
                return await self.tokenizer.completed(server, body, completion)
            ticket = await self.pool.pace(server, request_tokens(body))
            try:
                completion = await self.client.chat_choices(
                    server, body, streamed, endpoint=endpoint
                )
            except Exception as exc:  # a bug here must not take the other requests down
                return exc, self.pool.paced(server, ticket, exc)
            except BaseException as exc:  # cancelled: no longer in flight, for the pacer
                self.pool.paced(server, ticket, exc)
                raise
            self.pool.paced(server, ticket, completion[0])
            return await self.tokenizer.completed(server, body, completion)
        finally:
            self.pool.request_ended(server, sequences)

    async def draws(self, leases: list[Lease], info: DatasetInfo) -> list[Outcome]:
        """Samples of one prompt (consecutive seeds, the first's given) in one request
        with ``n`` choices: one outcome per lease, in order. The prompt is prefilled
        once. A server that answers fewer choices ignores ``n``: the dataset falls back
        to a request per sample (logged once), and the samples left are asked so now."""
        lease = leases[0]
        body = item_body(info.settings, lease.request, seed(lease, info))
        body["n"] = len(leases)
        server = self.pool.pick(body.get("messages") or body.get("prompt"), width=len(leases))
        if server is None:
            failure = Failure(ec.UNAVAILABLE, "no server reachable")
            return [Release(each, failure, time.time()) for each in leases]
        asked, sent = await self._fitting(server, info, body, None, lease)
        if not isinstance(sent, list):
            first = await self._failed(lease, info, server, asked, *sent)
            exc = sent[0]
            return [first, *(_failed_too(e, first, exc, info, self.config) for e in leases[1:])]
        choices = sent
        tokens = sum((c.usage or {}).get("completion_tokens") or 0 for c in choices)
        self.pool.succeeded(server, tokens, choices[0].latency)
        outcomes = []
        for choice, (each, answer) in enumerate(zip(leases, choices, strict=False)):
            # Marked as a choice before it is judged: kept or thrown away, the request
            # and its prompt are billed once, with choice 0 (store.spend).
            usage = as_choice(answer.usage, choice, len(leases))
            answer = dataclasses.replace(answer, usage=usage)
            result = classify.answered(each, info, asked, answer, self.config)
            if isinstance(result, Output) and asked is not body:
                result = classify.reduced(result, each, asked)
            outcomes.append(_done(each, result))
        if len(choices) < len(leases):
            await self._n_ignored(info, server, len(leases), len(choices))
            rest = leases[len(choices) :]
            outcomes += await asyncio.gather(*(self._one(each, info) for each in rest))
        return outcomes

    async def _one(self, lease: Lease, info: DatasetInfo) -> Outcome:
        """One sample asked alone, with its own seed."""
        return _done(lease, await self.turn(lease, info))

    async def _n_ignored(self, info: DatasetInfo, server: str, asked: int, got: int) -> None:
        if info.id in self._fell_back:
            return
        self._fell_back.add(info.id)
        log.warning(
            "n_ignored", dataset=info.name, server=server, asked=asked, choices=got,
            falls_back_to="seeds",
        )  # fmt: skip
        if self.ignores_n is not None:
            await self.ignores_n(info.id)

    def asks_together(self, info: DatasetInfo) -> bool:
        """Whether the dataset's samples go out as one request with ``n`` choices."""
        return (
            info.samples > 1
            and info.draw_mode == "n"
            and info.regenerate != "all"
            and info.id not in self._fell_back
        )

    async def _failed(
        self,
        lease: Lease,
        info: DatasetInfo,
        server: str,
        body: dict[str, Any],
        exc: Exception,
        limited_for: float | None = None,
    ) -> Outcome:
        """Classify a request's failure; the server's accounting hears of it too. A 429
        from a server rate limited past the warning's time says for how long."""
        if isinstance(exc, BatchUnanswered) and exc.released:
            failure = Failure(exc.error_class, str(exc), server)
            return Release(lease, failure, time.time() + (exc.retry_after or 0.0))
        if isinstance(exc, ServerUnavailable):
            self.pool.mark_down(server, str(exc))
            return Release(lease, Failure(exc.error_class, str(exc), server), time.time())
        if isinstance(exc, TransientError):
            if exc.error_class in classify.MAYBE_DOWN and not await self.client.health(server):
                # The connection broke because the server went away: an outage, not
                # the item's fault.
                self.pool.mark_down(server, str(exc))
                return Release(lease, Failure(ec.UNAVAILABLE, str(exc), server), time.time())
            self.pool.failed(server, exc.error_class)
            if limited_for is not None:
                said = ec.limited_message(limited_for, str(exc))
                exc = TransientError(said, error_class=exc.error_class, retry_after=exc.retry_after)
            thrown = classify.failed_answer(exc)
            return classify.retry_or_fail(
                lease, exc, exc.retry_after, self.config, server=server, waste=thrown
            )
        if isinstance(exc, PermanentError):
            said = classify.overflowed(exc, body, self.context_of(server, body.get("model")))
            if said is not None:
                # The item's own length, not a setting: failed at once, the breaker aside.
                return classify.overflow_failed(lease, body, said, server, str(exc))
            failure = Failure(exc.error_class, where(lease) + str(exc), server)
            return Rejected(lease, server, str(exc), failure, info.params_hash)
        return classify.crashed(lease, exc, self.config, server=server)


def seed(lease: Lease, info: DatasetInfo) -> int | None:
    """The seed a sample is asked with: none for a dataset of one unseeded sample."""
    if info.samples <= 1 and not info.draw_seeds:
        return None
    return seed_of(lease.key, lease.sample, info.draw_seeds)


def _done(lease: Lease, result: Outcome | Output) -> Outcome:
    return Done(lease, result) if isinstance(result, Output) else result


def _failed_too(
    lease: Lease, first: Outcome, exc: Exception, info: DatasetInfo, config: WorkerConfig
) -> Outcome:
    """What a request's failure makes of another sample it asked for, decided for that
    sample (its own attempts) as the first sample's was; the server heard of it once."""
    if isinstance(first, Release):
        return Release(lease, first.failure, first.not_before)
    if isinstance(first, Rejected):
        failure = Failure(first.failure.error_class, first.message, first.server)
        return Rejected(lease, first.server, first.message, failure, first.settings)
    if isinstance(first, Retry | Failed):
        server = first.failure.server
        if not isinstance(exc, InferenceError):
            exc = InferenceError(f"{type(exc).__name__}: {exc}", error_class=ec.INTERNAL)
        after = exc.retry_after if isinstance(exc, TransientError) else None
        return classify.retry_or_fail(lease, exc, after, config, server=server)
    return first
