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

import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Generator
from typing import TYPE_CHECKING, TypeVar

from orchestrator.store.reader import EngineRows, Reader, open_reader, sqlite_path

if TYPE_CHECKING:
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


async def read(database: Database, fn: Callable[[Rows], T]) -> T:
    """``fn`` over one read transaction of ``database``, through whichever adapter fits.

    On an SQLite file ``fn`` runs on a worker thread (the event loop stays free); on other
    databases inside the async connection's ``run_sync``.
    """
    import asyncio

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


async def read_batches(
    database: Database, fn: Callable[[Rows], Generator[T, None, None]]
) -> AsyncIterator[T]:
    """What ``fn`` yields over one read transaction, handed over as it comes.

    Each ``next`` runs where the adapter needs it: on a worker thread for the sqlite3
    reader, or inside ``run_sync`` on the engine's connection (its server-side cursor
    stays open between them).
    """
    import asyncio

    end = object()
    reader = None
    if database.is_sqlite:
        database.check_file()
        reader = fast_reader(database, check_same_thread=False)
    if reader is not None:
        with reader:
            produced = fn(reader)
            try:
                while (item := await asyncio.to_thread(next, produced, end)) is not end:
                    yield item  # type: ignore[misc]
            except sqlite3.Error as exc:
                raise _storage_error(exc, database) from exc
            finally:
                produced.close()
        return
    async with database.read() as conn:
        produced = await conn.run_sync(lambda c: fn(EngineRows(c, database.where)))
        try:
            while (item := await conn.run_sync(lambda _c: next(produced, end))) is not end:
                yield item  # type: ignore[misc]
        finally:
            await conn.run_sync(lambda _c: produced.close())


def _storage_error(exc: sqlite3.Error, database: Database) -> Exception:
    from orchestrator.store.engine import storage_error

    return storage_error(exc, database.url)
