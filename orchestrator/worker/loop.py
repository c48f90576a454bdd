"""The worker loop: claim → call → classify → commit, within concurrency limits, until
told to stop.

Each committer round claims a batch (``claim.Claims.plan``, ``deliver``); each claimed
item runs as its own task (``_process``): ``call.Caller`` calls a server for it, turn by
turn, and its outcome (``classify``) goes past the run guard (``gate``) to the committer,
whose next round writes it (``_settled``). Beside them run the keeper (``keeper``) and
one prober per unreachable server (``orchestrator.inference.pool``). An outage (no server
reachable) pauses claiming; items caught in it are released with their attempt given
back. Retryable failures go back to pending with exponential backoff and jitter;
permanent ones fail at once with the server's reason. ``stop`` drains at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from orchestrator._util import procinfo
from orchestrator._util.urls import credentials_sent
from orchestrator.errors import RunStopped, ServersUnreachable, StorageError
from orchestrator.inference.autoconcurrency import Controller
from orchestrator.inference.batchapi import BatchApi
from orchestrator.inference.client import InferenceClient
from orchestrator.inference.pool import ServerPool
from orchestrator.items import error_classes as ec
from orchestrator.store import Database, Failure, Lease, Queue
from orchestrator.store import workers as worker_rows
from orchestrator.store.datasets import set_draw_mode
from orchestrator.worker import budget, classify, keeper, stop, summary
from orchestrator.worker.batches import Batches
from orchestrator.worker.call import Caller
from orchestrator.worker.call import seed as call_seed
from orchestrator.worker.claim import Catalog, Claimed, Claims
from orchestrator.worker.committer import Committer
from orchestrator.worker.config import Notifier, Silent, WorkerConfig, WorkerStats, stats_fields
from orchestrator.worker.gate import Gate
from orchestrator.worker.guard import RunGuard
from orchestrator.worker.outcomes import Advance, Failed, Outcome, Rejected, Release

if TYPE_CHECKING:
    from orchestrator.worker.metrics import WorkerMetrics

log = structlog.get_logger("orchestrator.worker")


class Worker:
    """One process's share of the run.

    Every lease is held from its claim until its outcome is written. A slot (one of the
    healthy servers' caps, summed) frees as soon as the answer arrives, not when it is
    committed, and the next item starts at once from a small prefetch of claimed items.
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
        self.database, self.client, self.config, self.metrics = database, client, config, metrics
        self.notifier: Notifier = notifier or Silent()
        self.owner = owner or procinfo.owner_id()
        self.stats = WorkerStats()
        self.queue = Queue(database)
        self.pool = _pool(config, client, self._capacity_changed)
        self.catalog = Catalog(database, config.datasets)
        # Trial items, served models and the circuit breaker (orchestrator.worker.guard).
        self.guard = RunGuard(config.breaker_items, config.trial_seconds, _sent(config, client))
        self._stopping = asyncio.Event()
        self.claims = Claims(
            self.owner,
            config,
            self.stats,
            self.pool,
            self.guard,
            self.catalog,
            self._stopping,
            self._process,
        )
        self.committer = Committer(
            self.queue,
            plan=self.claims.plan,
            deliver=self.claims.deliver,
            settled=self._settled,
            idle_poll=config.poll_interval,
            unstorable=lambda entry, reason: classify.unstorable(entry, reason, config),
        )
        self.batches = (
            Batches(
                database,
                BatchApi(client),
                config.batch_limits,
                config.batch_servers,
                self.owner,
            )
            if config.batch_servers
            else None
        )
        self.caller = Caller(
            self.pool,
            client,
            config,
            self.committer.submit,
            context_of=self.guard.context_of,
            ignores_n=self._ignores_n,
            batches=self.batches,
        )
        self.claims.joins = self._joins
        self.claims.budget = budget.of(config)
        self.claims.together = self.caller.asks_together
        self.gate = Gate(self.guard, self.committer, self.catalog, client, self._halt)
        self.pool.vet = self.gate.vet
        self._grace = config.grace_seconds
        self._file_gone: StorageError | None = None
        #: Why the run stopped before its work was done; ``run`` raises it after cleaning up.
        self.halted: RunStopped | None = None
        #: With ``exit_when_done``: what was left undone at the end (failed, or paused).
        self.unfinished: RunStopped | None = None
        if metrics is not None:
            _export_gauges(metrics, self.claims, self.pool)

    async def run(self) -> WorkerStats:
        await worker_rows.register(
            self.database,
            self.owner,
            procinfo.hostname(),
            os.getpid(),
            lease_seconds=self.config.lease_seconds,
        )
        await keeper.reap(self)
        await self.catalog.load()
        if self.batches is not None:
            await self.batches.start()
        self.pool.start()
        self.committer.start()
        helpers = [
            asyncio.create_task(keeper.keep(self), name="keeper"),
            asyncio.create_task(keeper.watch_file(self), name="file-watcher"),
        ]
        if self.pool.tuned():
            helpers.append(asyncio.create_task(keeper.tune(self), name="tuner"))
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

    async def _process(self, held: Claimed) -> None:
        """One item: call a server (each turn), then hand its outcome over; or several
        samples of one prompt in one request, each outcome handed over together, so one
        round writes them all."""
        leases = [held.lease, *held.draws]
        outcomes: list[Outcome | None] = []
        try:
            info = await self.catalog.get(held.lease.dataset_id)
            for lease in leases:
                self.gate.started(lease, info)
            if held.draws:
                outcomes = list(await self.caller.draws(leases, info))
            else:
                outcomes = [await self.caller.item(held, info)]
        except Exception as exc:
            # Anything that breaks between the request and the outcome (an answer's
            # check, its parsing) settles the item: a task dying here would leave its
            # lease renewed for ever, and the run waiting for it.
            leases = [held.lease, *held.draws]  # a multi-turn item's turn has moved on
            outcomes = [classify.crashed(lease, exc, self.config) for lease in leases]
        finally:
            # The slot is free once the answer is in; the write happens in a later round.
            self.claims.slot_freed(len(leases))
            outcomes += [None] * (len(leases) - len(outcomes))
            for lease, outcome in zip(leases, outcomes, strict=True):
                if (
                    outcome is None
                    and lease is not held.lease
                    and lease.item_id in self.claims.held
                ):
                    # The request stopped (its first sample's lease lost, a shutdown):
                    # the other samples it asked for go back, their attempts given back.
                    outcome = Release(lease, Failure(ec.SHUTDOWN, _STOPPED), 0.0)
                self._hand_over(lease.item_id, outcome)

    def _joins(self, first: Lease, lease: Lease, count: int) -> bool:
        """Whether ``lease`` is asked for in ``first``'s request: the next sample of the
        same prompt, claimed together, with the next seed, of a dataset asking with n,
        and asked exactly as ``first`` is (a sample requeued with other settings, say a
        larger ``max_tokens``, goes in a request of its own: ``n`` replaces the seed
        alone)."""
        info = self.catalog.infos.get(first.dataset_id)
        return (
            info is not None
            and self.caller.asks_together(info)
            and (lease.dataset_id, lease.key, lease.token)
            == (first.dataset_id, first.key, first.token)
            and lease.sample == first.sample + count
            and lease.turns == 1
            and call_seed(lease, info) == (call_seed(first, info) or 0) + count
            and lease.request == first.request
        )

    async def _ignores_n(self, dataset_id: int) -> None:
        """A server ignored ``n``: every worker asks this dataset's samples one by one."""
        with contextlib.suppress(StorageError):
            await set_draw_mode(self.database, dataset_id, "seeds")

    def _hand_over(self, item_id: int, outcome: Outcome | None) -> None:
        """Queue an item's outcome for writing, past the run guard (a guard that breaks
        lets it through: the outcome is written whatever the guard's bookkeeping)."""
        try:
            through = self.gate.passes(item_id, outcome)
        except Exception:
            log.exception("gate_crashed", item=item_id)
            if isinstance(outcome, Rejected):
                outcome = Failed(outcome.lease, outcome.failure)
            through = outcome is not None
        if through:
            assert outcome is not None
            self.committer.submit(outcome)
        elif outcome is None:
            self.committer.poke()

    def _settled(self, entry: Outcome, accepted: bool) -> None:
        """The committer wrote an outcome (``accepted``: its lease was still ours)."""
        entry.written(accepted)
        lease = entry.lease
        if self.batches is not None:
            self.batches.written(lease.item_id, accepted)
        if isinstance(entry, Advance) and accepted:
            self.gate.answered(entry.output.server, lease.dataset_id, entry.output)
            self.stats.turns += 1
            if self.metrics is not None:
                summary.observe(self.metrics, self.catalog.name(lease.dataset_id), entry)
            return  # the item goes on with its next turn, under the same lease
        held = self.claims.settle(lease.item_id)
        if not accepted:
            if isinstance(entry, Release) and entry.failure.error_class == ec.SHUTDOWN:
                return  # its answer was written first, or its lease had already gone
            if held is None:
                return  # the keeper found the lease gone first, and counted it
            self.stats.lost += 1
            log.warning("result_dropped_lease_lost", **lease.log_fields, kind=entry.kind)
            return
        if self.metrics is not None:
            summary.observe(self.metrics, self.catalog.name(lease.dataset_id), entry)
        if summary.count(self.stats, entry):
            self.claims.answered()

    async def _supervise(self) -> None:
        """Wait for a server, then for the end: all done, or told to stop. (The claims
        themselves are made in the committer's rounds.)"""
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
            self.claims.idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.claims.idle.wait(), self.config.poll_interval)
            if self.catalog.stale():
                with contextlib.suppress(StorageError):
                    await self.catalog.load()
                    if self.metrics is not None:
                        self.metrics.set_items(await self.queue.counts())
                        self.metrics.set_wasted(await self._wasted())
            # A claim being written is evidence on its way too: a slow round between
            # two datasets' trials must not decide what is held.
            self.gate.quiet(bool(self.claims.in_flight) or self.claims.claiming)
            spent = budget.spent(self.claims.budget)
            if spent is not None and not self.claims.held and not self.committer.backlog:
                left = await self.queue.remaining(self.config.datasets or None)
                if left:
                    self._halt(budget.stopped(spent, left))
                    return
            if (
                self.config.exit_when_done
                and not self.claims.held
                and not self.committer.backlog
                and not self._stopping.is_set()
                and await self.queue.remaining(self.config.datasets or None) == 0
            ):
                counts = await self.queue.counts()
                infos = self.catalog.infos.values()
                self.unfinished = summary.left_undone(counts, self.config.datasets, infos)
                return

    async def _wasted(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """The queue's work thrown away by (dataset name, cause), for the metrics."""
        return {
            (self.catalog.name(w.dataset_id), w.cause): (w.requests, w.tokens, w.unknown)
            for w in await self.queue.wasted()
        }

    # -------------------------------------------------------------------- stopping

    def request_stop(self, *, force: bool = False) -> None:
        """Stop claiming; in-flight requests get the grace period (none when forced)."""
        if force or self._stopping.is_set():
            self._grace = 0.0
        # Outcomes the database still refuses once the grace period is over are dropped.
        self.committer.give_up_at(time.monotonic() + self._grace)
        self.notifier.stopping()
        self._stopping.set()
        self.claims.idle.set()
        log.info("stopping", in_flight=self.in_flight, grace_s=self._grace)

    @property
    def in_flight(self) -> int:
        """Items claimed and not yet answered: requests running, and the prefetch."""
        return self.claims.in_flight

    def file_gone(self, error: StorageError) -> None:
        """The database file was deleted or replaced: stop at once; ``run`` raises it."""
        self._file_gone = error
        self.request_stop(force=True)

    def halt(self, error: RunStopped) -> None:
        """Stop the run for a reason found outside the worker (its launched servers
        all given up on); ``run`` raises it once the in-flight items are settled."""
        self._halt(error)

    def _halt(self, error: RunStopped) -> None:
        """Stop the run for a reason the operator must act on; ``run`` raises it."""
        if self.halted is None:
            self.halted = error
            log.error("run_halted", reason=str(error), exit_code=error.exit_code)
        self.request_stop()

    async def _wait_for_server(self) -> None:
        """Wait for a server to answer (the prober says why none does), at most
        ``give_up_after`` seconds when that is set."""
        log.info("waiting_for_server", servers=list(self.config.servers))
        self.notifier.status("waiting for an inference server")
        limit = self.config.give_up_after
        if await stop.until_set(self.pool.available, self._stopping, seconds=limit):
            return
        assert limit is not None  # without a limit the wait ends only with a server, or a stop
        reasons = "; ".join(f"{url}: {why}" for url, why, _ in self.pool.unreachable())
        self._halt(ServersUnreachable(f"no server answered within {limit:g}s: {reasons}"))

    async def _shut_down(self, helpers: list[asyncio.Task[None]]) -> None:
        """Release what is held, drain, stop the helpers, write the last outcomes."""
        self.gate.release_held()
        await stop.drain(self.claims, self.committer, self.stats, lambda: self._grace)
        for task in helpers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.committer.close()
        self.stats.dropped = self.committer.dropped
        if self.batches is not None:
            await self.batches.close()
        await self.pool.close()
        with contextlib.suppress(StorageError):
            await worker_rows.mark_stopped(
                self.database, self.owner, completed=self.stats.completed
            )
        with contextlib.suppress(Exception):
            await self.database.checkpoint("TRUNCATE")
        log.info("worker_stopped", **stats_fields(self.stats))

    def _capacity_changed(self) -> None:
        """A server came or went, or its cap changed: claim and start what now fits."""
        self.claims.capacity_changed()
        self.committer.poke()


_STOPPED = "released: the request that asked for it stopped before its answer came"


def _pool(
    config: WorkerConfig, client: InferenceClient, on_change: Callable[[], None]
) -> ServerPool:
    """The servers, each with its cap and its budgets a minute; an ``auto`` cap gets
    its controller."""
    caps: dict[str, int] = {}
    controllers: dict[str, Controller] = {}
    budgets = {
        server: config.server_budgets.get(server, (config.rpm, config.tpm))
        for server in config.servers
    }
    for server in config.servers:
        cap = config.server_caps.get(server, config.concurrency)
        if cap == "auto":
            controllers[server] = Controller(config.auto_limits)
            cap = controllers[server].cap
        caps[server] = cap
    return ServerPool(
        caps, client, config, controllers=controllers, budgets=budgets, on_change=on_change
    )


def _sent(config: WorkerConfig, client: InferenceClient) -> dict[str, str]:
    """The credentials each server is sent, for what a refusal tells to check."""
    settings = client.config
    return {
        server: credentials_sent(server, settings.api_key, settings.basic_auth)
        for server in config.servers
    }


def _export_gauges(metrics: WorkerMetrics, claims: Claims, pool: ServerPool) -> None:
    metrics.in_flight.set_function(lambda: claims.active)
    metrics.prefetched.set_function(lambda: len(claims.buffer))
    for server, state in pool.states.items():
        metrics.server_up.labels(server).set_function(lambda st=state: float(st.healthy))
        metrics.server_concurrency.labels(server).set_function(lambda st=state: float(st.cap))
