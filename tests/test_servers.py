"""Several inference servers: per-server caps, least-loaded routing, health, servers files."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from orchestrator.errors import ConfigError
from orchestrator.formats import iter_records
from orchestrator.inference.client import ClientConfig
from orchestrator.inference.servers_file import ServerSpec, merge_servers, parse_servers_file
from orchestrator.store import Database, DatasetSpec, enqueue
from orchestrator.worker import WorkerConfig, WorkerStats
from orchestrator.worker.metrics import WorkerMetrics
from tests.conftest import StartSim
from tests.helpers import SimProcess, cli, item_rows, prompts, write_jsonl
from tests.test_worker import check_outputs_match, sim_stats, states
from tests.test_worker import config as worker_config
from tests.test_worker import run_worker as run_one

# Routing and health do not depend on the storage backend: SQLite files only.
pytestmark = pytest.mark.sqlite_only


async def load(database: Database, tmp_path: Path, n: int) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    await enqueue(database, DatasetSpec("ds"), iter_records(path), path=str(path))


def config(servers: tuple[str, ...], **overrides: Any) -> WorkerConfig:
    return worker_config(servers[0], **{"servers": servers, "concurrency": 4, **overrides})


async def run_worker(
    database: Database, cfg: WorkerConfig, metrics: WorkerMetrics | None = None
) -> WorkerStats:
    return await run_one(database, cfg, ClientConfig(request_timeout=10), metrics)


async def until(check: Callable[[], bool]) -> None:
    for _ in range(1500):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never happened")


async def until_async(get: Callable[[], Awaitable[Any]], check: Callable[[Any], bool]) -> None:
    for _ in range(1500):
        if check(await get()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never happened")


async def test_each_server_keeps_to_its_own_cap(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 60)
    small = await sim(latency=0.03)
    large = await sim(latency=0.03)
    metrics = WorkerMetrics()
    cfg = config((small, large), concurrency=5, server_caps={small: 2})
    stats = await run_worker(database, cfg, metrics)
    assert stats.completed == 60
    assert (await sim_stats(small))["peak_running"] == 2
    assert (await sim_stats(large))["peak_running"] == 5
    text = metrics.exposition().decode()
    assert f'orchestrator_server_concurrency{{server="{small}"}} 2.0' in text
    assert f'orchestrator_server_concurrency{{server="{large}"}} 5.0' in text
    await check_outputs_match(database, 60)


async def test_requests_go_to_the_least_loaded_server(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 80)
    a = await sim(latency=0.02)
    b = await sim(latency=0.02)
    stats = await run_worker(database, config((a, b)))
    assert stats.completed == 80
    done_a = (await sim_stats(a))["completed"]
    done_b = (await sim_stats(b))["completed"]
    assert done_a + done_b == 80
    # Alike servers with alike caps share the work about evenly.
    assert 25 <= done_a <= 55, (done_a, done_b)
    assert (await sim_stats(a))["peak_running"] == (await sim_stats(b))["peak_running"] == 4


async def test_a_slow_server_does_not_hold_up_a_fast_one(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 100)
    slow = await sim(latency=1.5)
    fast = await sim(latency=0.005)
    stats = await run_worker(database, config((slow, fast), concurrency=2))
    assert stats.completed == 100
    slow_stats, fast_stats = await sim_stats(slow), await sim_stats(fast)
    # The slow server's two slots stay full; the fast one takes every other item.
    assert slow_stats["peak_running"] == 2
    assert slow_stats["completed"] <= 4
    assert fast_stats["completed"] >= 96
    assert await states(database) == {"done": 100}


async def test_a_dead_server_is_taken_out_and_comes_back(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 300)
    flaky = SimProcess("--latency", "0.1")
    flaky.start()
    steady = await sim(latency=0.1)
    try:
        with capture_logs() as logs:
            task = asyncio.create_task(run_worker(database, config((flaky.url, steady))))
            await until(lambda: flaky.stats()["completed"] >= 20)
            flaky.kill()  # connections refused from now on
            before = (await sim_stats(steady))["completed"]
            await until_async(lambda: sim_stats(steady), lambda s: s["completed"] >= before + 20)
            flaky.start()  # the same port, a fresh process
            stats = await task
        assert flaky.stats()["completed"] > 0  # it was put back into rotation
    finally:
        flaky.stop()
    assert stats.completed == 300 and stats.failed == 0
    events = [(e["event"], e.get("server")) for e in logs]
    assert ("server_down", flaky.url) in events
    assert ("server_up", flaky.url) in events
    assert ("server_down", steady) not in events
    # Items caught on the dead server went back with their attempt given back.
    rows = item_rows(tmp_path / "queue.db")
    assert all(state == "done" and attempts == 1 for _, state, attempts in rows), [
        r for r in rows if r[2] != 1
    ][:5]


async def test_a_server_that_keeps_failing_is_taken_out(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    await load(database, tmp_path, 60)
    broken = await sim(faults={"500": 1.0})
    good = await sim(latency=0.01)
    with capture_logs() as logs:
        stats = await run_worker(database, config((broken, good), failure_limit=3))
    assert stats.completed == 60 and stats.failed == 0
    downs = [e for e in logs if e["event"] == "server_down"]
    assert downs and {e["server"] for e in downs} == {broken}
    assert "3 failures in a row" in downs[0]["reason"]
    assert (await sim_stats(good))["completed"] == 60


# ---------------------------------------------------------------------------- files


def test_servers_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    path.write_text(
        "# the GPU boxes\n"
        "\n"
        "http://gpu-1:30000\n"
        "http://gpu-2:30000/v1   concurrency=128  # the big one\n"
        "https://gpu-3:30000 concurrency=auto\n"
    )
    assert parse_servers_file(path) == [
        ServerSpec("http://gpu-1:30000"),
        ServerSpec("http://gpu-2:30000", 128),  # the /v1 is the client's to add
        ServerSpec("https://gpu-3:30000", "auto"),
    ]
    merged = merge_servers(["http://gpu-2:30000", "http://other:1"], parse_servers_file(path))
    assert [(s.url, s.concurrency) for s in merged] == [
        ("http://gpu-2:30000", 128),
        ("http://other:1", None),
        ("http://gpu-1:30000", None),
        ("https://gpu-3:30000", "auto"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("ftp://gpu-1:30000", "the scheme must be http:// or https://"),
        ("http://gpu-1:notaport", "the port must be a whole number from 1 to 65535"),
        ("http://gpu-1:99999", "the port must be a whole number from 1 to 65535"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://gpu-1:30000/v1/chat/completions", "without the endpoint path"),
        ("http://gpu-1:30000 concurrency=0", "at least 1"),
        ("http://gpu-1:30000 concurrency=many", "whole number or 'auto'"),
        ("http://gpu-1:30000 weight=2", "unknown option 'weight=2'"),
        ("http://gpu-1:30000 concurrency", "unknown option 'concurrency'"),
        ("http://GPU-0:1/", "already listed on line 2"),
    ],
)
def test_servers_file_bad_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "servers.txt"
    path.write_text(f"# servers\nhttp://gpu-0:1\n{line}\n")
    with pytest.raises(ConfigError) as exc:
        parse_servers_file(path)
    assert str(exc.value).startswith(f"{path}:3: ")
    assert message in str(exc.value)


def test_servers_file_with_no_server(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    path.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="no server listed"):
        parse_servers_file(path)


def test_run_refuses_a_bad_servers_file_before_touching_the_database(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    path.write_text("http://gpu-1:30000\nhttp://gpu-2:30000 concurrency=-3\n")
    db = tmp_path / "q.db"
    result = cli("run", "--servers-file", str(path), "--db", str(db), "--exit-when-done")
    assert result.returncode == 2
    assert f"{path}:2: concurrency must be at least 1" in result.stderr
    assert not db.exists()
    result = cli("run", "--server", "http://h:1", "--concurrency", "lots", "--db", str(db))
    assert (
        result.returncode == 2 and "whole number of at least 1 or 'auto', got lots" in result.stderr
    )


def test_worker_config_checks_caps() -> None:
    with pytest.raises(ConfigError, match="at least 1 or 'auto'"):
        WorkerConfig(servers=("http://a:1",), concurrency=0)
    with pytest.raises(ConfigError, match="not in use"):
        WorkerConfig(servers=("http://a:1",), server_caps={"http://b:1": 4})


def test_run_takes_servers_from_a_file(tmp_path: Path, sim_process: Callable[..., Any]) -> None:
    server = sim_process("--latency", "0.02")
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    assert cli("enqueue", str(data), "-d", "ds", "--db", str(db)).returncode == 0
    path = tmp_path / "servers.txt"
    path.write_text(f"{server.url} concurrency=3  # the only one\n")
    result = cli("run", "--servers-file", str(path), "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    assert server.stats()["completed"] == 30
    assert server.stats()["peak_running"] == 3
