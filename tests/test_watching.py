"""Watching a run (``status``, ``watch``, the dashboard, ``run``'s live line): what a
person reads there must be true of the run: shares that never round up to finished."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.monitor.text import percent
from tests.helpers import Heard, SimProcess, cli, prompts, start_worker, write_jsonl


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


def _status(db: Path) -> dict[str, Any]:
    shown = cli("status", "--json", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def _wait_for(db: Path, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while not check(snap := _status(db)):
        assert time.monotonic() < deadline, f"never {what}: {json.dumps(snap)[-3000:]}"
        time.sleep(0.2)
    return snap


def _answering(snap: dict[str, Any]) -> bool:
    """Answers done, an ETA, and the worker's heartbeat says its one server is up."""
    totals, workers = snap["totals"], snap["workers"]
    up = bool(workers) and workers[0]["servers"] == workers[0]["servers_up"] == 1
    return up and totals["counts"]["done"] >= 4 and totals["eta_seconds"] is not None


def _refused(snap: dict[str, Any]) -> bool:
    """Every worker waits for a server, its one server refusing connections."""
    down = [d for w in snap["workers"] for d in w["servers_down"]]
    said = all("connection refused" in d["reason"].lower() for d in down)
    return bool(snap["totals"]["waiting_for_server"] and down and said)


def test_status_says_when_no_server_is_reachable(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The only server killed under a running worker: status (text and JSON) says that
    none is reachable, since when and why, and gives no ETA; the server back, it clears."""
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(400))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    server = sim_process("--latency", "0.5")
    worker = Heard(start_worker(db, server.url, "--concurrency", "4"))
    snap = _wait_for(db, _answering, "answered")
    assert not snap["totals"]["waiting_for_server"] and not snap["workers"][0]["servers_down"]

    server.kill()
    # Requests cut by the kill may take it out first; the probes then find it refused.
    snap = _wait_for(db, _refused, "waiting for a server, refused")
    (entry,) = snap["workers"]
    assert entry["waiting_for_server"] and entry["servers_up"] == 0, entry
    (down,) = entry["servers_down"]
    assert down["server"] == server.url, down
    assert entry["unreachable_since"] and snap["totals"]["unreachable_since"]
    assert snap["totals"]["eta_seconds"] is None and snap["datasets"][0]["eta_seconds"] is None
    text = cli("status", "--db", str(db), env={"COLUMNS": "200"}).stdout
    assert re.search(r"servers: none reachable for \S+: " + re.escape(server.url), text), text
    assert "connection refused" in text.lower() and "waiting for a server" in text, text
    assert "WAITING FOR A SERVER" in text, text

    server.start()
    snap = _wait_for(db, lambda s: not s["totals"]["waiting_for_server"], "back")
    assert snap["workers"][0]["servers_up"] == 1 and not snap["workers"][0]["servers_down"]
    text = cli("status", "--db", str(db), env={"COLUMNS": "200"}).stdout
    assert "none reachable" not in text and "WAITING" not in text, text
    worker.proc.terminate()
    assert worker.proc.wait(60) == 0, worker.text()[-3000:]


def test_a_worker_not_heard_from_past_its_lease_is_presumed_dead(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A worker frozen (as one on another host that is gone looks: its process cannot be
    looked at) reads as silent and presumed dead once its heartbeat is older than its
    lease, when the others may take its items, not 120 s later; heard again, it is live."""
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(40))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    server = sim_process("--latency", "600")
    proc = start_worker(db, server.url, "--concurrency", "2", "--lease-seconds", "8")
    _wait_for(db, lambda s: bool(s["workers"]) and s["workers"][0]["in_flight"] == 2, "claimed")
    proc.send_signal(signal.SIGSTOP)
    try:
        snap = _wait_for(db, lambda s: s["workers"][0]["silent"], "silent")
        (entry,) = snap["workers"]
        assert entry["presumed_dead"] and not entry["dead"] and entry["lease_seconds"] == 8, entry
        text = cli("status", "--db", str(db)).stdout
        assert re.search(
            r"SILENT: no heartbeat for \d+s, longer than its lease: presumed dead", text
        )
    finally:
        proc.send_signal(signal.SIGCONT)
    _wait_for(db, lambda s: not s["workers"][0]["silent"], "heard again")
    proc.kill()
    proc.wait()
