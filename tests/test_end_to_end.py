"""Real processes: the CLI, worker subprocesses killed with SIGKILL, several workers at once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.helpers import (
    SimProcess,
    check_export,
    cli,
    item_rows,
    prompts,
    write_jsonl,
)


def test_enqueue_run_status_export(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.01")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(300))
    result = cli("enqueue", str(data), "--dataset", "e2e", "--db", str(db), "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
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
    server = sim_process("--max-model-len", "4000")
    a = write_jsonl(tmp_path / "a.jsonl", prompts(20, prefix="a"))
    b = write_jsonl(tmp_path / "b.jsonl", prompts(20, prefix="b"))
    assert cli("enqueue", str(a), "-d", "a", "--db", str(db)).returncode == 0
    too_long = ("--max-tokens", "4000")  # each of b's requests exceeds the context
    assert cli("enqueue", str(b), "-d", "b", "--db", str(db), *too_long).returncode == 0
    assert "paused" in cli("pause", "a", "--db", str(db)).stdout
    assert "(paused)" in cli("status", "--db", str(db)).stdout
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    # Finished, not all done: failed items (exit 6) outrank paused ones (7).
    assert result.returncode == 6, result.stderr
    assert "20 failed" in result.stderr and "20 pending in paused datasets" in result.stderr
    rows = dict((k, s) for k, s, _ in item_rows(db))
    assert {rows[f"a{i:06d}"] for i in range(20)} == {"pending"}  # paused: untouched
    assert {rows[f"b{i:06d}"] for i in range(20)} == {"failed"}  # longer than the context
    status = json.loads(cli("status", "--json", "--db", str(db)).stdout)
    assert status["totals"]["failed_by_class"] == {"context_overflow": 20}
    assert cli("resume", "a", "--db", str(db)).returncode == 0
    result = cli("requeue", "--dataset", "b", "--error-class", "context_overflow", "--db", str(db))
    assert result.stdout.strip() == "requeued 20 failed items"
    assert {s for k, s, n in item_rows(db) if k.startswith("b")} == {"pending"}
    assert cli("pause", "nope", "--db", str(db)).returncode == 2
