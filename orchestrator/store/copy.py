"""``orchestrator db copy``: move a run between databases (SQLite ⇄ PostgreSQL), mid-way.

Every table is copied whole, in primary-key order, in batches, with its ids: datasets,
param_sets, items, outputs, item_turns, attempt_errors, workers, and any table a later
migration added (samples, ...). Outputs are copied as stored, so an export from the
target is byte for byte the export from the source.

Rules:

* The source must be at this orchestrator's schema (``db upgrade`` it first); it is read
  in one snapshot, so a copy of a live database is consistent, but stop its workers
  first: what they commit after the snapshot is not copied.
* The target must be empty (no rows in any table); it is brought to the same schema,
  then filled in ONE transaction: a copy that fails leaves no row behind.
* Items that were ``running`` in the source are copied back as ``pending``, their lease
  cleared and the attempt given back: no worker on the target holds their lease, so the
  first worker there runs them again (an answer in flight when the source's workers
  stopped was never committed, so nothing is generated twice).
* Workers still marked live in the source are copied as stopped: they worked on the
  source.
* On PostgreSQL the id sequences are moved past the copied ids (``setval``), so rows
  added later get fresh ids.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.errors import ConfigError, SchemaError
from orchestrator.items.quality import NUL_CHAR
from orchestrator.store import open_database
from orchestrator.store.engine import Database, create_database, insert_many, resolve_url
from orchestrator.store.leases import put_back
from orchestrator.store.migrate import upgrade
from orchestrator.store.rounds import storable

log = structlog.get_logger("orchestrator.store.copy")

BATCH = 5000
# Parents before children (foreign keys); tables not named here follow, by name.
_ORDER = ("datasets", "param_sets", "items", "outputs", "item_turns", "attempt_errors", "workers")
_SKIP = {"alembic_version"}


@dataclass(slots=True)
class CopyReport:
    source: str
    target: str
    rows: dict[str, int] = field(default_factory=dict)
    requeued: int = 0
    """Items that were running in the source, copied as pending."""
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Table:
    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]
    convert: tuple[Callable[[Any], Any] | None, ...]


async def copy_database(
    source_url: str,
    target_url: str,
    *,
    batch: int = BATCH,
    progress: Callable[[str, int], None] | None = None,
) -> CopyReport:
    """Copy every row of ``source_url`` into the empty ``target_url`` (see the module)."""
    src_url, dst_url = resolve_url(source_url), resolve_url(target_url)
    if _same(src_url, dst_url):
        raise ConfigError("--from and --to name the same database")
    # Read as every read-only command reads: at this schema, and never changed; checked
    # before the target is touched.
    source = await open_database(source_url, mode="read")
    try:
        target = create_database(dst_url)
    except BaseException:
        await source.close()
        raise
    report = CopyReport(source=source.where, target=target.where)
    started = time.monotonic()
    try:
        await _refuse_non_empty(target)
        await upgrade(target)
        async with source.read() as read:
            tables = await read.run_sync(_tables)
            async with target.write() as write:
                target_tables = await write.run_sync(_tables)
                missing = [t for t in tables if t not in target_tables]
                if missing:
                    raise SchemaError(f"{target.where}: no table {', '.join(missing)}")
                for name in tables:
                    table = _merge(tables[name], target_tables[name])
                    n, requeued = await _copy_table(read, write, table, batch, progress)
                    report.rows[name] = n
                    report.requeued += requeued
                    log.info("db_copy_table", table=name, rows=n)
                await _check_counts(write, report.rows)
                if write.dialect.name == "postgresql":
                    await _reset_sequences(write, tables)
        await target.refresh_statistics(*tables)
    finally:
        await source.close()
        await target.close()
    report.seconds = round(time.monotonic() - started, 2)
    log.info("db_copy_done", rows=sum(report.rows.values()), requeued=report.requeued)
    return report


def _same(a: sa.URL, b: sa.URL) -> bool:
    if a.get_backend_name() == "sqlite" and b.get_backend_name() == "sqlite":
        return os.path.abspath(str(a.database)) == os.path.abspath(str(b.database))
    return a.set(drivername="x") == b.set(drivername="x")


async def _refuse_non_empty(target: Database) -> None:
    """A target holding any row is refused before anything is written to it."""

    def rows_in(conn: sa.Connection) -> list[str]:
        names = [n for n in sa.inspect(conn).get_table_names() if n not in _SKIP]
        quote = conn.dialect.identifier_preparer.quote
        return [
            n
            for n in names
            if conn.execute(sa.text(f"SELECT 1 FROM {quote(n)} LIMIT 1")).first() is not None
        ]

    async with target.read() as conn:
        full = await conn.run_sync(rows_in)
    if full:
        raise ConfigError(
            f"{target.where} is not empty (rows in {', '.join(sorted(full))}): "
            "copy into a new, empty database"
        )


def _tables(conn: sa.Connection) -> dict[str, _Table]:
    """The tables to copy, parents first, with their columns and primary keys."""
    inspector = sa.inspect(conn)
    names = [
        n for n in inspector.get_table_names() if n not in _SKIP and not n.startswith("sqlite_")
    ]
    ordered = [n for n in _ORDER if n in names] + sorted(n for n in names if n not in _ORDER)
    found = {}
    for name in ordered:
        columns = inspector.get_columns(name)
        key = tuple(inspector.get_pk_constraint(name)["constrained_columns"]) or (
            columns[0]["name"],
        )
        found[name] = _Table(
            name,
            tuple(c["name"] for c in columns),
            key,
            tuple(_converter(c["type"]) for c in columns),
        )
    return found


def _converter(kind: sa.types.TypeEngine[Any]) -> Callable[[Any], Any] | None:
    """How a value read from the source is made right for the target's column type.

    Text loses any U+0000 (to U+FFFD, as the queue stores it): an SQLite database written
    before the queue did so may hold one, and PostgreSQL text cannot.
    """
    if isinstance(kind, sa.String):
        return storable
    if isinstance(kind, sa.Boolean):
        return bool
    if isinstance(kind, sa.Float | sa.Numeric) and not isinstance(kind, sa.Integer):
        return float
    if isinstance(kind, sa.Integer):
        return int
    return None


def _merge(source: _Table, target: _Table) -> _Table:
    """The source's columns that the target has, converted to the target's types."""
    kinds = dict(zip(target.columns, target.convert, strict=True))
    columns = tuple(c for c in source.columns if c in kinds)
    return _Table(source.name, columns, source.key, tuple(kinds[c] for c in columns))


async def _copy_table(
    read: AsyncConnection,
    write: AsyncConnection,
    table: _Table,
    batch: int,
    progress: Callable[[str, int], None] | None,
) -> tuple[int, int]:
    quote = read.dialect.identifier_preparer.quote
    sql = (
        f"SELECT {', '.join(quote(c) for c in table.columns)} FROM {quote(table.name)}"
        f" ORDER BY {', '.join(quote(c) for c in table.key)}"
    )
    fix = _row_fix(table)
    copied = requeued = 0
    result = await read.stream(sa.text(sql).execution_options(yield_per=batch))
    async for part in result.partitions(batch):
        rows = [tuple(r) for r in part]
        if fix is not None:
            rows, n = fix(rows)
            requeued += n
        rows = [_convert(r, table.convert) for r in rows]
        await insert_many(write, table.name, table.columns, rows)
        copied += len(rows)
        if progress is not None:
            progress(table.name, copied)
        if copied % (batch * 20) == 0:
            log.info("db_copy_progress", table=table.name, rows=copied)
    return copied, requeued


def _convert(
    row: tuple[Any, ...], convert: tuple[Callable[[Any], Any] | None, ...]
) -> tuple[Any, ...]:
    return tuple(v if f is None or v is None else f(v) for v, f in zip(row, convert, strict=True))


def _row_fix(
    table: _Table,
) -> Callable[[list[tuple[Any, ...]]], tuple[list[tuple[Any, ...]], int]] | None:
    """Running items go back to pending (attempt given back); live workers stop; an
    answer holding a U+0000 in its text gets the ``nul`` flag (see ``_converter``)."""
    at = {c: i for i, c in enumerate(table.columns)}
    if table.name == "outputs" and {"content", "reasoning", "flags"} <= at.keys():
        text = (at["content"], at["reasoning"])

        def outputs_fix(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], int]:
            for i, row in enumerate(rows):
                if any(isinstance(row[c], str) and "\x00" in row[c] for c in text):
                    fixed = list(row)
                    fixed[at["flags"]] = (fixed[at["flags"]] or 0) | NUL_CHAR
                    rows[i] = tuple(fixed)
            return rows, 0

        return outputs_fix
    if table.name == "items" and {"state", "lease_token", "attempts"} <= at.keys():
        columns = table.columns

        def items_fix(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], int]:
            n = 0
            for i, row in enumerate(rows):
                if row[at["state"]] != "running":
                    continue
                # No worker on the target holds the lease: the queue's release rule.
                fixed = dict(zip(columns, row, strict=True))
                fixed.update((c, v) for c, v in put_back(fixed).items() if c in at)
                rows[i] = tuple(fixed.values())
                n += 1
            return rows, n

        return items_fix
    if table.name == "workers" and {"stopped_at", "heartbeat_at"} <= at.keys():

        def workers_fix(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], int]:
            stopped, beat = at["stopped_at"], at["heartbeat_at"]
            out = []
            for row in rows:
                if row[stopped] is None:
                    fixed = list(row)
                    fixed[stopped] = fixed[beat]
                    if "in_flight" in at:
                        fixed[at["in_flight"]] = 0
                    row = tuple(fixed)
                out.append(row)
            return out, 0

        return workers_fix
    return None


async def _check_counts(write: AsyncConnection, rows: dict[str, int]) -> None:
    """Before committing: every table holds exactly the rows copied into it."""
    quote = write.dialect.identifier_preparer.quote
    for name, n in rows.items():
        found = (await write.execute(sa.text(f"SELECT count(*) FROM {quote(name)}"))).scalar_one()
        if found != n:
            raise SchemaError(f"copy of {name}: {n} rows copied but {found} in the target")


async def _reset_sequences(write: AsyncConnection, tables: dict[str, _Table]) -> None:
    """Move each id sequence past the ids copied in (explicit ids do not advance it)."""
    for table in tables.values():
        if len(table.key) != 1:
            continue
        column = table.key[0]
        sequence = (
            await write.execute(
                sa.text("SELECT pg_get_serial_sequence(:table, :column)"),
                {"table": table.name, "column": column},
            )
        ).scalar_one()
        if sequence is None:
            continue
        quote = write.dialect.identifier_preparer.quote
        await write.execute(
            sa.text(
                f"SELECT setval(:sequence, coalesce((SELECT max({quote(column)})"
                f" FROM {quote(table.name)}), 0) + 1, false)"
            ),
            {"sequence": sequence},
        )
