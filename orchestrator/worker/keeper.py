"""The keeper: a worker's housekeeping beside its requests.

Renews the leases of in-flight items well before they expire (cancelling any request
whose lease was taken over), writes the worker's heartbeat, reaps expired leases and
those of dead workers on this host, checkpoints the WAL, samples the run's history, and
stops the worker when its database file is deleted or replaced under it; and, for
servers with an ``auto`` cap, has the pool tune their caps.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from orchestrator._util import procinfo
from orchestrator.errors import StorageError
from orchestrator.inference.server_metrics import scrape
from orchestrator.store import samples
from orchestrator.store import workers as worker_rows
from orchestrator.worker.config import stats_fields

if TYPE_CHECKING:
    from orchestrator.inference.pool import ServerPool
    from orchestrator.store import Database, Queue
    from orchestrator.worker.claim import Claims
    from orchestrator.worker.config import Notifier, WorkerConfig, WorkerStats
    from orchestrator.worker.metrics import WorkerMetrics


class Worker(Protocol):
    """What the keeper reads of the worker it keeps (``worker.loop.Worker``, which starts
    the keeper's tasks: a protocol, so that the two modules do not import each other)."""

    owner: str
    config: WorkerConfig
    database: Database
    queue: Queue
    pool: ServerPool
    claims: Claims
    stats: WorkerStats
    metrics: WorkerMetrics | None
    notifier: Notifier

    @property
    def in_flight(self) -> int: ...

    def file_gone(self, error: StorageError) -> None: ...


log = structlog.get_logger("orchestrator.worker")

# Seconds between looks at whether the database file is still the one opened.
FILE_CHECK_EVERY = 60.0
# Seconds between heartbeats at most: status shows a worker's requests in flight and
# servers as of its latest one (one small UPDATE each).
HEARTBEAT_EVERY = 5.0


async def keep(worker: Worker) -> None:
    """Every quarter lease: renew, reap; checkpoint, sample and report when due. The
    heartbeat, which status reads, more often (``HEARTBEAT_EVERY``) and at once when the
    servers go down or come back."""
    config = worker.config
    interval = config.lease_seconds / 4
    last_renew = last_checkpoint = last_progress = time.monotonic()
    last_sample = float("-inf")
    while True:
        await _pause(worker, min(HEARTBEAT_EVERY, interval))
        try:
            await beat(worker)
            now = time.monotonic()
            if now - last_renew < interval:
                continue
            last_renew = now
            await renew(worker)
            await reap(worker)
            if now - last_checkpoint >= config.checkpoint_every:
                await worker.database.checkpoint()
                last_checkpoint = now
            if config.sample_every and now - last_sample >= config.sample_every:
                last_sample = now
                await sample(worker)
            stats = worker.stats
            worker.notifier.status(
                f"{stats.completed} done, {stats.failed} failed, {worker.in_flight} in flight"
            )
            if now - last_progress >= config.progress_every:
                log.info("progress", in_flight=worker.in_flight, **stats_fields(stats))
                last_progress = now
        except StorageError as exc:
            log.error("keeper_failed", error=str(exc))
        except Exception:  # the keeper must outlive any one bad round
            log.exception("keeper_crashed")


async def _pause(worker: Worker, seconds: float) -> None:
    """``seconds``, or less when the servers go down or come back."""
    available = worker.pool.available
    was = available.is_set()
    steps = max(1, math.ceil(seconds / 0.5))
    for _ in range(steps):  # the pool has no event for going down: looked at twice a second
        await asyncio.sleep(seconds / steps)
        if available.is_set() != was:
            return


async def beat(worker: Worker) -> None:
    """The worker's heartbeat: its requests in flight, answers and servers."""
    await worker_rows.heartbeat(
        worker.database,
        worker.owner,
        in_flight=worker.in_flight,
        completed=worker.stats.completed,
        servers=servers_view(worker),
    )


def servers_view(worker: Worker) -> worker_rows.Servers:
    """How many servers the worker has and reaches, those down with why and since when,
    and since when none is reachable: the last of them to go down."""
    pool = worker.pool
    down = [
        {"server": url, "reason": reason, "since": since}
        for url, reason, since in pool.unreachable()
    ]
    total = len(pool.states)
    none_since = None
    if total and len(down) == total:
        none_since = max((d["since"] for d in down if d["since"]), default=time.time())
    return worker_rows.Servers(total, total - len(down), down, none_since)


async def watch_file(worker: Worker) -> None:
    """Stop at once when the database file is deleted or replaced under the worker.

    SQLite would go on committing into the deleted file (a run reporting success with
    nothing kept), or into the WAL of a file moved over it (corrupting that one).
    Looked at every minute, or every keeper round when leases are shorter.
    """
    every = min(FILE_CHECK_EVERY, worker.config.lease_seconds / 4)
    while True:
        await asyncio.sleep(every)
        try:
            worker.database.check_file()
        except StorageError as exc:
            log.error("stopping_database_file_gone", db=worker.database.where, error=str(exc))
            worker.file_gone(exc)
            return


async def sample(worker: Worker) -> None:
    """The run's history (store.samples), with the gauges of the servers we use.

    Every worker tries; the first past the interval writes. The servers are only
    scraped when a sample is due.
    """
    every = worker.config.sample_every
    if not await samples.due(worker.database, every):
        return
    gauges = await asyncio.gather(
        *(asyncio.to_thread(scrape, server) for server in worker.config.servers)
    )
    await samples.record(worker.database, interval=every, servers=gauges)


async def renew(worker: Worker) -> None:
    """Renew every held lease; one taken over by another worker is let go."""
    held = worker.claims.leases()
    if not held:
        return
    kept = await worker.queue.renew(held, lease_seconds=worker.config.lease_seconds)
    if worker.metrics is not None:
        worker.metrics.renewals.labels("kept").inc(len(kept))
        worker.metrics.renewals.labels("lost").inc(len(held) - len(kept))
    for item_id, _ in held:
        if item_id not in kept:
            worker.claims.lease_lost(item_id)


async def reap(worker: Worker) -> None:
    """Take back expired leases, and those of dead workers on this host."""
    queue = worker.queue
    owners = await queue.running_owners()
    dead = [o for o in owners if o != worker.owner and procinfo.is_dead_local(o)]
    reaped = await queue.reap(dead_owners=dead)
    if dead:
        await worker_rows.mark_dead(worker.database, dead)
    if reaped:
        log.info("leases_reclaimed", items=reaped, dead_workers=len(dead))


async def tune(worker: Worker) -> None:
    """Every ``auto_interval`` seconds, let the pool set its adapted servers' caps."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(worker.config.auto_interval)
        now = time.monotonic()
        elapsed, last = now - last, now
        try:
            await worker.pool.tune(elapsed)
        except Exception:  # the tuner must outlive any one bad look
            log.exception("tuner_crashed")
