"""A provider's batches, step by step: what makes the Batch API never pay twice.

A batch is written down with every line it asks for before its input file goes up
(``packing``), then with each id the provider gives as soon as it gives it: the input
file's (``uploaded``), the batch's (``created``). Its answers are handed to the items'
requests (``collected``); once no line of it is wanted any more (each written for its
item, or its item done or failed by other means) it is ``closed``. A batch the provider
never created, or lost, is ``abandoned``: its lines are asked again elsewhere.

A worker that takes the items of a dead one finds their lines here (:func:`wanted`), and
with them the batch to adopt: polled where it was created, looked up by its ``key`` in
the provider's metadata where the create's answer was never written. Every line is
written for its item through the queue's fenced path like any answer; this module keeps
only the batches' own records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import sqlalchemy as sa

from orchestrator.store.engine import Database
from orchestrator.store.schema import batch_entries, batches, items

PACKING = "packing"
UPLOADED = "uploaded"
#: A create asked of the provider and not yet answered: it may land until the call's
#: time is up, so nobody else gives the batch up before then.
CREATING = "creating"
CREATED = "created"
COLLECTED = "collected"
CLOSED = "closed"
ABANDONED = "abandoned"
#: The states of a batch whose lines may still answer their items.
LIVE = (PACKING, UPLOADED, CREATING, CREATED, COLLECTED)

#: The columns a step may write.
_STEP_FIELDS = frozenset(
    {
        "state",
        "status",
        "input_file_id",
        "provider_id",
        "output_file_id",
        "error_file_id",
        "completed",
        "failed",
        "error",
        "expires_at",
    }
)


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One batch as recorded."""

    id: int
    key: str
    server: str
    endpoint: str
    state: str
    status: str | None
    input_file_id: str | None
    provider_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    requests: int
    bytes: int
    completed: int
    failed: int
    worker: str | None
    error: str | None
    created_at: float
    updated_at: float
    expires_at: float | None

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_COLUMNS = [batches.c[f.name] for f in fields(BatchRow)]


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a batch: the request of an item's turn."""

    custom_id: str
    item_id: int
    turn: int


@dataclass(frozen=True, slots=True)
class Wanted:
    """A line still wanted by its item: the batch it is in and its id there."""

    batch_key: str
    custom_id: str
    item_id: int
    turn: int


async def open_batch(
    database: Database,
    key: str,
    server: str,
    endpoint: str,
    lines: Sequence[Line],
    size: int,
    worker: str | None,
) -> None:
    """Write a batch down with its lines, before anything is sent."""
    now = time.time()

    def write(conn: sa.Connection) -> None:
        batch_id = conn.execute(
            batches.insert()
            .values(
                key=key,
                server=server,
                endpoint=endpoint,
                state=PACKING,
                requests=len(lines),
                bytes=size,
                worker=worker,
                created_at=now,
                updated_at=now,
            )
            .returning(batches.c.id)
        ).scalar_one()
        conn.execute(
            batch_entries.insert(),
            [
                {"batch_id": batch_id, "custom_id": ln.custom_id, "item_id": ln.item_id,
                 "turn": ln.turn}
                for ln in lines
            ],
        )  # fmt: skip

    await database.run_write(write)


async def record(database: Database, key: str, holder: str, **values: Any) -> bool:
    """A step's outcome: the ids and status the provider gave, the batch's new state;
    written only while ``holder`` holds the batch (False when another worker took it)."""
    unknown = set(values) - _STEP_FIELDS
    if unknown:
        raise ValueError(f"not a batch step's field: {sorted(unknown)}")
    values["updated_at"] = time.time()
    held = sa.and_(batches.c.key == key, batches.c.worker == holder)
    return await _changed(database, batches.update().where(held).values(**values))


async def mark_creating(database: Database, key: str, holder: str) -> bool:
    """Say a create is about to be asked: only while ``holder`` holds the uploaded batch,
    so that a worker that took it over (and may create it anew) is never raced."""
    held = sa.and_(
        batches.c.key == key,
        batches.c.worker == holder,
        batches.c.state.in_((UPLOADED, CREATING)),
    )
    statement = batches.update().where(held).values(state=CREATING, updated_at=time.time())
    return await _changed(database, statement)


async def take_over(database: Database, row: BatchRow, holder: str) -> bool:
    """Make ``holder`` the batch's worker, only if its record is still as ``row`` read it:
    the previous holder's later steps are then not written, and it creates nothing."""
    same = sa.and_(
        batches.c.key == row.key,
        batches.c.state == row.state,
        batches.c.worker.is_not_distinct_from(row.worker),
        batches.c.updated_at == row.updated_at,
    )
    statement = batches.update().where(same).values(worker=holder, updated_at=time.time())
    return await _changed(database, statement)


async def _changed(database: Database, statement: sa.Update) -> bool:
    return bool(await database.run_write(lambda conn: conn.execute(statement).rowcount))


async def get(database: Database, key: str) -> BatchRow | None:
    async with database.read() as conn:
        row = (await conn.execute(sa.select(*_COLUMNS).where(batches.c.key == key))).first()
    return BatchRow(*row) if row is not None else None


async def listing(database: Database, *, live: bool = True, limit: int = 200) -> list[BatchRow]:
    """The batches, newest first: only those still live, or all."""
    query = sa.select(*_COLUMNS).order_by(batches.c.id.desc()).limit(limit)
    if live:
        query = query.where(batches.c.state.in_(LIVE))
    async with database.read() as conn:
        return [BatchRow(*row) for row in await conn.execute(query)]


async def wanted(database: Database, item_ids: Iterable[int]) -> dict[int, Wanted]:
    """The live, unsettled line of each of these items, if it has one."""
    ids = sorted(set(item_ids))
    found: dict[int, Wanted] = {}
    if not ids:
        return found
    async with database.read() as conn:
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            query = (
                sa.select(
                    batches.c.key,
                    batch_entries.c.custom_id,
                    batch_entries.c.item_id,
                    batch_entries.c.turn,
                )
                .join(batches, batches.c.id == batch_entries.c.batch_id)
                .where(
                    batch_entries.c.item_id.in_(part),
                    batch_entries.c.settled == 0,
                    batches.c.state.in_(LIVE),
                )
                .order_by(batches.c.id)
            )
            for row in await conn.execute(query):
                found[row.item_id] = Wanted(*row)
    return found


async def lines_of(database: Database, key: str) -> list[Line]:
    """Every line of a batch (settled or not)."""
    query = (
        sa.select(batch_entries.c.custom_id, batch_entries.c.item_id, batch_entries.c.turn)
        .join(batches, batches.c.id == batch_entries.c.batch_id)
        .where(batches.c.key == key)
    )
    async with database.read() as conn:
        return [Line(*row) for row in await conn.execute(query)]


async def settle(database: Database, lines: Sequence[tuple[str, str]]) -> None:
    """Lines (batch key, custom id) written for their items: no longer wanted."""
    if not lines:
        return
    by_batch: dict[str, list[str]] = {}
    for key, custom_id in lines:
        by_batch.setdefault(key, []).append(custom_id)

    def write(conn: sa.Connection) -> None:
        for key, custom_ids in sorted(by_batch.items()):
            batch_id = sa.select(batches.c.id).where(batches.c.key == key).scalar_subquery()
            conn.execute(
                batch_entries.update()
                .where(
                    batch_entries.c.batch_id == batch_id,
                    batch_entries.c.custom_id.in_(custom_ids),
                )
                .values(settled=1)
            )

    await database.run_write(write)


def settle_items(conn: sa.Connection, item_ids: Sequence[int]) -> None:
    """The lines of these items settled, in the caller's transaction: they are asked
    anew (a requeue), never answered from a batch made for what they were."""
    conn.execute(
        batch_entries.update()
        .where(batch_entries.c.item_id.in_(item_ids), batch_entries.c.settled == 0)
        .values(settled=1)
    )


def _still_wanted() -> sa.Exists:
    """A line of the batch in the outer query still waits to be written for its item."""
    return (
        sa.select(batch_entries.c.batch_id)
        .join(items, items.c.id == batch_entries.c.item_id)
        .where(
            batch_entries.c.batch_id == batches.c.id,
            batch_entries.c.settled == 0,
            items.c.state.in_(("pending", "running")),
        )
        .exists()
    )


async def unwanted(database: Database, keys: Sequence[str]) -> list[str]:
    """Of these batches, those none of whose lines is wanted any more (their items
    requeued, deleted, or ended otherwise): worth cancelling where still running."""
    if not keys:
        return []
    query = sa.select(batches.c.key).where(batches.c.key.in_(keys), ~_still_wanted())
    async with database.read() as conn:
        return list((await conn.execute(query)).scalars())


async def close_finished(database: Database) -> list[str]:
    """Close each collected batch none of whose lines is wanted any more (each written
    for its item, or its item no longer pending or running); the keys closed."""
    still_wanted = _still_wanted()

    def write(conn: sa.Connection) -> list[str]:
        keys = list(
            conn.execute(
                sa.select(batches.c.key).where(batches.c.state == COLLECTED, ~still_wanted)
            ).scalars()
        )
        if keys:
            conn.execute(
                batches.update()
                .where(batches.c.key.in_(keys))
                .values(state=CLOSED, updated_at=time.time())
            )
        return keys

    return await database.run_write(write)
