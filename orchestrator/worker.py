"""The worker loop: claim → call → commit, within concurrency limits, until told to stop.

It composes the queue (``orchestrator.store``) and the inference client
(``orchestrator.client``) and owns neither's details. One task per item calls a server;
beside them run:

* the committer, the worker's one writer: each of its rounds writes every outcome queued
  since the last one and claims work for the free slots, in a single transaction, so a
  busy worker writes many items per transaction and the database has one writer per
  process;
* the keeper: renews the leases of in-flight items well before they expire (cancelling
  any request whose lease was taken over), writes the worker's heartbeat, reaps expired
  leases and those of dead workers on this host, and checkpoints the WAL;
* one prober per unreachable server, polling ``/health`` until it answers.

An outage (no server reachable) pauses claiming; items caught in it are released with
their attempt given back. Retryable failures go back to pending with exponential backoff
and jitter; permanent ones fail at once with the server's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from sqlalchemy import exc as sa_exc

from orchestrator import procinfo
from orchestrator.autoconcurrency import Controller, Limits, Sample
from orchestrator.client import Completion, InferenceClient
from orchestrator.conversation import stops_after, turn_messages
from orchestrator.errors import (
    ConfigError,
    InferenceError,
    ItemsFailed,
    ItemsLeftPending,
    PermanentError,
    RunStopped,
    ServersUnreachable,
    ServerUnavailable,
    StorageError,
    TransientError,
)
from orchestrator.guard import Held, RunGuard
from orchestrator.quality import TOOL_MISMATCH
from orchestrator.servers import Cap, ServerPool
from orchestrator.store import Database, Failure, Lease, Output, Queue, list_datasets
from orchestrator.store import workers as worker_rows
from orchestrator.store.datasets import DatasetInfo
from orchestrator.store.queue import Claim, Round

if TYPE_CHECKING:
    from orchestrator.metrics import WorkerMetrics

log = structlog.get_logger("orchestrator.worker")

# How often a worker rereads dataset parameters and policies (seconds).
_DATASETS_EVERY = 5.0

# Items claimed first from each dataset, until it has had that many (see Claim.scouts).
SCOUTS = 16

# Seconds between looks at whether the database file is still the one opened.
FILE_CHECK_EVERY = 60.0

# Failures that may mean the server itself died mid-request; /health tells.
_MAYBE_DOWN = frozenset({"disconnect", "timeout", "stream_idle"})


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How a worker runs. Defaults suit long reasoning answers on a self-hosted server.

    ``lease_seconds`` is how long a claimed item stays ours without a renewal; leases are
    renewed every quarter of it, so a crashed worker's items return within that time (at
    once, for a worker on the same host). ``max_attempts`` counts claims: an item that
    keeps failing, or keeps killing its worker, fails after that many.

    ``concurrency`` is per server (``server_caps`` overrides it for some): the worker keeps
    the sum of its healthy servers' caps in flight. ``"auto"`` adapts a server's cap to
    what it takes (``orchestrator.autoconcurrency``), within ``auto_limits``, looking at
    it every ``auto_interval`` seconds.
    """

    servers: tuple[str, ...]
    concurrency: Cap = 64
    server_caps: Mapping[str, Cap] = dataclasses.field(default_factory=dict)
    auto_limits: Limits = dataclasses.field(default_factory=Limits)
    auto_interval: float = 1.0
    failure_limit: int = 5
    datasets: tuple[str, ...] = ()
    exit_when_done: bool = False
    lease_seconds: float = 120.0
    max_attempts: int = 8
    grace_seconds: float = 30.0
    backoff_base: float = 2.0
    backoff_cap: float = 300.0
    poll_interval: float = 0.5
    probe_min: float = 0.5
    probe_max: float = 5.0
    checkpoint_every: float = 60.0
    progress_every: float = 30.0
    # The run's history for the dashboard (orchestrator.store.samples); 0: none.
    sample_every: float = 60.0
    # Seconds without any reachable server after which the run stops (None: wait on).
    give_up_after: float | None = None
    # Different items rejected the same way in a row that stop the run (orchestrator.guard).
    breaker_items: int = 5
    # Seconds a dataset's trial request in flight unrefused opens it (orchestrator.guard).
    trial_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("at least one --server is needed")
        for cap in (self.concurrency, *self.server_caps.values()):
            if cap != "auto" and (not isinstance(cap, int) or cap < 1):
                raise ConfigError(f"--concurrency must be at least 1 or 'auto', got {cap!r}")
        unknown = set(self.server_caps) - set(self.servers)
        if unknown:
            raise ConfigError(f"a cap is given for servers not in use: {sorted(unknown)}")
        if self.failure_limit < 1:
            raise ConfigError("failure_limit must be at least 1")
        if self.lease_seconds < 2:
            raise ConfigError("--lease-seconds must be at least 2")
        if self.max_attempts < 1:
            raise ConfigError("--max-attempts must be at least 1")
        if self.grace_seconds < 0:
            raise ConfigError("--grace must not be negative")
        if self.give_up_after is not None and self.give_up_after <= 0:
            raise ConfigError("--give-up-after must be more than 0 seconds")
        if self.breaker_items < 1:
            raise ConfigError("breaker_items must be at least 1")


class Notifier(Protocol):
    """Who hears about the worker's life (a service manager, for one)."""

    def ready(self) -> None: ...
    def stopping(self) -> None: ...
    def status(self, text: str) -> None: ...


class _Silent:
    def ready(self) -> None:
        pass

    def stopping(self) -> None:
        pass

    def status(self, text: str) -> None:
        pass


@dataclass(slots=True)
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lost: int = 0
    completion_tokens: int = 0
    turns: int = 0  # turns of multi-turn items generated before their last one
    dropped: int = 0  # outcomes given up at shutdown: the database took none of them


def backoff_delay(attempt: int, *, base: float, cap: float, retry_after: float | None) -> float:
    """Capped exponential backoff with ±25 % jitter; a server's Retry-After wins if longer."""
    delay = min(cap, base * 2 ** max(attempt - 1, 0)) * random.uniform(0.75, 1.25)
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


# ------------------------------------------------------------------------ committer


@dataclass(slots=True)
class Outcome:
    """What became of one attempt, waiting for the committer to write it."""

    kind: str  # complete | advance | retry | release | fail
    lease: Lease
    payload: Any
    # Set when the outcome is written (an advance waits for it: the next turn needs it).
    written: asyncio.Future[bool] | None = None
    # Writes of it alone that failed while other outcomes were written (see Committer).
    failures: int = 0


# An outcome that fails alone this many times while others are written is at fault.
_ALONE_FAILURES = 3


class Committer:
    """The one writer of a worker: each round settles every queued outcome and claims
    work for the free slots, in one transaction.

    Rounds run back to back while there is work, so they grow with the load: a busy
    worker writes many outcomes per transaction instead of one transaction per item.

    A round that fails is written again one outcome at a time, so that one outcome the
    database cannot take (a value it cannot bind or hold) stops nobody else: that one is
    handed to ``unstorable``, which says what to write instead (the item retried or
    failed as ``bad_response``, with the reason). A storage fault (disk full, file locked
    for too long) fails every write; those outcomes are kept and written again with
    backoff until they land, their leases are gone, or the shutdown deadline passes:
    then they are dropped, counted in ``dropped``, and their leases left to expire.
    """

    def __init__(
        self,
        queue: Queue,
        *,
        plan: Callable[[], Claim | None],
        deliver: Callable[[list[Lease], Claim], None],
        settled: Callable[[Outcome, bool], None],
        idle_poll: float,
        unstorable: Callable[[Outcome, str], Outcome | None] | None = None,
    ):
        self.queue = queue
        self._plan = plan
        self._deliver = deliver
        self._settled = settled
        self._unstorable = unstorable or (lambda _entry, _reason: None)
        self._idle_poll = idle_poll
        self._items: list[Outcome] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._deadline: float | None = None
        self._deadline_moved = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="committer")

    def submit(
        self, kind: str, lease: Lease, payload: Any, written: asyncio.Future[bool] | None = None
    ) -> None:
        self._items.append(Outcome(kind, lease, payload, written))
        self._wake.set()

    def poke(self) -> None:
        """Something changed that may allow a claim (a free slot, a server back)."""
        self._wake.set()

    def give_up_at(self, deadline: float) -> None:
        """Once closing, drop what still cannot be written after ``deadline`` (monotonic
        seconds): a stop must not hang on a database that takes nothing."""
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            self._deadline_moved.set()

    @property
    def backlog(self) -> int:
        return len(self._items)

    async def close(self) -> None:
        """Write what is queued, claim nothing more, and stop."""
        self._closing = True
        self._wake.set()
        self._deadline_moved.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        delay = 0.5
        while True:
            claim = None if self._closing else self._plan()
            if not self._items and claim is None:
                if self._closing:
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._idle_poll)
                continue
            batch, self._items = self._items, []
            try:
                result = await self.queue.write_round(_round(batch, claim))
            except Exception as exc:
                kept, error = await self._isolate(batch, exc) if batch else ([], exc)
                if batch and not kept:
                    delay = 0.5
                    continue  # each outcome was written, or replaced, alone
                # Keep them and try again: the fault (a full disk, a lock held too long)
                # may be fixed, and fencing keeps a late write harmless.
                log.error(
                    "commit_failed",
                    error=str(error),
                    error_type=type(error).__name__,
                    batch=len(kept),
                    retry_in_s=delay,
                    exc_info=not isinstance(error, StorageError),
                )
                self._items[:0] = kept
                if self._past_deadline():
                    self._drop(str(error))
                    return
                with contextlib.suppress(Exception):
                    # A full disk may be the WAL's doing: fold it back and truncate it.
                    await self.queue.db.checkpoint("TRUNCATE")
                await self._pause(delay)
                if self._past_deadline():
                    self._drop(str(error))
                    return
                delay = min(delay * 2, 30.0)
                continue
            delay = 0.5
            for entry in batch:
                self._settled(entry, entry.lease.item_id in result.accepted.get(entry.kind, ()))
            if claim is not None:
                self._deliver(result.leases, claim)

    async def _isolate(
        self, batch: list[Outcome], error: Exception
    ) -> tuple[list[Outcome], Exception]:
        """After a failed round: write each outcome alone. Returns those still unwritten
        (a storage fault: every write fails) and the last error seen."""
        if len(batch) == 1 and not _is_data_fault(error):
            return batch, error
        failed: list[tuple[Outcome, Exception]] = []
        wrote = False
        for entry in batch:
            try:
                result = await self.queue.write_round(_round([entry], None))
            except Exception as exc:
                error = exc
                if _is_data_fault(exc):
                    await self._replace(entry, exc)
                else:
                    failed.append((entry, exc))
                continue
            wrote = True
            self._settled(entry, entry.lease.item_id in result.accepted.get(entry.kind, ()))
        kept: list[Outcome] = []
        for entry, exc in failed:
            # Others were written meanwhile: an outcome failing alone again and again is
            # at fault whatever the driver calls its error; a full disk or a lock is not.
            if wrote and not _is_fault_of(exc, _STORAGE_FAULTS):
                entry.failures += 1
            if entry.failures >= _ALONE_FAILURES:
                await self._replace(entry, exc)
            else:
                kept.append(entry)
        return kept, error

    async def _replace(self, entry: Outcome, error: Exception) -> None:
        """Write what ``unstorable`` says instead of an outcome that cannot be stored."""
        reason = f"{type(error).__name__}: {error}"
        log.error(
            "outcome_unstorable",
            item=entry.lease.item_id,
            key=entry.lease.key,
            kind=entry.kind,
            error=reason[:500],
        )
        if entry.written is not None and not entry.written.done():
            entry.written.set_result(False)  # the next turn must not start from it
        instead = self._unstorable(entry, reason)
        if instead is not None:
            try:
                result = await self.queue.write_round(_round([instead], None))
            except Exception as exc:
                if not _is_data_fault(exc):
                    self._items.append(instead)  # the database's fault: try again later
                    return
                log.error("outcome_dropped", item=entry.lease.item_id, error=str(exc)[:500])
            else:
                accepted = instead.lease.item_id in result.accepted.get(instead.kind, ())
                self._settled(instead, accepted)
                return
        # Nothing could be written for it: its lease expires and the item is taken back.
        self._settled(entry, False)

    def _past_deadline(self) -> bool:
        return self._closing and self._deadline is not None and time.monotonic() >= self._deadline

    async def _pause(self, delay: float) -> None:
        """Sleep before the next try; a stop deadline passing cuts it short."""
        until = time.monotonic() + delay
        while (left := until - time.monotonic()) > 0 and not self._past_deadline():
            if self._closing and self._deadline is not None:
                left = min(left, max(self._deadline - time.monotonic(), 0.0))
            self._deadline_moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_moved.wait(), left)

    def _drop(self, error: str) -> None:
        """Stop trying: drop what is unwritten, in one log line; the leases expire."""
        dropped, self._items = self._items, []
        for entry in dropped:
            if entry.written is not None and not entry.written.done():
                entry.written.set_result(False)
        self.dropped += len(dropped)
        log.error("outcomes_dropped", outcomes=len(dropped), error=error[:500])


def _is_data_fault(exc: BaseException) -> bool:
    """The error is about the values written, not the database: a value the driver
    cannot bind, or the database cannot hold (a NUL in PostgreSQL text, a number out of
    range, a constraint)."""
    return _is_fault_of(exc, _DATA_FAULTS, binding=True)


def _is_fault_of(
    exc: BaseException, kinds: tuple[type[BaseException], ...], *, binding: bool = False
) -> bool:
    """Whether ``exc`` or an error under it (its cause, the driver's own) is one of
    ``kinds`` (or, with ``binding``, a parameter the driver could not bind)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, kinds):
            return True
        driver_error = isinstance(current, sa_exc.DBAPIError | sqlite3.Error)
        if binding and driver_error and "binding" in str(current):
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


# Disk full, locks, I/O errors, a lost connection: the database's state, not the data's.
_STORAGE_FAULTS = (sa_exc.OperationalError, sqlite3.OperationalError)

_DATA_FAULTS = (
    sa_exc.DataError,
    sa_exc.IntegrityError,
    sqlite3.DataError,
    sqlite3.IntegrityError,
    TypeError,
    ValueError,
    OverflowError,
)


def _round(batch: list[Outcome], claim: Claim | None) -> Round:
    work = Round(claim=claim)
    for entry in batch:
        if entry.kind == "complete":
            work.complete.append((entry.lease, entry.payload))
        elif entry.kind == "advance":
            work.advance.append((entry.lease, entry.payload))
        elif entry.kind == "fail":
            work.fail.append((entry.lease, entry.payload))
        elif entry.kind == "retry":
            work.retry.append((entry.lease, *entry.payload))
        else:
            work.release.append((entry.lease, *entry.payload))
    return work


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


# ------------------------------------------------------------------------ worker


@dataclass(slots=True)
class _Held:
    """A lease this worker holds, from its claim until its outcome is written."""

    lease: Lease
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None


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
        self.notifier: Notifier = notifier or _Silent()
        self.client = client
        self.config = config
        self.owner = owner or procinfo.owner_id()
        self.stats = WorkerStats()
        self.queue = Queue(database)
        caps: dict[str, int] = {}
        controllers: dict[str, Controller] = {}
        for server in config.servers:
            cap = config.server_caps.get(server, config.concurrency)
            if cap == "auto":
                controllers[server] = Controller(config.auto_limits)
                cap = controllers[server].cap
            caps[server] = cap
        self.pool = ServerPool(
            caps, client, config, controllers=controllers, on_change=self._capacity_changed
        )
        self.committer = Committer(
            self.queue,
            plan=self._plan_claim,
            deliver=self._deliver,
            settled=self._settled,
            idle_poll=config.poll_interval,
            unstorable=self._unstorable,
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
            metrics.in_flight.set_function(lambda: self._active)
            metrics.prefetched.set_function(lambda: len(self._buffer))
            for server, state in self.pool.states.items():
                metrics.server_up.labels(server).set_function(lambda st=state: float(st.healthy))
                metrics.server_concurrency.labels(server).set_function(
                    lambda st=state: float(st.cap)
                )

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
        await self._reap()
        await self._load_datasets()
        self.pool.start()
        self.committer.start()
        keeper = asyncio.create_task(self._keeper(), name="keeper")
        watcher = asyncio.create_task(self._watch_file(), name="file-watcher")
        tuner = None
        if any(st.controller is not None for st in self.pool.states.values()):
            tuner = asyncio.create_task(self._tune(), name="tuner")
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
            self._release_held()
            await self._drain()
            for task in (keeper, watcher, tuner):
                if task is not None:
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
            log.info("worker_stopped", **_stats_fields(self.stats))
        if self.halted is not None:
            raise self.halted
        if self._file_gone is not None:
            raise self._file_gone
        return self.stats

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
                self.committer.submit("fail", entry.lease, entry.failure)
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
        scope = set(self.config.datasets) or {name for name, _ in counts}
        by_state: dict[str, int] = {}
        for (name, state), n in counts.items():
            if name in scope:
                by_state[state] = by_state.get(state, 0) + n
        left = by_state.get("pending", 0) + by_state.get("running", 0)
        failed = by_state.get("failed", 0)
        log.info("all_done", done=by_state.get("done", 0), failed=failed, left_pending=left)
        summary = f"finished with {by_state.get('done', 0):,} done"
        if failed:
            self.unfinished = ItemsFailed(
                f"{summary}, {failed:,} failed (see `orchestrator status`; "
                "`orchestrator requeue` retries them)"
                + (f", {left:,} pending in paused datasets" if left else "")
            )
        elif left:
            paused = sorted(d.name for d in self._datasets.values() if d.paused and d.name in scope)
            self.unfinished = ItemsLeftPending(
                f"{summary}, {left:,} pending in paused datasets ({', '.join(paused)}): "
                "`orchestrator resume NAME`, then run again"
            )

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

    def _settled(self, entry: Outcome, accepted: bool) -> None:
        lease = entry.lease
        if entry.written is not None and not entry.written.done():
            entry.written.set_result(accepted)
        if entry.kind == "advance" and accepted:
            self._answered(entry.payload.server, lease.dataset_id)
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
        if accepted and self.metrics is not None:
            self._observe(entry)
        if not accepted:
            if entry.kind == "release" and entry.payload[0].error_class == "shutdown":
                return  # its answer was written first, or its lease had already gone
            if held is None:
                return  # the keeper found the lease gone first, and counted it
            self.stats.lost += 1
            log.warning(
                "result_dropped_lease_lost", item=lease.item_id, key=lease.key, kind=entry.kind
            )
            return
        if entry.kind == "complete":
            self.stats.completed += 1
            self.stats.completion_tokens += (entry.payload.usage or {}).get(
                "completion_tokens", 0
            ) or 0
            self._rate.add()
        elif entry.kind == "retry":
            self.stats.retried += 1
        elif entry.kind == "fail":
            self.stats.failed += 1
            log.warning(
                "item_failed",
                item=lease.item_id,
                key=lease.key,
                error_class=entry.payload.error_class,
                error=entry.payload.message[:500],
            )
        else:
            self.stats.released += 1

    def _observe(self, entry: Outcome) -> None:
        assert self.metrics is not None
        info = self._datasets.get(entry.lease.dataset_id)
        name = info.name if info is not None else str(entry.lease.dataset_id)
        payload = entry.payload
        if isinstance(payload, Output):
            self.metrics.settled(name, entry.kind, None, payload.usage, payload.latency)
        else:
            failure = payload if isinstance(payload, Failure) else payload[0]
            self.metrics.settled(name, entry.kind, failure.error_class, None, None)

    # -------------------------------------------------------------------- one item

    def _outcome(self, lease: Lease, kind: str, payload: Any) -> None:
        """Queue an item's outcome for writing, past the run guard: a rejection that may
        be run-level is held until the breaker decides (orchestrator.guard)."""
        if kind == "hold":
            server, message, failure = payload
            entry = Held(lease, failure)
            was_tripped = self.guard.breaker.tripped is not None
            if not self.guard.rejected(server, entry, message):
                self.committer.submit("fail", lease, failure)
            elif was_tripped:
                self._release_held(entry)
            elif self.guard.breaker.tripped is not None:
                halted = self.guard.trip({d.id: d.name for d in self._datasets.values()})
                if halted is not None:
                    self._halt(halted)
                self._release_held()
            self.committer.poke()  # the slot is free: the next trial item may go
            return
        if kind == "complete":
            self._answered(payload.server, lease.dataset_id)
        else:
            self.guard.settled(lease.dataset_id, kind)
        self.committer.submit(kind, lease, payload)

    def _answered(self, server: str, dataset_id: int) -> None:
        for entry in self.guard.answered(server, dataset_id):
            self.committer.submit("fail", entry.lease, entry.failure)

    def _release_held(self, *extra: Held) -> None:
        """Give the attempts back of every held rejection (tripped, or stopping)."""
        for entry in [*self.guard.breaker.take_all(), *extra]:
            self.committer.submit("release", entry.lease, (entry.failure, time.time()))

    async def _vet(self, server: str) -> bool:
        """A server's ``/v1/models``, once, before its first request (orchestrator.guard)."""
        from orchestrator import preflight

        found = await preflight.models(
            self.client.session, server, self.client.config.health_timeout
        )
        halted = self.guard.check_models(server, found, self._scope())
        if halted is not None:
            self._halt(halted)
            return False
        return True

    async def _process(self, held: _Held) -> None:
        outcome: tuple[str, Any] | None = None
        try:
            outcome = await self._call(held)
        finally:
            # The slot is free once the answer is in; the write happens in a later round.
            self._active -= 1
            self._fill()
            if outcome is not None:
                self._outcome(held.lease, *outcome)
            else:
                self.committer.poke()

    async def _call(self, held: _Held) -> tuple[str, Any] | None:
        """Call a server for one item (each of its turns, for a multi-turn item); say
        what should become of it. None: the lease went while a turn was being written."""
        lease = held.lease
        info = await self._dataset(lease.dataset_id)
        while True:
            result = await self._call_turn(lease, info)
            if not isinstance(result, Output):
                return result
            if lease.turn + 1 >= lease.turns:
                return "complete", result
            if stops_after(lease.request["messages"], lease.turn, result.message):
                return "complete", self._stopped(lease, result)
            written = asyncio.get_running_loop().create_future()
            self.committer.submit("advance", lease, result, written)
            if not await written:
                return None
            lease = dataclasses.replace(
                lease,
                turn=lease.turn + 1,
                attempt=1,
                generated=(*lease.generated, result.message),
                generated_tokens=lease.generated_tokens
                + ((result.usage or {}).get("completion_tokens") or 0),
                generated_flags=lease.generated_flags | result.flags,
                generated_latency=lease.generated_latency + result.latency,
            )
            held.lease = lease

    async def _call_turn(self, lease: Lease, info: DatasetInfo) -> tuple[str, Any] | Output:
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
                return "fail", Failure("conversation", _where(lease) + str(exc))
        server = self.pool.pick()
        if server is None:
            return "release", (Failure("unavailable", "no server reachable"), time.time())
        state = self.pool.states[server]
        state.in_flight += 1
        try:
            completion = await self.client.chat(server, body)
        except ServerUnavailable as exc:
            self.pool.mark_down(server, str(exc))
            return "release", (Failure(exc.error_class, str(exc)), time.time())
        except TransientError as exc:
            if exc.error_class in _MAYBE_DOWN and not await self.client.health(server):
                # The connection broke because the server went away: an outage, not
                # the item's fault.
                self.pool.mark_down(server, str(exc))
                return "release", (Failure("unavailable", str(exc)), time.time())
            self.pool.failed(server, exc.error_class)
            return self._retry_or_fail(lease, exc, exc.retry_after)
        except PermanentError as exc:
            return "hold", (server, str(exc), Failure(exc.error_class, _where(lease) + str(exc)))
        except InferenceError as exc:
            return self._retry_or_fail(lease, exc, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take the other requests down
            log.exception("item_crashed", item=lease.item_id, key=lease.key)
            error = InferenceError(f"{type(exc).__name__}: {exc}", error_class="internal")
            return self._retry_or_fail(lease, error, None)
        finally:
            state.in_flight -= 1
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
        if completion.finish_reason == "length" and info.on_truncated != "keep":
            limit = body.get("max_tokens") or body.get("max_completion_tokens")
            truncated = TransientError(
                f"the answer was cut at max_tokens={limit}", error_class="truncated"
            )
            if info.on_truncated == "fail":
                return "fail", Failure("truncated", _where(lease) + str(truncated))
            return self._retry_or_fail(lease, truncated, None)
        return _output(completion, info.params_hash)

    @staticmethod
    def _stopped(lease: Lease, result: Output) -> Output:
        """The last turn of a conversation that cannot go on: the model's tool calls went
        another way than the original's, whose results would answer calls never made."""
        log.info(
            "conversation_stopped",
            item=lease.item_id,
            key=lease.key,
            turn=lease.turn,
            turns=lease.turns,
            reason="tool_mismatch",
        )
        return dataclasses.replace(result, flags=result.flags | TOOL_MISMATCH)

    def _retry_or_fail(
        self, lease: Lease, exc: InferenceError, retry_after: float | None
    ) -> tuple[str, Any]:
        if exc.error_class == "rate_limited" and retry_after is not None:
            # The server said when to come back: not the item's fault, so the attempt is
            # given back and a long rate limit cannot use up the item's attempts.
            delay = backoff_delay(
                1,
                base=self.config.backoff_base,
                cap=self.config.backoff_cap,
                retry_after=retry_after,
            )
            failure = Failure(exc.error_class, _where(lease) + str(exc))
            return "release", (failure, time.time() + delay)
        if lease.attempt >= self.config.max_attempts:
            message = f"{_where(lease)}gave up after {lease.attempt} attempts: {exc}"
            return "fail", Failure(exc.error_class, message)
        delay = backoff_delay(
            lease.attempt,
            base=self.config.backoff_base,
            cap=self.config.backoff_cap,
            retry_after=retry_after,
        )
        log.warning(
            "item_retry",
            item=lease.item_id,
            key=lease.key,
            attempt=lease.attempt,
            error_class=exc.error_class,
            delay_s=round(delay, 2),
            error=str(exc)[:300],
        )
        return "retry", (Failure(exc.error_class, _where(lease) + str(exc)), time.time() + delay)

    def _unstorable(self, entry: Outcome, reason: str) -> Outcome | None:
        """What to write for an outcome the database refused: an answer becomes a
        ``bad_response`` attempt (retried, or failed once attempts are spent); a failure
        is written with its message left out. None: nothing more to try."""
        lease = entry.lease
        if entry.kind in ("complete", "advance"):
            error = TransientError(
                f"the answer could not be stored: {reason}", error_class="bad_response"
            )
            kind, payload = self._retry_or_fail(lease, error, None)
            return Outcome(kind, lease, payload)
        failure = entry.payload if isinstance(entry.payload, Failure) else entry.payload[0]
        if failure.message.startswith("(unstorable)"):
            return None
        plain = Failure(failure.error_class[:64], f"(unstorable) {reason}"[:4000])
        if entry.kind == "fail":
            return Outcome("fail", lease, plain)
        return Outcome(entry.kind, lease, (plain, *entry.payload[1:]))

    async def _dataset(self, dataset_id: int) -> DatasetInfo:
        if dataset_id not in self._datasets:
            await self._load_datasets()
        return self._datasets[dataset_id]

    async def _load_datasets(self) -> None:
        """Parameters and policies of the datasets; reloaded every few seconds, so an
        ``enqueue --update`` reaches running workers for the items they claim next."""
        self._datasets = {d.id: d for d in await list_datasets(self.database)}
        self._datasets_loaded = time.monotonic()

    # -------------------------------------------------------------------- auto caps

    async def _tune(self) -> None:
        """Every ``auto_interval`` seconds, look at each adapted server and set its cap."""
        blind: set[str] = set()
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.config.auto_interval)
            now = time.monotonic()
            elapsed, last = now - last, now
            try:
                tuned = [st for st in self.pool.states.values() if st.controller and st.healthy]
                views = await asyncio.gather(*(self.pool.metrics(st.url) for st in tuned))
                for state, view in zip(tuned, views, strict=True):
                    if view is None and state.url not in blind:
                        blind.add(state.url)
                        log.info("server_metrics_unavailable", server=state.url)
                    sample = Sample(
                        elapsed=elapsed,
                        in_flight=state.in_flight,
                        tokens_per_s=state.tokens / elapsed if elapsed > 0 else None,
                        latency=state.latency / state.answers if state.answers else None,
                        **(view or {}),
                    )
                    state.answers = state.tokens = 0
                    state.latency = 0.0
                    assert state.controller is not None
                    change = state.controller.update(sample)
                    if change is not None:
                        log.info(
                            "concurrency_changed",
                            server=state.url,
                            old=change.old,
                            new=change.new,
                            reason=change.reason,
                        )
                        self.pool.set_cap(state.url, change.new)
            except Exception:  # the tuner must outlive any one bad look
                log.exception("tuner_crashed")

    # -------------------------------------------------------------------- leases

    async def _keeper(self) -> None:
        interval = self.config.lease_seconds / 4
        last_checkpoint = last_progress = time.monotonic()
        last_sample = float("-inf")
        while True:
            await asyncio.sleep(interval)
            try:
                await self._renew()
                await worker_rows.heartbeat(
                    self.database,
                    self.owner,
                    in_flight=self.in_flight,
                    completed=self.stats.completed,
                )
                await self._reap()
                now = time.monotonic()
                if now - last_checkpoint >= self.config.checkpoint_every:
                    await self.database.checkpoint()
                    last_checkpoint = now
                if self.config.sample_every and now - last_sample >= self.config.sample_every:
                    last_sample = now
                    await self._sample()
                self.notifier.status(
                    f"{self.stats.completed} done, {self.stats.failed} failed, "
                    f"{self.in_flight} in flight"
                )
                if now - last_progress >= self.config.progress_every:
                    log.info("progress", in_flight=self.in_flight, **_stats_fields(self.stats))
                    last_progress = now
            except StorageError as exc:
                log.error("keeper_failed", error=str(exc))
            except Exception:  # the keeper must outlive any one bad round
                log.exception("keeper_crashed")

    async def _watch_file(self) -> None:
        """Stop at once when the database file is deleted or replaced under the worker.

        SQLite would go on committing into the deleted file (a run reporting success with
        nothing kept), or into the WAL of a file moved over it (corrupting that one).
        Looked at every minute, or every keeper round when leases are shorter.
        """
        every = min(FILE_CHECK_EVERY, self.config.lease_seconds / 4)
        while True:
            await asyncio.sleep(every)
            try:
                self.database.check_file()
            except StorageError as exc:
                log.error("stopping_database_file_gone", db=self.database.where, error=str(exc))
                self._file_gone = exc
                self.request_stop(force=True)
                return

    async def _sample(self) -> None:
        """The run's history (store.samples), with the gauges of the servers we use.

        Every worker tries; the first past the interval writes. The servers are only
        scraped when a sample is due.
        """
        from orchestrator.monitor.server_metrics import scrape
        from orchestrator.store import samples

        if not await samples.due(self.database, self.config.sample_every):
            return
        gauges = await asyncio.gather(
            *(asyncio.to_thread(scrape, server) for server in self.config.servers)
        )
        await samples.record(self.database, interval=self.config.sample_every, servers=gauges)

    async def _renew(self) -> None:
        held = [(h.lease.item_id, h.lease.token) for h in self._held.values()]
        if not held:
            return
        kept = await self.queue.renew(held, lease_seconds=self.config.lease_seconds)
        if self.metrics is not None:
            self.metrics.renewals.labels("kept").inc(len(kept))
            self.metrics.renewals.labels("lost").inc(len(held) - len(kept))
        for item_id, _ in held:
            entry = self._held.get(item_id)
            if item_id in kept or entry is None:
                continue
            if entry.task is not None and entry.task.done():
                continue  # its outcome is queued; the fenced write will drop it
            # Taken over by another worker: stop working on it (or never start).
            self._held.pop(item_id)
            self._suspects -= entry.lease.suspect
            if entry.task is not None:
                entry.cancel_reason = "lease_lost"
                entry.task.cancel()
            self.stats.lost += 1
            log.warning("lease_lost", item=item_id, key=entry.lease.key)

    async def _reap(self) -> None:
        owners = await self.queue.running_owners()
        dead = [o for o in owners if o != self.owner and procinfo.is_dead_local(o)]
        reaped = await self.queue.reap(max_attempts=self.config.max_attempts, dead_owners=dead)
        if dead:
            await worker_rows.mark_dead(self.database, dead)
        if reaped:
            log.info("leases_reclaimed", items=reaped, dead_workers=len(dead))

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
        failure = Failure("shutdown", "released at worker shutdown")
        for lease in [h.lease for h in leftovers if h.cancel_reason == "shutdown"] + unstarted:
            if lease.item_id in self._held:
                self.committer.submit("release", lease, (failure, 0.0))
        if leftovers or unstarted:
            await self.committer.close()
            log.info("released_at_shutdown", items=self.stats.released - released_before)


def _output(c: Completion, params_hash: str) -> Output:
    return Output(
        message=c.message,
        content=c.content,
        reasoning=c.reasoning,
        finish_reason=c.finish_reason,
        usage=c.usage,
        latency=c.latency,
        server=c.server,
        model=c.model,
        response_id=c.response_id,
        flags=c.flags,
        params_hash=params_hash,
    )


def _where(lease: Lease) -> str:
    """Names the turn in a multi-turn item's error (requeue resumes it there)."""
    return f"turn {lease.turn + 1} of {lease.turns}: " if lease.turns > 1 else ""


def _stats_fields(stats: WorkerStats) -> dict[str, int]:
    return dataclasses.asdict(stats)


async def _first(*aws: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
