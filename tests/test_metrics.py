"""The worker's Prometheus metrics and health endpoint, scraped and parsed back."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.formats import iter_records
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.store import Database, DatasetSpec, enqueue
from orchestrator.worker import Worker, WorkerConfig
from orchestrator.worker.metrics import WorkerMetrics, serve_metrics
from tests.conftest import StartSim
from tests.helpers import cli, prompts, start_worker, write_jsonl


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_what_the_worker_wrote(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    await enqueue(database, DatasetSpec("ds"), iter_records(path), path=str(path))
    url = await sim(faults={"400": 0.25}, mean_tokens=16)
    metrics = WorkerMetrics()
    runner, port = await serve_metrics(metrics, lambda: {}, "127.0.0.1", 0)
    try:
        config = WorkerConfig(
            servers=(url,), concurrency=8, exit_when_done=True, poll_interval=0.05
        )
        async with InferenceClient(ClientConfig(request_timeout=5)) as client:
            worker = Worker(database, client, config, metrics=metrics)
            stats = await asyncio.wait_for(worker.run(), 60)
        metrics.set_items(await worker.queue.counts())
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                found = samples(await resp.text())
            async with s.get(f"http://127.0.0.1:{port}/health") as resp:
                assert (await resp.json())["status"] == "ok"
    finally:
        await runner.cleanup()
    done = value(
        found, "orchestrator_outcomes_total", dataset="ds", outcome="complete", error_class=""
    )
    failed = value(
        found, "orchestrator_outcomes_total", dataset="ds", outcome="fail", error_class="http_400"
    )
    assert (done, failed) == (stats.completed, stats.failed) and done + failed == 60 and failed > 0
    assert value(found, "orchestrator_items", dataset="ds", state="done") == done
    assert value(found, "orchestrator_items", dataset="ds", state="failed") == failed
    assert value(found, "orchestrator_tokens_total", dataset="ds", kind="completion") == (
        stats.completion_tokens
    )
    assert value(found, "orchestrator_request_latency_seconds_count", dataset="ds") == done
    assert value(found, "orchestrator_server_up", server=url) == 1.0
    assert value(found, "orchestrator_in_flight_requests") == 0


def test_run_serves_metrics_on_loopback(tmp_path: Path, sim_process: Any) -> None:
    db = tmp_path / "q.db"
    path = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    assert cli("enqueue", str(path), "-d", "ds", "--db", str(db)).returncode == 0
    server = sim_process("--latency", "0")
    worker = start_worker(db, server.url, "--metrics-port", "0")
    assert worker.stderr is not None
    url = None
    for line in worker.stderr:
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == "metrics_listening":
            url = event["url"]
            break
    assert url is not None and url.startswith("http://127.0.0.1:")

    def completed(text: str) -> float:
        found = samples(text)
        return value(
            found, "orchestrator_outcomes_total", dataset="ds", outcome="complete", error_class=""
        )

    async def scrape() -> tuple[dict[str, Any], str]:
        """Both documents once they count the 20 items, read as numbers: a text search
        for "20.0" stopped at a histogram's ``le="20.0"`` bucket."""
        deadline = time.monotonic() + 120  # a busy 2-core machine
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(url) as resp:
                    text = await resp.text()
                async with s.get(url.replace("/metrics", "/health")) as resp:
                    health = await resp.json()
                if completed(text) == 20 and health.get("completed") == 20:
                    return health, text
                assert time.monotonic() < deadline, (completed(text), health)
                await asyncio.sleep(0.1)

    health, text = asyncio.run(scrape())
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=30)
    assert worker.returncode == 0
    assert health["status"] == "ok" and health["completed"] == 20
    assert completed(text) == 20
