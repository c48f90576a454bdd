"""The SQL the transitions share: statements run on the connection under a write
transaction, the lease fence every change of a leased item goes through, and bounded
parameter lists.

Apart from the transitions themselves so that the claims, the write rounds and the
requeue moves all build on one gate and one way of running a statement.
"""

from __future__ import annotations

import dataclasses
import functools
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

# Bound parameter lists so one statement stays well under SQLite's variable limit.
CHUNK = 400


def chunks(seq: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


class Statements:
    """Plain SQL, written once, in a write transaction the caller holds.

    On SQLite through pysqlite the worker's rounds (claim, complete, renew) run on the
    sqlite3 connection under ``conn``: for statements this small, binding them through
    the SQL layer costs more than SQLite takes to run them. Every other backend runs the
    same text through SQLAlchemy. Parameters are ``:name``, which both take.
    """

    def __init__(self, conn: sa.Connection):
        self.conn = conn
        self.raw = _sqlite_driver(conn)
        self.postgres = conn.dialect.name == "postgresql"

    def among(self, column: str, ids: Sequence[int]) -> tuple[str, dict[str, Any]]:
        """``column`` is one of the item ids ``ids``: on PostgreSQL one array parameter
        (``:fi``), so the text is the same for any number of ids and the driver prepares
        it once, not once per size; elsewhere ``IN`` a list of parameters (``:i0``…)."""
        if self.postgres:
            return f"{column} = ANY({_INTS})", {"fi": list(ids)}
        listed, params = placeholders("i", ids)
        return f"{column} IN ({listed})", params

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        if self.raw is not None:
            return self.raw.execute(sql, params).fetchall()
        result = self.conn.execute(_text(sql), params)
        return [tuple(r) for r in result] if result.returns_rows else []


@functools.lru_cache(maxsize=256)
def _text(sql: str) -> sa.TextClause:
    """A statement's text as SQLAlchemy takes it, parsed for its ``:name`` parameters
    once per text rather than once per execution."""
    return sa.text(sql)


def _sqlite_driver(conn: sa.Connection) -> sqlite3.Connection | None:
    """The sqlite3 connection under ``conn``, when there is one."""
    if conn.dialect.name == "sqlite" and conn.dialect.driver == "pysqlite":
        return conn.connection.driver_connection  # type: ignore[return-value]
    return None


def placeholders(prefix: str, values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``:p0, :p1, …`` for a list of values, and their parameters."""
    params = {f"{prefix}{n}": v for n, v in enumerate(values)}
    return ", ".join(f":{k}" for k in params), params


@dataclass(frozen=True, slots=True)
class Expr:
    """A value computed from the row: its SQL, and the same rule applied to a row read
    out of the database (``db copy`` puts items back with it)."""

    sql: str
    apply: Callable[[Mapping[str, Any]], Any]


def _fence(st: Statements, pairs: Sequence[tuple[int, str]]) -> tuple[str, dict[str, Any]]:
    """The fence: these rows, still running, each under its own lease token.

    ``id IN (…)`` makes the lookup a primary-key search; the ``(id, token)`` row values
    then keep only the rows whose lease is still the one the caller holds (SQLite takes
    a row-value list as VALUES, PostgreSQL as a list of rows). A row holding a token is
    running (the ``lease_iff_running`` check), so the state is not tested again: a test
    of it lets PostgreSQL's planner read ``ix_items_running`` too, whose entries for
    rows no longer running pile up between vacuums (20,000 read per round after a
    20,000-item run, where the primary key reads the round's own).
    """
    among, params = st.among("id", [item_id for item_id, _ in pairs])
    if st.postgres:  # the pairs as two arrays, for the same reason as ``among``'s
        listed = f"SELECT * FROM unnest({_INTS}, CAST(:ft AS varchar[]))"
        tokens: dict[str, Any] = {"ft": [token for _, token in pairs]}
    else:
        listed = "VALUES " + ", ".join(f"(:i{n}, :t{n})" for n in range(len(pairs)))
        tokens = {f"t{n}": token for n, (_, token) in enumerate(pairs)}
    where = f"{among} AND (id, lease_token) IN ({listed})"
    return where, params | tokens


#: Item ids as one PostgreSQL array parameter (``Statements.among``, the fence).
_INTS = "CAST(:fi AS integer[])"


def fenced_update(
    conn: sa.Connection, pairs: Sequence[tuple[int, str]], values: Mapping[str, Any]
) -> set[int]:
    """Apply ``values`` to the rows still held under these leases; return their ids.

    Every transition of a leased item goes through here: the state machine's one gate.
    """
    st = Statements(conn)
    assignments = ", ".join(
        f"{column} = {v.sql}" if isinstance(v, Expr) else f"{column} = :v_{column}"
        for column, v in values.items()
    )
    bound = {f"v_{c}": v for c, v in values.items() if not isinstance(v, Expr)}
    changed: set[int] = set()
    for chunk in chunks(pairs, CHUNK // 2):
        where, params = _fence(st, chunk)
        sql = f"UPDATE items SET {assignments} WHERE {where} RETURNING id"
        changed.update(row[0] for row in st.rows(sql, bound | params))
    return changed


def add_counts(
    conn: sa.Connection, table: str, keys: tuple[str, ...], rows: Sequence[Any], now: float
) -> None:
    """Add ``rows`` (dataclasses whose fields are the table's columns: ``keys``, then
    counters) to a table of counters, in the caller's write transaction: one upsert that
    SQLite and PostgreSQL both take, so that concurrent writers add rather than overwrite."""
    if not rows:
        return
    sql, columns = _counts_upsert(table, keys, type(rows[0]))
    params = [
        {**{c: _plain(getattr(r, c)) for c in columns}, "updated_at": now}
        for r in sorted(rows, key=lambda r: tuple(getattr(r, k) for k in keys))
    ]
    conn.execute(sql, params)


@functools.cache
def _counts_upsert(table: str, keys: tuple[str, ...], row: type) -> tuple[sa.TextClause, list[str]]:
    """The upsert of ``add_counts`` and its columns, built once per table (a write round
    runs it)."""
    columns = [f.name for f in dataclasses.fields(row)]
    counters = [c for c in columns if c not in keys]
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)}, updated_at)"
        f" VALUES ({', '.join(':' + c for c in columns)}, :updated_at)"
        f" ON CONFLICT ({', '.join(keys)}) DO UPDATE SET "
        + "".join(f"{c} = {table}.{c} + excluded.{c}, " for c in counters)
        + "updated_at = excluded.updated_at"
    )
    return sa.text(sql), columns


def _plain(value: Any) -> Any:
    """A bool as the integer column that holds it."""
    return int(value) if isinstance(value, bool) else value
