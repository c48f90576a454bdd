"""The sbatch script of ``deploy slurm`` with servers the task launches itself: llama.cpp's
``llama-server`` started by each task's worker (``--launch``), the test PostgreSQL as
the queue, a task preempted with SIGTERM to its batch shell, requeued and resumed."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.helpers import cli, query, write_jsonl
from tests.test_launch import alive, wait_for
from tests.test_launch_llamacpp import MAX_TOKENS, MODEL, command, listening
from tests.test_slurm import cluster, submit

pytestmark = pytest.mark.llamacpp
__all__ = ["cluster", "command"]  # fixtures, used by name


def launched(where: Path) -> list[dict[str, object]]:
    """Every server the tasks launched, from their workers' servers.json."""
    found: list[dict[str, object]] = []
    for path in sorted(where.glob("*/servers.json")):
        found.extend(json.loads(path.read_text())["servers"])
    return found


def test_a_preempted_task_stops_its_servers_requeues_and_resumes(
    cluster: slurm_cluster.SlurmCluster,
    command: str,
    tmp_path: Path,
    pg_database: Callable[[], str],
) -> None:
    db = pg_database()
    rows = enqueue_pg(db, tmp_path)
    where = tmp_path / "servers"
    run_args = f"--concurrency 4 --replicas 2 --launch-dir {shlex.quote(str(where))}"
    job, _ = submit(
        cluster, tmp_path, db, "--array", "1", "--launch", command, "--grace", "10",
        "--signal-lead", "90", "--run-args", run_args,
    )  # fmt: skip
    wait_for(lambda: _done(db) >= 60, "the first answers", 180)
    first = launched(where)
    pids = [s["pid"] for s in first if isinstance(s["pid"], int)]
    assert len(pids) == 2
    cluster.command("scancel", "--batch", "--signal=TERM", f"{job}_0", check=True)
    cluster.wait(job, 300)
    log = (tmp_path / f"task-{job}_0.log").read_text()
    assert "items left: requeued" in log and "the worker exited 0" in log, log
    assert '"event": "stopping_servers"' in log, log
    check_exported_once(db, rows, tmp_path / "out.jsonl")
    # Two workers, each with its two servers, none of them left running.
    everyone = launched(where)
    assert len(everyone) == 4 and {s["state"] for s in everyone} == {"stopped"}
    assert not any(alive(pid) for pid in pids)
    ports = [int(str(s["url"]).rsplit(":", 1)[1]) for s in everyone]
    assert listening(ports) == []


def enqueue_pg(db: str, tmp_path: Path) -> list[dict[str, object]]:
    """600 short prompts in the PostgreSQL queue."""
    rows = [
        {"id": f"s{i:04d}", "messages": [{"role": "user", "content": f"Tell of stone {i}."}]}
        for i in range(600)
    ]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    result = cli("enqueue", str(data), "-d", "l", "--db", db, "--model", MODEL,
                 "--max-tokens", str(MAX_TOKENS))  # fmt: skip
    assert result.returncode == 0, result.stderr
    return rows


def check_exported_once(db: str, rows: list[dict[str, object]], out: Path) -> None:
    """Every item exported once, with llama-server's own usage."""
    result = cli("export", str(out), "--db", db)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [row["id"] for row in rows]
    for line in lines:
        usage = line["usage"]
        assert 0 < usage["completion_tokens"] <= MAX_TOKENS and usage["prompt_tokens"] > 5
    assert query(db, "SELECT count(*) FROM outputs")[0][0] == len(rows)


def _done(db: str) -> int:
    return int(query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0])
