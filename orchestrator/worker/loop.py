"""The worker loop: claim → call → classify → commit, within concurrency limits, until
told to stop.

One task per item calls a server; beside them run the committer (``committer``), the
keeper (``keeper``) and one prober per unreachable server (``orchestrator.servers``).
An outage (no server reachable) pauses claiming; items caught in it are released with
their attempt given back. Retryable failures go back to pending with exponential backoff
and jitter; permanent ones fail at once with the server's reason (``classify``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from orchestrator import client as inference
from orchestrator import error_classes as ec
from orchestrator import procinfo
from orchestrator.autoconcurrency import Controller
from orchestrator.client import InferenceClient
from orchestrator.conversation import stops_after, turn_messages
from orchestrator.errors import (
    InferenceError,
    PermanentError,
    RunStopped,
    ServersUnreachable,
    ServerUnavailable,
    StorageError,
    TransientError,
)
from orchestrator.guard import Held, RunGuard
from orchestrator.servers import ServerPool
from orchestrator.store import Database, Failure, Lease, Output, Queue, list_datasets
from orchestrator.store import workers as worker_rows
from orchestrator.store.datasets import DatasetInfo
from orchestrator.store.queue import Claim
from orchestrator.worker import classify, keeper, summary
from orchestrator.worker.classify import where
from orchestrator.worker.committer import Committer
from orchestrator.worker.config import Notifier, Silent, WorkerConfig, WorkerStats, stats_fields
from orchestrator.worker.outcomes import (
    Advance,
    Done,
    Failed,
    Outcome,
    Rejected,
    Release,
)

if TYPE_CHECKING:
    from orchestrator.metrics import WorkerMetrics

log = structlog.get_logger("orchestrator.worker")

# How often a worker rereads dataset parameters and policies (seconds).
_DATASETS_EVERY = 5.0

# Items claimed first from each dataset, until it has had that many (see Claim.scouts).
SCOUTS = 16


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


@dataclass(slots=True)
class _Held:
    """A lease this worker holds, from its claim until its outcome is written."""

    lease: Lease
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None


def _pool(
    config: WorkerConfig, client: InferenceClient, on_change: Callable[[], None]
) -> ServerPool:
    """The servers, each with its cap; an ``auto`` cap gets its controller."""
    caps: dict[str, int] = {}
    controllers: dict[str, Controller] = {}
    for server in config.servers:
        cap = config.server_caps.get(server, config.concurrency)
        if cap == "auto":
            controllers[server] = Controller(config.auto_limits)
            cap = controllers[server].cap
        caps[server] = cap
    return ServerPool(caps, client, config, controllers=controllers, on_change=on_change)


class Worker:
    """One process's share of the run.

    Every lease is held from its claim until its outcome is written. A slot (one of the
    healthy servers' caps, summed) frees as soon as the answer arrives, not when it is
    committed, and the next item starts at once from a small prefetch of claimed items,
    sized to about 20 ms of the recent answer rate (none for slow servers, where it would
    only hold items back from other workers).
    """

    def __init__(
        self,
        database: Database,
        client: InferenceClient,
        config: WorkerConfig,
        *,
        owner: str | None = None,
        notifier: Notifier | None = None,
        metrics: WorkerMetrics | None = None,
    ):
        self.database = database
        self.metrics = metrics
        self.notifier: Notifier = notifier or Silent()
        self.client = client
        self.config = config
        self.owner = owner or procinfo.owner_id()
        self.stats = WorkerStats()
        self.queue = Queue(database)
        self.pool = _pool(config, client, self._capacity_changed)
        self.committer = Committer(
            self.queue,
            plan=self._plan_claim,
            deliver=self._deliver,
            settled=self._settled,
            idle_poll=config.poll_interval,
            unstorable=lambda entry, reason: classify.unstorable(entry, reason, config),
        )
        self._held: dict[int, _Held] = {}
        self._buffer: deque[Lease] = deque()
        self._started: set[int] = set()
        self._active = 0
        self._suspects = 0
        self._next_claim = 0.0
        self._next_suspect_probe = 0.0
        self._rate = _Rate()
        self._datasets: dict[int, DatasetInfo] = {}
        self._datasets_loaded = 0.0
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._grace = config.grace_seconds
        self._file_gone: StorageError | None = None
        # Trial items, served models and the circuit breaker (orchestrator.guard).
        self.guard = RunGuard(config.breaker_items, config.trial_seconds)
        self.pool.vet = self._vet
        self._trial_claim: int | None = None  # the dataset of the round's trial claim
        #: Why the run stopped before its work was done; ``run`` raises it after cleaning up.
        self.halted: RunStopped | None = None
        #: With ``exit_when_done``: what was left undone at the end (failed, or paused).
        self.unfinished: RunStopped | None = None
        if metrics is not None:
            self._export_gauges(metrics)

    def _export_gauges(self, metrics: WorkerMetrics) -> None:
        metrics.in_flight.set_function(lambda: self._active)
        metrics.prefetched.set_function(lambda: len(self._buffer))
        for server, state in self.pool.states.items():
            metrics.server_up.labels(server).set_function(lambda st=state: float(st.healthy))
            metrics.server_concurrency.labels(server).set_function(lambda st=state: float(st.cap))

    def request_stop(self, *, force: bool = False) -> None:
        """Stop claiming; in-flight requests get the grace period (none when forced)."""
        if force or self._stopping.is_set():
            self._grace = 0.0
        # Outcomes the database still refuses once the grace period is over are dropped.
        self.committer.give_up_at(time.monotonic() + self._grace)
        self.notifier.stopping()
        self._stopping.set()
        self._idle.set()
        log.info("stopping", in_flight=self.in_flight, grace_s=self._grace)

    @property
    def in_flight(self) -> int:
        """Items claimed and not yet answered: requests running, and the prefetch."""
        return self._active + len(self._buffer)

    async def run(self) -> WorkerStats:
        await worker_rows.register(self.database, self.owner, procinfo.hostname(), os.getpid())
        await keeper.reap(self)
        await self._load_datasets()
        self.pool.start()
        self.committer.start()
        helpers = [
            asyncio.create_task(keeper.keep(self), name="keeper"),
            asyncio.create_task(keeper.watch_file(self), name="file-watcher"),
        ]
        if self.pool.tuned():
            helpers.append(asyncio.create_task(self._tune(), name="tuner"))
        log.info(
            "worker_started",
            worker=self.owner,
            servers=list(self.config.servers),
            concurrency={
                s: "auto" if st.controller else st.cap for s, st in self.pool.states.items()
            },
            datasets=list(self.config.datasets) or None,
        )
        try:
            await self._supervise()
        finally:
            await self._shut_down(helpers)
        if self.halted is not None:
            raise self.halted
        if self._file_gone is not None:
            raise self._file_gone
        return self.stats

    async def _shut_down(self, helpers: list[asyncio.Task[None]]) -> None:
        """Release what is held, drain, stop the helpers, write the last outcomes."""
        self._release_held()
        await self._drain()
        for task in helpers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.committer.close()
        self.stats.dropped = self.committer.dropped
        await self.pool.close()
        with contextlib.suppress(StorageError):
            await worker_rows.mark_stopped(
                self.database, self.owner, completed=self.stats.completed
            )
        with contextlib.suppress(Exception):
            await self.database.checkpoint("TRUNCATE")
        log.info("worker_stopped", **stats_fields(self.stats))

    # -------------------------------------------------------------------- claiming

    async def _supervise(self) -> None:
        """Wait for a server, then for the end: all done, or told to stop."""
        ready = False
        while not self._stopping.is_set():
            if not self.pool.available.is_set():
                await self._wait_for_server()
                self.committer.poke()
                continue
            if not ready:
                # The database is open and a server answers: ready for work.
                self.notifier.ready()
                ready = True
                self.committer.poke()
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.config.poll_interval)
            if time.monotonic() - self._datasets_loaded >= _DATASETS_EVERY:
                with contextlib.suppress(StorageError):
                    await self._load_datasets()
                    if self.metrics is not None:
                        self.metrics.set_items(await self.queue.counts())
            for entry in self.guard.quiet(bool(self._active or self._buffer), time.monotonic()):
                self.committer.submit(Failed(entry.lease, entry.failure))
            if (
                self.config.exit_when_done
                and not self._held
                and not self.committer.backlog
                and not self._stopping.is_set()
                and await self.queue.remaining(self.config.datasets or None) == 0
            ):
                await self._all_done()
                return

    async def _wait_for_server(self) -> None:
        """Wait for a server to answer (the prober says why none does), at most
        ``give_up_after`` seconds when that is set."""
        log.info("waiting_for_server", servers=list(self.config.servers))
        self.notifier.status("waiting for an inference server")
        limit = self.config.give_up_after
        waits = [self.pool.available.wait(), self._stopping.wait()]
        await _first(*waits, *([asyncio.sleep(limit)] if limit is not None else []))
        if self.pool.available.is_set() or self._stopping.is_set():
            return
        reasons = "; ".join(f"{url}: {why}" for url, why, _ in self.pool.unreachable())
        self._halt(ServersUnreachable(f"no server answered within {limit:g}s: {reasons}"))

    def _halt(self, error: RunStopped) -> None:
        """Stop the run for a reason the operator must act on; ``run`` raises it."""
        if self.halted is None:
            self.halted = error
            log.error("run_halted", reason=str(error), exit_code=error.exit_code)
        self.request_stop()

    async def _all_done(self) -> None:
        """Nothing left to claim: done, or say what is not (failed, or paused)."""
        counts = await self.queue.counts()
        self.unfinished = summary.left_undone(counts, self.config.datasets, self._datasets.values())

    def _plan_claim(self) -> Claim | None:
        """How much to ask for in the committer's next round (None: nothing)."""
        if self._stopping.is_set() or not self.pool.available.is_set():
            return None
        now = time.monotonic()
        concurrency = self.pool.capacity()
        scope = self._scope()
        trial = self.guard.trial(scope, self._held, now)
        if trial is not None and self._active + len(self._buffer) < concurrency:
            # One item of a dataset not yet answered in this run, before any more of it:
            # any item, a dead worker's too (its only ones left may be those).
            self._trial_claim = trial.id
            return Claim(self.owner, 1, self.config.lease_seconds, (trial.name,), None)
        if now < self._next_claim:
            return None
        prefetch = min(concurrency // 2, int(self._rate.per_second() * 0.02))
        want = concurrency + prefetch - self._active - len(self._buffer)
        names = self.guard.open_names(scope)
        if want <= 0 or names == ():
            return None
        suspect_slots = 0
        if not self._suspects and now >= self._next_suspect_probe:
            # Suspects are rare: once none is found, look again a second later rather
            # than in every round.
            suspect_slots = 1
            self._next_suspect_probe = now + 1.0
        return Claim(
            self.owner,
            want,
            self.config.lease_seconds,
            names or self.config.datasets or None,
            suspect_slots,
            scouts=SCOUTS,
            started=self._started,
        )

    def _scope(self) -> list[DatasetInfo]:
        """The datasets this worker may claim from now, highest priority first."""
        names = set(self.config.datasets)
        infos = [
            d
            for d in self._datasets.values()
            if not d.paused and not d.passthrough and (not names or d.name in names)
        ]
        return sorted(infos, key=lambda d: (-d.priority, d.id))

    def _deliver(self, leases: list[Lease], claim: Claim) -> None:
        trial, self._trial_claim = self._trial_claim, None
        if trial is not None:
            now = time.monotonic()
            self.guard.trial_claimed(trial, leases, now, now + self.config.poll_interval)
        if leases:
            self.guard.quiet(True, time.monotonic())  # more evidence is on its way
        for lease in leases:
            self._held[lease.item_id] = _Held(lease)
            self._suspects += lease.suspect
            self._buffer.append(lease)
        self.stats.claimed += len(leases)
        if claim.suspect_slots and any(lease.suspect for lease in leases):
            # Where there was one suspect there may be more (a dead worker's whole
            # share): look again as soon as this one is settled.
            self._next_suspect_probe = 0.0
        self._fill()
        if trial is not None:
            if not self._held:
                self._idle.set()
        elif len(leases) < claim.want:
            # The queue has nothing more for us now: ask again after a pause, or as soon
            # as one of our outcomes frees room under a dataset's cap.
            self._next_claim = time.monotonic() + self.config.poll_interval
            if not self._held:
                self._idle.set()

    def _fill(self) -> None:
        """Start buffered items while slots are free."""
        capacity = self.pool.capacity()
        while self._buffer and self._active < capacity:
            lease = self._buffer.popleft()
            held = self._held.get(lease.item_id)
            if held is None:  # its lease was lost while it waited
                continue
            self._active += 1
            held.task = asyncio.create_task(self._process(held), name=f"item {lease.item_id}")

    def _capacity_changed(self) -> None:
        """A server came or went, or its cap changed: claim and start what now fits."""
        self._next_claim = 0.0
        self._fill()
        self.committer.poke()

    # -------------------------------------------------------------------- settling

    def _settled(self, entry: Outcome, accepted: bool) -> None:
        """The committer wrote an outcome (``accepted``: its lease was still ours)."""
        entry.written(accepted)
        lease = entry.lease
        if isinstance(entry, Advance) and accepted:
            self._answered(entry.output.server, lease.dataset_id)
            self.stats.turns += 1
            if self.metrics is not None:
                self._observe(entry)
            return  # the item goes on with its next turn, under the same lease
        held = self._held.pop(lease.item_id, None)
        if held is not None:
            self._suspects -= held.lease.suspect
        self._next_claim = 0.0
        if not self._held:
            self._idle.set()
        if not accepted:
            if isinstance(entry, Release) and entry.failure.error_class == ec.SHUTDOWN:
                return  # its answer was written first, or its lease had already gone
            if held is None:
                return  # the keeper found the lease gone first, and counted it
            self.stats.lost += 1
            log.warning(
                "result_dropped_lease_lost", item=lease.item_id, key=lease.key, kind=entry.kind
            )
            return
        if self.metrics is not None:
            self._observe(entry)
        if summary.count(self.stats, entry):
            self._rate.add()

    def _observe(self, entry: Outcome) -> None:
        assert self.metrics is not None
        info = self._datasets.get(entry.lease.dataset_id)
        name = info.name if info is not None else str(entry.lease.dataset_id)
        summary.observe(self.metrics, name, entry)

    def _hand_over(self, outcome: Outcome) -> None:
        """Queue an item's outcome for writing, past the run guard."""
        if isinstance(outcome, Rejected):
            self._rejected(outcome)
            return
        if isinstance(outcome, Done):
            self._answered(outcome.output.server, outcome.lease.dataset_id)
        else:
            self.guard.settled(outcome.lease.dataset_id, outcome.kind)
        self.committer.submit(outcome)

    def _rejected(self, outcome: Rejected) -> None:
        """A rejection that may be run-level is held until the breaker decides
        (orchestrator.guard): failed alone, or released when the breaker trips."""
        entry = Held(outcome.lease, outcome.failure)
        was_tripped = self.guard.breaker.tripped is not None
        if not self.guard.rejected(outcome.server, entry, outcome.message):
            self.committer.submit(Failed(outcome.lease, outcome.failure))
        elif was_tripped:
            self._release_held(entry)
        elif self.guard.breaker.tripped is not None:
            halted = self.guard.trip({d.id: d.name for d in self._datasets.values()})
            if halted is not None:
                self._halt(halted)
            self._release_held()
        self.committer.poke()  # the slot is free: the next trial item may go

    def _answered(self, server: str, dataset_id: int) -> None:
        for entry in self.guard.answered(server, dataset_id):
            self.committer.submit(Failed(entry.lease, entry.failure))

    def _release_held(self, *extra: Held) -> None:
        """Give the attempts back of every held rejection (tripped, or stopping)."""
        for entry in [*self.guard.breaker.take_all(), *extra]:
            self.committer.submit(Release(entry.lease, entry.failure, time.time()))

    async def _vet(self, server: str) -> bool:
        """A server's ``/v1/models``, once, before its first request (orchestrator.guard)."""
        found = await inference.models(
            self.client.session, server, self.client.config.health_timeout
        )
        halted = self.guard.check_models(server, found, self._scope())
        if halted is not None:
            self._halt(halted)
            return False
        return True

    # -------------------------------------------------------------------- one item

    async def _process(self, held: _Held) -> None:
        outcome: Outcome | None = None
        try:
            outcome = await self._call(held)
        finally:
            # The slot is free once the answer is in; the write happens in a later round.
            self._active -= 1
            self._fill()
            if outcome is not None:
                self._hand_over(outcome)
            else:
                self.committer.poke()

    async def _call(self, held: _Held) -> Outcome | None:
        """Call a server for one item (each of its turns, for a multi-turn item); say
        what should become of it. None: the lease went while a turn was being written."""
        lease = held.lease
        info = await self._dataset(lease.dataset_id)
        while True:
            result = await self._call_turn(lease, info)
            if not isinstance(result, Output):
                return result
            if lease.turn + 1 >= lease.turns:
                return Done(lease, result)
            if stops_after(lease.request["messages"], lease.turn, result.message):
                return Done(lease, classify.stopped(lease, result))
            landed = asyncio.get_running_loop().create_future()
            self.committer.submit(Advance(lease, result, landed))
            if not await landed:
                return None
            lease = held.lease = classify.next_turn(lease, result)

    async def _call_turn(self, lease: Lease, info: DatasetInfo) -> Outcome | Output:
        """One request: its answer, or what should become of the item."""
        body = {**info.params, **lease.request}
        if lease.turns > 1 or info.regenerate == "all":
            # Every turn of such an item, its only one too, is asked without its original
            # answer, which the stored conversation still holds.
            try:
                body["messages"] = turn_messages(
                    lease.request["messages"], lease.turn, lease.generated
                )
            except ValueError as exc:
                return Failed(lease, Failure(ec.CONVERSATION, where(lease) + str(exc)))
        server = self.pool.pick()
        if server is None:
            return Release(lease, Failure(ec.UNAVAILABLE, "no server reachable"), time.time())
        self.pool.request_started(server)
        try:
            completion = await self.client.chat(server, body)
        except Exception as exc:  # a bug here must not take the other requests down
            return await self._call_failed(lease, server, exc)
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

    async def _call_failed(self, lease: Lease, server: str, exc: Exception) -> Outcome:
        """Classify a request's failure; the server's accounting hears of it too."""
        if isinstance(exc, ServerUnavailable):
            self.pool.mark_down(server, str(exc))
            return Release(lease, Failure(exc.error_class, str(exc)), time.time())
        if isinstance(exc, TransientError):
            if exc.error_class in classify.MAYBE_DOWN and not await self.client.health(server):
                # The connection broke because the server went away: an outage, not
                # the item's fault.
                self.pool.mark_down(server, str(exc))
                return Release(lease, Failure(ec.UNAVAILABLE, str(exc)), time.time())
            self.pool.failed(server, exc.error_class)
            return classify.retry_or_fail(lease, exc, exc.retry_after, self.config)
        if isinstance(exc, PermanentError):
            failure = Failure(exc.error_class, where(lease) + str(exc))
            return Rejected(lease, server, str(exc), failure)
        if not isinstance(exc, InferenceError):
            log.exception("item_crashed", item=lease.item_id, key=lease.key)
            exc = InferenceError(f"{type(exc).__name__}: {exc}", error_class=ec.INTERNAL)
        return classify.retry_or_fail(lease, exc, None, self.config)

    async def _dataset(self, dataset_id: int) -> DatasetInfo:
        if dataset_id not in self._datasets:
            await self._load_datasets()
        return self._datasets[dataset_id]

    async def _load_datasets(self) -> None:
        """Parameters and policies of the datasets; reloaded every few seconds, so an
        ``enqueue --update`` reaches running workers for the items they claim next."""
        self._datasets = {d.id: d for d in await list_datasets(self.database)}
        self._datasets_loaded = time.monotonic()

    async def _tune(self) -> None:
        """Every ``auto_interval`` seconds, let the pool set its adapted servers' caps."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.config.auto_interval)
            now = time.monotonic()
            elapsed, last = now - last, now
            try:
                await self.pool.tune(elapsed)
            except Exception:  # the tuner must outlive any one bad look
                log.exception("tuner_crashed")

    # -------------------------------------------------------------------- leases

    def held_leases(self) -> list[tuple[int, str]]:
        """Each held item and its lease token, for the keeper to renew."""
        return [(h.lease.item_id, h.lease.token) for h in self._held.values()]

    def lease_lost(self, item_id: int) -> None:
        """The keeper could not renew this lease: another worker took the item over."""
        entry = self._held.get(item_id)
        if entry is None:
            return
        if entry.task is not None and entry.task.done():
            return  # its outcome is queued; the fenced write will drop it
        # Stop working on it (or never start).
        self._held.pop(item_id)
        self._suspects -= entry.lease.suspect
        if entry.task is not None:
            entry.cancel_reason = "lease_lost"
            entry.task.cancel()
        self.stats.lost += 1
        log.warning("lease_lost", item=item_id, key=entry.lease.key)

    def file_gone(self, error: StorageError) -> None:
        """The database file was deleted or replaced: stop at once; ``run`` raises it."""
        self._file_gone = error
        self.request_stop(force=True)

    # -------------------------------------------------------------------- shutdown

    async def _drain(self) -> None:
        """Let running requests finish within the grace period, release the rest."""
        unstarted = list(self._buffer)
        self._buffer.clear()
        running = [h for h in self._held.values() if h.task is not None and not h.task.done()]
        tasks = [h.task for h in running if h.task is not None]
        if tasks and self._grace > 0:
            log.info("draining", in_flight=len(tasks), grace_s=self._grace)
            done_waiting = asyncio.create_task(asyncio.wait(tasks, timeout=self._grace))
            # A second signal (forced stop) cuts the grace period short.
            while not done_waiting.done():
                await _first(asyncio.shield(done_waiting), asyncio.sleep(0.2))
                if self._grace == 0:
                    break
            done_waiting.cancel()
        leftovers = [h for h in running if h.task is not None and not h.task.done()]
        for held in leftovers:
            held.cancel_reason = held.cancel_reason or "shutdown"
            held.task.cancel()  # type: ignore[union-attr]
        for held in leftovers:
            with contextlib.suppress(asyncio.CancelledError):
                await held.task  # type: ignore[misc]
        # Through the committer, after any outcome already queued for the same item, so
        # a result that made it in time is kept and its release is fenced out.
        released_before = self.stats.released
        failure = Failure(ec.SHUTDOWN, "released at worker shutdown")
        for lease in [h.lease for h in leftovers if h.cancel_reason == "shutdown"] + unstarted:
            if lease.item_id in self._held:
                self.committer.submit(Release(lease, failure, 0.0))
        if leftovers or unstarted:
            await self.committer.close()
            log.info("released_at_shutdown", items=self.stats.released - released_before)


async def _first(*aws: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
