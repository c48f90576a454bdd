"""Reliability scenarios with real processes: every guarantee, checked on its outcome.

Each scenario ends with every item done (or failed for a stated reason), each exported
answer made for its own item's prompt, no key twice, and ``PRAGMA integrity_check`` ok.
The ``ci`` variants run in the default suite; ``pytest -m slow`` runs the full sizes.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from orchestrator.store import crashes
from tests.helpers import (
    Heard,
    SimProcess,
    check_export,
    cli,
    events,
    item_rows,
    prompts,
    query,
    start_worker,
    write_jsonl,
)

SimFactory = Callable[..., SimProcess]


def sizes(ci: Any, full: Any) -> list[Any]:
    """The CI variant, and the full one (selected with ``-m slow``)."""

    def args(value: Any) -> tuple[Any, ...]:
        return value if isinstance(value, tuple) else (value,)

    return [
        pytest.param(*args(ci), id="ci"),
        pytest.param(*args(full), id="full", marks=pytest.mark.slow),
    ]


def enqueue(tmp_path: Path, db: Path, n: int, *extra: str) -> list[str]:
    data = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    result = cli("enqueue", str(data), "--dataset", "d", "--db", str(db), *extra)
    assert result.returncode == 0, result.stderr
    return [f"p{i:06d}" for i in range(n)]


def finish(db: Path, url: str, *extra: str, timeout: float = 600, code: int = 0) -> str:
    """Run to the end; ``code`` 6: some items are expected to fail."""
    worker = start_worker(db, url, "--exit-when-done", *extra)
    _, stderr = worker.communicate(timeout=timeout)
    assert worker.returncode == code, stderr[-3000:]
    return stderr


def integrity_ok(db: Path) -> bool:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def status(db: Path) -> dict[str, Any]:
    result = cli("status", "--json", "--db", str(db))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def scalar(db: Path, sql: str) -> Any:
    with closing(sqlite3.connect(db)) as conn:
        row = conn.execute(sql).fetchone()
    return row[0] if row else None


def wait_until(condition: Callable[[], Any], what: str, deadline: float = 120.0) -> None:
    """Poll until ``condition`` holds: a worker's start-up takes seconds on a loaded
    machine, so a fixed sleep may end before it has done anything."""
    until = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > until:
            raise AssertionError(f"timed out after {deadline:.0f} s waiting for {what}")
        time.sleep(0.05)


def verify_outcome(tmp_path: Path, db: Path, keys: list[str], figures: dict[str, Any]) -> None:
    """The common ending: all done, exported once each, answers match, file intact."""
    rows = item_rows(db)
    figures["done"] = sum(1 for _, s, _ in rows if s == "done")
    figures["failed"] = sum(1 for _, s, _ in rows if s == "failed")
    assert {s for _, s, _ in rows} == {"done"}
    check_export(db, tmp_path / "out.jsonl", keys)
    assert scalar(db, "SELECT count(*) FROM outputs") == len(keys)
    assert integrity_ok(db)
    figures.update(lost=0, duplicated=0, mismatched=0, integrity="ok")


# 1 ------------------------------------------------------------------------------


def kill_repeatedly(
    start: Callable[[], subprocess.Popen[str]],
    kills: int,
    rng: random.Random,
    running: Callable[[], int],
    *,
    awake: tuple[float, float],
) -> int:
    """SIGKILL a freshly started worker ``kills`` times; the leases taken back meanwhile.

    Each new worker must take the dead one's leases back at once (same host, pid gone),
    not after the lease expires.
    """
    stranded = reclaimed = killed = 0  # stranded: items left running by the last one
    for _ in range(kills):
        worker = start()
        time.sleep(rng.uniform(*awake))
        worker.kill()
        _, stderr = worker.communicate(timeout=30)
        killed += worker.returncode == -signal.SIGKILL
        got = sum(e["items"] for e in events(stderr) if e["event"] == "leases_reclaimed")
        if stranded and "worker_started" in stderr:
            assert got >= stranded
        reclaimed += got
        stranded = running()
    assert killed == kills
    return reclaimed


@pytest.mark.parametrize(("n", "kills"), sizes((3000, 8), (5000, 20)))
def test_crash_loop(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], n: int, kills: int
) -> None:
    rng = random.Random(n + kills)
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.05", "--per-token", "0.001", "--mean-tokens", "40")
    keys = enqueue(tmp_path, db, n)
    reclaimed = kill_repeatedly(
        lambda: start_worker(db, server.url, "--concurrency", "48", "--exit-when-done"),
        kills,
        rng,
        lambda: scalar(db, "SELECT count(*) FROM items WHERE state = 'running'"),
        awake=(0.8, 2.5),
    )
    finish(db, server.url, "--concurrency", "48")
    figures.update(items=n, kills=kills, leases_reclaimed=reclaimed)
    figures["requests_sent"] = server.stats()["chat_requests"]
    verify_outcome(tmp_path, db, keys, figures)


# 2 ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", sizes(1500, 5000))
def test_fault_mix(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], n: int
) -> None:
    db = tmp_path / "q.db"
    server = sim_process(
        "--latency", "0.02", "--retry-after", "1", "--seed", "11",
        "--fault", "500=0.05", "--fault", "429=0.02", "--fault", "reset=0.02",
        "--fault", "hang=0.01", "--fault", "malformed=0.01",
    )  # fmt: skip
    keys = enqueue(tmp_path, db, n)
    finish(
        db, server.url, "--concurrency", "64", "--request-timeout", "2", "--retry-backoff", "0.5"
    )
    errors = status(db)["totals"]["errors"]
    retried = {cls: v["retried"] for cls, v in errors.items()}
    assert {"http_500", "rate_limited", "disconnect", "timeout", "bad_response"} <= set(retried)
    assert all(v["failed"] == 0 for v in errors.values())
    figures.update(items=n, faults_injected=server.stats()["faults"], retried_by_class=retried)
    verify_outcome(tmp_path, db, keys, figures)


# 3 ------------------------------------------------------------------------------


@pytest.mark.parametrize("down_for", sizes(5.0, 30.0))
def test_outage(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], down_for: float
) -> None:
    db = tmp_path / "q.db"
    args = ("--latency", "0.05", "--per-token", "0.001", "--mean-tokens", "40")
    server = sim_process(*args)
    n = 4000
    keys = enqueue(tmp_path, db, n)
    worker = start_worker(db, server.url, "--concurrency", "32", "--exit-when-done")
    # The server goes down while the worker is answering, not before it has started.
    wait_until(lambda: scalar(db, "SELECT count(*) FROM outputs") >= 100, "100 answers")
    server.kill()
    stopped_at = time.time()
    time.sleep(down_for)
    done_at_restart = scalar(db, "SELECT count(*) FROM outputs")
    assert scalar(db, "SELECT count(*) FROM items WHERE state = 'failed'") == 0
    server.start()
    back_at = time.time()
    _, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, stderr[-3000:]
    first_after = scalar(db, f"SELECT min(created_at) FROM outputs WHERE created_at > {back_at}")
    resumed_after = first_after - back_at
    # Probing backs off to 5 s at most: work resumes within a few seconds.
    assert resumed_after < 10
    # No attempt was spent on the outage: every item was claimed for good exactly once.
    assert {a for _, _, a in item_rows(db)} == {1}
    released = status(db)["totals"]["errors"]
    assert all(v["retried"] == 0 and v["failed"] == 0 for v in released.values())
    names = [e["event"] for e in events(stderr)]
    assert "server_down" in names and "server_up" in names
    figures.update(
        items=n,
        outage_s=round(back_at - stopped_at, 1),
        done_before_restart=done_at_restart,
        released_during_outage=sum(v["released"] for v in released.values()),
        attempts_spent_on_outage=0,
        resumed_after_s=round(resumed_after, 2),
    )
    verify_outcome(tmp_path, db, keys, figures)


# 4 ------------------------------------------------------------------------------


def test_hung_request_is_timed_out_and_retried(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any]
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--fault", "hang=0.3", "--seed", "5")
    keys = enqueue(tmp_path, db, 60)
    finish(db, server.url, "--request-timeout", "1", "--retry-backoff", "0.2")
    errors = status(db)["totals"]["errors"]
    assert errors["timeout"]["retried"] > 0
    figures.update(items=60, hangs=server.stats()["faults"]["hang"], timeouts=errors["timeout"])
    verify_outcome(tmp_path, db, keys, figures)


def test_stalled_stream_is_cut_by_inactivity_timeout(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any]
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--fault", "stall=0.3", "--seed", "5", "--mean-tokens", "40")
    keys = enqueue(tmp_path, db, 60)
    finish(db, server.url, "--stream", "--stream-idle-timeout", "1", "--retry-backoff", "0.2")
    errors = status(db)["totals"]["errors"]
    assert errors["stream_idle"]["retried"] > 0
    figures.update(items=60, stalls=server.stats()["faults"]["stall"], cut=errors["stream_idle"])
    verify_outcome(tmp_path, db, keys, figures)


def test_answer_slower_than_lease_keeps_it(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any]
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "5")
    keys = enqueue(tmp_path, db, 20)
    stderr = finish(db, server.url, "--lease-seconds", "2", "--concurrency", "20")
    assert "lease_lost" not in stderr
    assert {a for _, _, a in item_rows(db)} == {1}
    # The server saw every request once: never run twice, not even at the same time.
    assert server.stats()["chat_requests"] == 20
    figures.update(items=20, answer_s=5, lease_s=2, requests=20)
    verify_outcome(tmp_path, db, keys, figures)


# 5 ------------------------------------------------------------------------------


@pytest.mark.parametrize("latency", [0.3, 30.0], ids=["short-requests", "long-requests"])
def test_graceful_stop(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], latency: float
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", str(latency))
    enqueue(tmp_path, db, 400)
    grace = 3.0
    worker = start_worker(db, server.url, "--concurrency", "32", "--grace", str(grace))
    # Signalled once it has items in flight, however long its start took.
    deadline = time.monotonic() + 120
    while not (in_flight := scalar(db, "SELECT count(*) FROM items WHERE state = 'running'")):
        assert worker.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    sent = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    took = time.monotonic() - sent
    assert worker.returncode == 0, stderr[-3000:]
    assert took < grace + 5
    assert scalar(db, "SELECT count(*) FROM items WHERE state = 'running'") == 0
    # Released items got their attempt back.
    assert scalar(db, "SELECT max(attempts) FROM items WHERE state = 'pending'") in (0, None)
    assert integrity_ok(db)
    figures.update(in_flight_at_sigterm=in_flight, grace_s=grace, exit_s=round(took, 2))


# 6 ------------------------------------------------------------------------------


def share(db: Path | str, url: str, workers: int, n: int) -> list[int]:
    """``workers`` worker processes on one queue, to the end; how many each completed.

    Each item must have been claimed exactly once (one attempt, one request each): no
    item ever ran in two workers at once, and the work was really shared.
    """
    procs = [
        start_worker(db, url, "--concurrency", "32", "--exit-when-done") for _ in range(workers)
    ]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr[-3000:]
        assert "database is locked" not in stderr
    assert {(s, a) for _, s, a in item_rows(db)} == {("done", 1)}
    done_by = [
        next(e for e in events(stderr) if e["event"] == "worker_stopped")["completed"]
        for _, stderr in outputs
    ]
    assert sum(done_by) == n
    assert sum(1 for d in done_by if d > 0) >= 2
    return done_by


@pytest.mark.parametrize(("workers", "n"), sizes((3, 3000), (4, 20000)))
def test_many_workers(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], workers: int, n: int
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.02")
    keys = enqueue(tmp_path, db, n)
    done_by = share(db, server.url, workers, n)
    assert server.stats()["chat_requests"] == n
    figures.update(items=n, workers=workers, done_by_worker=done_by)
    verify_outcome(tmp_path, db, keys, figures)


# 7 ------------------------------------------------------------------------------


def test_poison_item(tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any]) -> None:
    """An item whose handling kills the worker every time: the harness SIGKILLs the
    worker whenever that item is running, as a segfault or an OOM kill would."""
    db = tmp_path / "q.db"
    server = sim_process("--latency", "0.2")
    n = 300
    keys = enqueue(tmp_path, db, n)
    poison = keys[0]
    kills = 0
    while True:
        worker = start_worker(
            db, server.url, "--concurrency", "16", "--max-attempts", "3", "--exit-when-done"
        )
        while worker.poll() is None:
            owner = scalar(
                db, f"SELECT lease_owner FROM items WHERE key = '{poison}' AND state = 'running'"
            )
            if owner and f":{worker.pid}:" in owner:  # this worker is handling it
                worker.kill()
                kills += 1
                break
            time.sleep(0.02)
        worker.communicate(timeout=60)
        if worker.returncode == 6:  # finished: the poison item failed, the rest done
            break
        with closing(sqlite3.connect(db)) as conn:
            history = conn.execute(
                "SELECT e.attempt, e.error_class, e.outcome FROM attempt_errors e"
                " JOIN items i ON i.id = e.item_id WHERE i.key = ?",
                (poison,),
            ).fetchall()
        assert kills <= crashes.most_deaths(16), history
    with closing(sqlite3.connect(db)) as conn:
        state, error_class, attempts, reason = conn.execute(
            "SELECT state, error_class, attempts, last_error FROM items WHERE key = ?", (poison,)
        ).fetchone()
        others = conn.execute(
            "SELECT state, count(*), max(attempts) FROM items WHERE key != ? GROUP BY state",
            (poison,),
        ).fetchall()
    # Found by bisection (store.crashes): its deaths gave its attempts back, and it died
    # alone twice. The bystanders of its crashes kept theirs, and none failed.
    assert (state, error_class, attempts) == ("failed", "lease_lost", 0)
    assert "kills its worker" in reason
    assert [(s, c) for s, c, _ in others] == [("done", n - 1)]
    assert others[0][2] < 3
    check_export(db, tmp_path / "out.jsonl", keys[1:])
    assert integrity_ok(db)
    figures.update(
        items=n, kills=kills, poison_state=state, poison_reason=reason,
        others_done=n - 1, max_attempts_of_others=others[0][2],
    )  # fmt: skip


def test_the_items_of_a_crash_go_back_to_work_side_by_side(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any]
) -> None:
    """A worker SIGKILLed with 128 requests in flight, started again at once: its items
    run side by side (they ran one at a time), and a graceful restart keeps them so."""
    db = tmp_path / "q.db"
    n = 128
    keys = enqueue(tmp_path, db, n)
    args = ("--concurrency", str(n), "--exit-when-done")
    first = sim_process("--latency", "30")
    worker = start_worker(db, first.url, *args, log_level="warning")
    wait_until(lambda: first.stats()["running"] == n, f"{n} requests in flight")
    worker.kill()
    worker.communicate(timeout=60)
    # Restarted against a server of its own, so that its peak is the restarted worker's.
    second = sim_process("--latency", "30")
    worker = start_worker(db, second.url, *args, "--grace", "0", log_level="warning")
    wait_until(lambda: second.stats()["running"] >= n - 1, "the items back at work")
    peak_after_crash = second.stats()["peak_running"]
    said = cli("status", "--db", str(db)).stdout
    assert f"after a crash: {n} items left were in flight when a worker died" in said
    worker.send_signal(signal.SIGTERM)  # a graceful restart: released at once, no death
    worker.communicate(timeout=60)
    third = sim_process("--latency", "0.5")
    finish(db, third.url, *args[:2])
    assert third.stats()["peak_running"] >= n - 1
    rows = query(db, "SELECT state, attempts, deaths, count(*) FROM items GROUP BY 1, 2, 3")
    assert rows == [("done", 1, 1, n)]
    check_export(db, tmp_path / "out.jsonl", keys)
    figures.update(
        in_flight_at_kill=n, peak_after_crash=peak_after_crash,
        peak_after_graceful_restart=third.stats()["peak_running"],
    )  # fmt: skip


# 9 ------------------------------------------------------------------------------


def test_not_an_sqlite_file(tmp_path: Path, figures: dict[str, Any]) -> None:
    db = tmp_path / "q.db"
    db.write_bytes(b"this is a spreadsheet, not a database\n" * 200)
    before = db.read_bytes()
    result = cli("status", "--db", str(db))
    assert result.returncode == 3
    assert "not an orchestrator (SQLite) database" in result.stderr
    assert db.read_bytes() == before
    figures.update(exit_code=3, message=result.stderr.strip())


def test_newer_schema_is_refused(tmp_path: Path, figures: dict[str, Any]) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db, 3)
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    before = db.read_bytes()
    for args in (["status"], ["run", "--server", "http://127.0.0.1:9"], ["db", "upgrade"]):
        result = cli(*args, "--db", str(db))
        assert result.returncode == 3, result.stderr
        assert "schema version '9999' is newer than this orchestrator knows" in result.stderr
    assert db.read_bytes() == before
    figures.update(exit_code=3, message=result.stderr.strip())


def test_full_disk_then_fixed(
    tmp_path: Path, sim_process: SimFactory, mounted: Callable[..., Path], figures: dict[str, Any]
) -> None:
    disk = mounted("-t", "tmpfs", "-o", "size=3m")
    db = disk / "q.db"
    # An enqueue that does not fit fails cleanly and leaves the database as it was.
    keys = enqueue(tmp_path, db, 200)
    before = db.read_bytes()
    big = write_jsonl(
        tmp_path / "big.jsonl",
        [{"id": f"b{i}", "prompt": "x" * 2000 + str(i)} for i in range(3000)],
    )
    result = cli("enqueue", str(big), "-d", "big", "--db", str(db))
    assert result.returncode == 3
    assert "disk holding the database is full" in result.stderr
    assert db.read_bytes() == before and integrity_ok(db)
    # A run whose outputs fill the disk keeps its answers waiting, then finishes once
    # there is room again.
    filler = disk / "filler"
    free = subprocess.run(
        ["df", "--output=avail", "-B1", str(disk)], capture_output=True, text=True
    )
    filler.write_bytes(b"\0" * max(int(free.stdout.split()[-1]) - 150_000, 0))
    server = sim_process("--mean-tokens", "300")
    worker = start_worker(db, server.url, "--concurrency", "8", "--exit-when-done")
    heard = Heard(worker)
    heard.wait_for("disk holding the database is full")
    done_while_full = scalar(db, "SELECT count(*) FROM items WHERE state = 'done'")
    filler.unlink()
    mounted("-o", "remount,size=64m", source="tmpfs", name="mnt")
    stderr = heard.text()
    assert worker.returncode == 0, stderr[-3000:]
    figures.update(items=200, done_while_full=done_while_full)
    verify_outcome(tmp_path, db, keys, figures)


def test_read_only_database_then_fixed(
    tmp_path: Path, sim_process: SimFactory, mounted: Callable[..., Path], figures: dict[str, Any]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = data / "q.db"
    keys = enqueue(tmp_path, db, 50)
    before = db.read_bytes()
    ro = mounted("--bind", source=str(data), name="ro")
    mounted("-o", "remount,ro,bind", source=str(data), name="ro")
    server = sim_process()
    result = cli("run", "--server", server.url, "--db", str(ro / "q.db"), "--exit-when-done")
    assert result.returncode == 3
    assert "read-only" in result.stderr or "readonly" in result.stderr
    assert db.read_bytes() == before and integrity_ok(db)
    # Fixed (the writable path): the run goes through.
    finish(db, server.url)
    figures.update(exit_code=3, message=result.stderr.strip().splitlines()[-1])
    verify_outcome(tmp_path, db, keys, figures)


# 10 -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_server_answers(
    tmp_path: Path, sim_process: SimFactory, figures: dict[str, Any], stream: bool
) -> None:
    db = tmp_path / "q.db"
    server = sim_process(
        "--seed", "2", "--fault", "nochoices=0.05", "--fault", "empty=0.05",
        "--fault", "html=0.05", "--fault", "malformed=0.05",
    )  # fmt: skip
    keys = enqueue(tmp_path, db, 300)
    finish(db, server.url, "--retry-backoff", "0.2", *(["--stream"] if stream else []))
    errors = status(db)["totals"]["errors"]
    expected = {"bad_response", "empty_content"} | ({"stream_cut"} if stream else set())
    assert expected <= set(errors)
    figures.update(
        items=300, faults_injected=server.stats()["faults"],
        retried_by_class={k: v["retried"] for k, v in errors.items()},
    )  # fmt: skip
    verify_outcome(tmp_path, db, keys, figures)


def test_bad_answers_that_never_improve_fail_with_reason(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    db = tmp_path / "q.db"
    server = sim_process("--fault", "empty=1.0")
    enqueue(tmp_path, db, 5)
    finish(db, server.url, "--max-attempts", "2", "--retry-backoff", "0.1", code=6)
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT state, error_class, last_error FROM items").fetchall()
    assert {(s, c) for s, c, _ in rows} == {("failed", "empty_content")}
    assert all("no content" in r for _, _, r in rows)
    assert scalar(db, "SELECT count(*) FROM outputs") == 0  # never exported as complete


# security -----------------------------------------------------------------------


def test_api_key_is_used_and_never_leaks(tmp_path: Path, figures: dict[str, Any]) -> None:
    secret = "sk-test-9f8e7d6c5b4a39281706"
    db = tmp_path / "q.db"
    server = SimProcess(env={"SIM_API_KEY": secret})
    server.start()
    try:
        keys = enqueue(tmp_path, db, 30)
        # Without the key the server refuses /v1/models: the run stops before any item
        # (exit 5), the reason said, no secret.
        worker = start_worker(db, server.url, "--exit-when-done", log_level="debug")
        _, stderr = worker.communicate(timeout=60)
        assert worker.returncode == 5, stderr[-3000:]
        assert "HTTP 401 on /v1/models" in stderr and "API key" in stderr
        assert scalar(db, "SELECT count(*) FROM items WHERE attempts > 0") == 0
        # From the environment...
        worker = start_worker(
            db, server.url, "--exit-when-done", env={"ORCHESTRATOR_API_KEY": secret}
        )
        _, stderr1 = worker.communicate(timeout=60)
        assert worker.returncode == 0
        # ...or from a file; either way never on the command line.
        key_file = tmp_path / "key"
        key_file.write_text(secret + "\n")
        assert cli("requeue", "--state", "done", "--all", "--db", str(db)).returncode == 0
        worker = start_worker(
            db, server.url, "--exit-when-done", "--api-key-file", str(key_file), log_level="debug"
        )
        _, stderr2 = worker.communicate(timeout=60)
        assert worker.returncode == 0
        verify_outcome(tmp_path, db, keys, figures)
        status_text = (
            cli("status", "--db", str(db)).stdout + cli("status", "--json", "--db", str(db)).stdout
        )
        stored = b"".join(p.read_bytes() for p in tmp_path.glob("q.db*"))
        exported = (tmp_path / "out.jsonl").read_text()
        for where, text in (
            ("logs", stderr + stderr1 + stderr2),
            ("status", status_text),
            ("export", exported),
        ):
            assert secret not in text, where
        assert secret.encode() not in stored
    finally:
        server.stop()
    figures.update(
        secret_in_logs=False,
        secret_in_database=False,
        secret_in_status=False,
        secret_in_export=False,
    )


def test_database_files_are_private(tmp_path: Path, sim_process: SimFactory) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db, 5)
    server = sim_process("--latency", "1")
    worker = start_worker(db, server.url, "--exit-when-done")
    time.sleep(1.5)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.glob("q.db*")}
    worker.communicate(timeout=60)
    assert modes and set(modes.values()) == {0o600}, modes


def test_simulated_server_binds_loopback_by_default() -> None:
    server = SimProcess()
    server.start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()
