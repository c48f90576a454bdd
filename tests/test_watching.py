"""Watching a run (``status``, ``watch``, the dashboard, ``run``'s live line): what a
person reads there must be true of the run: shares that never round up to finished."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.monitor.text import percent
from tests.helpers import cli, prompts, write_jsonl


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
