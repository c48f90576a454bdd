"""Files, signals and odd inputs, through the real command: a database file deleted or
replaced under a worker, id-less files sharing a dataset, exports stopped by SIGTERM or
SIGKILL, requests nested too deep, and the environment's errors (a full or read-only
disk, a path through a file, numbers too large) as one line each instead of a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    REPO,
    SimProcess,
    cli,
    events,
    export_caught,
    prompts,
    start_worker,
    write_jsonl,
)


def _no_traceback(result: subprocess.CompletedProcess[str]) -> str:
    """The one-line error of a refused command (and that there is nothing else)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _done(db: Path) -> int:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM items WHERE state = 'done'").fetchone()[0]


def _busy_worker(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> tuple[Path, Any]:
    """A worker half-way through 300 slow items (a file check every 0.5 s: lease 2 s)."""
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(300))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    server = sim_process("--latency", "0.3")
    worker = start_worker(
        db, server.url, "--concurrency", "4", "--lease-seconds", "2", "--exit-when-done"
    )
    deadline = time.monotonic() + 60
    while _done(db) < 8:
        assert worker.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return db, worker


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_worker_signalled_as_it_starts_stops_cleanly(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """SIGTERM while the worker is still setting up (here it waits for its API key from a
    pipe nobody has written to yet) stops it cleanly once it can: exit 0, nothing lost."""
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    assert cli("enqueue", str(data), "-d", "d", "--db", str(db)).returncode == 0
    server = sim_process()
    key = tmp_path / "key"
    os.mkfifo(key)
    worker = start_worker(db, server.url, "--api-key-file", str(key), "--exit-when-done")
    deadline = time.monotonic() + 30
    while not _catches(worker.pid, signal.SIGTERM) and time.monotonic() < deadline:
        assert worker.poll() is None
        time.sleep(0.01)
    worker.send_signal(signal.SIGTERM)
    while worker.poll() is None:  # the key, once the worker reads the pipe
        try:
            fd = os.open(key, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.01)
            continue
        os.write(fd, b"secret\n")
        os.close(fd)
        break
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0, stderr[-3000:]
    assert any(e["event"] == "stopping" for e in events(stderr))
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT state, attempts, count(*) FROM items GROUP BY 1, 2").fetchall()
    assert rows == [("pending", 0, 20)]


# 11 ------------------------------------------------------------------------------------


def test_worker_stops_when_its_database_is_deleted(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    db, worker = _busy_worker(tmp_path, sim_process)
    for path in (db, Path(f"{db}-wal")):
        path.unlink()
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 3, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {db}: the database file was deleted"), last
    assert any(e["event"] == "stopping_database_file_gone" for e in events(stderr))
    assert "Traceback" not in stderr
    assert not db.exists()


def test_worker_stops_when_its_database_is_replaced(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    other = tmp_path / "other.db"
    data = write_jsonl(tmp_path / "other.jsonl", prompts(5, prefix="o"))
    assert cli("enqueue", str(data), "-d", "other", "--db", str(other)).returncode == 0
    db, worker = _busy_worker(tmp_path, sim_process)
    os.replace(other, db)
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 3, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {db}: the database file was replaced by another file"), last
    # The file moved in is left as it was: its own dataset, nothing of the worker's.
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = conn.execute("SELECT d.name, i.state FROM items i JOIN datasets d").fetchall()
    assert rows == [("other", "pending")] * 5


# 17 ------------------------------------------------------------------------------------


def test_a_second_file_without_ids_is_told_its_keys_are_line_numbers(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    part1 = write_jsonl(tmp_path / "part1.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    part2 = write_jsonl(tmp_path / "part2.jsonl", [{"prompt": "c"}])
    assert cli("enqueue", str(part1), "-d", "d", "--db", str(db)).returncode == 0
    result = cli("enqueue", str(part2), "-d", "d", "--db", str(db))
    assert result.returncode == 2
    line = _no_traceback(result)
    assert line.startswith(f"error: {part2}:1: key '1' is already enqueued in dataset 'd'")
    assert "keyed by its line number" in line
    assert 'give every line an "id"' in line and "a dataset of its own" in line
    # Both ways out work; the first file stays idempotent.
    again = cli("enqueue", str(part1), "-d", "d", "--db", str(db))
    assert again.returncode == 0 and "nothing new" in again.stdout
    assert cli("enqueue", str(part2), "-d", "d2", "--db", str(db)).returncode == 0
    with_ids = write_jsonl(tmp_path / "part2-ids.jsonl", [{"id": "p2-1", "prompt": "c"}])
    assert cli("enqueue", str(with_ids), "-d", "d", "--db", str(db)).returncode == 0
    # An "id" that happens to equal its line number is not said to be one.
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": 1, "prompt": "z"}])
    refused = cli("enqueue", str(clash), "-d", "d", "--db", str(db))
    assert refused.returncode == 2 and "with different content" in refused.stderr


# 18 ------------------------------------------------------------------------------------


@pytest.fixture
def big_db(tmp_path: Path) -> Path:
    """20,000 done items, about 40 MB of export."""
    db = tmp_path / "big.db"
    reply = "y" * 2000
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": reply},
            ]
        }
        for i in range(20_000)
    ]
    data = write_jsonl(tmp_path / "done.jsonl", rows)
    result = cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", str(db))
    assert result.returncode == 0, result.stderr
    return db


def _export_caught_writing(db: Path, out: Path) -> tuple[subprocess.Popen[str], Path]:
    """An export, stopped (SIGSTOP) while its temporary file is being written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "export", str(out), "--db", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    tmp = export_caught(proc, out, 30)
    proc.send_signal(signal.SIGSTOP)
    assert not out.exists()
    return proc, tmp


def test_sigterm_during_export_removes_its_temporary_file(big_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    proc, tmp = _export_caught_writing(big_db, out)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "Traceback" not in stderr, stderr
    assert not tmp.exists() and not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_temporary_files_of_dead_exports_are_removed(big_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    proc, killed = _export_caught_writing(big_db, out)
    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=30)
    assert killed.exists()
    # Another process's temporary file, still running: not ours to remove.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = out.with_name(f".{out.name}.{live.pid}.tmp")
        alive.write_bytes(b"in progress")
        other = out.with_name(f".other.jsonl.{proc.pid}.tmp")  # another target's
        other.write_bytes(b"x")
        result = cli("export", str(out), "--db", str(big_db))
        assert result.returncode == 0, result.stderr
        assert not killed.exists()
        assert alive.exists() and other.exists()
        assert len(out.read_bytes().splitlines()) == 20_000
    finally:
        live.kill()
        live.wait()


# 19 ------------------------------------------------------------------------------------


def _nested(depth: int) -> dict[str, object]:
    value: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        value = {"a": value}
    return value


def _json_lines(path: Path, rows: list[dict[str, object]]) -> Path:
    """``write_jsonl`` with the standard library's encoder, which nests without limit."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_request_nested_too_deep_is_a_bad_line(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    ok = {"id": "ok", "messages": [{"role": "user", "content": "hi"}]}
    deep = {**ok, "id": "deep", "response_format": _nested(300)}
    data = _json_lines(tmp_path / "in.jsonl", [ok, deep])
    result = cli("enqueue", str(data), "-d", "d", "--db", str(db))
    assert result.returncode == 2
    line = _no_traceback(result)
    assert line.startswith(f"error: {data}:2: nested 302 levels deep at response_format.a.a")
    assert "at most 254 levels" in line
    skipped = cli("enqueue", str(data), "-d", "d", "--skip-invalid", "--db", str(db))
    assert skipped.returncode == 0, skipped.stderr
    assert f"{data}:2: nested 302 levels deep" in skipped.stderr
    assert "1 invalid lines skipped" in skipped.stdout
    # Nesting the parser itself refuses (over 1,024 levels) says the same.
    deeper = tmp_path / "deeper.jsonl"
    deeper.write_text('{"prompt": "x", "x": ' + "[" * 1100 + "]" * 1100 + "}\n")
    refused = cli("enqueue", str(deeper), "-d", "d", "--db", str(db))
    assert refused.returncode == 2
    assert "nested deeper than 254 levels" in _no_traceback(refused)
    # Just inside the limit is accepted.
    edge = _json_lines(
        tmp_path / "edge.jsonl", [{**ok, "id": "e", "response_format": _nested(252)}]
    )
    assert cli("enqueue", str(edge), "-d", "d", "--db", str(db)).returncode == 0


# 20 ------------------------------------------------------------------------------------


def test_export_onto_a_full_disk(
    big_db: Path, tmp_path: Path, mounted: Callable[..., Path]
) -> None:
    disk = mounted("-t", "tmpfs", "-o", "size=2m")
    out = disk / "out.jsonl"
    result = cli("export", str(out), "--db", str(big_db))
    assert result.returncode == 2
    line = _no_traceback(result)
    assert line.startswith(f"error: {out}: the disk is full"), line
    assert list(disk.iterdir()) == []


def test_export_under_a_path_through_a_file(big_db: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "out.jsonl"
    result = cli("export", str(out), "--db", str(big_db))
    assert result.returncode == 2
    line = _no_traceback(result)
    assert line.startswith(f"error: {out}:") and "not a directory" in line, line


def test_new_database_in_a_read_only_directory(
    tmp_path: Path, mounted: Callable[..., Path]
) -> None:
    ro = mounted("-t", "tmpfs", "-o", "ro,size=1m")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    result = cli("enqueue", str(data), "-d", "d", "--db", str(ro / "new.db"))
    assert result.returncode == 3  # a storage error, as for an existing read-only database
    line = _no_traceback(result)
    assert line.startswith(f"error: {ro / 'new.db'}: cannot create the database"), line
    assert "read-only file system" in line and "--db" in line


@pytest.mark.parametrize("option", ["--concurrency", "--priority"])
def test_numbers_too_large_for_the_database(tmp_path: Path, option: str) -> None:
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    result = cli("enqueue", str(data), "-d", "d", option, "99999999999999999999", "--db", str(db))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr
    assert f"Invalid value for '{option}'" in result.stderr
    assert "2147483647" in result.stderr
    settings = {"name": '"d"', "file": '"in.jsonl"', "max_tokens": "8"}
    settings[option.removeprefix("--").replace("-", "_")] = "9999999999999"
    config = tmp_path / "run.toml"
    config.write_text("[[dataset]]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    from_file = cli("enqueue", "--config", str(config), "--db", str(db))
    assert from_file.returncode == 2
    assert "2147483647, got 9999999999999" in _no_traceback(from_file)
