"""The worker loop: claim → call → commit, within concurrency limits, until told to stop.

It composes the queue (``orchestrator.store``) and the inference client
(``orchestrator.client``) and owns neither's details. Three background tasks run beside
the claim loop:

* the committer: every outcome goes through one task that writes them in batches (one
  transaction for many completions), so the database has one writer per process;
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
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from orchestrator import procinfo
from orchestrator.client import Completion, InferenceClient
from orchestrator.errors import (
    ConfigError,
    InferenceError,
    PermanentError,
    ServerUnavailable,
    StorageError,
    TransientError,
)
from orchestrator.store import Database, Failure, Lease, Output, Queue, list_datasets
from orchestrator.store import workers as worker_rows

log = structlog.get_logger("orchestrator.worker")

# Failures that may mean the server itself died mid-request; /health tells.
_MAYBE_DOWN = frozenset({"disconnect", "timeout", "stream_idle"})


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How a worker runs. Defaults suit long reasoning answers on a self-hosted server.

    ``lease_seconds`` is how long a claimed item stays ours without a renewal; leases are
    renewed every quarter of it, so a crashed worker's items return within that time (at
    once, for a worker on the same host). ``max_attempts`` counts claims: an item that
    keeps failing, or keeps killing its worker, fails after that many.
    """

    servers: tuple[str, ...]
    concurrency: int = 64
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

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("at least one --server is needed")
        if self.concurrency < 1:
            raise ConfigError("--concurrency must be at least 1")
        if self.lease_seconds < 2:
            raise ConfigError("--lease-seconds must be at least 2")
        if self.max_attempts < 1:
            raise ConfigError("--max-attempts must be at least 1")
        if self.grace_seconds < 0:
            raise ConfigError("--grace must not be negative")


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


def backoff_delay(attempt: int, *, base: float, cap: float, retry_after: float | None) -> float:
    """Capped exponential backoff with ±25 % jitter; a server's Retry-After wins if longer."""
    delay = min(cap, base * 2 ** max(attempt - 1, 0)) * random.uniform(0.75, 1.25)
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


# ------------------------------------------------------------------------ servers


@dataclass(slots=True)
class _ServerState:
    healthy: bool = False
    in_flight: int = 0
    failures: int = 0
    down_reason: str | None = None
    probe: asyncio.Task[None] | None = None


class ServerPool:
    """The servers a worker may use: least-loaded healthy one first, the rest probed."""

    def __init__(self, servers: tuple[str, ...], client: InferenceClient, config: WorkerConfig):
        self.client = client
        self.config = config
        self.states = {s: _ServerState() for s in servers}
        self.available = asyncio.Event()

    def start(self) -> None:
        for server in self.states:
            self.mark_down(server, "not probed yet", quiet=True)

    def healthy(self) -> list[str]:
        return [s for s, st in self.states.items() if st.healthy]

    def pick(self) -> str | None:
        candidates = self.healthy()
        if not candidates:
            return None
        return min(candidates, key=lambda s: self.states[s].in_flight)

    def mark_down(self, server: str, reason: str, *, quiet: bool = False) -> None:
        state = self.states[server]
        if state.probe is not None and not state.probe.done():
            return
        state.healthy = False
        state.failures += 1
        state.down_reason = reason
        if not quiet:
            log.warning("server_down", server=server, reason=reason)
        if not self.healthy():
            self.available.clear()
        state.probe = asyncio.create_task(self._probe(server), name=f"probe {server}")

    async def _probe(self, server: str) -> None:
        state = self.states[server]
        delay = self.config.probe_min * min(2 ** max(state.failures - 2, 0), 8)
        waited = 0.0
        while True:
            await asyncio.sleep(delay)
            waited += delay
            if await self.client.health(server):
                break
            if waited > 30 and state.failures <= 1:
                log.warning("server_unreachable", server=server, waited_s=round(waited))
                state.failures += 1
            delay = min(delay * 2, self.config.probe_max)
        was_reason = state.down_reason
        state.healthy = True
        state.down_reason = None
        self.available.set()
        if was_reason != "not probed yet":
            log.info("server_up", server=server, down_for_s=round(waited, 1))
        else:
            state.failures = 0

    def succeeded(self, server: str) -> None:
        self.states[server].failures = 0

    async def close(self) -> None:
        tasks = [st.probe for st in self.states.values() if st.probe and not st.probe.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ------------------------------------------------------------------------ committer


@dataclass(slots=True)
class _Pending:
    kind: str  # complete | retry | release | fail
    lease: Lease
    payload: Any
    future: asyncio.Future[bool]


class Committer:
    """The one writer of outcomes: drains everything queued into a few transactions.

    A storage fault (disk full, file locked for too long) does not lose outcomes: the
    batch is retried with backoff until it lands or its leases are gone.
    """

    def __init__(self, queue: Queue):
        self.queue = queue
        self._items: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="committer")

    def submit(self, kind: str, lease: Lease, payload: Any) -> asyncio.Future[bool]:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._items.append(_Pending(kind, lease, payload, future))
        self._wake.set()
        return future

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        delay = 0.5
        while True:
            if not self._items:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._items)
            self._items.clear()
            try:
                await self._write(batch)
                delay = 0.5
            except Exception as exc:
                # Keep every outcome and try again: the fault (a full disk, a lock held
                # too long) may be fixed, and fencing keeps a late write harmless.
                log.error(
                    "commit_failed",
                    error=str(exc),
                    error_type=type(exc).__name__,
                    batch=len(batch),
                    retry_in_s=delay,
                    exc_info=not isinstance(exc, StorageError),
                )
                self._items.extendleft(reversed(batch))
                with contextlib.suppress(Exception):
                    # A full disk may be the WAL's doing: fold it back and truncate it.
                    await self.queue.db.checkpoint("TRUNCATE")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def _write(self, batch: list[_Pending]) -> None:
        groups: dict[str, list[_Pending]] = {}
        for entry in batch:
            groups.setdefault(entry.kind, []).append(entry)
        # Keyed by entry: one item may have two outcomes in a batch (a result that
        # arrived, then its release at shutdown), and each gets its own answer.
        results: dict[int, bool] = {}
        for kind, entries in groups.items():
            if kind == "complete":
                accepted = await self.queue.complete([(e.lease, e.payload) for e in entries])
            elif kind == "fail":
                accepted = await self.queue.fail([(e.lease, e.payload) for e in entries])
            elif kind == "retry":
                accepted = await self.queue.retry([(e.lease, *e.payload) for e in entries])
            else:
                accepted = await self.queue.release([(e.lease, *e.payload) for e in entries])
            results.update({id(e): e.lease.item_id in accepted for e in entries})
        for entry in batch:
            if not entry.future.done():
                entry.future.set_result(results[id(entry)])


# ------------------------------------------------------------------------ worker


@dataclass(slots=True)
class _InFlight:
    lease: Lease
    task: asyncio.Task[None]
    cancel_reason: str | None = None


class Worker:
    """One process's share of the run."""

    def __init__(
        self,
        database: Database,
        client: InferenceClient,
        config: WorkerConfig,
        *,
        owner: str | None = None,
        notifier: Notifier | None = None,
    ):
        self.database = database
        self.notifier: Notifier = notifier or _Silent()
        self.client = client
        self.config = config
        self.owner = owner or procinfo.owner_id()
        self.stats = WorkerStats()
        self.queue = Queue(database)
        self.pool = ServerPool(config.servers, client, config)
        self.committer = Committer(self.queue)
        self._inflight: dict[int, _InFlight] = {}
        self._suspects = 0
        self._params: dict[int, dict[str, Any]] = {}
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._grace = config.grace_seconds

    def request_stop(self, *, force: bool = False) -> None:
        """Stop claiming; in-flight requests get the grace period (none when forced)."""
        if force or self._stopping.is_set():
            self._grace = 0.0
        self.notifier.stopping()
        self._stopping.set()
        self._slot_freed.set()
        log.info("stopping", in_flight=len(self._inflight), grace_s=self._grace)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def run(self) -> WorkerStats:
        await worker_rows.register(self.database, self.owner, procinfo.hostname(), os.getpid())
        await self._reap()
        await self._load_params()
        self.pool.start()
        self.committer.start()
        keeper = asyncio.create_task(self._keeper(), name="keeper")
        log.info(
            "worker_started",
            worker=self.owner,
            servers=list(self.config.servers),
            concurrency=self.config.concurrency,
            datasets=list(self.config.datasets) or None,
        )
        try:
            await self._claim_loop()
        finally:
            await self._drain()
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self.committer.close()
            await self.pool.close()
            with contextlib.suppress(StorageError):
                await worker_rows.mark_stopped(
                    self.database, self.owner, completed=self.stats.completed
                )
            with contextlib.suppress(Exception):
                await self.database.checkpoint("TRUNCATE")
            log.info("worker_stopped", **_stats_fields(self.stats))
        return self.stats

    # -------------------------------------------------------------------- claiming

    async def _claim_loop(self) -> None:
        storage_delay = 0.5
        ready = False
        while not self._stopping.is_set():
            if not self.pool.available.is_set():
                log.info("waiting_for_server", servers=list(self.config.servers))
                self.notifier.status("waiting for an inference server")
                await _first(self.pool.available.wait(), self._stopping.wait())
                continue
            if not ready:
                # The database is open and a server answers: ready for work.
                self.notifier.ready()
                ready = True
            free = self.config.concurrency - len(self._inflight)
            leases: list[Lease] = []
            if free > 0:
                try:
                    leases = await self.queue.claim(
                        self.owner,
                        free,
                        lease_seconds=self.config.lease_seconds,
                        dataset_names=self.config.datasets or None,
                        suspect_slots=0 if self._suspects else 1,
                    )
                    storage_delay = 0.5
                except StorageError as exc:
                    log.error("claim_failed", error=str(exc), retry_in_s=storage_delay)
                    await _first(asyncio.sleep(storage_delay), self._stopping.wait())
                    storage_delay = min(storage_delay * 2, 30.0)
                    continue
                for lease in leases:
                    self._start(lease)
            if free > 0 and len(leases) == free:
                await self._wait_slot(None)
                continue
            if (
                not leases
                and not self._inflight
                and self.config.exit_when_done
                and await self.queue.remaining(self.config.datasets or None) == 0
            ):
                log.info("all_done")
                return
            await self._wait_slot(self.config.poll_interval)

    async def _wait_slot(self, limit: float | None) -> None:
        self._slot_freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._slot_freed.wait(), limit)
        # Let a few more slots free up so that one claim serves several of them.
        await asyncio.sleep(0.002)

    def _start(self, lease: Lease) -> None:
        self.stats.claimed += 1
        self._suspects += lease.suspect
        task = asyncio.create_task(self._process(lease), name=f"item {lease.item_id}")
        self._inflight[lease.item_id] = _InFlight(lease, task)
        task.add_done_callback(lambda _t, item_id=lease.item_id: self._finished(item_id))

    def _finished(self, item_id: int) -> None:
        flight = self._inflight.pop(item_id, None)
        if flight is not None:
            self._suspects -= flight.lease.suspect
        self._slot_freed.set()

    # -------------------------------------------------------------------- one item

    async def _process(self, lease: Lease) -> None:
        body = {**await self._dataset_params(lease.dataset_id), **lease.request}
        server = self.pool.pick()
        if server is None:
            await self._outcome(
                "release", lease, (Failure("unavailable", "no server reachable"), time.time())
            )
            return
        state = self.pool.states[server]
        state.in_flight += 1
        try:
            completion = await self.client.chat(server, body)
        except ServerUnavailable as exc:
            self.pool.mark_down(server, str(exc))
            failure = Failure(exc.error_class, str(exc))
            await self._outcome("release", lease, (failure, time.time()))
        except TransientError as exc:
            if exc.error_class in _MAYBE_DOWN and not await self.client.health(server):
                # The connection broke because the server went away: an outage, not
                # the item's fault.
                self.pool.mark_down(server, str(exc))
                await self._outcome(
                    "release", lease, (Failure("unavailable", str(exc)), time.time())
                )
            else:
                await self._retry_or_fail(lease, exc, exc.retry_after)
        except PermanentError as exc:
            await self._outcome("fail", lease, Failure(exc.error_class, str(exc)))
        except InferenceError as exc:
            await self._retry_or_fail(lease, exc, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take the other requests down
            log.exception("item_crashed", item=lease.item_id, key=lease.key)
            error = InferenceError(f"{type(exc).__name__}: {exc}", error_class="internal")
            await self._retry_or_fail(lease, error, None)
        else:
            self.pool.succeeded(server)
            accepted = await self._outcome("complete", lease, _output(completion))
            if accepted:
                self.stats.completed += 1
                self.stats.completion_tokens += (completion.usage or {}).get(
                    "completion_tokens", 0
                ) or 0
        finally:
            state.in_flight -= 1

    async def _retry_or_fail(
        self, lease: Lease, exc: InferenceError, retry_after: float | None
    ) -> None:
        if lease.attempt >= self.config.max_attempts:
            message = f"gave up after {lease.attempt} attempts: {exc}"
            await self._outcome("fail", lease, Failure(exc.error_class, message))
            return
        delay = backoff_delay(
            lease.attempt,
            base=self.config.backoff_base,
            cap=self.config.backoff_cap,
            retry_after=retry_after,
        )
        log.debug(
            "item_retry",
            item=lease.item_id,
            key=lease.key,
            attempt=lease.attempt,
            error_class=exc.error_class,
            delay_s=round(delay, 2),
        )
        await self._outcome(
            "retry", lease, (Failure(exc.error_class, str(exc)), time.time() + delay)
        )

    async def _outcome(self, kind: str, lease: Lease, payload: Any) -> bool:
        """Hand the outcome to the committer; the write itself survives our cancellation."""
        accepted = await asyncio.shield(self.committer.submit(kind, lease, payload))
        if not accepted:
            self.stats.lost += 1
            log.warning("result_dropped_lease_lost", item=lease.item_id, key=lease.key, kind=kind)
            return False
        if kind == "retry":
            self.stats.retried += 1
        elif kind == "fail":
            self.stats.failed += 1
            log.warning(
                "item_failed",
                item=lease.item_id,
                key=lease.key,
                error_class=payload.error_class,
                error=payload.message[:500],
            )
        elif kind == "release":
            self.stats.released += 1
        return True

    async def _dataset_params(self, dataset_id: int) -> dict[str, Any]:
        if dataset_id not in self._params:
            await self._load_params()
        return self._params.get(dataset_id, {})

    async def _load_params(self) -> None:
        self._params = {d.id: d.params for d in await list_datasets(self.database)}

    # -------------------------------------------------------------------- leases

    async def _keeper(self) -> None:
        interval = self.config.lease_seconds / 4
        last_checkpoint = last_progress = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                await self._renew()
                await worker_rows.heartbeat(
                    self.database,
                    self.owner,
                    in_flight=len(self._inflight),
                    completed=self.stats.completed,
                )
                await self._reap()
                now = time.monotonic()
                if now - last_checkpoint >= self.config.checkpoint_every:
                    await self.database.checkpoint()
                    last_checkpoint = now
                self.notifier.status(
                    f"{self.stats.completed} done, {self.stats.failed} failed, "
                    f"{len(self._inflight)} in flight"
                )
                if now - last_progress >= self.config.progress_every:
                    log.info("progress", in_flight=len(self._inflight), **_stats_fields(self.stats))
                    last_progress = now
            except StorageError as exc:
                log.error("keeper_failed", error=str(exc))
            except Exception:  # the keeper must outlive any one bad round
                log.exception("keeper_crashed")

    async def _renew(self) -> None:
        held = [(f.lease.item_id, f.lease.token) for f in self._inflight.values()]
        if not held:
            return
        kept = await self.queue.renew(held, lease_seconds=self.config.lease_seconds)
        for item_id, _ in held:
            flight = self._inflight.get(item_id)
            if item_id not in kept and flight is not None and not flight.task.done():
                flight.cancel_reason = "lease_lost"
                flight.task.cancel()
                self.stats.lost += 1
                log.warning("lease_lost", item=item_id, key=flight.lease.key)

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
        """Let in-flight requests finish within the grace period, release the rest."""
        tasks = [f.task for f in self._inflight.values()]
        if tasks and self._grace > 0:
            log.info("draining", in_flight=len(tasks), grace_s=self._grace)
            done_waiting = asyncio.create_task(asyncio.wait(tasks, timeout=self._grace))
            # A second signal (forced stop) cuts the grace period short.
            while not done_waiting.done():
                await _first(asyncio.shield(done_waiting), asyncio.sleep(0.2))
                if self._grace == 0:
                    break
            done_waiting.cancel()
        leftovers = list(self._inflight.values())
        for flight in leftovers:
            flight.cancel_reason = flight.cancel_reason or "shutdown"
            flight.task.cancel()
        for flight in leftovers:
            with contextlib.suppress(asyncio.CancelledError):
                await flight.task
        # Through the committer, after any outcome already queued for the same item, so
        # a result that made it in time is kept and its release is fenced out.
        releases = [
            self.committer.submit(
                "release", f.lease, (Failure("shutdown", "released at worker shutdown"), 0.0)
            )
            for f in leftovers
            if f.cancel_reason == "shutdown"
        ]
        if releases:
            accepted = await asyncio.gather(*releases)
            self.stats.released += sum(accepted)
            log.info("released_at_shutdown", items=sum(accepted))


def _output(c: Completion) -> Output:
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
    )


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
