"""Launched servers for real: llama.cpp's ``llama-server`` (built by
scripts/llama_server.py, with its tiny model) started by ``run --launch``, killed under
the run, and the worker killed or stopped under its servers."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from scripts import llama_server
from tests.helpers import cli, done_count, events, exported, query, write_jsonl
from tests.test_launch import alive, start_run, states, wait_for
from tests.test_llamacpp import require_llama_server

pytestmark = pytest.mark.llamacpp
MODEL = llama_server.MODEL_ALIAS
N = 600
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def command() -> str:
    """llama-server as a launch command: 4 slots of 2,048 tokens, one thread, metrics."""
    require_llama_server()
    binary, model = map(str, (llama_server.binary_path(), llama_server.model_path()))
    return shlex.join([binary, "-m", model, "-a", MODEL, "--host", "127.0.0.1"]) + (
        " --port {port} -c 8192 -np 4 -t 1 --metrics"
    )


def enqueue(db: Path, n: int = N, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    rows = [
        {"id": f"s{i:04d}", "messages": [{"role": "user", "content": f"Tell of stone {i}."}]}
        for i in range(n)
    ]
    data = write_jsonl(db.parent / "in.jsonl", rows)
    result = cli(
        "enqueue",
        str(data),
        "-d",
        "l",
        "--db",
        str(db),
        "--model",
        MODEL,
        "--max-tokens",
        str(max_tokens),
    )
    assert result.returncode == 0, result.stderr
    return rows


def check_exported_once(db: Path, rows: list[dict[str, Any]]) -> None:
    """Every item exported once, with the usage llama-server itself reported."""
    lines = exported(db, db.parent / "out.jsonl", [row["id"] for row in rows])
    for line in lines:
        usage = line["usage"]
        assert 0 < usage["completion_tokens"] <= MAX_TOKENS and usage["prompt_tokens"] > 5, line
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert query(db, "SELECT count(*) FROM outputs")[0][0] == N


def launched_pids(db: Path) -> list[int]:
    """The servers' and their watchdogs' pids, as the workers wrote them."""
    pids = []
    for server in states(db):
        pids += [pid for pid in (server["pid"], server.get("watchdog_pid")) if pid]
    return pids


def generating(db: Path) -> int:
    """Requests the launched servers are generating now (llama-server's ``/metrics``)."""
    total = 0
    for server in states(db):
        try:
            with urllib.request.urlopen(server["url"] + "/metrics", timeout=5) as answer:
                text = answer.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("llamacpp:requests_processing "):
                total += int(float(line.split()[1]))
    return total


def listening(ports: list[int]) -> list[str]:
    """Processes whose command line names one of ``ports`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.isdigit() and alive(int(entry)):
            text = [w.decode(errors="replace") for w in words]
            if "--port" in text and any(str(p) in text for p in ports) and MODEL in text:
                found.append(" ".join(text))
    return found


def run_args(command: str, *more: str) -> list[str]:
    return [
        "--launch",
        command,
        "--replicas",
        "2",
        "--concurrency",
        "4",
        "--restart-backoff",
        "0.5",
        *more,
    ]


def test_two_replicas_one_killed_mid_run_is_restarted(command: str, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    rows = enqueue(db)
    proc = start_run(db, "--exit-when-done", *run_args(command))
    wait_for(lambda: done_count(db) >= N // 4, "a quarter done")
    victim = states(db)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = done_count(db)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert killed_at < N, "the kill must land mid-run"
    died = [e for e in events(stderr) if e["event"] == "server_died"]
    assert [(e["server"], e["reason"]) for e in died] == [
        (victim["url"], "exited (killed by SIGKILL)")
    ]
    assert [s["restarts"] for s in states(db)] == [1, 0]
    check_exported_once(db, rows)
    # The items the dead server held went back without an attempt charged.
    assert query(db, "SELECT max(attempts) FROM items")[0][0] == 1


def test_a_killed_worker_leaves_no_server_and_the_next_run_resumes(
    command: str, tmp_path: Path
) -> None:
    db = tmp_path / "q.db"
    rows = enqueue(db)
    proc = start_run(db, *run_args(command))
    wait_for(lambda: done_count(db) >= N // 4, "a quarter done")
    pids = launched_pids(db)
    ports = [int(s["url"].rsplit(":", 1)[1]) for s in states(db)]
    assert len(pids) == 4 and all(alive(pid) for pid in pids)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    killed_at = done_count(db)
    assert 0 < killed_at < N
    # The watchdogs saw their pipe close and stopped the servers: none survives.
    wait_for(lambda: not any(alive(pid) for pid in pids), "every launched process gone", 60)
    assert listening(ports) == []
    result = cli("run", "--db", str(db), "--exit-when-done", *run_args(command))
    assert result.returncode == 0, result.stderr
    check_exported_once(db, rows)
    assert not any(alive(pid) for pid in launched_pids(db))


def test_sigterm_lets_answers_finish_then_stops_the_servers(command: str, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    # Long answers, so that requests are still in flight when the worker, loaded as it
    # may be, gets to its drain after the signal (300 tokens were done within it).
    enqueue(db, 200, 1000)
    proc = start_run(db, *run_args(command, "--grace", "60"))
    wait_for(lambda: done_count(db) >= 20, "20 items done")
    pids = launched_pids(db)
    # The signal lands while the servers are generating (a busy machine may have them
    # between answers, or one being restarted, at the moment 20 are done).
    wait_for(lambda: generating(db) > 0, "a request being generated")
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stderr
    logged = [e["event"] for e in events(stderr)]
    # The worker drained and wrote its last answers before its servers were stopped.
    assert logged.index("worker_stopped") < logged.index("stopping_servers")
    stopped = next(e for e in events(stderr) if e["event"] == "worker_stopped")
    # Every request in flight was answered: none cut (prefetched ones went back unasked).
    draining = [e for e in events(stderr) if e["event"] == "draining"]
    assert len(draining) == 1 and draining[0]["in_flight"] > 0, stderr
    assert [e["cut"] for e in events(stderr) if e["event"] == "released_at_shutdown"] in ([], [0])
    assert not any(alive(pid) for pid in pids)
    assert [s["state"] for s in states(db)] == ["stopped", "stopped"]
    done = done_count(db)
    assert done == stopped["completed"]
    assert query(db, "SELECT count(*) FROM items WHERE state = 'running'")[0][0] == 0


def test_the_llama_cpp_preset_launches_the_real_server(command: str, tmp_path: Path) -> None:
    """``--engine llama.cpp`` builds a command llama-server takes; ``plan`` reads its
    per-slot context (``-c`` over ``-np``) and its metrics, and the run answers with it."""
    db = tmp_path / "q.db"
    rows = enqueue(db, 20)
    preset = [
        "--engine",
        "llama.cpp",
        "--engine-bin",
        str(llama_server.binary_path()),
        "--model",
        str(llama_server.model_path()),
        "--served-model-name",
        MODEL,
        "--engine-args",
        "-c 8192 -np 4 -t 1",
    ]
    planned = cli("plan", "--db", str(db), "--json", *preset)
    assert planned.returncode == 0, planned.stderr
    looked = orjson.loads(planned.stdout)["launched"]
    assert (looked["context_length"], looked["metrics"]) == (2048, "llamacpp")
    assert "--metrics" in looked["command"] and f"--alias {MODEL}" in looked["command"]
    result = cli("run", "--db", str(db), "--exit-when-done", *preset)
    assert result.returncode == 0, result.stderr
    lines = exported(db, db.parent / "out.jsonl", [row["id"] for row in rows])
    assert all(line["usage"]["prompt_tokens"] > 5 for line in lines)
