"""Claiming: what the worker holds, how much more to ask for, and when to start it.

The committer asks ``Claims.plan`` before each round and hands what it claimed to
``Claims.deliver``. A claim fits the healthy servers' caps, summed, plus a small prefetch
sized to about 20 ms of the recent answer rate (none for slow servers, where it would only
hold items back from other workers); a dataset not yet answered in this run gets one
trial item first, and claiming pauses while no server is up (``orchestrator.worker.guard``,
``orchestrator.inference.pool``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from orchestrator.inference.pool import ServerPool
from orchestrator.inference.streaming import Streamed
from orchestrator.items.answer_length import Expected, expected
from orchestrator.store import Database, Lease, list_datasets
from orchestrator.store.datasets import DatasetInfo
from orchestrator.store.leases import Claim
from orchestrator.store.length_stats import length_stats
from orchestrator.store.spend import Budget
from orchestrator.worker.config import WorkerConfig, WorkerStats
from orchestrator.worker.guard import RunGuard

log = structlog.get_logger("orchestrator.worker")

# How often a worker rereads dataset parameters and policies (seconds).
_DATASETS_EVERY = 5.0

# Items claimed first from each dataset, until it has had that many (see Claim.scouts).
SCOUTS = 16


@dataclass(slots=True)
class Claimed:
    """A lease this worker holds, from its claim until its outcome is written;
    ``streamed``: what the request in flight has said of its tokens so far."""

    lease: Lease
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None
    streamed: Streamed | None = None
    #: Samples of the same prompt asked for in this item's request (``n`` choices);
    #: each is held too, its ``task`` this one's, and ``follows`` set.
    draws: list[Lease] = field(default_factory=list)
    follows: bool = False


class Catalog:
    """The datasets' parameters and policies, and how their items rank by answer length
    (``orchestrator.items.answer_length``); reread every few seconds, so an ``enqueue --update``
    reaches running workers for the items they claim next and the ranking follows the
    answers measured."""

    def __init__(self, database: Database, names: tuple[str, ...]) -> None:
        self.database = database
        self.infos: dict[int, DatasetInfo] = {}
        self.lengths: dict[int, Expected] = {}
        self._names = set(names)
        self._loaded = 0.0

    async def load(self) -> None:
        self.infos = {d.id: d for d in await list_datasets(self.database)}
        sending = [d.id for d in self.infos.values() if not d.passthrough]
        measured = await length_stats(self.database, sending)
        self.lengths = {
            i: expected(measured.get(i), self.infos[i].params.get("max_tokens")) for i in sending
        }
        self._loaded = time.monotonic()

    def stale(self) -> bool:
        return time.monotonic() - self._loaded >= _DATASETS_EVERY

    async def get(self, dataset_id: int) -> DatasetInfo:
        if dataset_id not in self.infos:
            await self.load()
        return self.infos[dataset_id]

    def name(self, dataset_id: int) -> str:
        info = self.infos.get(dataset_id)
        return info.name if info is not None else str(dataset_id)

    def scope(self) -> list[DatasetInfo]:
        """The datasets this worker may claim from now, highest priority first."""
        infos = [
            d
            for d in self.infos.values()
            if not d.paused and not d.passthrough and (not self._names or d.name in self._names)
        ]
        return sorted(infos, key=lambda d: (-d.priority, d.id))


class Claims:
    """The held leases, the prefetch, and the running count against the pool's capacity.

    ``start`` runs one item; it is called for each buffered lease as a slot frees, and
    the running item gives its slot back with ``slot_freed`` once its answer is in (not
    when it is committed). ``idle`` is set whenever nothing is held or claiming paused.
    """

    def __init__(
        self,
        owner: str,
        config: WorkerConfig,
        stats: WorkerStats,
        pool: ServerPool,
        guard: RunGuard,
        catalog: Catalog,
        stopping: asyncio.Event,
        start: Callable[[Claimed], Coroutine[Any, Any, None]],
    ) -> None:
        self.owner = owner
        self.config = config
        self.stats = stats
        self.pool = pool
        self.guard = guard
        self.catalog = catalog
        self.idle = asyncio.Event()
        self._stopping = stopping
        self._start = start
        self.held: dict[int, Claimed] = {}
        self.buffer: deque[Lease] = deque()
        self.active = 0
        self._started: set[int] = set()
        self._suspects = 0
        self._next_claim = 0.0
        self._next_suspect_probe = 0.0
        self._rate = _Rate()
        self._trial_claim: int | None = None  # the dataset of the round's trial claim
        #: A claim is being written: items (a trial, say) may be on their way.
        self.claiming = False
        #: Whether a buffered lease is asked for in the request of the one started
        #: before it, the ``count``-th sample after it (``Caller.joins``).
        self.joins: Callable[[Lease, Lease, int], bool] = lambda first, lease, count: False
        #: Whether a dataset's samples of a prompt go out in one request
        #: (``Caller.asks_together``): they are then claimed, and started, together.
        self.together: Callable[[DatasetInfo], bool] = lambda info: False
        #: The run's budget (``orchestrator.worker.budget``): every claim is held to it.
        self.budget: Budget | None = None

    @property
    def in_flight(self) -> int:
        """Items claimed and not yet answered: requests running, and the prefetch."""
        return self.active + len(self.buffer)

    def plan(self) -> Claim | None:
        """How much to ask for in the committer's next round (None: nothing)."""
        claim = self._plan()
        self.claiming = claim is not None
        return claim

    def _plan(self) -> Claim | None:
        if self._stopping.is_set() or not self.pool.available.is_set():
            return None
        now = time.monotonic()
        concurrency = self.pool.capacity()
        scope = self.catalog.scope()
        together = {d.id: d.samples for d in scope if self.together(d)}
        trial = self.guard.trial(scope, self.held, now)
        if trial is not None and self.active + len(self.buffer) < concurrency:
            # One item of a dataset not yet answered in this run, before any more of it:
            # one never put back if there is one, else any item, a dead worker's too
            # (its only ones left may be those).
            self._trial_claim = trial.id
            lease_seconds = self.config.lease_seconds
            return Claim(
                self.owner, 1, lease_seconds, (trial.name,), None, fresh_first=True,
                together=together, budget=self.budget,
            )  # fmt: skip
        if now < self._next_claim:
            return None
        prefetch = min(concurrency, int(self._rate.per_second() * 0.02))
        want = concurrency + prefetch - self.active - len(self.buffer)
        names = self.guard.open_names(scope)
        if want <= 0 or names == ():
            return None
        suspect_slots = 0
        if not self._suspects and now >= self._next_suspect_probe:
            # Room for one group of suspects (store.crashes), sized from the capacity.
            # They are rare: once none is found, look again a second later rather than
            # in every round.
            suspect_slots = concurrency
            self._next_suspect_probe = now + 1.0
        return Claim(
            self.owner,
            want,
            self.config.lease_seconds,
            names or self.config.datasets or None,
            suspect_slots,
            scouts=SCOUTS,
            started=self._started,
            lengths=self.catalog.lengths,
            together=together,
            budget=self.budget,
        )

    def deliver(self, leases: list[Lease], claim: Claim) -> None:
        """Hold what the committer claimed, and start what fits."""
        self.claiming = False
        trial, self._trial_claim = self._trial_claim, None
        if trial is not None:
            now = time.monotonic()
            self.guard.trial_claimed(trial, leases, now, now + self.config.poll_interval)
        if leases:
            self.guard.quiet(True, time.monotonic())  # more evidence is on its way
        for lease in leases:
            self.held[lease.item_id] = Claimed(lease)
            self._suspects += lease.suspect
            self.buffer.append(lease)
        self.stats.claimed += len(leases)
        if claim.suspect_slots and any(lease.suspect for lease in leases):
            # Where there was one group there may be more (a bisection's other half):
            # look again as soon as this one is settled.
            self._next_suspect_probe = 0.0
        self.fill()
        if trial is not None:
            if not self.held:
                self.idle.set()
        elif len(leases) < claim.want:
            # The queue has nothing more for us now: ask again after a pause, or as soon
            # as one of our outcomes frees room under a dataset's cap.
            self._next_claim = time.monotonic() + self.config.poll_interval
            if not self.held:
                self.idle.set()

    def fill(self) -> None:
        """Start buffered items while slots are free (none once stopping: a claim
        delivered after the stop is released unstarted)."""
        if self._stopping.is_set():
            return
        capacity = self.pool.capacity()
        while self.buffer and self.active < capacity:
            free, widest = capacity - self.active, self.pool.widest()
            if self.active and self._cut(free, widest):
                break  # a request of several samples waits for room for them all
            lease = self.buffer.popleft()
            held = self.held.get(lease.item_id)
            if held is None:  # its lease was lost while it waited
                continue
            held.draws = self._draws(lease, min(free, widest) - 1)
            self.active += 1 + len(held.draws)
            held.task = asyncio.create_task(self._start(held), name=f"item {lease.item_id}")
            for other in held.draws:
                self.held[other.item_id].task = held.task

    def _cut(self, free: int, widest: int) -> bool:
        """Whether the next buffered lease's request, as many samples as one server takes
        (``widest``), needs more than the ``free`` slots: started now, it would ask for
        some only and leave the others to requests of their own. Such a request waits
        for the slots (a request larger than the whole capacity goes as large as it
        fits once nothing is running)."""
        first = self.buffer[0]
        size = 1
        for lease in itertools.islice(self.buffer, 1, None):
            if size >= widest or size > free or not self.joins(first, lease, size):
                break
            size += 1
        return size > free

    def _draws(self, first: Lease, room: int) -> list[Lease]:
        """The samples after ``first`` in the buffer that its request asks for too: each
        takes a slot, as each is a sequence the server generates."""
        found: list[Lease] = []
        while (
            self.buffer and len(found) < room and self.joins(first, self.buffer[0], len(found) + 1)
        ):
            lease = self.buffer.popleft()
            held = self.held.get(lease.item_id)
            if held is None:
                continue
            held.follows = True
            found.append(lease)
        return found

    def slot_freed(self, n: int = 1) -> None:
        """An item's answer is in: its slot (``n``: the samples it asked for) goes to
        the next buffered item."""
        self.active -= n
        self.fill()

    def capacity_changed(self) -> None:
        """A server came or went, or its cap changed: claim and start what now fits."""
        self._next_claim = 0.0
        self.fill()

    def settle(self, item_id: int) -> Claimed | None:
        """An item's outcome is written: let its lease go, and claim again soon."""
        held = self.held.pop(item_id, None)
        if held is not None:
            self._suspects -= held.lease.suspect
        self._next_claim = 0.0
        if not self.held:
            self.idle.set()
        return held

    def answered(self) -> None:
        """One more answer for the rate that sizes the prefetch."""
        self._rate.add()

    def leases(self) -> list[tuple[int, str]]:
        """Each held item and its lease token, for the keeper to renew."""
        return [(h.lease.item_id, h.lease.token) for h in self.held.values()]

    def lease_lost(self, item_id: int) -> None:
        """The keeper could not renew this lease: another worker took the item over."""
        entry = self.held.get(item_id)
        if entry is None:
            return
        if entry.task is not None and entry.task.done():
            return  # its outcome is queued; the fenced write will drop it
        # Stop working on it (or never start).
        self.held.pop(item_id)
        self._suspects -= entry.lease.suspect
        if entry.task is not None and not entry.follows:  # the other samples go on
            entry.cancel_reason = "lease_lost"
            entry.task.cancel()
        self.stats.lost += 1
        log.warning("lease_lost", **entry.lease.log_fields)


class _Rate:
    """Answers per second over the last two whole seconds: sizes the prefetch."""

    def __init__(self) -> None:
        self._second = 0
        self._counts = [0, 0, 0]

    def add(self, n: int = 1) -> None:
        self._roll()
        self._counts[self._second % 3] += n

    def per_second(self) -> float:
        self._roll()
        return (self._counts[(self._second - 1) % 3] + self._counts[(self._second - 2) % 3]) / 2

    def _roll(self) -> None:
        second = int(time.monotonic())
        if second != self._second:
            for s in range(max(self._second + 1, second - 2), second + 1):
                self._counts[s % 3] = 0
            self._second = second
