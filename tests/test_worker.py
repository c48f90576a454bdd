"""The worker loop in-process against the simulated server: outcomes, outages, leases."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa

from orchestrator.formats import iter_records
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.sim import answer_matches
from orchestrator.store import Database, DatasetSpec, enqueue, iter_done
from orchestrator.store.schema import attempt_errors, items
from orchestrator.worker import Worker, WorkerConfig, WorkerStats, backoff_delay
from orchestrator.worker.metrics import WorkerMetrics
from tests.conftest import StartSim
from tests.helpers import prompts, write_jsonl


async def load(database: Database, tmp_path: Path, n: int, **params: Any) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    await enqueue(database, DatasetSpec("ds", params), iter_records(path), path=str(path))


def config(url: str, **overrides: Any) -> WorkerConfig:
    base: dict[str, Any] = {
        "servers": (url,),
        "concurrency": 16,
        "exit_when_done": True,
        "backoff_base": 0.02,
        "backoff_cap": 0.2,
        "poll_interval": 0.05,
        "probe_min": 0.05,
        "probe_max": 0.2,
    }
    base.update(overrides)
    return WorkerConfig(**base)


async def run_worker(
    database: Database,
    cfg: WorkerConfig,
    client_cfg: ClientConfig | None = None,
    metrics: WorkerMetrics | None = None,
) -> WorkerStats:
    async with InferenceClient(client_cfg or ClientConfig(request_timeout=2)) as client:
        return await asyncio.wait_for(Worker(database, client, cfg, metrics=metrics).run(), 60)


async def states(database: Database) -> dict[str, int]:
    async with database.read() as conn:
        result = await conn.execute(
            sa.select(items.c.state, sa.func.count()).group_by(items.c.state)
        )
        return dict(result.all())


async def check_outputs_match(database: Database, expected: int) -> None:
    done = [d async for d in iter_done(database)]
    assert len(done) == expected
    assert len({d.key for d in done}) == expected
    for d in done:
        assert answer_matches(d.request["messages"], d.message["content"]), d.key


async def sim_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/stats") as resp:
        return await resp.json()


async def test_run_to_completion_with_dataset_params(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 200, max_tokens=5, model="sim-model")
    url = await sim(mean_tokens=50)
    stats = await run_worker(database, config(url))
    assert stats.completed == 200 and stats.failed == 0
    assert await states(database) == {"done": 200}
    await check_outputs_match(database, 200)
    # Dataset parameters reached the server: every answer was cut at max_tokens.
    assert {d.finish_reason async for d in iter_done(database)} == {"length"}


async def test_fault_mix_ends_all_done(database: Database, tmp_path: Path, sim: StartSim) -> None:
    await load(database, tmp_path, 300)
    faults = {"500": 0.05, "429": 0.02, "reset": 0.02, "hang": 0.01, "malformed": 0.01}
    url = await sim(faults=faults, retry_after=0.05, seed=3)
    stats = await run_worker(
        database, config(url, max_attempts=10), ClientConfig(request_timeout=0.5)
    )
    assert await states(database) == {"done": 300}
    assert stats.retried > 0
    await check_outputs_match(database, 300)
    async with database.read() as conn:
        classes = set(
            (await conn.execute(sa.select(attempt_errors.c.error_class).distinct())).scalars()
        )
    assert {"http_500", "rate_limited", "disconnect"} <= classes


async def test_rejected_request_fails_at_once(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    """A refusal of the item alone (its prompt is too long) fails it, without retries."""
    await load(database, tmp_path, 5, max_tokens=4000)
    url = await sim(max_model_len=4000)
    stats = await run_worker(database, config(url))
    assert stats.failed == 5 and stats.retried == 0
    async with database.read() as conn:
        result = await conn.execute(
            sa.select(items.c.attempts, items.c.error_class, items.c.last_error)
        )
        rows = result.all()
    assert {(r.attempts, r.error_class) for r in rows} == {(1, "context_overflow")}
    assert all("the prompt has 2 tokens, max_tokens 4,000" in r.last_error for r in rows)
    assert all("maximum context length is 4000 tokens" in r.last_error for r in rows)


async def test_outage_pauses_without_spending_attempts(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 200)
    url = await sim(latency=0.02, outages=[(0.3, 1.5)])
    stats = await run_worker(database, config(url, max_attempts=2))
    assert await states(database) == {"done": 200}
    assert stats.failed == 0
    async with database.read() as conn:
        attempts = set((await conn.execute(sa.select(items.c.attempts))).scalars())
        outcomes = set(
            (await conn.execute(sa.select(attempt_errors.c.outcome).distinct())).scalars()
        )
    # Every item was generated on its first counted attempt: the outage cost none.
    assert attempts == {1}
    assert outcomes <= {"released"}
    await check_outputs_match(database, 200)


async def test_slow_answer_keeps_its_lease(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 4)
    url = await sim(latency=3.5)
    stats = await run_worker(
        database, config(url, lease_seconds=2), ClientConfig(request_timeout=10)
    )
    assert stats.completed == 4 and stats.lost == 0
    async with database.read() as conn:
        attempts = set((await conn.execute(sa.select(items.c.attempts))).scalars())
    assert attempts == {1}
    # The server saw each request once: never run twice at once.
    assert (await sim_stats(url))["chat_requests"] == 4


async def test_graceful_stop_releases_in_flight(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 50)
    url = await sim(latency=5)
    async with InferenceClient(ClientConfig(request_timeout=30)) as client:
        # A request in flight 0.1 s without a refusal opens the dataset to more.
        settings = config(url, concurrency=8, grace_seconds=0.3, trial_seconds=0.1)
        worker = Worker(database, client, settings)
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(0.8)
        assert worker.in_flight == 8
        worker.request_stop()
        stats = await asyncio.wait_for(task, 5)
    assert stats.released == 8
    assert await states(database) == {"pending": 50}
    async with database.read() as conn:
        attempts = set((await conn.execute(sa.select(items.c.attempts))).scalars())
    assert attempts == {0}


async def test_retries_exhausted_fail_with_reason(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 3)
    url = await sim(faults={"500": 1.0})
    stats = await run_worker(database, config(url, max_attempts=3))
    assert stats.failed == 3
    async with database.read() as conn:
        rows = (await conn.execute(sa.select(items.c.attempts, items.c.last_error))).all()
    assert all(
        r.attempts == 3 and r.last_error.startswith("gave up after 3 attempts") for r in rows
    )


def test_backoff_grows_is_capped_and_honours_retry_after() -> None:
    delays = [backoff_delay(a, base=1, cap=60, retry_after=None) for a in range(1, 10)]
    assert 0.75 <= delays[0] <= 1.25
    assert 3 <= delays[2] <= 5
    assert max(delays) <= 60 * 1.25
    assert backoff_delay(1, base=1, cap=60, retry_after=30) >= 30


async def test_concurrency_and_dataset_cap_hold_with_prefetch(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    """Claimed-ahead items wait for a free slot: neither limit is ever exceeded."""
    await load(database, tmp_path, 150)
    capped = write_jsonl(tmp_path / "capped.jsonl", prompts(60, prefix="capped"))
    spec = DatasetSpec("capped", {}, concurrency=3)
    await enqueue(database, spec, iter_records(capped), path=str(capped))
    url = await sim(latency=0.01)
    stats = await run_worker(database, config(url, concurrency=5, datasets=("ds",)))
    assert stats.completed == 150
    assert (await sim_stats(url))["peak_running"] == 5
    url = await sim(latency=0.01)
    stats = await run_worker(database, config(url, concurrency=16))
    assert stats.completed == 60
    assert (await sim_stats(url))["peak_running"] == 3
    await check_outputs_match(database, 210)


async def test_write_lock_held_by_another_process_delays_but_loses_nothing(
    database: Database, db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 300)
    url = await sim(latency=0.005)
    async with InferenceClient(ClientConfig(request_timeout=10)) as client:
        worker = Worker(database, client, config(url, concurrency=8))
        task = asyncio.create_task(worker.run())
        while worker.stats.completed < 20:  # noqa: ASYNC110 (polling a counter, not an event)
            await asyncio.sleep(0.01)
        # Another process takes the write lock for a while (sqlite3 in a thread here:
        # its own connection, as a second process would have).
        with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            held_at = worker.stats.completed
            await asyncio.sleep(1.0)
            assert worker.stats.completed <= held_at + 8 + 4  # answers wait to be written
            other.execute("COMMIT")
        stats = await asyncio.wait_for(task, 60)
    assert stats.completed == 300 and stats.lost == 0
    assert await states(database) == {"done": 300}
    await check_outputs_match(database, 300)
