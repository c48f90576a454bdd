"""Logs: JSON lines off a terminal, a readable console on one; requests at debug."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.helpers import REPO, SimProcess, cli, prompts, run_on_a_terminal, write_jsonl

ORCH = (sys.executable, "-m", "orchestrator")


def _run(db: Path, url: str, level: str) -> list[dict[str, object]]:
    """A worker to the end, with stderr a pipe: every line must be one JSON event."""
    result = subprocess.run(
        [*ORCH, "--log-level", level, "run", "--server", url, "--db", str(db), "--exit-when-done"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_LOG_LEVEL"},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines
    parsed = [json.loads(line) for line in lines]  # no line of prose in between
    for event in parsed:
        assert {"event", "level", "timestamp"} <= event.keys()
    return parsed


def test_json_lines_off_a_terminal_with_requests_at_debug(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0", "--mean-tokens", "8")
    data = write_jsonl(tmp_path / "p.jsonl", prompts(5))
    for name in ("info.db", "debug.db"):
        enqueued = cli("enqueue", str(data), "--dataset", "p", "--db", str(tmp_path / name))
        assert enqueued.returncode == 0, enqueued.stderr

    quiet = _run(tmp_path / "info.db", server.url, "info")
    names = {e["event"] for e in quiet}
    assert "all_done" in names and "worker_stopped" in names
    assert "answered" not in names
    assert {e["level"] for e in quiet} <= {"info", "warning"}

    chatty = _run(tmp_path / "debug.db", server.url, "debug")
    answered = [e for e in chatty if e["event"] == "answered"]
    assert sorted(e["key"] for e in answered) == [f"p{i:06d}" for i in range(5)]
    first = answered[0]
    assert first["level"] == "debug" and first["dataset"] == "p"
    assert first["server"] == server.url and first["finish_reason"] == "stop"
    assert isinstance(first["completion_tokens"], int) and first["latency_s"] >= 0


def test_readable_console_on_a_terminal(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """On a terminal the same events are rendered for people, not as JSON."""
    server = sim_process("--latency", "0", "--mean-tokens", "8")
    data = write_jsonl(tmp_path / "p.jsonl", prompts(3))
    db = str(tmp_path / "t.db")
    assert cli("enqueue", str(data), "--dataset", "p", "--db", db).returncode == 0
    code, raw = run_on_a_terminal(
        [*ORCH, "run", "--server", server.url, "--db", db, "--exit-when-done"],
        {**os.environ, "ORCHESTRATOR_LOG_LEVEL": "debug"},
        timeout=60,
    )
    assert code == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    lines = [line for line in text.splitlines() if line.strip()]
    assert any("all_done" in line for line in lines), text
    assert any("answered" in line and "key=p000000" in line for line in lines), text
    for line in lines:
        assert not line.lstrip().startswith("{"), line
