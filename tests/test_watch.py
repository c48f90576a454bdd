"""``orchestrator watch``: the live view, drawn from the same document as ``status``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from orchestrator.monitor.live import render
from tests.helpers import SimProcess, cli, prompts, write_jsonl


def draw(snap: dict[str, Any]) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(render(snap))
    return console.export_text()


def test_watch_shows_progress_errors_workers_and_servers(tmp_path: Path, sim_process: Any) -> None:
    db = tmp_path / "q.db"
    for name, n in (("short", 30), ("long", 10)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", prompts(n, prefix=name))
        assert cli("enqueue", str(path), "-d", name, "--db", str(db)).returncode == 0
    server: SimProcess = sim_process("--latency", "0", "--fault", "400=0.2")
    ran = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert ran.returncode == 6, ran.stderr  # some items failed (the 400s)
    snap = json.loads(cli("status", "--json", "--db", str(db), "--server", server.url).stdout)
    text = draw(snap)
    for e in snap["datasets"]:
        c = e["counts"]
        assert f"{c['done']:,}/{c['total']:,}" in text
    assert "TOTAL" in text and "40/40" not in text  # some failed: not all done
    failed = snap["totals"]["counts"]["failed"]
    assert failed > 0 and f"http_400: failed {failed}" in text
    assert f"{server.url} (sglang)  running 0, queued 0" in text

    # The command itself, twice over, as a terminal would get it.
    env = {**os.environ, "COLUMNS": "150"}
    result = cli(
        "watch", "--db", str(db), "--count", "2", "--interval", "0.1", "--server", server.url,
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "short" in result.stdout and "long" in result.stdout
    assert "servers (their own /metrics)" in result.stdout


def test_an_empty_database_and_a_silent_worker() -> None:
    snap = {
        "database": "q.db",
        "window_seconds": 300.0,
        "datasets": [],
        "totals": {
            "counts": {"pending": 0, "running": 0, "done": 0, "failed": 0, "total": 0},
            "progress": 0.0,
            "recent": {"requests_per_s": 0.0, "tokens_per_s": 0.0},
            "completion_tokens": {"mean": None, "p50": None, "p90": None},
            "eta_seconds": None,
            "errors": {},
            "flags": {"truncated": 2},
        },
        "workers": [
            {"id": "h:1:2", "stopped": False, "silent": True, "in_flight": 3, "completed": 9,
             "heartbeat_age_s": 400.0},
        ],
    }  # fmt: skip
    text = draw(snap)
    assert "flagged answers: truncated 2" in text
    assert "h:1:2" in text and "SILENT" in text


def test_the_live_line_counts_the_rationed_apart_from_its_eta() -> None:
    """Suspects go a group at a time: the line's ETA is for the rest, and says how many
    are rationed, rather than an ETA from the pace of one group."""
    import asyncio
    from types import SimpleNamespace

    from orchestrator.monitor.progress import Counts, ProgressLine
    from orchestrator.worker.config import WorkerStats

    reachable = asyncio.Event()
    reachable.set()  # a server answers: the line has an ETA
    pool = SimpleNamespace(available=reachable)
    worker = SimpleNamespace(stats=WorkerStats(), in_flight=3, pool=pool)
    line = ProgressLine(worker)  # type: ignore[arg-type]
    line.counts = Counts(done=100, pending=110, running=10, after_crash=40, rationed=20)
    line.samples.extend([(0.0, 0, 0, 0), (10.0, 100, 0, 100)])  # 10 answers a second
    assert "ETA 10s + 20 rationed after crashes" in line.render(200)
    line.counts.rationed = 0
    assert "ETA 12s (40 back after a crash)" in line.render(200)
