"""A read-only snapshot of an SQLite database through plain ``sqlite3``, without SQLAlchemy.

``status`` and ``export`` only read. On an SQLite file whose schema is already current
they need none of the async engine, the connection pool or alembic: importing those
costs more than ``status`` spends in its queries, and streaming a million rows through
the async layer costs more than SQLite spends reading them. Anything this module cannot
vouch for (a URL for another database, a missing file, a schema that is behind, newer or
absent, a file that is not a database) is left to the full store, which creates,
upgrades or explains as it always has.

Every read query of the store is written once, over :class:`Rows`: :class:`Reader` is
its sqlite3 adapter, :class:`EngineRows` its SQLAlchemy one (a synchronous connection,
as ``run_sync`` hands it over). ``store.access`` chooses between them.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Protocol

    import sqlalchemy as sa

from orchestrator.store.migrate import SCHEMA_REVISION

# The same defaults as orchestrator.store.engine (not imported: it loads SQLAlchemy).
DEFAULT_DB = "orchestrator.db"
BUSY_TIMEOUT_MS = 30_000
_SQLITE_SCHEMES = ("sqlite", "sqlite+aiosqlite", "sqlite+pysqlite")


def sqlite_path(db: str | os.PathLike[str] | None) -> str | None:
    """The SQLite file a ``--db`` value names, as the store shows it; None for anything else.

    Mirrors ``engine.resolve_url`` for plain paths and simple ``sqlite:///`` URLs; URLs
    with options, in-memory databases and other backends go through SQLAlchemy.
    """
    text = os.fspath(db) if db is not None else os.environ.get("ORCHESTRATOR_DB") or DEFAULT_DB
    if "://" not in text:
        return str(Path(text).expanduser()) if text not in ("", ":memory:") else None
    scheme, _, rest = text.partition("://")
    if scheme not in _SQLITE_SCHEMES or not rest.startswith("/") or any(c in rest for c in "?%"):
        return None
    # Taken as written, like SQLAlchemy does: no "~" expansion, no normalising.
    path = rest[1:]
    return path if path not in ("", ":memory:") else None


Params = Mapping[str, Any]
_NONE: Params = {}

if TYPE_CHECKING:
    # For type checkers only: building a Protocol class costs status a share of its time.
    class Rows(Protocol):
        """One read transaction, whichever driver: the seam every read query is written over.

        The SQL is plain text that SQLite and PostgreSQL read alike, with ``:name`` parameters.
        """

        where: str

        def fetch(self, sql: str, params: Params = _NONE) -> list[tuple[Any, ...]]:
            """Every row of ``sql``."""
            ...

        def stream(self, sql: str, params: Params, batch: int) -> Iterator[list[tuple[Any, ...]]]:
            """The rows of ``sql``, ``batch`` at a time, without holding them all."""
            ...


class Reader:
    """One deferred read transaction: every query sees the same committed state."""

    def __init__(self, conn: sqlite3.Connection, where: str):
        self.conn = conn
        self.where = where

    def fetch(self, sql: str, params: Params = _NONE) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def stream(self, sql: str, params: Params, batch: int) -> Iterator[list[tuple[Any, ...]]]:
        # The driver's fetchmany: no event loop or second thread to pass each row across.
        cursor = self.conn.execute(sql, params)
        try:
            while rows := cursor.fetchmany(batch):
                yield rows
        finally:
            cursor.close()

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("ROLLBACK")
        self.conn.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_reader(path: str, *, check_same_thread: bool = True) -> Reader | None:
    """A read transaction on an existing SQLite file at the current schema, else None.

    Opened ``mode=rw`` so that a missing file is not created (the store decides that),
    with ``query_only`` so that nothing here can write.
    """
    uri = Path(path).absolute().as_uri() + "?mode=rw"
    try:
        conn = sqlite3.connect(
            uri,
            uri=True,
            isolation_level=None,
            timeout=BUSY_TIMEOUT_MS / 1000,
            check_same_thread=check_same_thread,
        )
    except sqlite3.Error:
        return None
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        conn.execute("BEGIN")
        # The first read fixes the snapshot: the revision and the figures come from it.
        rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.Error:
        conn.close()
        return None
    if rows != [(SCHEMA_REVISION,)]:
        conn.close()
        return None
    return Reader(conn, path)


class EngineRows:
    """:class:`Rows` over a synchronous SQLAlchemy connection (any backend)."""

    def __init__(self, conn: sa.Connection, where: str):
        from sqlalchemy import text

        self.conn = conn
        self.where = where
        self._text = text

    def fetch(self, sql: str, params: Params = _NONE) -> list[tuple[Any, ...]]:
        result = self.conn.execute(self._text(sql), dict(params))
        return [tuple(r) for r in result.all()] if result.returns_rows else []

    def stream(self, sql: str, params: Params, batch: int) -> Iterator[list[tuple[Any, ...]]]:
        statement = self._text(sql).execution_options(yield_per=batch)
        result = self.conn.execute(statement, dict(params))
        try:
            for part in result.partitions(batch):
                yield [tuple(r) for r in part]
        finally:
            result.close()
