"""Opening the database: URL resolution, SQLite pragmas, and the single-writer discipline.

SQLite choices, and why:

* ``journal_mode=WAL``: readers (``status``, ``export``) never block the writer.
* ``synchronous=NORMAL`` by default: in WAL mode a commit survives a crash of the
  process (kill -9) and of the OS kernel; only a power cut can lose the last few
  commits, never corrupt the file. A lost commit means an item is generated again, not
  a duplicate output. Set ``ORCHESTRATOR_SQLITE_SYNCHRONOUS=FULL`` to fsync every commit.
* ``busy_timeout``: other processes' write transactions are waited for, not failed.
* ``BEGIN IMMEDIATE`` for every write transaction: a deferred transaction that reads
  then writes gets SQLITE_BUSY at once, which no timeout can save. The driver's own
  BEGIN is switched off and the store emits its own.
* One writer per process: an ``asyncio.Lock`` serialises write transactions, so the
  process never competes with itself for the file lock; callers batch their rows.
* ``journal_size_limit`` and periodic checkpoints keep the WAL file from growing over a
  30-hour run.

PostgreSQL (``postgresql://…``, through asyncpg): every transaction is READ COMMITTED.
Many worker processes, on many hosts, write at once; nothing serialises them but row
locks. A claim picks its rows with ``FOR UPDATE SKIP LOCKED`` (two claims never take the
same row, and never wait for each other), a dataset's concurrency cap is counted under
a lock on the dataset's row, and every renew, complete, retry, fail, release and advance
is fenced in its UPDATE (id, lease token, ``state = 'running'``), which PostgreSQL
re-checks against the row's latest version.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import queue
import random
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
import structlog
from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from orchestrator.errors import StorageError
from orchestrator.store.reader import not_a_file, read_uri

log = structlog.get_logger("orchestrator.store")

T = TypeVar("T")

DEFAULT_DB = "orchestrator.db"
BUSY_TIMEOUT_MS = 30_000
_LOCKED_RETRIES = 20


def resolve_url(db: str | os.PathLike[str] | None) -> URL:
    """Accept a plain path or an SQLAlchemy URL, and pick the async driver for it."""
    text = os.fspath(db) if db is not None else os.environ.get("ORCHESTRATOR_DB") or DEFAULT_DB
    if "://" not in text:
        return URL.create("sqlite+aiosqlite", database=str(Path(text).expanduser()))
    url = make_url(text)
    if url.get_backend_name() == "sqlite":
        return url.set(drivername="sqlite+aiosqlite")
    if url.get_backend_name() == "postgresql":
        return url.set(drivername="postgresql+asyncpg")
    raise StorageError(f"unsupported database URL {url.render_as_string(hide_password=True)!r}")


def describe(url: URL) -> str:
    """A URL as it may be shown to users: no password."""
    if url.get_backend_name() == "sqlite":
        return str(url.database)
    return url.render_as_string(hide_password=True)


def storage_error(exc: BaseException, url: URL) -> StorageError:
    """Turn a driver error into a message a user can act on."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip() or type(orig).__name__
    where = describe(url)
    hints = {
        "file is not a database": "the file is not an orchestrator (SQLite) database",
        "readonly database": "the database file is read-only (check its permissions)",
        "database or disk is full": "the disk holding the database is full",
        "unable to open database file": "cannot open the database file",
        "disk i/o error": "disk I/O error (is the disk full or failing?)",
    }
    if url.get_backend_name() == "sqlite" and "unable to open" in text.lower():
        hints["unable to open database file"] = _open_failure(str(url.database or ""))
    for needle, hint in hints.items():
        if needle in text.lower():
            return StorageError(f"{where}: {hint} ({text})")
    return StorageError(f"{where}: {text}")


def _open_failure(path: str) -> str:
    """Say why SQLite could not open a file (it only says that it could not)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"directory {folder} does not exist"
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "the database is on a read-only file system (WAL mode needs to write beside it)"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "the database file or its directory is read-only (check permissions)"
    return "cannot open the database file"


def _file_identity(url: URL) -> tuple[int, int] | None:
    """The (device, inode) of an SQLite database file, to tell it from a later one."""
    path = str(url.database or "")
    if path in ("", ":memory:") or path.startswith("file:"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _is_locked(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", exc)
    return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig).lower()


def _sqlite_synchronous() -> str:
    value = os.environ.get("ORCHESTRATOR_SQLITE_SYNCHRONOUS", "NORMAL").upper()
    if value not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
        raise StorageError(f"ORCHESTRATOR_SQLITE_SYNCHRONOUS must be NORMAL or FULL, not {value!r}")
    return value


def _prepare_sqlite_file(path: str) -> None:
    """Create the database file readable by its owner only, before SQLite creates it."""
    if path in ("", ":memory:"):
        return
    if os.path.exists(path):
        problem = not_a_file(path)
        if problem:
            raise StorageError(problem)
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            raise StorageError(f"{path}: {parent} is a file, not a directory")
        raise StorageError(f"{path}: directory {parent} does not exist")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageError(
            f"{os.path.abspath(path)}: cannot create the database: {_create_failure(parent, exc)}"
            "; choose a writable place with --db (or ORCHESTRATOR_DB)"
        ) from None


def _create_failure(folder: str, exc: OSError) -> str:
    """Why a new database file could not be made in ``folder``."""
    if exc.errno == errno.EROFS:
        return f"{folder} is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write in {folder}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk holding {folder} is full"
    return exc.strerror or str(exc)


class Database:
    """An async engine plus the rules for using it: one writer, immediate transactions."""

    def __init__(self, engine: AsyncEngine, url: URL, *, read_only: bool = False):
        self.engine = engine
        self.url = url
        self.is_sqlite = url.get_backend_name() == "sqlite"
        #: Opened to read only (``create_database(read_only=True)``): writes are refused.
        self.read_only = read_only
        self._write_lock = asyncio.Lock()
        self._sync_engine: sa.Engine | None = None
        self._writer_thread: _WriterThread | None = None
        self._file = _file_identity(url) if self.is_sqlite else None
        self._gone: StorageError | None = None
        # Reads given up before their end, being ended on the loop (store.access.Batches).
        self.reads_ending: set[asyncio.Future[None]] = set()
        if self._file is not None:
            event.listen(engine.sync_engine, "do_connect", self._before_connect)

    def _before_connect(self, *_args: Any) -> None:
        """Every new connection opens the path again: only while it names the file opened
        (one on a file moved over it would read this file's WAL into that one)."""
        self.check_file()

    def check_file(self) -> None:
        """Raise ``StorageError`` once the path no longer names the SQLite file opened.

        SQLite goes on writing to a deleted file without a word, and a file moved over
        the path is opened by every new connection together with this file's WAL, which
        corrupts it. Once this has raised, every later write or read raises the same
        error: nothing more is written anywhere.
        """
        if self._gone is not None:
            raise self._gone
        if self._file is None:
            return
        path = str(self.url.database)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            what = "was deleted"
        except OSError:
            return  # cannot tell (a permission change, say): the next look may
        else:
            if (st.st_dev, st.st_ino) == self._file:
                return
            what = "was replaced by another file"
        self._gone = StorageError(
            f"{os.path.abspath(path)}: the database file {what} while in use; nothing more "
            "was written to it: restore the file (or point --db at the right one) and start again"
        )
        raise self._gone

    @property
    def where(self) -> str:
        return describe(self.url)

    def _check_writable(self) -> None:
        if self._gone is not None:
            raise self._gone
        if self.read_only:
            raise StorageError(f"{self.where}: opened to read only; nothing was written")

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction: serialised in this process, BEGIN IMMEDIATE on SQLite.

        A lock held by another process longer than ``busy_timeout`` is retried with
        jittered backoff rather than surfacing "database is locked".
        """
        self._check_writable()
        async with self._write_lock:
            conn = await self._begin_write()
            try:
                yield conn
                await conn.commit()
            except DBAPIError as exc:
                await _quiet_rollback(conn)
                raise storage_error(exc, self.url) from exc
            except BaseException:
                await _quiet_rollback(conn)
                raise
            finally:
                await conn.close()

    async def run_write(self, fn: Callable[[sa.Connection], T]) -> T:
        """Run ``fn`` in one write transaction, with the same rules as :meth:`write`.

        For the hot transitions (a worker's rounds of outcomes and claims). ``fn`` is
        plain synchronous SQLAlchemy: on SQLite the whole transaction runs in one hop to
        a writer thread with its own connection, instead of one hop to the driver's thread
        per statement (which costs more than SQLite does); on PostgreSQL it runs through
        the async connection's ``run_sync``.
        """
        if not self.is_sqlite or self.url.database in (None, "", ":memory:"):
            async with self.write() as conn:
                return await conn.run_sync(fn)
        self._check_writable()
        async with self._write_lock:
            if self._writer_thread is None:
                self._writer_thread = _WriterThread("sqlite-writer")
            for attempt in range(_LOCKED_RETRIES):
                try:
                    return await self._writer_thread.run(self._write_in_thread, fn)
                except OperationalError as exc:
                    if not _is_locked(exc) or attempt == _LOCKED_RETRIES - 1:
                        raise storage_error(exc, self.url) from exc
                    log.warning("db_locked_retry", attempt=attempt + 1)
                    await asyncio.sleep(random.uniform(0.05, 0.5))
                except DBAPIError as exc:
                    raise storage_error(exc, self.url) from exc
        raise AssertionError("unreachable")

    def _write_in_thread(self, fn: Callable[[sa.Connection], T]) -> T:
        if self._sync_engine is None:
            url = self.url.set(drivername="sqlite+pysqlite")
            self._sync_engine = sa.create_engine(
                url,
                poolclass=sa.pool.StaticPool,
                connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            )
            _install_sqlite_hooks(self._sync_engine)
            if self._file is not None:
                event.listen(self._sync_engine, "do_connect", self._before_connect)
        with self._sync_engine.begin() as conn:
            return fn(conn)

    def _empty_wal(self) -> None:
        """Fold the WAL into the file this database opened, and empty it, through the
        connection that still has that file open.

        The WAL keeps its name when the database file is deleted or replaced, and SQLite
        does not checkpoint a moved file on close: a file moved over the path would be
        read with this file's pages, and corrupted by them, by the next process to open it.
        """
        assert self._sync_engine is not None
        with contextlib.suppress(Exception):
            raw = self._sync_engine.raw_connection()  # the open one: StaticPool
            try:
                cursor = raw.cursor()
                cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                cursor.close()
            finally:
                raw.close()

    async def _begin_write(self) -> AsyncConnection:
        for attempt in range(_LOCKED_RETRIES):
            conn = await self._connect()
            try:
                await conn.begin()
                return conn
            except OperationalError as exc:
                await conn.close()
                if not (self.is_sqlite and _is_locked(exc)) or attempt == _LOCKED_RETRIES - 1:
                    raise storage_error(exc, self.url) from exc
                log.warning("db_locked_retry", attempt=attempt + 1)
                await asyncio.sleep(random.uniform(0.05, 0.5))
            except DBAPIError as exc:
                await conn.close()
                raise storage_error(exc, self.url) from exc
        raise AssertionError("unreachable")

    async def _connect(self) -> AsyncConnection:
        try:
            return await self.engine.connect()
        except DBAPIError as exc:
            raise storage_error(exc, self.url) from exc

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only snapshot (deferred BEGIN on SQLite, so it never takes the write lock)."""
        conn = await self.begin_read()
        try:
            yield conn
        except DBAPIError as exc:
            raise storage_error(exc, self.url) from exc
        finally:
            await conn.close()

    async def begin_read(self) -> AsyncConnection:
        """A connection in a read-only snapshot, for a read held across the caller's own
        awaits (``store.access.Batches``): closing it ends the snapshot."""
        if self._gone is not None:
            raise self._gone
        try:
            conn = await self._reader.connect()
        except DBAPIError as exc:
            raise storage_error(exc, self.url) from exc
        try:
            await conn.begin()
        except BaseException as exc:
            await conn.close()
            if isinstance(exc, DBAPIError):
                raise storage_error(exc, self.url) from exc
            raise
        return conn

    @property
    def _reader(self) -> AsyncEngine:
        """Connections for one snapshot: a deferred BEGIN on SQLite; REPEATABLE READ on
        PostgreSQL, whose READ COMMITTED (the queue's level) would let each statement see
        what committed since the one before, and an export's card count answers its
        rows do not hold. A read-only transaction there never fails to serialise."""
        if self.url.get_backend_name() == "postgresql":
            return self.engine.execution_options(isolation_level="REPEATABLE READ")
        return self.engine.execution_options(sqlite_begin="DEFERRED")

    async def checkpoint(self, mode: str = "PASSIVE") -> None:
        """Fold the WAL back into the database file so that it stops growing."""
        if not self.is_sqlite or self._gone is not None:
            return

        def run(sync_conn: sa.Connection) -> tuple[int, int, int]:
            # On the driver's connection, outside any transaction: a checkpoint inside
            # BEGIN IMMEDIATE fails with "database table is locked".
            cursor = sync_conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cursor.execute(f"PRAGMA wal_checkpoint({mode})")
                return tuple(cursor.fetchone())  # type: ignore[return-value]
            finally:
                cursor.close()

        try:
            async with self._write_lock, self.engine.connect() as conn:
                busy, wal_pages, moved = await conn.run_sync(run)
            log.debug("checkpoint", mode=mode, busy=busy, wal_pages=wal_pages, moved=moved)
        except (DBAPIError, sqlite3.Error) as exc:
            # Best effort: a busy database checkpoints next time.
            log.warning("checkpoint_skipped", mode=mode, error=str(getattr(exc, "orig", exc)))

    async def refresh_statistics(self, *tables: str) -> None:
        """After a bulk write, on PostgreSQL: ANALYZE these tables.

        Until autovacuum first looks (a minute or more), a table just loaded is planned
        from guesses: the claim of a 100,000-item dataset then sorted every pending row
        (40 ms a claim, where the index in claim order takes 1 ms). SQLite picks these
        plans by rule, from the indexes alone: nothing to do there. Best effort: the
        statistics only speed the plans up.
        """
        if self.is_sqlite or self._gone is not None or self.read_only:
            return
        try:
            async with self.engine.connect() as conn:
                for table in tables:
                    await conn.exec_driver_sql(f"ANALYZE {table}")
                await conn.commit()
        except DBAPIError as exc:
            log.warning("analyze_skipped", tables=list(tables), error=str(exc.orig)[:200])

    async def close(self) -> None:
        if self.reads_ending:
            await asyncio.gather(*self.reads_ending, return_exceptions=True)
        if self._writer_thread is not None:
            if self._sync_engine is not None:
                if self._gone is not None:
                    await self._writer_thread.run(self._empty_wal)
                await self._writer_thread.run(self._sync_engine.dispose)
            self._writer_thread.shutdown()
            self._writer_thread = None
        await self.engine.dispose()


class _WriterThread:
    """The one thread an SQLite file's write transactions run on, in the order given.

    A round's hop to it costs the event loop a third of what ``run_in_executor`` costs
    (no concurrent future made and chained to an asyncio one: 10 against 30 µs of the
    loop's CPU, measured), and a worker makes a few hundred hops a second. A daemon: a
    process that ends without closing its database is not held up by an idle writer.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on the thread; the future has its result or its exception (a
        cancelled future does not stop a transaction under way: it is let finish)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def shutdown(self) -> None:
        """Let the jobs given so far finish, then end the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # handed to the awaiting task, whatever it is
                outcome = (None, exc)
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def insert_many(
    conn: AsyncConnection, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> None:
    """INSERT rows given as tuples straight through the driver's executemany.

    For the hot inserts (a million enqueued lines, every completed output): building and
    binding a dict per row through the SQL layer costs more than the database does.
    """
    await conn.exec_driver_sql(_insert_sql(conn.dialect, table, columns), rows)


def insert_rows(
    conn: sa.Connection, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> None:
    """:func:`insert_many` for a synchronous connection (see :meth:`Database.run_write`)."""
    conn.exec_driver_sql(_insert_sql(conn.dialect, table, columns), rows)


def _insert_sql(dialect: sa.Dialect, table: str, columns: tuple[str, ...]) -> str:
    quote = dialect.identifier_preparer.quote
    style = dialect.paramstyle
    if style == "qmark":
        marks = ["?"] * len(columns)
    elif style in ("numeric", "numeric_dollar"):
        prefix = "$" if style == "numeric_dollar" else ":"
        marks = [f"{prefix}{i}" for i in range(1, len(columns) + 1)]
    else:
        marks = ["%s"] * len(columns)
    return (
        f"INSERT INTO {quote(table)} ({', '.join(quote(c) for c in columns)}) "
        f"VALUES ({', '.join(marks)})"
    )


async def _quiet_rollback(conn: AsyncConnection) -> None:
    with contextlib.suppress(Exception):
        await conn.rollback()


def create_database(
    db: str | os.PathLike[str] | URL | None = None, *, read_only: bool = False
) -> Database:
    """The database ``db`` names, not connected yet.

    ``read_only``: an SQLite file is read as ``store.reader.read_uri`` says, with
    ``query_only`` on and none of the writer's pragmas (no switch to WAL): reading it
    changes nothing, and a missing file is not created. Writes are refused.
    """
    url = db if isinstance(db, URL) else resolve_url(db)
    kwargs: dict[str, Any] = {}
    if url.get_backend_name() == "sqlite":
        path = str(url.database or "")
        if not read_only:
            _prepare_sqlite_file(path)
        elif path not in ("", ":memory:") and not path.startswith("file:"):
            read_uri(path)  # a directory, or a WAL that cannot be read, is said at once
        kwargs["connect_args"] = {"timeout": BUSY_TIMEOUT_MS / 1000}
    elif url.get_backend_name() == "postgresql":
        # READ COMMITTED, said outright: each statement sees what was committed before it
        # began. Claims lock the rows they take (FOR UPDATE SKIP LOCKED) and every
        # fenced transition re-checks its row's lease when it updates it, so many
        # processes on many hosts share one queue without serialising on a lock.
        kwargs["isolation_level"] = "READ COMMITTED"
    engine = create_async_engine(url, **kwargs)
    if url.get_backend_name() == "sqlite":
        _install_sqlite_hooks(engine.sync_engine, read_only=read_only)
    return Database(engine, url, read_only=read_only)


def _install_sqlite_hooks(engine: sa.Engine, *, read_only: bool = False) -> None:
    pragmas = (
        f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}",
        *(("PRAGMA query_only = ON",) if read_only else _writer_pragmas()),
        "PRAGMA foreign_keys = ON",
        # 8 MiB a connection: the hot pages (the front of the pending index, the
        # rows in flight, the end of outputs) fit, and a worker's memory stays flat
        # however many items are done (a larger cache only filled up with them).
        "PRAGMA cache_size = -8192",
    )

    if read_only:

        @event.listens_for(engine, "do_connect")
        def _read_only_open(_dialect: Any, _record: Any, cargs: list[Any], cparams: Any) -> None:
            path = str(engine.url.database or "")
            if path not in ("", ":memory:") and not path.startswith("file:"):
                cargs[:1] = [read_uri(path)]
                cparams["uri"] = True

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver; _on_begin emits our own BEGIN.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        for pragma in pragmas:
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        conn.exec_driver_sql(f"BEGIN {mode}")


def _writer_pragmas() -> tuple[str, ...]:
    """What a connection that may write sets: WAL, and how hard a commit is synced."""
    return (
        "PRAGMA journal_mode = WAL",
        f"PRAGMA synchronous = {_sqlite_synchronous()}",
        "PRAGMA journal_size_limit = 67108864",
    )
