"""Periodic samples (store.samples): written by running workers, once per interval
whatever the number of workers, carried across restarts, equal to what the rows hold."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from orchestrator.formats import iter_records
from orchestrator.inference.client import ClientConfig
from orchestrator.store import Database, DatasetSpec, enqueue, open_database, samples
from tests.conftest import StartSim
from tests.helpers import prompts, write_jsonl
from tests.test_worker import config as worker_config
from tests.test_worker import run_worker


async def fill(
    database: Database, tmp_path: Path, url: str, datasets: dict[str, int], **cfg: Any
) -> None:
    """Enqueue each dataset (name -> max_tokens, so lengths differ) and run a real worker
    against the simulated server until everything is done or failed."""
    for name, max_tokens in datasets.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", prompts(12, prefix=name))
        spec = DatasetSpec(name, {"max_tokens": max_tokens})
        await enqueue(database, spec, iter_records(path), path=str(path))
    quick = {"backoff_base": 0.01, "backoff_cap": 0.02, "max_attempts": 2, "lease_seconds": 2}
    config = worker_config(url, **{"concurrency": 4, **quick, **cfg})
    await run_worker(database, config, ClientConfig(request_timeout=5))


def truth(db: Path) -> dict[str, dict[str, Any]]:
    """What the rows hold, per dataset, read with plain SQL."""
    out: dict[str, dict[str, Any]] = {}
    with closing(sqlite3.connect(db)) as conn:
        for ds_id, name in conn.execute("SELECT id, name FROM datasets"):
            counts = dict(
                conn.execute(
                    "SELECT state, count(*) FROM items WHERE dataset_id = ? GROUP BY state",
                    (ds_id,),
                ).fetchall()
            )
            n, completion, prompt = conn.execute(
                "SELECT count(*), coalesce(sum(completion_tokens), 0),"
                " coalesce(sum(prompt_tokens), 0) FROM outputs WHERE dataset_id = ?",
                (ds_id,),
            ).fetchone()
            errors: dict[str, dict[str, int]] = {}
            for cls, outcome, k in conn.execute(
                "SELECT error_class, outcome, count(*) FROM attempt_errors"
                " WHERE dataset_id = ? GROUP BY error_class, outcome",
                (ds_id,),
            ):
                slot = errors.setdefault(cls, {"retried": 0, "released": 0, "failed": 0})
                slot[{"retry": "retried"}.get(outcome, outcome)] = k
            out[name] = {
                **{s: counts.get(s, 0) for s in ("pending", "running", "done", "failed")},
                "answers": n,
                "completion_tokens": completion,
                "prompt_tokens": prompt,
                "errors": errors,
            }
    return out


def latest(history: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for s in history["samples"]:
        out[s["dataset"]] = {k: v for k, v in s.items() if k not in ("taken_at", "dataset")}
    return out


async def test_a_running_worker_records_samples_with_server_gauges(
    database: Database, db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    # Slow enough answers that the worker's keeper ticks (every 0.5 s) during the run.
    url = await sim(faults={"400": 0.1, "500": 0.15}, seed=3, latency=0.2)
    await fill(database, tmp_path, url, {"short": 8, "long": 400}, sample_every=0.3)
    history = await samples.history(database)
    assert {s["dataset"] for s in history["samples"]} == {"short", "long"}
    assert {s["server"] for s in history["servers"]} == {url}
    assert all(s["running"] is not None for s in history["servers"])
    # Once every settled answer is in, the sample holds exactly what the rows hold.
    later = time.time() + samples.SETTLE_SECONDS + 1
    assert await samples.record(database, interval=0.3, now=later) == 2
    assert latest(await samples.history(database)) == truth(db_path)
    # Different limits, different lengths: the histograms count every answer.
    lengths = {d["name"]: d for d in (await samples.lengths(database))["datasets"]}
    facts = truth(db_path)
    assert {k: v["count"] for k, v in lengths.items()} == {
        k: v["answers"] for k, v in facts.items()
    }
    assert lengths["short"]["buckets"][-1][1] <= 16 < lengths["long"]["buckets"][-1][1]
    assert facts["short"]["failed"] + facts["long"]["failed"] > 0


async def test_one_sample_per_interval_whatever_the_number_of_writers(
    db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    url = await sim()
    database = await open_database(db_url)
    other = await open_database(db_url)  # another process's connection
    try:
        await fill(database, tmp_path, url, {"a": 16}, sample_every=0)
        t0 = time.time() + samples.SETTLE_SECONDS + 1  # every answer settled
        written = await asyncio.gather(
            samples.record(database, interval=60, now=t0),
            samples.record(other, interval=60, now=t0 + 0.5),
            samples.record(other, interval=60, now=t0 + 1),
        )
        assert sorted(written) == [0, 0, 1]
        assert await samples.record(database, interval=60, now=t0 + 30) == 0
        assert await samples.record(other, interval=60, now=t0 + 60) == 1
        taken = [s["taken_at"] for s in (await samples.history(database))["samples"]]
        assert len(taken) == 2 and taken[1] - taken[0] >= 59
        assert [s["answers"] for s in (await samples.history(other))["samples"]] == [12, 12]
    finally:
        await other.close()
        await database.close()


async def test_history_continues_across_a_restart(
    db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    url = await sim()
    database = await open_database(str(db_path))
    try:
        await fill(database, tmp_path, url, {"first": 16}, sample_every=0)
        now = time.time() + samples.SETTLE_SECONDS + 1
        await samples.record(database, interval=60, now=now)
    finally:
        await database.close()
    # A new process: more work, then the next sample carries the sums forward.
    database = await open_database(str(db_path))
    try:
        await fill(database, tmp_path, url, {"second": 16}, sample_every=0)
        assert await samples.record(database, interval=60, now=now + 60) == 2
        history = await samples.history(database)
    finally:
        await database.close()
    first = [s for s in history["samples"] if s["dataset"] == "first"]
    assert [s["answers"] for s in first] == [12, 12]
    assert latest(history) == truth(db_path)
    since = history["samples"][0]["taken_at"]
    newer = await _history_sqlite(db_path, since)
    assert {s["taken_at"] for s in newer["samples"]} == {now + 60}


async def _history_sqlite(db: Path, since: float) -> dict[str, Any]:
    from orchestrator.store.reader import open_reader

    reader = open_reader(str(db))
    assert reader is not None
    with reader:
        return samples.read_history(reader, since=since)
