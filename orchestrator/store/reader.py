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

from orchestrator.errors import StorageError
from orchestrator.store.revision import SCHEMA_REVISION

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


def not_a_file(path: str) -> str | None:
    """What is wrong with ``path`` as a database file before SQLite is asked, or None.

    SQLite opens a directory and then fails on it as a "disk I/O error"; said plainly here.
    """
    if os.path.isdir(path):
        return (
            f"{path}: is a directory, not a database file (--db names the file, "
            f"e.g. {os.path.join(path, DEFAULT_DB)})"
        )
    return None


def read_uri(path: str) -> str:
    """The URI that reads the existing SQLite file ``path`` without changing it.

    * A writable directory: ``mode=rw``, with ``query_only`` set by the caller. A WAL
      database needs its ``-wal`` and ``-shm`` files to be read; a read-write connection
      removes them again when it is the last to close, where a ``mode=ro`` one leaves them
      behind. Nothing is written to the file itself.
    * A directory that cannot be written (a read-only file system, or no permission):
      ``mode=ro``. A WAL database whose ``-shm`` exists is read through it (a writer on
      another mount may be live). Without one, nobody has the file open: it is read as
      ``immutable``, unless its ``-wal`` holds commits not yet in the file (a writer that
      crashed), which only a writable directory can fold in; then refused.
    """
    problem = not_a_file(path)
    if problem:
        raise StorageError(problem)
    uri = Path(path).absolute().as_uri()
    folder = os.path.dirname(os.path.abspath(path))
    if os.access(folder, os.W_OK) and os.access(path, os.W_OK):
        return f"{uri}?mode=rw"
    if os.path.exists(f"{path}-shm") or not _wal_mode(path):
        return f"{uri}?mode=ro"
    wal = f"{path}-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        raise StorageError(
            f"{path}: its write-ahead log {wal} holds commits not yet in the database file, "
            "and its directory cannot be written (a read-only file system, or no "
            "permission), so they cannot be read: read it where it can be written (mount "
            "it read-write, or copy the file together with its -wal file elsewhere)"
        )
    return f"{uri}?mode=ro&immutable=1"


def _wal_mode(path: str) -> bool:
    """Whether the file's header says WAL mode (bytes 18 and 19 are 2)."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(20)
    except OSError:
        return False
    return len(header) == 20 and header[18:20] == b"\x02\x02"


def connect(path: str, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """An sqlite3 connection that reads ``path`` and cannot write (:func:`read_uri`).

    Raises ``StorageError`` for a path that cannot be read so, ``sqlite3.Error`` for what
    SQLite refuses.
    """
    conn = sqlite3.connect(
        read_uri(path),
        uri=True,
        isolation_level=None,
        timeout=BUSY_TIMEOUT_MS / 1000,
        check_same_thread=check_same_thread,
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def open_reader(path: str, *, check_same_thread: bool = True) -> Reader | None:
    """A read transaction on an existing SQLite file at the current schema, else None.

    Opened by :func:`connect`: a missing file is not created (the store decides that), and
    nothing here can write.
    """
    if not os.path.exists(path):
        return None
    try:
        conn = connect(path, check_same_thread=check_same_thread)
    except (sqlite3.Error, StorageError):
        return None
    try:
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
