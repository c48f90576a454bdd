"""Shared fixtures: real SQLite files, the simulated server over loopback, subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.sim import SimConfig, serve
from orchestrator.store import Database, open_database

REPO = Path(__file__).resolve().parents[1]

StartSim = Callable[..., Awaitable[str]]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
async def database(db_path: Path) -> AsyncIterator[Database]:
    db = await open_database(str(db_path))
    yield db
    await db.close()


@pytest.fixture
async def sim() -> AsyncIterator[StartSim]:
    """Start in-process simulated servers on free ports; stopped after the test."""
    runners = []

    async def start(**options: Any) -> str:
        runner, port = await serve(SimConfig(**options), "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


class SimProcess:
    """The simulated server as a separate process, as in a real deployment."""

    def __init__(self, *args: str, port: int = 0):
        self.args = args
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> str:
        cmd = [sys.executable, "-m", "orchestrator.sim.server", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert "listening on" in line, line
        self.url = line.rsplit(" ", 1)[-1]
        self.port = int(self.url.rsplit(":", 1)[-1])
        return self.url

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def sim_process() -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def start(*args: str, port: int = 0) -> SimProcess:
        proc = SimProcess(*args, port=port)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


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
