"""Watching a run (``status``, ``watch``, the dashboard, ``run``'s live line): what a
person reads there must be true of the run: shares that never round up to finished."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.monitor.text import percent
from tests.helpers import SimProcess, cli, prompts, start_worker, write_jsonl


@given(st.integers(min_value=1, max_value=10**9), st.data())
def test_a_share_is_rounded_down_and_whole_only_when_all(total: int, data: st.DataObject) -> None:
    part = data.draw(st.integers(min_value=0, max_value=total))
    shown = float(percent(part, total).rstrip("%"))
    exact = 100 * part / total
    assert exact - 0.1 < shown <= exact + 1e-9
    assert (shown == 100.0) == (part == total)


def _states(db: Path, done: int, failed: int) -> None:
    """The first ``failed`` items failed, the next ``done`` done, the rest pending."""
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE items SET state = 'pending', error_class = NULL")
        conn.execute(
            "UPDATE items SET state = 'failed', error_class = 'http_400' WHERE id <= ?", (failed,)
        )
        conn.execute(
            "UPDATE items SET state = 'done' WHERE id > ? AND id <= ?", (failed, failed + done)
        )


def test_failures_are_not_shown_as_finished(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3000))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    _states(db, done=2889, failed=111)
    for command in (("status",), ("watch", "--count", "1")):
        shown = cli(*command, "--db", str(db), env={"COLUMNS": "200"})
        assert shown.returncode == 0, shown.stderr
        assert "2,889/3,000" in shown.stdout and "96.3" in shown.stdout, shown.stdout
        assert "100.0" not in shown.stdout, shown.stdout
    _states(db, done=2999, failed=0)
    shown = cli("status", "--db", str(db))
    assert "2,999/3,000" in shown.stdout and "99.9%" in shown.stdout, shown.stdout
    assert "100.0" not in shown.stdout


def _workers(db: Path) -> list[dict[str, Any]]:
    shown = cli("status", "--json", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["workers"]


def test_workers_show_their_requests_in_flight_and_death(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A worker's requests in flight show in status soon after it claims them (not a
    quarter lease later), and a worker killed with -9 shows as dead, not as live."""
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    server = sim_process("--latency", "600")
    worker = start_worker(db, server.url, "--concurrency", "20", "--lease-seconds", "600")
    deadline = time.monotonic() + 60  # its first heartbeat was 150 s after its start
    while not (seen := _workers(db)) or seen[0]["in_flight"] != 20:
        assert worker.poll() is None and time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert not seen[0]["dead"]
    worker.kill()
    worker.wait()
    (entry,) = _workers(db)
    assert entry["dead"] and not entry["stopped"], entry
    text = cli("status", "--db", str(db)).stdout
    assert "DEAD" in text, text
