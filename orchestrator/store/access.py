"""Which way a read goes: the one place the store chooses between its two adapters.

An SQLite file at the current schema is read through plain ``sqlite3``
(``store.reader.Reader``): no SQLAlchemy, no event loop, rows handed over 2,000 at a
time by the driver. Anything else (PostgreSQL, a URL with options, a file that is
behind) is read through the store's engine (``store.reader.EngineRows``), which also
reports what is wrong with a database the quick path steps aside from. The queries are
the same either way: they take a :class:`~orchestrator.store.reader.Rows`.

Neither SQLAlchemy nor asyncio is imported here until the engine's path is taken.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from orchestrator.store.reader import EngineRows, Reader, open_reader, sqlite_path

if TYPE_CHECKING:
    import asyncio

    from sqlalchemy.ext.asyncio import AsyncConnection

    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

T = TypeVar("T")


def fast_reader(
    db: str | os.PathLike[str] | Database | None, *, check_same_thread: bool = True
) -> Reader | None:
    """The sqlite3 adapter when ``db`` is an SQLite file at the current schema, else None
    (the engine's adapter is then the way: :func:`read`)."""
    if db is None or isinstance(db, str | os.PathLike):
        path = sqlite_path(db)
    elif db.is_sqlite and db.url.database not in (None, "", ":memory:"):
        path = str(db.url.database)
    else:
        path = None
    return open_reader(path, check_same_thread=check_same_thread) if path else None


def read_fast(db: str | os.PathLike[str] | None, fn: Callable[[Rows], T]) -> T | None:
    """``fn`` over the sqlite3 adapter, in this thread; None when that path does not apply
    or a read on it failed (the caller then opens the store, which says why)."""
    reader = fast_reader(db)
    if reader is None:
        return None
    with reader:
        try:
            return fn(reader)
        except sqlite3.Error:
            return None


def read_fast_once(db: str | os.PathLike[str] | None, fn: Callable[[Rows], T]) -> tuple[bool, T]:
    """``fn`` over the sqlite3 adapter, in this thread, for a caller that writes out as it
    reads: what it wrote cannot be taken back, so a read that fails is not left to the
    store to try again (as :func:`read_fast` does) but raised, in the store's words.
    ``(False, None)`` when the path does not apply."""
    reader = fast_reader(db)
    if reader is None:
        return False, None  # type: ignore[return-value]
    with reader:
        try:
            return True, fn(reader)
        except sqlite3.Error as exc:
            from orchestrator.store.engine import resolve_url, storage_error  # lazy: sqlalchemy

            raise storage_error(exc, resolve_url(db)) from exc


async def read(database: Database, fn: Callable[[Rows], T]) -> T:
    """``fn`` over one read transaction of ``database``, through whichever adapter fits.

    On an SQLite file ``fn`` runs on a worker thread (the event loop stays free); on other
    databases inside the async connection's ``run_sync``.
    """
    import asyncio  # lazy: asyncio

    def fast() -> tuple[bool, T | None]:
        database.check_file()  # a file deleted or replaced is not read, as on the engine
        reader = fast_reader(database, check_same_thread=False)
        if reader is None:
            return False, None
        with reader:
            return True, fn(reader)

    if database.is_sqlite:
        try:
            done, value = await asyncio.to_thread(fast)
        except sqlite3.Error as exc:
            raise _storage_error(exc, database) from exc
        if done:
            return value  # type: ignore[return-value]
    async with database.read() as conn:
        return await conn.run_sync(lambda c: fn(EngineRows(c, database.where)))


def read_batches(database: Database, fn: Callable[[Rows], Generator[T, None, None]]) -> Batches[T]:
    """What ``fn`` yields over one read transaction, handed over as it comes (:class:`Batches`)."""
    return Batches(database, fn)


class Batches(Generic[T]):
    """What ``fn`` yields over one read transaction, as an async iterator.

    The transaction is held from the first ``next`` until the last batch, :meth:`aclose`
    (or the end of ``async with``), or until the iterator is dropped: then it is ended at
    once (sqlite3) or on its event loop (the engine), quietly, and ``Database.close``
    waits for it. (An async generator would leave that to the loop's hooks, which close
    nested generators in no order, print what goes wrong, and do nothing once the loop
    is gone.)

    Each ``next`` runs where the adapter needs it: on a worker thread for the sqlite3
    reader, or inside ``run_sync`` on the engine's connection (its server-side cursor
    stays open between them).
    """

    def __init__(self, database: Database, fn: Callable[[Rows], Generator[T, None, None]]):
        self._database = database
        self._fn = fn
        self._held: _FileRead | _EngineRead | None = None
        self._done = False
        self._lock: asyncio.Lock | None = None

    def __aiter__(self) -> Batches[T]:
        return self

    async def __anext__(self) -> T:
        import asyncio  # lazy: asyncio

        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._done:
                raise StopAsyncIteration
            try:
                if self._held is None:
                    self._held = await _hold(self._database, self._fn)
                item = await self._held.step()
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._release()
                raise
            if item is _END:
                await self._release()
                raise StopAsyncIteration
            return item  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """End the read now (after a ``next`` in flight); later ``next`` calls stop."""
        if self._lock is None:
            self._done = True
            return
        async with self._lock:
            await self._release()

    async def __aenter__(self) -> Batches[T]:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _release(self) -> None:
        self._done = True
        held, self._held = self._held, None
        if held is not None:
            await held.release()

    def __del__(self) -> None:
        held, self._held = getattr(self, "_held", None), None
        if held is not None:
            held.release_later()


_END = object()


class _FileRead:
    """A read on the sqlite3 adapter (opened ``check_same_thread=False``: any thread
    may step it or close it)."""

    def __init__(self, reader: Reader, produced: Generator[Any, None, None], database: Database):
        self.reader = reader
        self.produced = produced
        self.database = database

    async def step(self) -> Any:
        import asyncio  # lazy: asyncio

        try:
            return await asyncio.to_thread(next, self.produced, _END)
        except sqlite3.Error as exc:
            raise _storage_error(exc, self.database) from exc

    async def release(self) -> None:
        import asyncio  # lazy: asyncio

        await asyncio.to_thread(self.release_later)

    def release_later(self) -> None:
        """Close now, from whichever thread: no event loop is needed to end it."""
        with contextlib.suppress(Exception):
            self.produced.close()
        self.reader.close()


class _EngineRead:
    """A read on the engine's connection: every step inside its ``run_sync``."""

    def __init__(
        self,
        conn: AsyncConnection,
        produced: Generator[Any, None, None],
        database: Database,
        loop: asyncio.AbstractEventLoop,
    ):
        self.conn = conn
        self.produced = produced
        self.database = database
        self.loop = loop

    async def step(self) -> Any:
        from sqlalchemy.exc import DBAPIError

        try:
            return await self.conn.run_sync(lambda _c: next(self.produced, _END))
        except DBAPIError as exc:
            from orchestrator.store.engine import storage_error  # lazy: sqlalchemy

            raise storage_error(exc, self.database.url) from exc

    async def release(self) -> None:
        try:
            await self.conn.run_sync(lambda _c: self.produced.close())
        finally:
            await self.conn.close()

    def release_later(self) -> None:
        """End the read on its own loop, from whichever thread dropped it; the database
        keeps the task until it is done (and ``Database.close`` waits for it)."""
        import asyncio  # lazy: asyncio

        if self.loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self.loop:
            self._spawn()
        else:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to run on
                self.loop.call_soon_threadsafe(self._spawn)

    def _spawn(self) -> None:
        task = self.loop.create_task(self._quiet_release())
        self.database.reads_ending.add(task)
        task.add_done_callback(self.database.reads_ending.discard)

    async def _quiet_release(self) -> None:
        with contextlib.suppress(Exception):
            await self.release()


async def _hold(
    database: Database, fn: Callable[[Rows], Generator[T, None, None]]
) -> _FileRead | _EngineRead:
    """One read transaction through whichever adapter fits, and ``fn``'s generator on it."""
    import asyncio  # lazy: asyncio

    if database.is_sqlite:
        database.check_file()
        reader = fast_reader(database, check_same_thread=False)
        if reader is not None:
            return _FileRead(reader, fn(reader), database)
    conn = await database.begin_read()
    try:
        produced = await conn.run_sync(lambda c: fn(EngineRows(c, database.where)))
    except BaseException:
        await conn.close()
        raise
    return _EngineRead(conn, produced, database, asyncio.get_running_loop())


def _storage_error(exc: sqlite3.Error, database: Database) -> Exception:
    from orchestrator.store.engine import storage_error  # lazy: sqlalchemy

    return storage_error(exc, database.url)
