"""Commands that only read leave what they read as it was, and say what it is.

Every read-only command (doctor, status, watch, plan, export, report, dashboard, a dry-run
requeue, the source of ``db copy``) is run on files that are not a current orchestrator
database: another application's SQLite file (rollback-journal mode), a 0-byte file, a file
that is not SQLite, a directory and an orchestrator database at an older schema. The file's
bytes, its modification time and its journal mode, and the names in its directory, are the
same afterwards, and the message says what the file is. The same on PostgreSQL for another
application's database, an empty one and an older schema. Then the read-only file system,
a missing database for ``plan``, and ``--db`` naming a directory for every command.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from orchestrator.store import create_database
from orchestrator.store.migrate import alembic_config
from tests.helpers import REPO, cli, db_snapshot, prompts, query, write_jsonl

OLDER = "0007"

# What the message must say about each kind of file, whichever command reads it.
SAYS = {
    "foreign": ("not an orchestrator database", "--into-existing"),
    "empty": ("empty database",),
    "text": ("not an orchestrator (SQLite) database",),
    "directory": ("is a directory",),
    "older": (f"schema {OLDER}", "db upgrade"),
}

# The read-only commands; OUT and HTML are files in another directory, DB the database.
READS = [
    ["doctor"],
    ["status"],
    ["status", "--json"],
    ["watch", "--count", "1"],
    ["plan"],
    ["plan", "--json"],
    ["export", "OUT"],
    ["export", "-"],
    ["report", "HTML"],
    ["dashboard", "--port", "0"],
    ["requeue", "--all", "--dry-run"],
    ["requeue", "--undo", "--dry-run"],
    ["db", "copy", "--from", "DB", "--to", "NEW"],
]


def _ids(args: list[str]) -> str:
    return " ".join(a for a in args if a.isalpha() or a.startswith("-"))[:40]


def _passthrough_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"k{i}",
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ],
        }
        for i in range(n)
    ]


def _enqueue_done(tmp_path: Path, db: str, n: int = 5) -> None:
    data = write_jsonl(tmp_path / "done.jsonl", _passthrough_rows(n))
    result = cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", db)
    assert result.returncode == 0, result.stderr


def _downgrade(db: str, revision: str) -> None:
    """Take an orchestrator database back to an older schema, as an older version left it."""
    from alembic import command

    async def run() -> None:
        database = create_database(db)
        try:
            async with database.write() as conn:
                await conn.run_sync(
                    lambda c: command.downgrade(alembic_config(c), revision)  # type: ignore[arg-type]
                )
        finally:
            await database.close()

    asyncio.run(run())


def _sqlite_file(kind: str, tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / f"{kind}.db"
    if kind == "foreign":
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
            conn.execute("INSERT INTO notes (body) VALUES ('kept')")
        assert _journal(path) == "rollback"
    elif kind == "empty":
        path.touch()
    elif kind == "text":
        path.write_text("a plain text file, not a database\n" * 50)
    elif kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("x")
    else:
        _enqueue_done(tmp_path, str(path))
        _downgrade(str(path), OLDER)
        assert query(path, "SELECT version_num FROM alembic_version") == [(OLDER,)]
    # An mtime in the past, so that a write within the same clock tick still shows.
    os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    return path


def _journal(path: Path) -> str:
    """The journal mode the file's header records: bytes 18 and 19 are 2 in WAL mode."""
    header = path.read_bytes()[:20]
    if len(header) < 20 or not header.startswith(b"SQLite format 3\0"):
        return "none"
    return "wal" if header[18:20] == b"\x02\x02" else "rollback"


def _fingerprint(path: Path) -> tuple[Any, ...]:
    """What a read must leave as it was: bytes, mtime, journal mode, and the names beside it."""
    beside = sorted(os.listdir(path.parent))
    if path.is_dir():
        return ("directory", path.stat().st_mtime_ns, sorted(os.listdir(path)), beside)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return (digest, path.stat().st_mtime_ns, _journal(path), beside)


def _argv(args: list[str], db: str, out: Path) -> list[str]:
    names = {
        "OUT": str(out / "out.jsonl"),
        "HTML": str(out / "report.html"),
        "NEW": str(out / "new.db"),
        "DB": db,
    }
    argv = [names.get(a, a) for a in args]
    return argv if "DB" in args else [*argv, "--db", db]


def _check_refusal(
    result: subprocess.CompletedProcess[str], args: list[str], says: tuple[str, ...]
) -> None:
    """A refusal in one line (a FAIL line for doctor) that says what the file is."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    if args == ["doctor"]:
        line = next(x for x in result.stdout.splitlines() if "  database: " in x)
        expected = 0 if says == SAYS["empty"] else 1
        assert result.returncode == expected, output
        assert line.startswith("INFO" if expected == 0 else "FAIL"), line
    else:
        assert result.returncode == 3, output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), output
        line = lines[0]
    for phrase in says:
        assert phrase in line, (args, line)


@pytest.mark.parametrize("args", READS, ids=_ids)
@pytest.mark.parametrize("kind", list(SAYS))
def test_a_read_leaves_the_file_as_it_was(tmp_path: Path, kind: str, args: list[str]) -> None:
    path = _sqlite_file(kind, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    before = _fingerprint(path)
    result = cli(*_argv(args, str(path), out), timeout=120)
    assert _fingerprint(path) == before, (args, result.stderr)
    _check_refusal(result, args, SAYS[kind])
    assert os.listdir(out) == [], "nothing is written for a database that is refused"


def _pg_database(kind: str, tmp_path: Path, url: str) -> None:
    async def run(sql: str) -> None:
        import asyncpg

        conn = await asyncpg.connect(url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    if kind == "foreign":
        asyncio.run(run("CREATE TABLE notes (id serial PRIMARY KEY, body text)"))
        asyncio.run(run("INSERT INTO notes (body) VALUES ('kept')"))
    elif kind == "older":
        _enqueue_done(tmp_path, url)
        _downgrade(url, OLDER)


def _pg_tables(url: str) -> list[tuple[Any, ...]]:
    return query(
        url,
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema = 'public' ORDER BY table_name",
    )


@pytest.mark.postgresql
@pytest.mark.parametrize("args", READS, ids=_ids)
@pytest.mark.parametrize("kind", ["foreign", "empty", "older"])
def test_a_read_leaves_a_postgresql_database_as_it_was(
    tmp_path: Path, pg_database: Callable[[], str], kind: str, args: list[str]
) -> None:
    url = pg_database()
    _pg_database(kind, tmp_path, url)
    out = tmp_path / "out"
    out.mkdir()
    before = (_pg_tables(url), db_snapshot(url))
    result = cli(*_argv(args, url, out), timeout=120)
    assert (_pg_tables(url), db_snapshot(url)) == before, (args, result.stderr)
    _check_refusal(result, args, SAYS[kind])
    assert os.listdir(out) == []


# A database on a read-only file system -----------------------------------------------


def _head_db(tmp_path: Path, mounted: Callable[..., Path]) -> tuple[Path, str]:
    """A current database with 5 done items on a file system remounted read-only; and its
    export, made before, to compare with."""
    disk = mounted("-t", "tmpfs", "-o", "size=8m")
    db = disk / "q.db"
    _enqueue_done(tmp_path, str(db))
    expected = cli("export", "-", "--db", str(db))
    assert expected.returncode == 0, expected.stderr
    assert _journal(db) == "wal" and not Path(f"{db}-shm").exists()
    remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
    assert remount.returncode == 0, remount.stderr
    return db, expected.stdout


READ_ONLY_FS = [
    ["status", "--json"],
    ["watch", "--count", "1"],
    ["plan", "--json"],
    ["export", "OUT"],
    ["report", "HTML"],
    ["doctor"],
    ["requeue", "--all", "--dry-run"],
]


@pytest.mark.parametrize("args", READ_ONLY_FS, ids=_ids)
def test_a_database_on_a_read_only_file_system_is_read(
    tmp_path: Path, mounted: Callable[..., Path], args: list[str]
) -> None:
    db, exported = _head_db(tmp_path, mounted)
    out = tmp_path / "out"
    out.mkdir()
    before = _fingerprint(db)
    result = cli(*_argv(args, str(db), out), timeout=120)
    assert result.returncode == (1 if args == ["doctor"] else 0), result.stdout + result.stderr
    assert _fingerprint(db) == before
    if args[0] == "status":
        assert json.loads(result.stdout)["totals"]["counts"]["done"] == 5
    elif args[0] == "export":
        assert (out / "out.jsonl").read_text() == exported
    elif args[0] == "report":
        assert '"done":5' in (out / "report.html").read_text()
    elif args[0] == "doctor":
        assert "PASS  database: " in result.stdout and "5 items (5 done)" in result.stdout
        # Readable, but no worker can write there: the one failure.
        assert f"FAIL  disk: {db.parent} is on a read-only file system" in result.stdout


def test_the_dashboard_reads_a_read_only_file_system(
    tmp_path: Path, mounted: Callable[..., Path]
) -> None:
    db, _ = _head_db(tmp_path, mounted)
    argv = [sys.executable, "-m", "orchestrator", "dashboard", "--port", "0", "--db", str(db)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=REPO)
    watchdog = threading.Timer(120, proc.kill)  # a dashboard that never says where it is
    watchdog.start()
    try:
        assert proc.stderr is not None
        said = []
        # Log events, then "dashboard on URL (Ctrl-C stops it)"; or the error, and the end.
        while (line := proc.stderr.readline()) and not line.startswith("dashboard on "):
            said.append(line)
        assert line.startswith("dashboard on "), "".join(said)
        url = line.split()[2]
        with urllib.request.urlopen(url + "api/status", timeout=30) as resp:
            assert json.loads(resp.read())["totals"]["counts"]["done"] == 5
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(30)


def test_a_read_only_wal_with_commits_not_in_the_file_is_refused(
    tmp_path: Path, mounted: Callable[..., Path]
) -> None:
    """A writer that died with commits in its -wal, on a read-only file system: reading the
    file alone would miss them, and folding them in needs to write. Said, not misread."""
    disk = mounted("-t", "tmpfs", "-o", "size=8m")
    db = disk / "q.db"
    _enqueue_done(tmp_path, str(db))
    writer = sqlite3.connect(db)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("UPDATE datasets SET priority = 1")
    writer.commit()
    crashed = disk / "crashed"
    crashed.mkdir()
    for name in ("q.db", "q.db-wal"):  # as a kill -9 leaves them, without the -shm
        shutil.copyfile(disk / name, crashed / name)
    writer.close()
    assert (crashed / "q.db-wal").stat().st_size > 0
    remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
    assert remount.returncode == 0, remount.stderr
    for args in (["status"], ["export", "-"], ["report", str(tmp_path / "r.html")]):
        result = cli(*args, "--db", str(crashed / "q.db"))
        assert result.returncode == 3, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert f"write-ahead log {crashed / 'q.db-wal'} holds commits" in result.stderr
        assert "mount it read-write" in result.stderr


def test_a_live_database_seen_through_a_read_only_mount_shows_its_last_commit(
    tmp_path: Path, mounted: Callable[..., Path]
) -> None:
    """A writer holds the file open through a writable path; a read-only view of the same
    directory reads through the writer's -shm, so the commit still in the -wal shows."""
    source = tmp_path / "rw"
    source.mkdir()
    db = source / "q.db"
    _enqueue_done(tmp_path, str(db))
    view = mounted("--bind", source=str(source), name="view")
    remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True)
    assert remount.returncode == 0, remount.stderr
    with closing(sqlite3.connect(db)) as writer:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("UPDATE items SET state = 'failed', error_class = 'x' WHERE key = 'k0'")
        writer.commit()
        result = cli("status", "--json", "--db", str(view / "q.db"))
        assert result.returncode == 0, result.stderr
        counts = json.loads(result.stdout)["totals"]["counts"]
        assert (counts["done"], counts["failed"]) == (4, 1)


# plan and a missing database -----------------------------------------------------------


def test_plan_without_a_database_is_a_missing_database(tmp_path: Path) -> None:
    typo = tmp_path / "typo.db"
    for args in (["plan"], ["plan", "--json"], ["report", str(tmp_path / "r.html")]):
        result = cli(*args, "--db", str(typo), cwd=tmp_path)
        assert result.returncode == 3, result.stderr
        assert f"error: no database at {typo} (named by --db" in result.stderr
    missing_config = cli("plan", "--config", str(tmp_path / "run.toml"), "--db", str(typo))
    assert missing_config.returncode == 2, missing_config.stderr
    assert f"{tmp_path / 'run.toml'}: no such file" in missing_config.stderr
    # A run file is planned without a database: nothing is done yet, nothing is created.
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    (tmp_path / "run.toml").write_text(
        f'[[dataset]]\nname = "d"\nfile = "{data}"\nmax_tokens = 100\n'
    )
    planned = cli("plan", "--config", str(tmp_path / "run.toml"), "--json", "--db", str(typo))
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["total"]["requests"] == 3
    assert not typo.exists()


# --db naming a directory, for every command ------------------------------------------

URL = "http://127.0.0.1:9"  # never reached: the database is refused first

EVERY = [
    *READS,
    ["enqueue", "IN", "-d", "d"],
    ["run", "--server", URL, "--exit-when-done"],
    ["requeue", "--all"],
    ["requeue", "--undo"],
    ["pause", "d"],
    ["resume", "d"],
    ["db", "upgrade"],
    ["db", "copy", "--from", "OTHER", "--to", "DB"],
]


@pytest.mark.parametrize("args", EVERY, ids=_ids)
def test_a_directory_as_the_database(tmp_path: Path, args: list[str]) -> None:
    folder = _sqlite_file("directory", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    other = tmp_path / "other.db"
    _enqueue_done(tmp_path, str(other))
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    argv = [{"IN": str(data), "OTHER": str(other)}.get(a, a) for a in args]
    before = _fingerprint(folder)
    result = cli(*_argv(argv, str(folder), out), timeout=120)
    assert _fingerprint(folder) == before
    _check_refusal(result, args, SAYS["directory"])
    assert os.listdir(out) == []
