"""One item's call: its request, each of its turns, and what the answer or error means.

The server pool picks the server and hears how each request went; the client does the
HTTP; ``classify`` turns the answer or the error into an outcome.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from orchestrator import error_classes as ec
from orchestrator.client import InferenceClient
from orchestrator.conversation import stops_after, turn_messages
from orchestrator.draws import seed_of
from orchestrator.errors import InferenceError, PermanentError, ServerUnavailable, TransientError
from orchestrator.params import item_body
from orchestrator.servers import ServerPool
from orchestrator.store import Failure, Lease, Output
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker import classify
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
    #: Called once a server is found to ignore ``n`` for a dataset (its id): the
    #: dataset's samples are asked for one request each from then on.
    ignores_n: Callable[[int], Awaitable[None]] | None = None
    _fell_back: set[int] = field(default_factory=set)

    async def item(self, held: Claimed, info: DatasetInfo) -> Outcome | None:
        """Call a server for one item (each of its turns, for a multi-turn item); say
        what should become of it. None: the lease went while a turn was being written."""
        lease = held.lease
        while True:
            result = await self.turn(lease, info)
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

    async def turn(self, lease: Lease, info: DatasetInfo) -> Outcome | Output:
        """One request: its answer, or what should become of the item."""
        body = item_body(info.params, lease.request, seed(lease, info))
        if lease.turns > 1 or info.regenerate == "all":
            # Every turn of such an item, its only one too, is asked without its original
            # answer, which the stored conversation still holds.
            try:
                body["messages"] = turn_messages(
                    lease.request["messages"], lease.turn, lease.generated
                )
            except ValueError as exc:
                return Failed(lease, Failure(ec.CONVERSATION, where(lease) + str(exc)))
        # The prompt as text picks the server holding its prefix (the previous turn's,
        # a retry's, another item's with the same system prompt) in its cache.
        server = self.pool.pick(body.get("messages") or body.get("prompt"))
        if server is None:
            return Release(lease, Failure(ec.UNAVAILABLE, "no server reachable"), time.time())
        self.pool.request_started(server)
        epoch = self.pool.states[server].epoch
        try:
            completion = await self.client.chat(server, body)
        except Exception as exc:  # a bug here must not take the other requests down
            if self.pool.states[server].epoch != epoch and not isinstance(exc, PermanentError):
                # A launched server died under the request: an outage, not the item's.
                reason = f"the server died during the request: {exc}"
                return Release(lease, Failure(ec.UNAVAILABLE, reason, server), time.time())
            return await self._failed(lease, info, server, exc)
        finally:
            self.pool.request_ended(server)
        usage = completion.usage or {}
        self.pool.succeeded(server, usage.get("completion_tokens") or 0, completion.latency)
        log.debug(
            "answered",
            item=lease.item_id,
            key=lease.key,
            dataset=info.name,
            turn=lease.turn,
            server=server,
            latency_s=round(completion.latency, 3),
            completion_tokens=usage.get("completion_tokens"),
            finish_reason=completion.finish_reason,
        )
        return classify.answered(lease, info, body, completion, self.config)

    async def draws(self, leases: list[Lease], info: DatasetInfo) -> list[Outcome]:
        """Samples of one prompt (consecutive seeds, the first's given) in one request
        with ``n`` choices: one outcome per lease, in order. The prompt is prefilled
        once. A server that answers fewer choices ignores ``n``: the dataset falls back
        to a request per sample (logged once), and the samples left are asked so now."""
        lease = leases[0]
        body = item_body(info.params, lease.request, seed(lease, info))
        body["n"] = len(leases)
        server = self.pool.pick(body.get("messages"))
        if server is None:
            failure = Failure(ec.UNAVAILABLE, "no server reachable")
            return [Release(each, failure, time.time()) for each in leases]
        self.pool.request_started(server)
        try:
            choices = await self.client.chat_choices(server, body)
        except Exception as exc:  # a bug here must not take the other requests down
            first = await self._failed(lease, info, server, exc)
            return [
                first,
                *(_failed_too(each, first, exc, info, self.config) for each in leases[1:]),
            ]
        finally:
            self.pool.request_ended(server)
        tokens = sum((c.usage or {}).get("completion_tokens") or 0 for c in choices)
        self.pool.succeeded(server, tokens, choices[0].latency)
        outcomes = [
            _done(each, classify.answered(each, info, body, answer, self.config))
            for each, answer in zip(leases, choices, strict=False)
        ]
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
            and info.regenerate == "last"
            and info.id not in self._fell_back
        )

    async def _failed(
        self, lease: Lease, info: DatasetInfo, server: str, exc: Exception
    ) -> Outcome:
        """Classify a request's failure; the server's accounting hears of it too."""
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
            return classify.retry_or_fail(lease, exc, exc.retry_after, self.config, server=server)
        if isinstance(exc, PermanentError):
            failure = Failure(exc.error_class, where(lease) + str(exc), server)
            return Rejected(lease, server, str(exc), failure, info.params_hash)
        if not isinstance(exc, InferenceError):
            log.exception("item_crashed", item=lease.item_id, key=lease.key)
            exc = InferenceError(f"{type(exc).__name__}: {exc}", error_class=ec.INTERNAL)
        return classify.retry_or_fail(lease, exc, None, self.config, server=server)


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
