"""Waiting for a server: a pool whose ``available`` event is set and cleared again before
the waiting task resumes (a server that flaps) must not end the wait, with or without
``give_up_after``; the run gives up only once the deadline has passed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.inference.client import InferenceClient
from orchestrator.store import open_database
from orchestrator.worker import Worker, WorkerConfig
from orchestrator.worker.stop import until_set


async def _turns(n: int = 5) -> None:
    """Let every ready task run ``n`` times over."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("give_up_after", [None, 3600.0])
async def test_a_flapping_server_does_not_end_the_workers_wait(
    tmp_path: Path, give_up_after: float | None
) -> None:
    """Before, the flap woke the wait, which then took the give-up branch: a ``TypeError``
    on ``None`` without a limit, and "no server answered within 3600s" at once with it."""
    database = await open_database(str(tmp_path / "q.db"))
    try:
        async with InferenceClient() as client:
            config = WorkerConfig(servers=("http://127.0.0.1:9",), give_up_after=give_up_after)
            worker = Worker(database, client, config)
            available = worker.pool.available
            waiting = asyncio.create_task(worker._wait_for_server())
            await _turns()
            available.set()
            available.clear()  # gone again before the waiting task resumed
            await _turns()
            assert not waiting.done() and worker.halted is None
            available.set()
            await asyncio.wait_for(waiting, 30)
            assert worker.halted is None
    finally:
        await database.close()


async def test_a_stop_ends_the_wait() -> None:
    available, stopping = asyncio.Event(), asyncio.Event()
    waiting = asyncio.create_task(until_set(available, stopping, seconds=None))
    await _turns()
    stopping.set()
    assert await asyncio.wait_for(waiting, 30) is True


@settings(max_examples=25, deadline=None)
@given(
    flaps=st.lists(st.integers(0, 3), max_size=6),
    seconds=st.floats(0.001, 0.03),
)
def test_the_wait_gives_up_only_once_its_time_has_passed(flaps: list[int], seconds: float) -> None:
    """Any number of flaps, each after a few turns of the loop: the wait never ends while
    the event is clear before ``seconds`` have passed, and ends False after them."""

    async def scenario() -> None:
        available = asyncio.Event()
        started = time.monotonic()
        waiting = asyncio.create_task(until_set(available, seconds=seconds))
        for turns in flaps:
            await _turns(turns)
            available.set()
            available.clear()
            if waiting.done():
                break
        assert await asyncio.wait_for(waiting, 30) is False
        assert time.monotonic() - started >= seconds

    asyncio.run(scenario())
