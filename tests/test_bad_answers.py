"""Answers a database cannot store, malformed answers, rate limits and stops that must not
hang: each through the real command, against ``tests/fixtures/bad_server.py``."""

from __future__ import annotations

import email.utils
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.inference.failures import _retry_after
from orchestrator.store import Database
from tests.helpers import REPO, ServerScript, cli, events, query, start_worker, write_jsonl

FIXTURE = REPO / "tests" / "fixtures" / "bad_server.py"
# A run that stalls never ends; one that works ends in seconds.
RUN_TIMEOUT = 120


class BadServer(ServerScript):
    """``bad_server.py`` as a process on a free port."""

    def __init__(self, kind: str):
        super().__init__([sys.executable, str(FIXTURE), "0", kind])


@pytest.fixture
def bad_server() -> Iterator[type[BadServer]]:
    started: list[BadServer] = []

    def start(kind: str) -> BadServer:
        started.append(BadServer(kind))
        return started[-1]

    yield start  # type: ignore[misc]
    for server in started:
        server.stop()


def enqueue(db: str, tmp_path: Path, n: int = 50) -> None:
    rows = [{"id": f"k{i}", "prompt": f"hello {i}"} for i in range(n)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    result = cli("enqueue", str(source), "--dataset", "d", "--model", "m", "--db", db)
    assert result.returncode == 0, result.stderr


def enqueued(tmp_path: Path, n: int = 50) -> str:
    """A new SQLite queue in ``tmp_path`` holding ``n`` prompts; its path."""
    db = str(tmp_path / "queue.db")
    enqueue(db, tmp_path, n)
    return db


def run(db: str, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``run --exit-when-done``: a worker that stalls fails the test at the timeout."""
    try:
        return cli(
            "--log-json", "--log-level", "info", "run", "--server", url, "--db", db,
            "--exit-when-done", *extra,
            timeout=RUN_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the run stalled: {str(exc.stderr)[-4000:]}") from None


def ended(result: subprocess.CompletedProcess[str]) -> None:
    """The run ended on its own, every write landing (some items may have failed)."""
    assert "commit_failed" not in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode != 3, result.stderr[-2000:]


def states(db: str) -> dict[str, str]:
    return dict(query(db, "SELECT key, state FROM items"))


def exported(db: str, out: Path) -> dict[str, dict[str, object]]:
    result = cli("export", str(out), "--db", db, "--provenance")
    assert result.returncode == 0, result.stderr
    return {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}


# -------------------------------------------------------------------- A1: unstorable


@pytest.mark.parametrize(
    "kind,where",
    [
        ("nul", "postgresql"),
        ("nul", "sqlite"),
        ("longfinish", "postgresql"),
        ("dictfinish", "sqlite"),
        ("dictfinish", "postgresql"),
    ],
)
def test_an_answer_the_database_cannot_take_as_sent_does_not_stall_the_run(
    kind: str, where: str, tmp_path: Path, pg_database: Any, bad_server: type[BadServer]
) -> None:
    """A NUL (PostgreSQL text refuses it), a 40-character finish_reason (varchar(32)), a
    finish_reason object: all 50 are done, and the odd answer exports as it was sent."""
    db_url = pg_database() if where == "postgresql" else str(tmp_path / "queue.db")
    server = bad_server(kind)
    enqueue(db_url, tmp_path)
    result = run(db_url, server.url)
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(states(db_url).values()) == {"done"}
    lines = exported(db_url, tmp_path / "out.jsonl")
    assert len(lines) == 50
    odd = lines["k7"]
    if kind == "nul":
        # The message exactly as the model emitted it, on both backends, and flagged.
        assert odd["messages"][-1]["content"] == "a NUL \x00 in the answer"
        assert odd["flags"] == ["nul"]
        # Stored once, in the message JSON, with the NUL escaped.
        stored = query(db_url, "SELECT content, message FROM outputs WHERE flags != 0")
        assert [(c, orjson.loads(m)["content"]) for c, m in stored] == [
            (None, "a NUL \x00 in the answer")
        ]
    elif kind == "longfinish":
        assert odd["finish_reason"] == "stop_because_the_server_said_so_40chars"
    else:
        assert odd["finish_reason"] == "stop"  # {"type": "stop"} read as its type


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"], indirect=True)
def test_an_error_message_holding_a_nul_is_stored(
    db_url: str, tmp_path: Path, bad_server: type[BadServer]
) -> None:
    server = bad_server("err500nul")
    enqueue(db_url, tmp_path, n=20)
    result = run(db_url, server.url, "--max-attempts", "1")
    ended(result)
    rows = query(db_url, "SELECT state, error_class, last_error FROM items")
    assert len(rows) == 20
    assert {(s, c) for s, c, _ in rows} == {("failed", "http_500")}
    assert all("boom \ufffd here" in message for _, _, message in rows)


@pytest.mark.parametrize("kind", ["dictfinish", "dictmodel"])
def test_a_restart_does_not_stall_again_on_the_same_answer(
    kind: str, tmp_path: Path, bad_server: type[BadServer]
) -> None:
    """The same prompt gets the same answer after a SIGKILL: the run still finishes."""
    server = bad_server(kind)
    db = enqueued(tmp_path)
    worker = start_worker(db, server.url, "--concurrency", "4")
    time.sleep(1.5)
    worker.kill()
    worker.communicate()
    result = run(db, server.url, "--max-attempts", "2", "--retry-backoff", "0.05")
    ended(result)
    found = states(db)
    assert "running" not in found.values() and "pending" not in found.values()
    outputs = query(db, "SELECT count(*), count(DISTINCT item_id) FROM outputs")
    if kind == "dictfinish":
        assert set(found.values()) == {"done"} and outputs == [(50, 50)]
    else:  # a model or id that is an object: refused when the answer is read
        assert found.pop("k7") == "failed" and set(found.values()) == {"done"}
        error = query(db, "SELECT error_class, last_error FROM items WHERE key = 'k7'")
        assert error[0][0] == "bad_response" and "model is a dict" in error[0][1]


def test_db_copy_to_postgresql_keeps_an_answer_holding_a_nul(
    tmp_path: Path, pg_database: object, bad_server: type[BadServer]
) -> None:
    """A run made on SQLite copies to PostgreSQL and exports the same bytes there."""
    server = bad_server("nul")
    db = enqueued(tmp_path)
    assert run(db, server.url).returncode == 0
    # An answer stored by an older version, with the NUL in its text columns too.
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE outputs SET reasoning = ?, flags = 0 WHERE flags != 0", ("x\x00y",))
    conn.close()
    target = pg_database()  # type: ignore[operator]
    result = cli("db", "copy", "--from", db, "--to", target)
    assert result.returncode == 0, result.stderr
    source_lines = (tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert cli("export", str(source_lines[0]), "--db", db).returncode == 0
    assert cli("export", str(source_lines[1]), "--db", target).returncode == 0
    assert source_lines[0].read_bytes() == source_lines[1].read_bytes()
    assert b"\\u0000" in source_lines[1].read_bytes()
    assert query(target, "SELECT reasoning, flags FROM outputs WHERE flags != 0") == [
        ("x\ufffdy", 16)
    ]


# -------------------------------------------------------------------- C9: malformed


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("badtools", "malformed tool_calls"),
        ("strtokens", "usage.completion_tokens"),
        ("nulltokens", "usage.completion_tokens"),
        ("bigtokens", "usage.completion_tokens"),
        ("listcontent", "content is a list"),
        ("intcontent", "content is a int"),
        ("nofinish", "no finish_reason"),
        ("dictmodel", "model is a dict"),
    ],
)
def test_a_malformed_answer_is_a_bad_response_not_training_data(
    kind: str, says: str, tmp_path: Path, bad_server: type[BadServer]
) -> None:
    server = bad_server(kind)
    db = enqueued(tmp_path, n=10)
    result = run(db, server.url, "--max-attempts", "1")
    ended(result)
    found = states(db)
    assert found.pop("k7") == "failed" and set(found.values()) == {"done"}
    ((error_class, message),) = query(
        db, "SELECT error_class, last_error FROM items WHERE key = 'k7'"
    )
    assert error_class == "bad_response" and says in message, message
    assert "k7" not in exported(db, tmp_path / "out.jsonl")
    status = cli("status", "--json", "--db", db)
    assert orjson.loads(status.stdout)["totals"]["completion_tokens"]["total"] == 9


# -------------------------------------------------------------------- A2: stops


@pytest.fixture
def small_disk(mounted: Callable[..., Path]) -> Path:
    """A small tmpfs to fill up: commits fail with "database or disk is full"."""
    return mounted("-t", "tmpfs", "-o", "size=16m", name="disk")


def fill(filler: Path) -> None:
    """Fill the disk to the last byte (the file exists: making one may need room)."""
    with open(filler, "ab", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


def wait_for(proc: subprocess.Popen[str], event: str, timeout: float) -> list[str]:
    """Read the worker's JSON log until ``event``; the lines read."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stderr.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            time.sleep(0.05)
            continue
        lines.append(line)
        if f'"event": "{event}"' in line:
            return lines
    raise AssertionError(f"no {event} within {timeout}s: {''.join(lines)[-2000:]}")


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    os.set_blocking(proc.stderr.fileno(), True)  # type: ignore[union-attr]
    try:
        _, rest = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker was still running {timeout:g}s after the stop") from None
    return proc.returncode, rest


@pytest.mark.parametrize("signals", [1, 2])
def test_a_stop_ends_a_worker_whose_commits_keep_failing(
    signals: int, small_disk: Path, tmp_path: Path, bad_server: type[BadServer]
) -> None:
    """Disk full: one SIGTERM ends the worker after --grace, a second at once; the
    answers it could not write are dropped in one line, the exit is non-zero, and a
    restart does every item exactly once."""
    db = str(small_disk / "queue.db")
    filler = small_disk / "filler"
    filler.touch()
    server = bad_server("slow")
    enqueue(db, tmp_path, n=300)
    grace = "2" if signals == 1 else "120"
    worker = start_worker(db, server.url, "--concurrency", "4", "--grace", grace)
    wait_for(worker, "worker_started", 20)
    time.sleep(1.0)
    fill(filler)
    seen = wait_for(worker, "commit_failed", 20)
    worker.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    if signals == 2:
        time.sleep(0.5)
        worker.send_signal(signal.SIGTERM)
    code, rest = finish(worker, 15)
    took = time.monotonic() - stopped
    logged = events("".join(seen) + rest)
    dropped = [e for e in logged if e["event"] == "outcomes_dropped"]
    assert code == 3, rest[-2000:]
    assert len(dropped) == 1 and dropped[0]["outcomes"] > 0
    assert next(e for e in logged if e["event"] == "worker_stopped")["dropped"] > 0
    assert took < (8 if signals == 1 else 4), took
    # Room again: a restart on this host takes the dead worker's leases back at once.
    filler.unlink()
    result = run(db, server.url, "--concurrency", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(states(db).values()) == {"done"}
    assert query(db, "SELECT count(*), count(DISTINCT item_id) FROM outputs") == [(300, 300)]


# -------------------------------------------------------------------- A3, D14: retries


def test_retry_backoff_sets_the_first_retry_delay(
    tmp_path: Path, bad_server: type[BadServer]
) -> None:
    server = bad_server("err500")
    db = enqueued(tmp_path, n=1)
    result = run(db, server.url, "--retry-backoff", "0.05", "--max-attempts", "3")
    ended(result)
    times = [t for (t,) in query(db, "SELECT created_at FROM attempt_errors ORDER BY id")]
    assert len(times) == 3
    # 0.05 s then 0.1 s (±25 %; claims look every 0.5 s), not 2 s then 4 s: 4.5 s at least
    assert times[-1] - times[0] < 2.5, times
    # And a long one is kept as long.
    db2 = str(tmp_path / "long.db")
    enqueue(db2, tmp_path, n=1)
    worker = start_worker(db2, server.url, "--retry-backoff", "60", "--max-attempts", "3")
    try:
        deadline = time.monotonic() + 20
        while not query(db2, "SELECT 1 FROM attempt_errors") and time.monotonic() < deadline:
            time.sleep(0.1)
        ((wait,),) = query(db2, "SELECT not_before - updated_at FROM items")
        assert 44 <= wait <= 76, wait
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)


def test_a_rate_limit_with_retry_after_does_not_use_up_attempts(
    tmp_path: Path, bad_server: type[BadServer]
) -> None:
    """Four 429s (Retry-After: 1) per prompt, three attempts allowed: a patient client
    finishes every item."""
    server = bad_server("429")
    db = enqueued(tmp_path, n=10)
    result = run(db, server.url, "--max-attempts", "3", "--retry-backoff", "0.05")
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(states(db).values()) == {"done"}
    assert set(server.stats().values()) == {5}
    waits = query(
        db,
        "SELECT count(*) FROM attempt_errors WHERE error_class = 'rate_limited'"
        " AND outcome = 'released'",
    )
    assert waits == [(40,)]


def test_retry_after_as_an_http_date_is_honoured(
    tmp_path: Path, bad_server: type[BadServer]
) -> None:
    server = bad_server("429date")
    db = enqueued(tmp_path, n=3)
    result = run(db, server.url, "--max-attempts", "1", "--retry-backoff", "0.05")
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(states(db).values()) == {"done"}  # waited for the date, not one attempt
    assert all(n >= 2 for n in server.stats().values())


def test_retry_after_header_forms() -> None:
    now = 2_000_000_000.0
    date = email.utils.formatdate(now + 90, usegmt=True)
    assert _retry_after({"Retry-After": date}, now=now) == pytest.approx(90)
    assert _retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=now) == 0.0
    assert _retry_after({"Retry-After": "Sunday, 06-Nov-94 08:49:37 GMT"}, now=now) == 0.0
    assert _retry_after({"Retry-After": " 120 "}, now=now) == 120.0
    assert _retry_after({"Retry-After": "-5"}, now=now) == 0.0
    assert _retry_after({"Retry-After": "soon"}, now=now) is None
    assert _retry_after({"Retry-After": "nan"}, now=now) is None
    assert _retry_after({}, now=now) is None


# -------------------------------------------------------------------- A1: the committer


async def test_one_unstorable_outcome_in_a_round_stops_nobody_else(
    database: Database, tmp_path: Path
) -> None:
    """A round of six answers, two the database refuses (a number out of range, an object
    for text): the four others are written, the two go back as bad_response retries."""
    import asyncio
    import dataclasses

    from orchestrator.inference.client import InferenceClient
    from orchestrator.store import Queue
    from orchestrator.worker import Worker, WorkerConfig
    from orchestrator.worker.outcomes import Done
    from tests.test_queue import answer, load, rows

    await load(database, tmp_path, 6)
    leases = await Queue(database).claim("w", 6, lease_seconds=60)
    bad = {
        leases[1].key: dataclasses.replace(answer(), usage={"completion_tokens": 2**70}),
        leases[4].key: dataclasses.replace(answer(), finish_reason={"type": "stop"}),  # type: ignore[arg-type]
    }
    async with InferenceClient() as client:
        worker = Worker(database, client, WorkerConfig(servers=("http://127.0.0.1:9",)))
        committer = worker.committer
        for lease in leases:
            committer.submit(Done(lease, bad.get(lease.key, answer(lease.key))))
        committer.start()
        await asyncio.wait_for(committer.close(), 30)
    found = await rows(database)
    assert {k for k, r in found.items() if r["state"] == "done"} == set(found) - set(bad)
    for key in bad:
        assert found[key]["state"] == "pending" and found[key]["error_class"] == "bad_response"
        assert "could not be stored" in found[key]["last_error"]
    assert worker.stats.completed == 4 and worker.stats.retried == 2


# ------------------------------------------------------- D13: SSE comments are no progress


@pytest.mark.parametrize(
    ("bounds", "error_class"),
    [
        (("--stream-idle-timeout", "1"), "stream_idle"),
        (("--stream-idle-timeout", "100", "--request-timeout", "2"), "timeout"),
    ],
)
def test_a_stream_of_comments_alone_times_out(
    tmp_path: Path, bad_server: type[BadServer], bounds: tuple[str, ...], error_class: str
) -> None:
    """``: ping`` every 0.2 s keeps the socket busy but brings no answer: the silence
    bound (counting data events only) or the whole request's bound ends it."""
    server = bad_server("pingstream")
    db = enqueued(tmp_path, n=10)
    started = time.monotonic()
    result = run(db, server.url, "--stream", "--max-attempts", "2", "--retry-backoff", "0.05",
                 *bounds)  # fmt: skip
    ended(result)
    assert time.monotonic() - started < 30
    assert result.returncode == 6, result.stderr[-2000:]  # one item failed
    got = states(db)
    assert got.pop("k7") == "failed"
    assert set(got.values()) == {"done"}
    classes = query(db, "SELECT DISTINCT error_class FROM attempt_errors")
    assert classes == [(error_class,)]
