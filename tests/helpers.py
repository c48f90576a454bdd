"""Helpers shared by the tests: input files, the CLI and simulated server as processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import hashlib
import itertools
import json
import os
import pty
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.sim import answer_matches

if TYPE_CHECKING:
    from orchestrator.inference.client import InferenceClient
    from orchestrator.inference.completions import Completion

REPO = Path(__file__).resolve().parents[1]

# Turns of a conversation: an answer, and a tool call with its result.
ANSWER = {"role": "assistant", "content": "a"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "r"}


class SimProcess:
    """The simulated server as a separate process, as in a real deployment.

    ``start()`` again after ``kill()`` brings it back on the same port, like a
    restarted inference server.
    """

    def __init__(self, *args: str, port: int = 0, env: dict[str, str] | None = None):
        self.args = args
        self.port = port
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> str:
        cmd = [sys.executable, "-m", "orchestrator.sim.server", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *self.args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **self.env},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert "listening on" in line, line
        self.url = line.rsplit(" ", 1)[-1]
        self.port = int(self.url.rsplit(":", 1)[-1])
        return self.url

    def kill(self) -> None:
        """Die at once, dropping every connection, as a crashed server does."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/sim/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ServerScript:
    """A test's own HTTP server script as a process: the first line it prints is
    ``listening on URL``, and ``/stats`` counts what it served."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        self.url = line.rsplit(" ", 1)[-1]
        self.port = int(self.url.rsplit(":", 1)[-1])

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Hostile(ServerScript):
    """``tests.hostile_server`` as its own process."""

    def __init__(self, *args: str):
        super().__init__([sys.executable, "-m", "tests.hostile_server", *args])


def wait_for(condition: Callable[[], Any], what: str, deadline: float = 120.0) -> Any:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``deadline`` s."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline:.0f} s waiting for {what}")


def kill_worker_once(
    worker: subprocess.Popen[str], reached: Callable[[], bool], *, pause: float = 0.05
) -> None:
    """SIGKILL ``worker`` once ``reached()`` (or it ended, or 60 s went by), and reap it."""
    deadline = time.monotonic() + 60
    while not reached() and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(pause)
    worker.send_signal(signal.SIGKILL)
    worker.communicate()


def kill_worker_after(db: Path | str, url: str, done: int, *extra: str, pause: float = 0.05) -> int:
    """A worker started on ``url`` and SIGKILLed once ``done`` items are (see
    :func:`kill_worker_once`); how many items were done then."""
    worker = start_worker(db, url, *extra)
    kill_worker_once(worker, lambda: done_count(db) >= done, pause=pause)
    return done_count(db)


def export_caught(proc: subprocess.Popen[Any], out: Path, seconds: float) -> Path:
    """The temporary file of the export ``proc`` writes to ``out``, once it holds bytes."""
    tmp = out.with_name(f".{out.name}.{proc.pid}.tmp")
    deadline = time.monotonic() + seconds
    while not (tmp.exists() and tmp.stat().st_size > 0):
        assert proc.poll() is None, "the export finished before it could be caught"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return tmp


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter (which modules a command loads is per process)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result


def cli_loading(
    args: list[str], packages: tuple[str, ...], *, fail_on_exit: bool = True
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The command ``args`` run in a fresh interpreter: the process, and the modules of
    ``packages`` it loaded (printed last on stderr)."""
    ended = "    assert not exc.code, exc.code\n" if fail_on_exit else "    pass\n"
    code = (
        "import json, sys\n"
        "from orchestrator.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit as exc:\n"
        f"{ended}"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})\n"
        "print(json.dumps(loaded), file=sys.stderr)\n"
    )
    result = run_python(code)
    return result, json.loads(result.stderr.strip().splitlines()[-1])


def planned(folder: Path, datasets: str) -> list[dict[str, Any]]:
    """``plan --json`` of a run file in ``folder`` with ``datasets`` (its [[dataset]]
    tables) under defaults of model m and max_tokens 1000, on an empty database."""
    config = folder / "run.toml"
    config.write_text('[defaults]\nmodel = "m"\nmax_tokens = 1000\n\n' + datasets)
    done = cli("plan", "--config", str(config), "--db", str(folder / "none.db"), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["datasets"]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with open(path, "wb") as fh:
        for row in rows:
            fh.write(row if isinstance(row, bytes) else orjson.dumps(row))
            fh.write(b"\n")
    return path


def prompts(n: int, prefix: str = "p") -> list[dict[str, Any]]:
    return [
        {"id": f"{prefix}{i:06d}", "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(n)
    ]


def dialogue(*turns: str, system: str | None = None) -> list[dict[str, str]]:
    """A conversation from its texts alone: user and assistant by turns, after the
    system message if there is one."""
    head = [{"role": "system", "content": system}] if system else []
    roles = itertools.cycle(("user", "assistant"))
    return head + [
        {"role": role, "content": text} for role, text in zip(roles, turns, strict=False)
    ]


def cli(
    *args: str, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point in a subprocess."""
    full_env = {**os.environ, "ORCHESTRATOR_LOG_LEVEL": "warning", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=kwargs.pop("cwd", REPO),
        timeout=kwargs.pop("timeout", 300),
        **kwargs,
    )


def enqueue_prompts(
    db: Path | str, path: Path, n: int, *extra: str, dataset: str = "d", prefix: str = "p"
) -> list[str]:
    """``n`` prompts written to ``path`` and enqueued into ``dataset`` with
    ``--max-tokens 16`` by the command; their keys."""
    rows = prompts(n, prefix)
    write_jsonl(path, rows)
    result = cli("enqueue", str(path), "-d", dataset, "--db", str(db), "--max-tokens", "16", *extra)
    assert result.returncode == 0, result.stderr
    return [row["id"] for row in rows]


# Every worker process a test starts, so that a failing test leaves none behind.
STARTED: list[subprocess.Popen[str]] = []


def start_worker(
    db: Path | str,
    url: str,
    *extra: str,
    env: dict[str, str] | None = None,
    log_level: str = "info",
) -> subprocess.Popen[str]:
    """``orchestrator run`` as a subprocess with JSON logs on stderr."""
    args = ("--log-level", log_level, "run", "--server", url, "--db", str(db), *extra)
    return start_cli(*args, env=env)


def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The command with ``args`` as a subprocess with JSON logs on stderr, stopped at the
    test's end if it has not ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--log-json", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    STARTED.append(proc)
    return proc


class Heard:
    """A process's stderr, read as it comes on a thread of its own, so that a test can
    wait for a line to be said while the process runs (``proc.communicate`` would wait
    for its end)."""

    def __init__(self, proc: subprocess.Popen[str]):
        assert proc.stderr is not None
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, deadline: float = 120.0) -> None:
        until = time.monotonic() + deadline
        while not any(text in line for line in self.lines):
            if time.monotonic() > until or not self._reader.is_alive():
                raise AssertionError(f"never said {text!r}:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.05)

    def text(self, timeout: float = 120.0) -> str:
        """Everything said, once the process has ended."""
        self.proc.wait(timeout)
        self._reader.join(timeout)
        return "".join(self.lines)


def read_terminal(leader: int) -> bytes:
    """What the process wrote next on the pty ``leader``; ``b""`` once it closed it."""
    try:
        return os.read(leader, 4096)
    except OSError:  # the process closed the terminal
        return b""


def run_on_a_terminal(
    argv: list[str], env: dict[str, str], *, timeout: float = 120, columns: int | None = None
) -> tuple[int, str]:
    """``argv`` with stderr a real pty (``columns`` wide if given); its exit code and
    everything it wrote there, raw."""
    leader, follower = pty.openpty()
    if columns is not None:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        cwd=REPO,
        env=env,
    )
    os.close(follower)
    chunks = []
    while chunk := read_terminal(leader):
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout), b"".join(chunks).decode(errors="replace")


def events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def is_postgres(db: Path | str) -> bool:
    return str(db).startswith("postgresql")


def query(db: Path | str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of one statement on either backend: an SQLite file, or a PostgreSQL URL.

    Parameters are ``?`` on both (PostgreSQL's ``$n`` are made from them).
    """
    if not is_postgres(db):
        with closing(sqlite3.connect(db)) as conn:
            return conn.execute(sql, params).fetchall()
    marks = itertools.count(1)
    pg_sql = re.sub(r"\?", lambda _: f"${next(marks)}", sql)

    async def run() -> list[tuple[Any, ...]]:
        import asyncpg

        conn = await asyncpg.connect(str(db))
        try:
            return [tuple(r) for r in await conn.fetch(pg_sql, *params)]
        finally:
            await conn.close()

    # A thread of its own: the caller may be inside a running event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def db_snapshot(db: Path | str) -> str:
    """What a refused command must leave unchanged: the file's bytes on SQLite, every row
    of every table on PostgreSQL."""
    if not is_postgres(db):
        return hashlib.sha256(Path(db).read_bytes()).hexdigest()
    tables = query(
        db,
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema = 'public' ORDER BY table_name",
    )
    digest = hashlib.sha256()
    for (table,) in tables:
        digest.update(repr((table, query(db, f'SELECT * FROM "{table}" ORDER BY 1'))).encode())
    return digest.hexdigest()


def item_rows(db: Path | str) -> list[tuple[Any, ...]]:
    return query(db, "SELECT key, state, attempts FROM items ORDER BY position")


def export_lines(db: Path | str, out: Path, *args: str) -> list[dict[str, Any]]:
    """The lines ``export`` with ``args`` writes to ``out``, parsed; it must succeed."""
    result = cli("export", str(out), "--db", str(db), *args)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(raw) for raw in out.read_bytes().splitlines()]


def exported(db: Path | str, out: Path, expected_keys: list[str]) -> list[dict[str, Any]]:
    """The lines of the export to ``out``, checked to hold each key once, in input order."""
    lines = export_lines(db, out)
    assert [line["id"] for line in lines] == expected_keys
    return lines


def done_count(db: Path | str) -> int:
    """How many items are done."""
    return int(query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0])


def check_export(db: Path | str, out: Path, expected_keys: list[str]) -> list[dict[str, Any]]:
    """Export, and check: each key once, in input order, each answer made for its prompt."""
    lines = exported(db, out, expected_keys)
    for line in lines:
        *prompt, answer = line["messages"]
        assert answer["role"] == "assistant"
        assert answer_matches(prompt, answer["content"]), line["id"]
    return lines


async def chat(
    client: InferenceClient, server: str, body: dict[str, Any], **options: Any
) -> Completion:
    """One request's first choice, read as the worker reads its answers (``chat_choices``)."""
    return (await client.chat_choices(server, body, **options))[0]
