"""Deleting a dataset, its dry run, its undo, and the purge that makes it final.

A mistaken dataset could only be paused, and a paused dataset keeps every run waiting on
it (``run --exit-when-done`` exits 7), counts in the ETA and is written, empty, by
exports. Deleting it moves every row of it, in one transaction, from its tables into
their ``deleted_<table>`` copies under a ``deletions`` row (``schema.KEPT``); the undo
moves them back as they were, until ``purge`` drops them.

Running items are refused (pause the dataset and let them finish): none is ever written
into a deleted dataset, and an answer still in flight for an item that was running is
fenced off by its lease token, whose row is gone. A dataset holding answers is deleted
only when the caller says so (``with_outputs``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.errors import ConfigError
from orchestrator.store.engine import Database
from orchestrator.store.schema import (
    DELETED_FROM,
    KEPT,
    attempt_errors,
    datasets,
    deletions,
    items,
    outputs,
    superseded_outputs,
)


@dataclass(frozen=True, slots=True)
class DeletionReport:
    """What a deletion took (or, in a dry run, would take), or what an undo gave back."""

    dataset: str
    #: The deletion's number; None in a dry run.
    deletion_id: int | None
    #: The dataset's items by state.
    states: dict[str, int] = field(default_factory=dict)
    #: Answers among them: done items' outputs, and answers a requeue set aside.
    answers: int = 0
    #: Rows by table (``items``, ``outputs``, ...).
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def items(self) -> int:
        return sum(self.states.values())


def _rows_of(table: sa.Table, dataset_id: int) -> sa.ColumnElement[bool]:
    """The rows of ``table`` that belong to the dataset."""
    if table is datasets:
        return datasets.c.id == dataset_id
    if "dataset_id" in table.c:
        return table.c.dataset_id == dataset_id
    return table.c.item_id.in_(sa.select(items.c.id).where(items.c.dataset_id == dataset_id))


def _dataset_row(conn: sa.Connection, name: str) -> Any:
    row = conn.execute(sa.select(datasets.c.id).where(datasets.c.name == name)).first()
    if row is None:
        raise ConfigError(f"no such dataset: {name}")
    return row


def _states(conn: sa.Connection, dataset_id: int, lock: bool) -> dict[str, int]:
    """The dataset's items by state; with ``lock``, on PostgreSQL, every one is locked
    until the transaction ends, so that no claim takes one meanwhile."""
    mine = items.c.dataset_id == dataset_id
    if lock and conn.dialect.name == "postgresql":
        locked = sa.select(items.c.state).where(mine).with_for_update().subquery()
        query = sa.select(locked.c.state, sa.func.count()).group_by(locked.c.state)
    else:
        query = sa.select(items.c.state, sa.func.count()).where(mine).group_by(items.c.state)
    return {state: n for state, n in conn.execute(query).all()}


def _answers(conn: sa.Connection, dataset_id: int) -> int:
    return sum(
        conn.execute(
            sa.select(sa.func.count()).select_from(t).where(t.c.dataset_id == dataset_id)
        ).scalar_one()
        for t in (outputs, superseded_outputs)
    )


def _surveyed(conn: sa.Connection, name: str, lock: bool) -> tuple[int, DeletionReport]:
    """The dataset's id and what deleting it would take."""
    dataset_id = _dataset_row(conn, name).id
    states = _states(conn, dataset_id, lock)  # first: on PostgreSQL it takes the locks
    rows = {
        str(t.name): conn.execute(
            sa.select(sa.func.count()).select_from(t).where(_rows_of(t, dataset_id))
        ).scalar_one()
        for t in DELETED_FROM
    }
    report = DeletionReport(name, None, states, _answers(conn, dataset_id), rows=rows)
    return dataset_id, report


def refusal(report: DeletionReport, with_outputs: bool) -> str | None:
    """Why the dataset may not be deleted now, or None."""
    name = report.dataset
    running = report.states.get("running", 0)
    if running:
        return (
            f"dataset {name!r} has {running:,} items running: pause it (`orchestrator pause "
            f"{name}`) and let them finish, or stop its workers, then delete it"
        )
    if report.answers and not with_outputs:
        return (
            f"dataset {name!r} holds {report.answers:,} answers: say --with-outputs "
            "(with_outputs=True) to delete them too; they are kept aside until purged"
        )
    return None


async def delete_dataset(
    database: Database,
    name: str,
    *,
    with_outputs: bool = False,
    dry_run: bool = False,
    now: float | None = None,
) -> DeletionReport:
    """Delete dataset ``name``, keeping its rows aside for :func:`undo_delete`; with
    ``dry_run`` only say what would go. Refused (``ConfigError``, nothing changed) while
    items of it run, and when it holds answers unless ``with_outputs``."""
    now = time.time() if now is None else now

    def run(conn: sa.Connection) -> DeletionReport:
        dataset_id, report = _surveyed(conn, name, lock=not dry_run)
        if dry_run:
            return report
        refused = refusal(report, with_outputs)
        if refused is not None:
            raise ConfigError(f"{refused}; nothing deleted")
        counts = orjson.dumps({"states": report.states, "rows": report.rows}).decode()
        deletion_id = conn.execute(
            deletions.insert()
            .values(dataset_id=dataset_id, name=name, created_at=now, counts=counts)
            .returning(deletions.c.id)
        ).scalar_one()
        for table in DELETED_FROM:
            kept = KEPT[table.name]
            columns = [c.name for c in table.columns]
            chosen = sa.select(sa.literal(deletion_id, sa.Integer), *table.c).where(
                _rows_of(table, dataset_id)
            )
            conn.execute(kept.insert().from_select(["deletion_id", *columns], chosen))
        for table in reversed(DELETED_FROM):
            conn.execute(table.delete().where(_rows_of(table, dataset_id)))
        return DeletionReport(name, deletion_id, report.states, report.answers, report.rows)

    if dry_run:
        async with database.read() as conn:
            return await conn.run_sync(run)
    async with database.write() as conn:
        return await conn.run_sync(run)


def _kept_deletion(conn: sa.Connection, name: str) -> Any:
    """The latest deletion of ``name`` still kept aside."""
    row = conn.execute(
        sa.select(deletions)
        .where(
            deletions.c.name == name,
            deletions.c.undone_at.is_(None),
            deletions.c.purged_at.is_(None),
        )
        .order_by(deletions.c.id.desc())
        .limit(1)
    ).first()
    if row is None:
        raise ConfigError(f"no deleted dataset {name!r} is kept: nothing to bring back")
    return row


def _shift(conn: sa.Connection, table: sa.Table, deletion_id: int) -> int:
    """How far the kept rows' ids must move so that none meets a row added since (SQLite
    gives a deleted highest id out again; PostgreSQL never does): 0 when none does."""
    kept = KEPT[table.name]
    mine = sa.select(kept.c.id).where(kept.c.deletion_id == deletion_id)
    taken = conn.execute(sa.select(table.c.id).where(table.c.id.in_(mine)).limit(1)).first()
    if taken is None:
        return 0
    top = conn.execute(sa.select(sa.func.max(table.c.id))).scalar_one()
    low = conn.execute(sa.select(sa.func.min(kept.c.id)).where(kept.c.deletion_id == deletion_id))
    return int(top) - int(low.scalar_one()) + 1


def _put_back(conn: sa.Connection, deletion_id: int) -> dict[str, int]:
    """Every kept row of the deletion into its table, parents first; ids moved only where
    rows added since took them. The rows put back, by table."""
    shifts = {
        "dataset_id": _shift(conn, datasets, deletion_id),
        "item_id": _shift(conn, items, deletion_id),
    }
    own = {"datasets": "dataset_id", "items": "item_id"}
    own_shift = {**{t: shifts[c] for t, c in own.items()}}
    own_shift["attempt_errors"] = _shift(conn, attempt_errors, deletion_id)
    counts: dict[str, int] = {}
    for table in DELETED_FROM:
        kept = KEPT[table.name]
        values = []
        for column in table.columns:
            by = own_shift.get(table.name, 0) if column.name == "id" else shifts.get(column.name, 0)
            values.append(kept.c[column.name] + by if by else kept.c[column.name])
        chosen = sa.select(*values).where(kept.c.deletion_id == deletion_id)
        result = conn.execute(table.insert().from_select([c.name for c in table.columns], chosen))
        counts[table.name] = max(result.rowcount or 0, 0)
        conn.execute(kept.delete().where(kept.c.deletion_id == deletion_id))
    return counts


async def undo_delete(
    database: Database, name: str, *, dry_run: bool = False, now: float | None = None
) -> DeletionReport:
    """Bring back the latest deletion of dataset ``name`` still kept: every row as it was
    (refused while another dataset has the name). ``dry_run``: only say what."""
    now = time.time() if now is None else now

    def run(conn: sa.Connection) -> DeletionReport:
        row = _kept_deletion(conn, name)
        taken = conn.execute(sa.select(datasets.c.id).where(datasets.c.name == name)).first()
        if taken is not None:
            raise ConfigError(
                f"a dataset named {name!r} was made since the deletion: delete it first "
                "(`orchestrator dataset delete`), then bring the old one back; nothing changed"
            )
        counts = orjson.loads(row.counts)
        if dry_run:
            return DeletionReport(name, row.id, counts["states"], rows=counts["rows"])
        rows = _put_back(conn, row.id)
        conn.execute(deletions.update().where(deletions.c.id == row.id).values(undone_at=now))
        return DeletionReport(name, row.id, counts["states"], rows=rows)

    if dry_run:
        async with database.read() as conn:
            return await conn.run_sync(run)
    async with database.write() as conn:
        return await conn.run_sync(run)


async def purge_deleted(database: Database, name: str, *, now: float | None = None) -> int:
    """Drop for good the kept rows of every deletion of dataset ``name`` not undone; the
    deletions purged (0: none was kept)."""
    now = time.time() if now is None else now

    def run(conn: sa.Connection) -> int:
        ids = list(
            conn.execute(
                sa.select(deletions.c.id).where(
                    deletions.c.name == name,
                    deletions.c.undone_at.is_(None),
                    deletions.c.purged_at.is_(None),
                )
            ).scalars()
        )
        for kept in KEPT.values():
            conn.execute(kept.delete().where(kept.c.deletion_id.in_(ids)))
        conn.execute(deletions.update().where(deletions.c.id.in_(ids)).values(purged_at=now))
        return len(ids)

    async with database.write() as conn:
        return await conn.run_sync(run)


__all__ = ["DeletionReport", "delete_dataset", "purge_deleted", "refusal", "undo_delete"]
