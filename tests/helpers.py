"""Helpers shared by the tests: input files, the CLI and simulated server as processes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson

from orchestrator.sim import answer_matches

REPO = Path(__file__).resolve().parents[1]


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
        cwd=REPO,
        timeout=kwargs.pop("timeout", 300),
        **kwargs,
    )


# Every worker process a test starts, so that a failing test leaves none behind.
STARTED: list[subprocess.Popen[str]] = []


def start_worker(
    db: Path, url: str, *extra: str, env: dict[str, str] | None = None, log_level: str = "info"
) -> subprocess.Popen[str]:
    """``orchestrator run`` as a subprocess with JSON logs on stderr."""
    cmd = [sys.executable, "-m", "orchestrator", "--log-json", "--log-level", log_level, "run"]
    proc = subprocess.Popen(
        [*cmd, "--server", url, "--db", str(db), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    STARTED.append(proc)
    return proc


def events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def item_rows(db: Path) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT key, state, attempts FROM items ORDER BY position").fetchall()


def check_export(db: Path, out: Path, expected_keys: list[str]) -> list[dict[str, Any]]:
    """Export, and check: each key once, in input order, each answer made for its prompt."""
    result = cli("export", str(out), "--db", str(db))
    assert result.returncode == 0, result.stderr
    lines = [orjson.loads(raw) for raw in out.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == expected_keys
    for line in lines:
        *prompt, answer = line["messages"]
        assert answer["role"] == "assistant"
        assert answer_matches(prompt, answer["content"]), line["id"]
    return lines
