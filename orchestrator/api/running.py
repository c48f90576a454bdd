"""A worker put together from its parts: the one composition ``orchestrator run`` and the
Python API (``orchestrator.api``) both use, so an embedded run behaves as the command's.

The caller opens the database and says whether the process's signals are the run's (the
command) or not (embedded: the run stops when its task is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator._util import stopsignals
from orchestrator.errors import ItemsFailed, ItemsLeftPending, RunStopped, ServersLost, StorageError
from orchestrator.ops.systemd import SystemdNotifier
from orchestrator.settings.prices import Prices, run_prices
from orchestrator.settings.run import TOKEN_PRICES
from orchestrator.store import check_datasets

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from orchestrator.inference.client import ClientConfig
    from orchestrator.inference.launch.supervisor import Supervisor
    from orchestrator.inference.servers_file import ServerSpec
    from orchestrator.settings.run import RunSettings
    from orchestrator.store import Database
    from orchestrator.worker import WorkerConfig, WorkerStats


@dataclass(slots=True)
class RunOutcome:
    """What a run did, and why it stopped short when it did (``RunStopped`` errors: a
    halt, items failed or left pending with ``exit_when_done``)."""

    stats: WorkerStats
    stopped: list[RunStopped] = field(default_factory=list)


def without_credentials(
    specs: list[ServerSpec], api_key: str | None, shared: Any = None
) -> tuple[list[ServerSpec], dict[str, Any]]:
    """The servers under their URLs without userinfo, and the Basic credentials to send
    each (theirs, else ``shared``, the ``--basic-auth-file``'s; orchestrator._util.urls): no
    password reaches a log line, a row or a label."""
    import structlog

    from orchestrator._util.urls import server_credentials  # lazy: aiohttp

    shown, auth = server_credentials([s.url for s in specs], api_key=api_key, shared=shared)
    in_urls = [url for url, spec in zip(shown, specs, strict=True) if url != spec.url.strip()]
    if in_urls:
        structlog.get_logger("orchestrator.cli").warning(
            "credentials_in_server_url",
            servers=in_urls,
            hint="anyone on this machine can read process arguments: use --basic-auth-file",
        )
    clean = [dataclasses.replace(spec, url=url) for url, spec in zip(shown, specs, strict=True)]
    return clean, auth


def configs(
    specs: list[ServerSpec], auth: dict[str, Any], api_key: str | None, settings: RunSettings
) -> tuple[WorkerConfig, ClientConfig]:
    """The worker's and the client's configuration for these servers (as
    :func:`without_credentials` left them) and settings."""
    from orchestrator.inference.batchapi import BatchLimits  # lazy: aiohttp
    from orchestrator.inference.client import ClientConfig  # lazy: aiohttp
    from orchestrator.worker import WorkerConfig  # lazy: aiohttp

    worker = WorkerConfig(
        servers=tuple(spec.url for spec in specs),
        concurrency=settings.concurrency,  # type: ignore[arg-type]
        server_caps=_caps(specs, settings),
        rpm=settings.rpm,
        tpm=settings.tpm,
        server_budgets={
            s.url: (s.rpm or settings.rpm, s.tpm or settings.tpm)
            for s in specs
            if s.rpm is not None or s.tpm is not None
        },
        rate_limited_warn_after=settings.rate_limited_warn_after,
        datasets=settings.datasets,
        exit_when_done=settings.exit_when_done,
        lease_seconds=settings.lease_seconds,
        max_attempts=settings.max_attempts,
        backoff_base=settings.retry_backoff,
        grace_seconds=settings.grace,
        give_up_after=settings.give_up_after,
        batch_servers=frozenset(
            s.url for s in specs if (settings.batch_api if s.batch_api is None else s.batch_api)
        ),
        batch_limits=BatchLimits(
            requests=settings.batch_requests,
            bytes=int(settings.batch_mb * 2**20),
            poll_max=settings.batch_poll,
            poll_first=min(1.0, settings.batch_poll),
        ),
        budget=settings.budget,
        prices=_token_prices(specs, settings),
    )
    client = ClientConfig(
        request_timeout=settings.request_timeout,
        stream=settings.stream,
        stream_idle_timeout=settings.stream_idle_timeout,
        stream_usage=settings.stream_usage,
        api_key=api_key,
        basic_auth=auth,
        max_response_bytes=int(settings.max_response_mb * 2**20),
    )
    return worker, client


def _caps(specs: list[ServerSpec], settings: RunSettings) -> dict[str, Any]:
    """Each server's own cap: a batch server's, unless given, is two batches' requests
    (one filling while the other is out)."""
    caps: dict[str, Any] = {}
    for spec in specs:
        batched = settings.batch_api if spec.batch_api is None else spec.batch_api
        if spec.concurrency is not None:
            caps[spec.url] = spec.concurrency
        elif batched:
            caps[spec.url] = 2 * settings.batch_requests
    return caps


def _token_prices(specs: list[ServerSpec], settings: RunSettings) -> Any:
    """The run's token prices (``orchestrator.settings.prices.RunPrices``), for its budget:
    the settings' for every server, a servers file's own for its servers."""
    default = Prices(**{name: getattr(settings, name) for name in TOKEN_PRICES})
    return run_prices(default, {spec.url: spec.prices for spec in specs})


async def run_worker(
    database: Database,
    config: WorkerConfig,
    client_config: ClientConfig,
    *,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    signals: bool = False,
    launch: Supervisor | None = None,
) -> RunOutcome:
    """Run a worker on an open database until it stops.

    ``signals``: SIGTERM/SIGINT stop it (the command; a second one forces). Cancelling
    the task running this stops the worker at once, its leases released, and then the
    cancellation goes on: an embedded run never leaves items running. ``launch``: the
    servers the run starts itself, ready before the first claim and stopped after the
    last answer (orchestrator.inference.launch).
    """
    from orchestrator.inference.client import InferenceClient  # lazy: aiohttp
    from orchestrator.worker import WorkerStats  # lazy: aiohttp

    await check_datasets(database, config.datasets)
    # Under systemd (Type=notify): READY=1, STOPPING=1, status and watchdog pings.
    async with InferenceClient(client_config) as client, SystemdNotifier() as notifier:
        try:
            async with _launched(launch, client, signals) as go:
                if not go:  # stopped while the servers were starting
                    return RunOutcome(WorkerStats())
                parts = (database, client, config, notifier)
                return await _work(*parts, launch, signals, metrics_host, metrics_port)
        except ServersLost as exc:  # none of them started
            return RunOutcome(WorkerStats(), [exc])


@contextlib.asynccontextmanager
async def _launched(launch: Supervisor | None, client: Any, signals: bool) -> AsyncIterator[bool]:
    """The run's own servers started (if any) before the worker, stopped after it;
    False when a signal came while they were starting."""
    if launch is None:
        yield True
        return
    stopping = asyncio.Event()
    if signals:
        stopsignals.hand_over(asyncio.get_running_loop(), stopping.set)
    try:
        await launch.start(client.session, stopping)
        yield not stopping.is_set()
    finally:
        await launch.stop()


def _supervised(worker: Any, launch: Supervisor) -> None:
    """Tie the supervisor to the worker's pool: a death takes the server out (its
    in-flight items given back), a server given up on leaves it, the last one halts."""

    def given_up(url: str, message: str) -> None:
        worker.pool.retire(url, message)
        if worker.pool.all_retired():
            worker.halt(ServersLost(f"no server left: {message}"))

    launch.on_down = worker.pool.server_died
    launch.on_given_up = given_up
    for server in launch.servers:
        if server.state == "given_up":
            worker.pool.retire(server.url, "it did not start")
    launch.watch()


async def _work(
    database: Database,
    client: Any,
    config: WorkerConfig,
    notifier: Any,
    launch: Supervisor | None,
    signals: bool,
    metrics_host: str,
    metrics_port: int | None,
) -> RunOutcome:
    """The worker itself, from its start to its last write."""
    from orchestrator.monitor import progress  # lazy: aiohttp
    from orchestrator.worker import Worker  # lazy: aiohttp

    outcome: RunOutcome | None = None
    stopped: list[RunStopped] = []
    metrics = None
    if metrics_port is not None:
        from orchestrator.worker.metrics import WorkerMetrics  # lazy: aiohttp

        metrics = WorkerMetrics()
    worker = Worker(database, client, config, notifier=notifier, metrics=metrics)
    if launch is not None:
        _supervised(worker, launch)
    if signals:  # those that came since the process started included
        stopsignals.hand_over(asyncio.get_running_loop(), worker.request_stop)
    line = progress.start(database, worker)  # on a terminal only
    try:
        run = _run_with_metrics(worker, metrics, metrics_host, metrics_port)
        outcome = RunOutcome(await _stop_on_cancel(worker, run), stopped)
    except RunStopped as exc:
        stopped.append(exc)  # said after the worker's own last line
        outcome = RunOutcome(worker.stats, stopped)
    finally:
        await progress.stop(line)
        if worker.unfinished is not None:
            stopped.append(worker.unfinished)
    return outcome


async def _stop_on_cancel(worker: Any, run: Any) -> WorkerStats:
    """Await the worker's run in a task of its own; when this is cancelled, stop the
    worker (forced: no grace), wait for it to release its leases, then re-raise."""
    task = asyncio.ensure_future(run)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            worker.request_stop(force=True)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        raise


async def _run_with_metrics(worker: Any, metrics: Any, host: str, port: int | None) -> Any:
    """The worker's run, with Prometheus metrics served beside it when asked."""
    if metrics is None or port is None:
        return await worker.run()
    import structlog

    from orchestrator.worker.metrics import serve_metrics  # lazy: aiohttp

    def health() -> dict[str, Any]:
        return {
            "worker": worker.owner,
            "in_flight": worker.in_flight,
            "completed": worker.stats.completed,
            "failed": worker.stats.failed,
        }

    runner, bound = await serve_metrics(metrics, health, host, port)
    structlog.get_logger("orchestrator.cli").info(
        "metrics_listening", url=f"http://{host}:{bound}/metrics"
    )
    try:
        return await worker.run()
    finally:
        await runner.cleanup()


def checked_outcome(outcome: RunOutcome) -> RunOutcome:
    """Raise what stopped a run short for a reason to act on; return the rest."""
    if outcome.stats.dropped:
        raise StorageError(
            f"{outcome.stats.dropped:,} answers could not be written before the stop and "
            "were dropped (their items run again once their leases expire)"
        )
    for reason in outcome.stopped:
        if not isinstance(reason, ItemsFailed | ItemsLeftPending):
            raise reason
    return outcome
