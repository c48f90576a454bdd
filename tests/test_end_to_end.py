"""Real processes: the CLI, worker subprocesses killed with SIGKILL, several workers at once."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from orchestrator.sim import answer_matches
from tests.conftest import REPO, SimProcess, cli, prompts, write_jsonl


def start_worker(db: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "orchestrator", "--log-json", "--log-level", "info", "run"]
    return subprocess.Popen(
        [*cmd, "--server", url, "--db", str(db), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ},
    )


def events(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def item_rows(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT key, state, attempts FROM items ORDER BY position").fetchall()


def check_export(db: Path, out: Path, expected_keys: list[str]) -> list[dict]:
    result = cli("export", str(out), "--db", str(db))
    assert result.returncode == 0, result.stderr
    lines = [orjson.loads(raw) for raw in out.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == expected_keys  # each once, in input order
    for line in lines:
        *prompt, answer = line["messages"]
        assert answer["role"] == "assistant"
        assert answer_matches(prompt, answer["content"]), line["id"]
    return lines


def test_enqueue_run_status_export(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.01")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(300))
    result = cli("enqueue", str(data), "--dataset", "e2e", "--db", str(db), "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    assert "300 done, 0 failed" in result.stderr
    out = tmp_path / "out.jsonl"
    lines = check_export(db, out, [f"p{i:06d}" for i in range(300)])
    assert all(line["dataset"] == "e2e" and line["usage"]["completion_tokens"] for line in lines)
    first = out.read_bytes()
    check_export(db, out, [f"p{i:06d}" for i in range(300)])
    assert out.read_bytes() == first  # byte-identical on a second export
    status = json.loads(cli("status", "--json", "--db", str(db)).stdout)
    assert status["totals"]["counts"] == {
        "pending": 0, "running": 0, "done": 300, "failed": 0, "total": 300,
    }  # fmt: skip
    assert status["datasets"][0]["name"] == "e2e"
    assert status["datasets"][0]["completion_tokens"]["mean"] > 0
    text = cli("status", "--db", str(db)).stdout
    assert "e2e" in text and "300/300" in text


def test_pause_resume_requeue(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> None:
    db = tmp_path / "q.db"
    server = sim_process()
    a = write_jsonl(tmp_path / "a.jsonl", prompts(20, prefix="a"))
    b = write_jsonl(tmp_path / "b.jsonl", prompts(20, prefix="b"))
    assert cli("enqueue", str(a), "-d", "a", "--db", str(db)).returncode == 0
    assert cli("enqueue", str(b), "-d", "b", "--db", str(db), "--model", "wrong").returncode == 0
    assert "paused" in cli("pause", "a", "--db", str(db)).stdout
    assert "(paused)" in cli("status", "--db", str(db)).stdout
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    rows = dict((k, s) for k, s, _ in item_rows(db))
    assert {rows[f"a{i:06d}"] for i in range(20)} == {"pending"}  # paused: untouched
    assert {rows[f"b{i:06d}"] for i in range(20)} == {"failed"}  # 404: wrong model
    status = json.loads(cli("status", "--json", "--db", str(db)).stdout)
    assert status["totals"]["failed_by_class"] == {"http_404": 20}
    assert cli("resume", "a", "--db", str(db)).returncode == 0
    result = cli("requeue", "--dataset", "b", "--error-class", "http_404", "--db", str(db))
    assert result.stdout.strip() == "requeued 20 failed items"
    assert {s for k, s, n in item_rows(db) if k.startswith("b")} == {"pending"}
    assert cli("pause", "nope", "--db", str(db)).returncode == 2


def test_sigterm_drains_and_exits_zero(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.4")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(400))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    worker = start_worker(db, server.url, "--concurrency", "32", "--grace", "10")
    time.sleep(3)
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    states = {s for _, s, _ in item_rows(db)}
    assert "running" not in states and "done" in states
    names = [e["event"] for e in events(stderr)]
    assert "stopping" in names and "worker_stopped" in names


def test_kill_9_loop_gives_every_output_exactly_once(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    rng = random.Random(7)
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.05", "--per-token", "0.001", "--mean-tokens", "40")
    n = 3000
    data = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    kills = 0
    stranded = 0  # items left running by the worker just killed
    for _ in range(6):
        worker = start_worker(db, server.url, "--concurrency", "48", "--exit-when-done")
        time.sleep(rng.uniform(1.5, 3.5))
        worker.kill()
        _, stderr = worker.communicate(timeout=30)
        kills += worker.returncode == -signal.SIGKILL
        reclaimed = sum(e["items"] for e in events(stderr) if e["event"] == "leases_reclaimed")
        # A restarted worker takes a dead one's leases back at once (same host, pid
        # gone), not after the 120 s lease expires.
        if stranded and "worker_started" in stderr:
            assert reclaimed >= stranded
        with sqlite3.connect(db) as conn:
            stranded = conn.execute(
                "SELECT count(*) FROM items WHERE state = 'running'"
            ).fetchone()[0]
    assert kills == 6
    final = start_worker(db, server.url, "--concurrency", "48", "--exit-when-done")
    _, stderr = final.communicate(timeout=300)
    assert final.returncode == 0, stderr
    rows = item_rows(db)
    assert {s for _, s, _ in rows} == {"done"}
    check_export(db, tmp_path / "out.jsonl", [f"p{i:06d}" for i in range(n)])
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM outputs").fetchone()[0] == n
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.parametrize("workers", [3])
def test_several_workers_share_one_database(
    tmp_path: Path, sim_process: Callable[..., SimProcess], workers: int
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.02")
    n = 3000
    data = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    procs = [
        start_worker(db, server.url, "--concurrency", "32", "--exit-when-done")
        for _ in range(workers)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert "database is locked" not in stderr
    # Each item was claimed exactly once: no item ever ran in two workers at once.
    assert {(s, a) for _, s, a in item_rows(db)} == {("done", 1)}
    done_by_worker = [
        next(e for e in events(stderr) if e["event"] == "worker_stopped")["completed"]
        for _, stderr in outputs
    ]
    assert sum(done_by_worker) == n
    assert sum(1 for d in done_by_worker if d > 0) >= 2  # the work really was shared
    check_export(db, tmp_path / "out.jsonl", [f"p{i:06d}" for i in range(n)])
