"""Output that is not a regular file, through the real command in a shell: a pipe whose
reader has gone (``| head -1``), a closed standard output (``>&-``), process substitution
(``>(cmd)``), a FIFO, and ``/dev/stdout`` (also appended to with ``>>``).

A reader that stops reading is a normal end: the command stops quietly with status 141
(128 + SIGPIPE, what the shell reports for any writer cut short so, ``seq 1e6 | head -1``).
A target that is not a regular file is written in place; regular files are still written
under a temporary name and renamed.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, cli, write_jsonl

ROWS = 3000  # about 400 KB of export: more than a pipe holds, so `| head` cuts it short
ORCH = f"{sys.executable} -m orchestrator"


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"k{i:05d}",
            "messages": [
                {"role": "user", "content": f"question {i} " + "q" * 40},
                {"role": "assistant", "content": f"answer {i} " + "a" * 60},
            ],
        }
        for i in range(n)
    ]


@pytest.fixture
def done_db(tmp_path: Path, db_url: str) -> tuple[str, bytes]:
    """A database of ROWS done items (SQLite or PostgreSQL), and their export's bytes."""
    data = write_jsonl(tmp_path / "done.jsonl", _rows(ROWS))
    result = cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", db_url)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "expected.jsonl"
    result = cli("export", str(out), "--db", db_url)
    assert result.returncode == 0, result.stderr
    return db_url, out.read_bytes()


def _shell(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` in bash, in ``tmp_path``, with the orchestrator's warnings only."""
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "ORCHESTRATOR_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO), **env},
        timeout=300,
    )


def test_export_into_head_ends_quietly(tmp_path: Path, done_db: tuple[str, bytes]) -> None:
    db, expected = done_db
    result = _shell(f'{ORCH} export - --db "{db}" | head -1; echo "${{PIPESTATUS[@]}}"', tmp_path)
    first, statuses = result.stdout.splitlines()
    assert first.encode() == expected.splitlines()[0]
    assert statuses == "141 0"
    assert result.stderr == ""


WRITERS = [
    ["export", "-"],
    ["export", "/dev/stdout"],
    ["status", "--json"],
    ["status"],
    ["plan", "--json"],
    ["plan"],
    ["report", "/dev/stdout"],
]


@pytest.mark.parametrize("args", WRITERS, ids=" ".join)
def test_a_pipe_nobody_reads_is_a_quiet_end(
    tmp_path: Path, done_db: tuple[str, bytes], args: list[str]
) -> None:
    """Standard output a pipe whose reader is gone already: the first write fails (EPIPE)."""
    db, _ = done_db
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args, "--db", db],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "ORCHESTRATOR_LOG_LEVEL": "warning"},
            timeout=300,
        )
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.parametrize("args", [["export", "-"], ["status", "--json"], ["export", "OUT"]])
def test_a_closed_standard_output_is_refused(
    tmp_path: Path, done_db: tuple[str, bytes], args: list[str]
) -> None:
    db, _ = done_db
    argv = " ".join("out.jsonl" if a == "OUT" else a for a in args)
    result = _shell(f'{ORCH} {argv} --db "{db}" >&-', tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: standard output is closed (>&-): nothing could be written to it; "
        "redirect it to a file, or to /dev/null to discard it"
    ]
    assert not (tmp_path / "out.jsonl").exists()


def test_export_to_process_substitution(tmp_path: Path, done_db: tuple[str, bytes]) -> None:
    db, expected = done_db
    result = _shell(f'{ORCH} export >(cat > got.jsonl) --db "{db}"; wait $!', tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "got.jsonl").read_bytes() == expected
    assert f"exported {ROWS:,} items to /dev/fd/" in result.stdout


def test_report_to_process_substitution(tmp_path: Path, done_db: tuple[str, bytes]) -> None:
    db, _ = done_db
    result = _shell(f'{ORCH} report >(cat > got.html) --db "{db}"; wait $!', tmp_path)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "got.html").read_text()
    assert page.startswith("<!doctype html>") and f'"done":{ROWS}' in page


def _read_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as fh:
            into.append(fh.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


@pytest.mark.parametrize("command", ["export", "report"])
def test_a_fifo_is_written_in_place(
    tmp_path: Path, done_db: tuple[str, bytes], command: str
) -> None:
    db, expected = done_db
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    result = cli(command, str(fifo), "--db", db)
    assert result.returncode == 0, result.stderr
    reader.join(60)
    assert stat.S_ISFIFO(fifo.stat().st_mode), "the FIFO is still a FIFO"
    if command == "export":
        assert got == [expected]
    else:
        assert got[0].startswith(b"<!doctype html>")
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_dev_stdout_is_standard_output(tmp_path: Path, done_db: tuple[str, bytes]) -> None:
    """Into a pipe, into a file, and appended to a file: the shell's descriptor is written,
    not the file it names replaced; the summary goes to stderr."""
    db, expected = done_db
    piped = _shell(f'{ORCH} export /dev/stdout --db "{db}" | cat > piped.jsonl', tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert (tmp_path / "piped.jsonl").read_bytes() == expected
    assert f"exported {ROWS:,} items to standard output" in piped.stderr
    script = f'{ORCH} export /dev/stdout --db "{db}" > new.jsonl'
    assert _shell(script, tmp_path).returncode == 0
    assert (tmp_path / "new.jsonl").read_bytes() == expected
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(b'{"id": "earlier"}\n')
    inode = kept.stat().st_ino
    script = f'{ORCH} export /dev/stdout --db "{db}" >> kept.jsonl'
    assert _shell(script, tmp_path).returncode == 0
    assert kept.read_bytes() == b'{"id": "earlier"}\n' + expected
    assert kept.stat().st_ino == inode
