"""The workers table: who is running, and when they last showed a sign of life."""

from __future__ import annotations

import time

import sqlalchemy as sa

from orchestrator.store.engine import Database
from orchestrator.store.schema import workers


async def register(database: Database, worker_id: str, host: str, pid: int) -> None:
    now = time.time()
    async with database.write() as conn:
        await conn.execute(workers.delete().where(workers.c.id == worker_id))
        # Keep the table small: forget workers that stopped long ago.
        await conn.execute(workers.delete().where(workers.c.stopped_at < now - 7 * 86400))
        await conn.execute(
            workers.insert().values(
                id=worker_id, host=host, pid=pid, started_at=now, heartbeat_at=now, progress_at=now
            )
        )


async def heartbeat(database: Database, worker_id: str, *, in_flight: int, completed: int) -> None:
    """A sign of life; ``progress_at`` moves only when ``completed`` did."""
    now = time.time()
    moved = sa.case((workers.c.completed != completed, now), else_=workers.c.progress_at)
    async with database.write() as conn:
        await conn.execute(
            workers.update()
            .where(workers.c.id == worker_id)
            .values(heartbeat_at=now, in_flight=in_flight, completed=completed, progress_at=moved)
        )


async def mark_stopped(database: Database, worker_id: str, *, completed: int) -> None:
    now = time.time()
    async with database.write() as conn:
        await conn.execute(
            workers.update()
            .where(workers.c.id == worker_id)
            .values(stopped_at=now, heartbeat_at=now, in_flight=0, completed=completed)
        )


async def mark_dead(database: Database, worker_ids: list[str]) -> None:
    if not worker_ids:
        return
    async with database.write() as conn:
        await conn.execute(
            workers.update()
            .where(workers.c.id.in_(worker_ids), workers.c.stopped_at.is_(None))
            .values(stopped_at=sa.func.coalesce(workers.c.heartbeat_at, time.time()))
        )
