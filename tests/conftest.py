"""Shared fixtures: real SQLite files, the simulated server over loopback, subprocesses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.sim import SimConfig, serve
from orchestrator.store import Database, open_database
from tests.helpers import STARTED, SimProcess


@pytest.fixture(autouse=True)
def _no_stray_workers() -> Iterator[None]:
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


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
