"""The workers table as status reads it: silent workers and stalled ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import sqlalchemy as sa

from orchestrator.formats import iter_records
from orchestrator.monitor.status import snapshot
from orchestrator.monitor.text import render_status
from orchestrator.store import Database, DatasetSpec, enqueue
from orchestrator.store import workers as worker_rows
from orchestrator.store.schema import workers
from tests.helpers import prompts, write_jsonl


async def progress_at(database: Database) -> float:
    async with database.read() as conn:
        return (await conn.execute(sa.select(workers.c.progress_at))).scalar_one()


async def test_progress_moves_only_with_answers_and_a_stalled_worker_is_named(
    database: Database, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    await enqueue(database, DatasetSpec("ds"), iter_records(path), path=str(path))
    await worker_rows.register(database, "h:1:2", "h", 1)
    registered = await progress_at(database)
    await worker_rows.heartbeat(database, "h:1:2", in_flight=3, completed=0)
    assert await progress_at(database) == registered
    await asyncio.sleep(0.01)
    await worker_rows.heartbeat(database, "h:1:2", in_flight=3, completed=5)
    assert await progress_at(database) > registered

    snap = await snapshot(database)
    [w] = snap["workers"]
    assert w["stalled"] is False and w["progress_age_s"] is not None

    # Heartbeats keep coming, the count does not move: stalled after 15 minutes.
    async with database.write() as conn:
        await conn.execute(workers.update().values(progress_at=time.time() - 1000))
    await worker_rows.heartbeat(database, "h:1:2", in_flight=3, completed=5)
    snap = await snapshot(database)
    [w] = snap["workers"]
    assert w["stalled"] is True and not w["silent"] and w["progress_age_s"] >= 1000
    assert "STALLED: no answer for 16m" in render_status(snap)
    # With nothing in flight it is idle, not stalled.
    await worker_rows.heartbeat(database, "h:1:2", in_flight=0, completed=5)
    assert (await snapshot(database))["workers"][0]["stalled"] is False
