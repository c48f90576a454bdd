"""The mistakes of a run's first hour, through the real command: a mistyped --db, another
application's database, a requeue of every answer, the terminal of a run under a pipe."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from tests.helpers import SimProcess, cli, db_snapshot, is_postgres, prompts, query, write_jsonl

URL = "http://127.0.0.1:9"  # never reached: the database is refused first


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["watch", "--count", "1"],
        ["export", "OUT"],
        ["run", "--server", URL, "--exit-when-done"],
        ["requeue", "--error-class", "timeout"],
        ["pause", "d"],
        ["resume", "d"],
        ["plan"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_missing_database_is_refused_not_created(tmp_path: Path, args: list[str]) -> None:
    typo = tmp_path / "typo.db"
    argv = [str(tmp_path / "out.jsonl") if a == "OUT" else a for a in args]
    result = cli(*argv, "--db", str(typo), cwd=tmp_path)
    assert result.returncode != 0
    assert str(typo) in result.stderr
    assert not typo.exists()
    assert not (tmp_path / "out.jsonl").exists()


def test_the_refusal_names_the_environment_and_working_directory(tmp_path: Path) -> None:
    result = cli("status", env={"ORCHESTRATOR_DB": "runs/typo.db"}, cwd=tmp_path)
    assert result.returncode == 3
    assert f"no database at {tmp_path / 'runs' / 'typo.db'}" in result.stderr
    assert "ORCHESTRATOR_DB (runs/typo.db)" in result.stderr
    assert f"working directory {tmp_path}" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_export_to_a_wrong_db_keeps_the_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "train.jsonl"
    out.write_text('{"id": "kept"}\n')
    result = cli("export", str(out), "--db", str(tmp_path / "typo.db"))
    assert result.returncode == 3
    assert out.read_text() == '{"id": "kept"}\n'


def _done_run(tmp_path: Path, db: str, server: SimProcess, n: int = 20) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    result = cli("enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    result = cli("run", "--server", server.url, "--db", db, "--exit-when-done")
    assert result.returncode == 0, result.stderr


def test_export_dash_writes_standard_output(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    _done_run(tmp_path, db_url, sim_process("--latency", "0.001"))
    out = tmp_path / "out.jsonl"
    assert cli("export", str(out), "--db", db_url).returncode == 0
    piped = cli("export", "-", "--db", db_url)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == out.read_text()
    assert len(piped.stdout.splitlines()) == 20
    assert "exported 20 items to standard output" in piped.stderr
    assert not (tmp_path / "-").exists()


def test_read_and_write_commands_refuse_an_empty_database(tmp_path: Path, db_url: str) -> None:
    """An SQLite file that is not there, or a PostgreSQL database nothing was enqueued into."""
    before = db_snapshot(db_url) if is_postgres(db_url) else None
    for args in (["status"], ["export", str(tmp_path / "o.jsonl")], ["pause", "d"]):
        result = cli(*args, "--db", db_url)
        assert result.returncode == 3, (args, result.stderr)
        assert ("empty database" if before else "no database at") in result.stderr
    if before is not None:
        assert db_snapshot(db_url) == before
        assert query(db_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]


def _foreign(path: Path) -> Path:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO notes (body) VALUES ('mine')")
        conn.commit()
    return path


def test_another_applications_sqlite_file_is_left_alone(tmp_path: Path) -> None:
    other = _foreign(tmp_path / "app.db")
    before = db_snapshot(other)
    for args in (
        ["status"],
        ["status", "--json"],
        ["export", str(tmp_path / "o.jsonl")],
        ["run", "--server", URL],
        ["requeue", "--error-class", "timeout"],
        ["enqueue", str(write_jsonl(tmp_path / "in.jsonl", prompts(2))), "-d", "d"],
        ["db", "upgrade"],
    ):
        result = cli(*args, "--db", str(other))
        assert result.returncode == 3, (args, result.stderr)
        assert "not an orchestrator database" in result.stderr
        assert "notes" in result.stderr
    assert db_snapshot(other) == before
    assert not Path(f"{other}-wal").exists()
    with closing(sqlite3.connect(other)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["notes"]
    adopted = cli("db", "upgrade", "--into-existing", "--db", str(other))
    assert adopted.returncode == 0, adopted.stderr
    assert json.loads(cli("status", "--json", "--db", str(other)).stdout)["datasets"] == []


def test_another_applications_postgresql_database_is_left_alone(
    tmp_path: Path, pg_database: Callable[[], str]
) -> None:
    url = pg_database()
    cli_sql = "CREATE TABLE notes (id integer PRIMARY KEY)"
    import asyncio

    import asyncpg

    async def make() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(cli_sql)
        finally:
            await conn.close()

    asyncio.run(make())
    before = db_snapshot(url)
    for args in (["status"], ["run", "--server", URL], ["db", "upgrade"]):
        result = cli(*args, "--db", url)
        assert result.returncode == 3, (args, result.stderr)
        assert "not an orchestrator database" in result.stderr
    assert db_snapshot(url) == before


def test_requeue_of_done_items_needs_a_filter_or_all(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    _done_run(tmp_path, db_url, sim_process("--latency", "0.001"))
    before = db_snapshot(db_url)
    refused = cli("requeue", "--state", "done", "--db", db_url)
    assert refused.returncode == 2
    assert "--all" in refused.stderr and "--dataset" in refused.stderr
    dry = cli("requeue", "--state", "done", "--all", "--dry-run", "--db", db_url)
    assert dry.returncode == 0, dry.stderr
    assert "would requeue 20 done items" in dry.stdout
    assert "  d  done 20" in dry.stdout
    assert db_snapshot(db_url) == before  # neither the refusal nor the dry run wrote


def test_a_requeue_of_every_answer_can_be_taken_back(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0.001")
    _done_run(tmp_path, db_url, server)
    first = cli("export", "-", "--db", db_url, "--provenance").stdout
    assert len(first.splitlines()) == 20
    moved = cli("requeue", "--state", "done", "--all", "--db", db_url)
    assert moved.stdout.startswith("requeued 20 done items"), moved.stderr
    assert cli("export", "-", "--db", db_url).stdout == ""
    undone = cli("requeue", "--undo", "--db", db_url)
    assert "put back 20 items" in undone.stdout, undone.stderr
    assert cli("export", "-", "--db", db_url, "--provenance").stdout == first
    assert query(db_url, "SELECT count(*) FROM superseded_outputs") == [(0,)]
    assert "nothing to undo" in cli("requeue", "--undo", "--db", db_url).stdout

    # Generated again before the undo: the new answers stand, the old ones stay kept.
    cli("requeue", "--dataset", "d", "--state", "done", "--db", db_url)
    assert cli("run", "--server", server.url, "--db", db_url, "--exit-when-done").returncode == 0
    late = cli("requeue", "--undo", "--db", db_url)
    assert "put back 0 items" in late.stdout and "20 claimed since" in late.stdout
    assert len(cli("export", "-", "--db", db_url).stdout.splitlines()) == 20
    assert query(db_url, "SELECT count(*) FROM superseded_outputs") == [(20,)]


def test_undo_gives_failed_items_their_error_back(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    # Each request exceeds the context: every item fails alone (context_overflow).
    server = sim_process("--latency", "0.001", "--max-model-len", "4000")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    cli("enqueue", str(data), "-d", "d", "--db", db_url, "--max-tokens", "4000")
    cli("run", "--server", server.url, "--db", db_url, "--exit-when-done")
    failed = query(db_url, "SELECT key, state, attempts, error_class FROM items ORDER BY key")
    assert {row[1:] for row in failed} == {("failed", 1, "context_overflow")}
    assert cli("requeue", "--db", db_url).stdout.strip() == "requeued 5 failed items"
    assert "put back 5 items" in cli("requeue", "--undo", "--db", db_url).stdout
    assert query(db_url, "SELECT key, state, attempts, error_class FROM items ORDER BY key") == (
        failed
    )


def test_ctrl_c_under_a_closed_pipe_stops_cleanly(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """``run ... 2>&1 | head -1`` then Ctrl-C: the reader is gone, the stop still runs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    db = str(tmp_path / "q.db")
    server = sim_process("--latency", "0.5")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(400))
    assert cli("enqueue", str(data), "-d", "d", "--db", db).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--log-json", "run", "--server", server.url,
         "--db", db],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert b"worker_started" in proc.stdout.readline()
        proc.stdout.close()  # the pipe's reader goes away, as `head -1` does
        deadline = time.monotonic() + 30
        while not query(db, "SELECT count(*) FROM items WHERE state = 'running'")[0][0]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert query(db, "SELECT count(*) FROM items WHERE state = 'running'") == [(0,)]
    assert query(db, "SELECT count(*) FROM workers WHERE stopped_at IS NULL") == [(0,)]


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


def test_doctor_before_enqueue_and_a_disk_line_that_adds_up(tmp_path: Path) -> None:
    import re

    db = tmp_path / "q.db"
    first = cli("doctor", "--db", str(db))
    assert first.returncode == 0, first.stdout
    assert "INFO  database: " in first.stdout and "not created yet" in first.stdout
    assert "FAIL" not in first.stdout and not db.exists()

    data = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    result = cli("doctor", "--db", str(db), "--bytes-per-item", str(1024 * 1024))
    disk = next(line for line in result.stdout.splitlines() if "disk:" in line)
    size = r"([\d.]+ [KMGT]?i?B)"
    found = re.search(
        rf"the database is {size}, and 10 items to go at ~1.0 MiB each \(as given\) add "
        rf"{size} \(ends near {size}\); with {size} for the WAL that needs {size} free",
        disk,
    )
    assert found, disk
    now, answers, end, wal, needed = (_bytes(g) for g in found.groups())
    assert answers == 10 * 1024 * 1024
    assert abs(end - (now + answers)) <= 0.05 * 1024 * 1024
    assert needed == answers + wal
