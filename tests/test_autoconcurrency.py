"""``--concurrency auto``: the controller on synthetic metrics, and a run against a
batching simulated server."""

from __future__ import annotations

import asyncio
import random
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from orchestrator.formats import iter_records
from orchestrator.inference.autoconcurrency import Controller, Limits, Sample
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.store import Database, DatasetSpec, enqueue
from orchestrator.worker import Worker, WorkerConfig, WorkerStats
from orchestrator.worker.metrics import WorkerMetrics
from tests.conftest import StartSim
from tests.helpers import prompts, write_jsonl
from tests.test_worker import sim_stats


def idle(c: Controller, **over: Any) -> Sample:
    """The server queues nothing and has room: our cap is full."""
    fields: dict[str, Any] = {
        "elapsed": 1.0,
        "in_flight": c.cap,
        "queued": 0,
        "running": c.cap,
        "kv_usage": 0.1,
        "retractions": 0,
    }
    fields.update(over)
    return Sample(**fields)


def test_ramps_up_quickly_on_an_idle_server_then_gently() -> None:
    c = Controller(Limits(minimum=1, maximum=1000, start=8))
    caps = []
    for kv in (0.1, 0.1, 0.3, 0.4):
        change = c.update(idle(c, kv_usage=kv))
        assert change is not None and change.reason == "ramp"
        caps.append(c.cap)
    assert caps == [32, 128, 256, 512]  # fourfold far from full, twofold nearer
    # Past half of the KV cache: an eighth at a time.
    change = c.update(idle(c, kv_usage=0.6))
    assert change is not None and (change.old, change.new, change.reason) == (512, 576, "room")


def test_an_unfilled_cap_is_not_raised() -> None:
    c = Controller(Limits(start=16))
    assert c.update(idle(c, in_flight=5, running=5)) is None
    assert c.cap == 16


def test_holds_with_a_short_queue_or_a_full_cache() -> None:
    c = Controller(Limits(start=64))
    assert c.update(idle(c, queued=3, running=60)) is None
    assert c.update(idle(c, kv_usage=0.95)) is None
    assert c.cap == 64


def test_backs_off_to_what_the_server_runs_when_a_queue_builds() -> None:
    c = Controller(Limits(start=256))
    change = c.update(idle(c, queued=150, running=100, kv_usage=0.97))
    assert change is not None and change.reason == "queue"
    assert change.new == 110  # what it runs, plus a short queue (a tenth)
    # Held a moment before raising again.
    assert c.update(idle(c, running=110)) is None


def test_backs_off_on_retractions_and_waits() -> None:
    c = Controller(Limits(start=100))
    # The counter's first value is no news, whatever it says.
    assert c.update(idle(c, retractions=5, kv_usage=0.95)) is None
    # What it took: 80 running, 20 retracted back to its queue.
    change = c.update(idle(c, retractions=9, kv_usage=0.95, running=80, queued=20))
    assert change is not None and change.reason == "retractions"
    assert change.new == 90
    # No raise right after a back-off, even if the server looks idle.
    assert c.update(idle(c, retractions=9)) is None
    # A counter that goes back (a restarted server) is no retraction either.
    c.update(idle(c, retractions=9))
    assert c.update(idle(c, retractions=0, kv_usage=0.95)) is None


def test_preemptions_never_cut_below_what_the_server_runs() -> None:
    # vLLM admits whatever fits the cache now and preempts the newest as the running
    # requests grow: a look after look with new preemptions while it runs 120 and queues
    # 30. Each cut a tenth of the last took the cap to 1, emptying the batch.
    c = Controller(Limits(start=256))
    c.update(idle(c, retractions=0))
    caps = []
    for look in range(1, 60):
        c.update(idle(c, retractions=5 * look, running=120, queued=30, kv_usage=0.99))
        caps.append(c.cap)
    assert caps[0] == 135  # a tenth off what it holds
    assert min(caps) >= 120, caps
    # Never raised by a preemption either: a cap under what the server runs stays.
    low = Controller(Limits(start=50))
    low.update(idle(low, retractions=0, in_flight=10))
    assert low.update(idle(low, retractions=3, running=80, queued=0)) is None
    assert low.cap == 50


def test_stays_within_bounds_whatever_it_is_fed() -> None:
    rng = random.Random(7)
    c = Controller(Limits(minimum=4, maximum=96, start=8))
    retractions = 0.0
    for _ in range(2000):
        retractions += rng.choice([0, 0, 0, 3])
        sample = Sample(
            elapsed=rng.uniform(0.5, 2),
            in_flight=rng.randint(0, 2 * c.cap),
            queued=rng.choice([0, 0, 1, 50, 500]),
            running=rng.randint(0, 300),
            kv_usage=rng.random(),
            retractions=retractions,
        )
        c.update(sample)
        assert 4 <= c.cap <= 96
    assert Controller(Limits(maximum=10, start=10)).update(idle(Controller())) is None
    with pytest.raises(ValueError):
        Limits(minimum=10, start=8)


def test_without_metrics_climbs_while_throughput_rises_then_steps_back() -> None:
    c = Controller(Limits(start=8))
    # Throughput proportional to the cap up to 40 requests, flat beyond.
    caps, reasons = [c.cap], []
    for _ in range(60):
        tput = 100.0 * min(c.cap, 40)
        change = c.update(Sample(elapsed=1.0, in_flight=c.cap, tokens_per_s=tput, latency=0.4))
        caps.append(c.cap)
        reasons.append(change.reason if change else None)
    assert max(caps) >= 40  # found the plateau
    assert "no_gain" in reasons  # and stepped back from beyond it
    assert 32 <= c.cap <= 64
    assert sum(cap > 64 for cap in caps[-30:]) <= 3  # mostly near it


# ---------------------------------------------------------------------------- end to end


async def run_auto(
    database: Database, tmp_path: Path, url: str, n: int, metrics: WorkerMetrics | None = None
) -> tuple[WorkerStats, list[MutableMapping[str, Any]]]:
    """``n`` prompts (``max_tokens`` 200) answered by ``url`` with auto concurrency, within
    90 s: the worker's stats and what it logged."""
    path = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    await enqueue(
        database, DatasetSpec("ds", {"max_tokens": 200}), iter_records(path), path=str(path)
    )
    cfg = WorkerConfig(
        servers=(url,),
        concurrency="auto",
        auto_interval=0.25,
        exit_when_done=True,
        poll_interval=0.05,
        probe_min=0.05,
    )
    with capture_logs() as logs:
        async with InferenceClient(ClientConfig(request_timeout=30)) as client:
            worker = Worker(database, client, cfg, metrics=metrics)
            stats = await asyncio.wait_for(worker.run(), 90)
    return stats, logs


@pytest.mark.sqlite_only
async def test_auto_converges_near_the_knee_of_a_batching_server(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    # Answers of 50-150 tokens and a 5000-token cache: about 60 requests fit at once.
    url = await sim(mean_tokens=100, kv_tokens=5000, step_time=0.002, step_per_request=0.00002)
    stats, logs = await run_auto(database, tmp_path, url, 1000, WorkerMetrics())
    assert stats.completed == 1000
    batch = (await sim_stats(url))["batch"]
    changes = [e for e in logs if e["event"] == "concurrency_changed"]
    assert changes and all(e["server"] == url for e in changes)
    assert changes[0]["old"] == 8 and changes[0]["reason"] == "ramp", changes[:5]
    # It found the server's limit: the cache was used, the batch grew well past the start...
    assert batch["peak_token_usage"] > 0.8
    assert batch["peak_running"] >= 40
    # ...without flooding it: a short queue and no retraction storm.
    assert batch["peak_queued"] <= 80
    assert batch["retracted"] <= 50
    final = changes[-1]["new"]
    assert 30 <= final <= 150, [(e["new"], e["reason"]) for e in changes]


@pytest.mark.sqlite_only
async def test_auto_reads_a_vllm_server_and_keeps_its_batch_full(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    # vLLM's scheduling and names: at most 32 sequences, first come first served while the
    # prompt fits, the newest preempted when the cache overflows.
    url = await sim(
        mean_tokens=100,
        kv_tokens=20_000,
        max_running=32,
        admission="fifo",
        metric_names="vllm",
        step_time=0.002,
        step_per_request=0.00002,
    )
    stats, logs = await run_auto(database, tmp_path, url, 600)
    assert stats.completed == 600
    batch = (await sim_stats(url))["batch"]
    changes = [(e["new"], e["reason"]) for e in logs if e["event"] == "concurrency_changed"]
    # Tuned from the server's /metrics (the blind climb's reasons never appear)...
    assert {reason for _, reason in changes} <= {"ramp", "room", "queue", "retractions"}, changes
    assert "queue" in {reason for _, reason in changes}, changes
    # ...its batch filled, and each queue that built cut back to what vLLM's gauge said
    # it ran (32 at most) plus a short queue.
    assert batch["peak_running"] == 32
    assert all(cap <= 35 for cap, reason in changes if reason == "queue"), changes
