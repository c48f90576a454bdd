"""What ``run`` prints: a live progress line on a terminal, repeated warnings summarised,
and why items were retried in ``status`` (text and JSON), all through the real commands."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from orchestrator import logs
from tests.helpers import REPO, SimProcess, cli, prompts, query, run_on_a_terminal, write_jsonl

ORCH = (sys.executable, "-m", "orchestrator")
PROGRESS = re.compile(
    r"(?P<done>[\d,]+)/(?P<total>[\d,]+) done +(?P<pct>[\d.]+)% +[\d.,]+ req/s +[\d,]+ tok/s"
    r" +ETA \S+ +failed (?P<failed>\d+) +retries (?P<retries>\d+) +in flight \d+"
)
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_LOG")}
    return {**env, **extra}


def _enqueue(tmp_path: Path, n: int, db: str | None = None) -> str:
    db = db or str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "p.jsonl", prompts(n))
    result = cli("enqueue", str(data), "--dataset", "p", "--db", db)
    assert result.returncode == 0, result.stderr
    return db


def _run_piped(argv: list[str], env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    lines = result.stderr.splitlines()
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    # Besides the events, only the closing verdict of a run that did not finish cleanly.
    assert all(line.startswith(("{", "incomplete: ")) for line in lines), result.stderr
    return result.returncode, parsed


def test_progress_line_on_a_terminal_with_logs_above_it(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0.25", "--mean-tokens", "8", "--fault", "500=0.3")
    db = _enqueue(tmp_path, 60)
    argv = [*ORCH, "run", "--server", server.url, "--db", db, "--exit-when-done"]
    argv += ["--concurrency", "4", "--retry-backoff", "0.05"]
    code, raw = run_on_a_terminal(argv, _env(), columns=200)
    assert code == 0, raw
    text = ANSI_COLOUR.sub("", raw)
    # Every write of the line starts by wiping the line it stands on; a log line wipes it
    # too and the line is drawn again below: split there, each piece is one or the other.
    pieces = [p for chunk in text.split("\r\x1b[K") for p in chunk.split("\n")]
    lines = [p.strip("\r") for p in pieces if p.strip()]
    drawn = [m for m in map(PROGRESS.fullmatch, lines) if m]
    assert len(drawn) >= 3, text
    for line in lines:
        if PROGRESS.search(line):
            assert PROGRESS.fullmatch(line), f"a log line ran into the progress line: {line!r}"
            assert not TIMESTAMP.search(line), line
    assert {m["total"] for m in drawn} == {"60"}
    done = [int(m["done"]) for m in drawn]
    assert done == sorted(done) and done[-1] > done[0], done
    retries = [int(m["retries"]) for m in drawn]
    assert retries == sorted(retries) and retries[-1] > 0
    # Log lines are still there, above the line, as readable text.
    assert any("worker_started" in line and TIMESTAMP.search(line) for line in lines), text
    assert any(re.search(r"item_retry x \d+ in \d+ s: http_500 \(\d+\)", line) for line in lines)
    # The line is taken away at the end: what the screen's last line shows is the summary.
    last = text.rstrip().rsplit("\n", 1)[-1].rsplit("\r\x1b[K", 1)[-1].strip("\r")
    assert last.startswith("worker stopped: 60 done"), text[-300:]


def test_progress_line_says_when_no_server_is_reachable(tmp_path: Path) -> None:
    """The only server down from the start: the live line gives no ETA, says that no
    server is reachable, which one and why, until the run gives up (exit 4)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    db = _enqueue(tmp_path, 5)
    argv = [*ORCH, "run", "--server", url, "--db", db, "--exit-when-done", "--give-up-after", "4"]
    code, raw = run_on_a_terminal(argv, _env(), columns=400)
    assert code == 4, raw
    text = ANSI_COLOUR.sub("", raw)
    outage = re.compile(
        r"0/5 done +0\.0% .* ETA \? \(waiting for a server\) +failed 0 .* in flight 0"
        rf"  NO SERVER REACHABLE: {re.escape(url)} \(connection refused by [^)]*\)?, for \d+s\)"
    )
    lines = [p.strip("\r") for chunk in text.split("\r\x1b[K") for p in chunk.split("\n")]
    assert any(outage.fullmatch(line) for line in lines), text


def test_no_progress_line_when_piped(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0.2", "--mean-tokens", "8")
    db = _enqueue(tmp_path, 20)
    argv = [*ORCH, "run", "--server", server.url, "--db", db, "--exit-when-done"]
    code, parsed = _run_piped([*argv, "--concurrency", "2"], _env())
    assert code == 0
    assert parsed[-1]["event"] == "worker_stopped" and parsed[-1]["completed"] == 20


def _summaries(parsed: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in parsed if e["event"] == "repeated" and e["repeated"] == name]


def test_repeated_warnings_are_counted_and_summarised_per_interval(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process(
        "--latency", "0.1", "--mean-tokens", "8", "--fault", "500=0.4", "--fault", "400=0.1"
    )  # fmt: skip
    db = _enqueue(tmp_path, 100)  # about 4 s: several intervals of 0.5 s
    argv = [*ORCH, "run", "--server", server.url, "--db", db, "--exit-when-done"]
    argv += ["--concurrency", "4", "--retry-backoff", "0.05", "--max-attempts", "30"]
    code, parsed = _run_piped(argv, _env(ORCHESTRATOR_LOG_REPEAT_SECONDS="0.5"))
    assert code in (0, 6)  # 6: the 400s failed for good (exit codes of `run`)
    stopped = parsed[-1]
    assert stopped["event"] == "worker_stopped"
    retried, failed = stopped["retried"], stopped["failed"]
    assert retried > 30 and failed > 3

    retry_lines = [e for e in parsed if e["event"] == "item_retry"]
    retry_summaries = _summaries(parsed, "item_retry")
    # Some were counted, not written: at most 3 are written per interval, however long
    # the run takes on a busy machine.
    assert len(retry_lines) < retried
    assert len(retry_summaries) >= 2  # one per interval that had more than it showed
    assert sum(s["count"] for s in retry_summaries) + _unsummarised(parsed, "item_retry") == retried
    for s in retry_summaries:
        assert s["level"] == "warning" and s["shown"] == 3 and s["seconds"] <= 1
        assert sum(s["by_class"].values()) == s["count"]
        assert set(s["by_class"]) == {"http_500"}
        assert s["summary"].startswith(f"item_retry x {s['count']:,} in {s['seconds']} s: ")
    # Each one shown carries why.
    assert all(e["error"].startswith("HTTP 500") for e in retry_lines)

    fail_summaries = _summaries(parsed, "item_failed")
    fail_lines = [e for e in parsed if e["event"] == "item_failed"]
    assert sum(s["count"] for s in fail_summaries) + _unsummarised(parsed, "item_failed") == failed
    assert len(fail_lines) < failed
    assert all(set(s["by_class"]) <= {"http_400", "http_500"} for s in fail_summaries)
    # The summaries come before the worker's last line, none after it.
    assert parsed.index(stopped) == len(parsed) - 1


def _unsummarised(parsed: list[dict[str, Any]], name: str) -> int:
    """Events of ``name`` written in intervals that showed all they had (no summary)."""
    shown, counted = 0, 0
    for e in parsed:
        if e["event"] == name:
            shown += 1
        elif e["event"] == "repeated" and e["repeated"] == name:
            counted += min(e["shown"], e["count"])
    return shown - counted


def test_debug_writes_every_event(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> None:
    server = sim_process("--latency", "0.02", "--mean-tokens", "8", "--fault", "500=0.4")
    db = _enqueue(tmp_path, 60)
    argv = [*ORCH, "--log-level", "debug", "run", "--server", server.url, "--db", db]
    argv += ["--exit-when-done", "--retry-backoff", "0.05", "--max-attempts", "30"]
    code, parsed = _run_piped(argv, _env(ORCHESTRATOR_LOG_REPEAT_SECONDS="0.5"))
    assert code == 0
    retried = parsed[-1]["retried"]
    assert retried > 10
    assert len([e for e in parsed if e["event"] == "item_retry"]) == retried
    assert not [e for e in parsed if e["event"] == "repeated"]


def test_status_shows_the_latest_messages_per_error_class(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process(
        "--latency", "0.01", "--mean-tokens", "8", "--fault", "500=0.3", "--fault", "400=0.1"
    )  # fmt: skip
    _enqueue(tmp_path, 80, db_url)
    worker = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done",
        "--retry-backoff", "0.05", "--max-attempts", "30",
    )  # fmt: skip
    assert worker.returncode in (0, 6), worker.stderr
    snap = json.loads(cli("status", "--json", "--db", db_url).stdout)
    messages = snap["totals"]["error_messages"]
    assert set(messages) == set(snap["totals"]["errors"]) == {"http_400", "http_500"}
    for cls, entry in messages.items():
        rows = query(
            db_url,
            "SELECT e.message, e.created_at, i.key FROM attempt_errors AS e JOIN items AS i"
            " ON i.id = e.item_id WHERE e.error_class = ? ORDER BY e.id DESC",
            cls,
        )
        assert entry["count"] == len(rows) == sum(snap["totals"]["errors"][cls].values())
        newest_message, newest_at, newest_key = rows[0]
        assert entry["last_message"] == newest_message and entry["last_at"] == newest_at
        assert entry["latest"][0]["item"] == newest_key
        assert entry["latest"][0]["dataset"] == "p"
        shown = [m["message"] for m in entry["latest"]]
        assert len(shown) == len(set(shown)) >= 1  # distinct messages, newest first
        assert [m["at"] for m in entry["latest"]] == sorted(
            (m["at"] for m in entry["latest"]), reverse=True
        )
    assert messages["http_500"]["last_message"].startswith("HTTP 500")
    assert "HTTP 400" in messages["http_400"]["last_message"]
    assert snap["datasets"][0]["error_messages"].keys() == messages.keys()

    text = cli("status", "--db", db_url).stdout
    after_500 = text.split("http_500", 1)[1].splitlines()[1]
    assert re.fullmatch(r"\s+\S+ ago  p/p\d{6}  HTTP 500.*", after_500), text
    assert f"p/{messages['http_500']['latest'][0]['item']}" in after_500


def test_summariser_keeps_the_first_few_per_interval_and_counts_the_rest() -> None:
    """The interval logic on a clock of the test's own (the commands above use real time)."""
    now = [0.0]
    summariser = logs.RepeatSummariser(60.0, 3, json=True, clock=lambda: now[0])
    seen: list[dict[str, Any]] = []

    def keep(_logger: Any, _method: str, event_dict: Any) -> Any:
        seen.append(dict(event_dict))
        raise structlog.DropEvent

    structlog.configure(
        processors=[summariser, keep],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    log = structlog.get_logger()
    for i in range(10):
        log.warning("item_retry", item=i, error_class="timeout" if i % 3 == 0 else "http_500")
    log.info("progress", done=5)  # about no item: passed as it is
    assert [(e["event"], e.get("item")) for e in seen] == [
        ("item_retry", 0), ("item_retry", 1), ("item_retry", 2), ("progress", None)
    ]  # fmt: skip
    now[0] = 61.0
    log.warning("item_retry", item=99, error_class="http_500")  # the next interval
    summary, first = seen[4:]
    assert summary == {
        "event": "repeated",
        "repeated": "item_retry",
        "count": 10,
        "seconds": 60,
        "by_class": {"http_500": 6, "timeout": 4},
        "summary": "item_retry x 10 in 60 s: http_500 (6), timeout (4)",
        "shown": 3,
        "hint": "--log-level debug shows each",
    }
    assert first["item"] == 99
    summariser.flush()  # the new interval showed all it had: nothing to tell
    assert len(seen) == 6
    for i in range(5):
        log.warning("lease_lost", item=i)
    now[0] = 70.0
    summariser.flush()  # the end of the run: what was counted so far, classless
    assert seen[-1]["summary"] == "lease_lost x 5 in 9 s" and seen[-1]["by_class"] == {}


def test_watch_shows_the_latest_message_of_each_class(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0.01", "--mean-tokens", "8", "--fault", "500=0.3")
    db = _enqueue(tmp_path, 30)
    worker = cli("run", "--server", server.url, "--db", db, "--exit-when-done")
    assert worker.returncode == 0, worker.stderr
    # A message is the server's text: rich markup in it is shown, not interpreted.
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE attempt_errors SET message = '[bold]x[/bold] HTTP 500: odd'"
            " WHERE id = (SELECT max(id) FROM attempt_errors)"
        )
    conn.close()
    result = cli("watch", "--db", db, "--count", "1", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "http_500: retried" in line)
    assert re.search(r"\S+ ago \[bold\]x\[/bold\] HTTP 500: odd", lines[at + 1]), result.stdout
