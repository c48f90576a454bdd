"""The workers table: who is running, and when they last showed a sign of life."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from orchestrator.store.engine import Database
from orchestrator.store.schema import workers

# Characters of a down server's reason kept in its row: enough for any probe's words.
REASON_CHARS = 300


@dataclass(frozen=True, slots=True)
class Servers:
    """A worker's servers as it sees them: how many, how many it reaches, each one down
    (``{"server", "reason", "since"}``), and since when it reaches none (None: one
    answers). Written with the heartbeat, so that status can tell an outage."""

    total: int
    up: int
    down: list[dict[str, Any]] = field(default_factory=list)
    unreachable_since: float | None = None

    def values(self) -> dict[str, Any]:
        down = [{**d, "reason": (d.get("reason") or "")[:REASON_CHARS]} for d in self.down]
        return {
            "servers": self.total,
            "servers_up": self.up,
            "servers_down": json.dumps(down),
            "unreachable_since": self.unreachable_since,
        }


async def register(
    database: Database, worker_id: str, host: str, pid: int, *, lease_seconds: float | None = None
) -> None:
    now = time.time()
    async with database.write() as conn:
        await conn.execute(workers.delete().where(workers.c.id == worker_id))
        # Keep the table small: forget workers that stopped long ago.
        await conn.execute(workers.delete().where(workers.c.stopped_at < now - 7 * 86400))
        await conn.execute(
            workers.insert().values(
                id=worker_id,
                host=host,
                pid=pid,
                started_at=now,
                heartbeat_at=now,
                progress_at=now,
                lease_seconds=lease_seconds,
            )
        )


async def heartbeat(
    database: Database,
    worker_id: str,
    *,
    in_flight: int,
    completed: int,
    servers: Servers | None = None,
) -> None:
    """A sign of life, with the worker's servers as it sees them (left as they were
    when not given); ``progress_at`` moves only when ``completed`` did."""
    now = time.time()
    moved = sa.case((workers.c.completed != completed, now), else_=workers.c.progress_at)
    seen = servers.values() if servers is not None else {}
    async with database.write() as conn:
        await conn.execute(
            workers.update()
            .where(workers.c.id == worker_id)
            .values(
                heartbeat_at=now,
                in_flight=in_flight,
                completed=completed,
                progress_at=moved,
                **seen,
            )
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
