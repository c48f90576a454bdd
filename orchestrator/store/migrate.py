"""Schema versions: applied by alembic on first use, refused when newer than this code.

alembic and the SQL layer are imported only when a migration may be needed: a database
already at :data:`SCHEMA_REVISION` (every open but the first after an upgrade) is
recognised by reading its version row, which keeps them out of every command's start-up.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from typing import TYPE_CHECKING, Any

from orchestrator.errors import EmptyDatabase, SchemaError, StorageError
from orchestrator.store.reader import DEFAULT_DB, connect
from orchestrator.store.revision import SCHEMA_REVISION

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection

    from orchestrator.store.engine import Database


_OUR_TABLES = {"datasets", "items", "outputs"}
# The PostgreSQL advisory lock that serialises schema upgrades ("orch" in ASCII).
_PG_LOCK = 0x6F726368


def alembic_config(connection: Connection | None = None) -> Config:
    from importlib.resources import files  # lazy: start-up

    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(files("orchestrator.migrations")))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _current(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def _check_known(connection: Connection, current: str | None, where: str) -> None:
    from alembic.script import ScriptDirectory
    from sqlalchemy import inspect

    script = ScriptDirectory.from_config(alembic_config())
    if current is None:
        tables = set(inspect(connection).get_table_names())
        if tables and not tables.isdisjoint(_OUR_TABLES):
            raise SchemaError(f"{where}: has orchestrator tables but no schema version")
        return
    try:
        script.get_revision(current)
    except Exception as exc:
        raise SchemaError(
            f"{where}: schema version {current!r} is newer than this orchestrator knows "
            f"(it knows up to {script.get_current_head()!r}); upgrade orchestrator"
        ) from exc


async def current_revision(database: Database) -> str | None:
    async with database.read() as conn:
        return await conn.run_sync(_current)


async def upgrade(database: Database) -> tuple[str | None, str]:
    """Bring the schema to head in one write transaction; returns (before, after)."""
    from alembic import command

    head = head_revision()

    def _upgrade(connection: Connection) -> str | None:
        if connection.dialect.name == "postgresql":
            # Concurrent first uses (several workers started at once) take turns: the
            # others wait here, then find the schema at head. SQLite's BEGIN IMMEDIATE
            # does the same.
            from sqlalchemy import text

            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
        before = _current(connection)
        _check_known(connection, before, database.where)
        if before != head:
            command.upgrade(alembic_config(connection), "head")
        return before

    async with database.write() as conn:
        before = await conn.run_sync(_upgrade)
    return before, head


async def _at_head(database: Database) -> bool:
    """True when the version row says head: the one answer that needs no alembic.

    Any other answer, including an error (no version table yet, not a database), is
    left to the full check below, which reports it properly.
    """
    from sqlalchemy import text

    try:
        async with database.read() as conn:
            rows = (await conn.execute(text("SELECT version_num FROM alembic_version"))).all()
    except StorageError:
        return False
    return [tuple(r) for r in rows] == [(SCHEMA_REVISION,)]


async def ensure_schema(database: Database) -> None:
    """Cheap check on every open; upgrade only when behind."""
    if await _at_head(database):
        return
    head = head_revision()

    def _check(connection: Connection) -> Any:
        current = _current(connection)
        _check_known(connection, current, database.where)
        return current

    async with database.read() as conn:
        current = await conn.run_sync(_check)
    if current != head:
        await upgrade(database)


# Which commands may do what to a database they are pointed at (modes create, write and
# read). A mistyped --db must not start a new, empty run, and a read must never change the
# file it reads.


def check_open(
    mode: str,
    where: str,
    *,
    revision: str | None,
    tables: list[str],
    adopt: bool = False,
) -> None:
    """Refuse what ``mode`` may not do to this database (found by ``revision`` and ``tables``).

    ``create`` (enqueue, db upgrade) may install the schema into an empty database;
    ``write`` (run, requeue, pause, resume) may upgrade an older schema; ``read`` (status,
    export, watch, ...) changes nothing and needs the schema at head. A non-empty database
    without the schema's version row is another application's: refused unless ``adopt``.
    """
    if revision is None:
        ours = set(tables) & _OUR_TABLES
        if ours:
            raise SchemaError(f"{where}: has orchestrator tables but no schema version")
        if tables and not (mode == "create" and adopt):
            shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
            raise SchemaError(
                f"{where}: not an orchestrator database (it holds other tables: {shown}); "
                "left unchanged. Check --db / ORCHESTRATOR_DB, or run `orchestrator db "
                "upgrade --into-existing` to add the queue's tables to it"
            )
        if mode != "create":
            raise EmptyDatabase(
                f"{where}: empty database, no orchestrator schema yet (nothing was enqueued "
                "into it); `orchestrator enqueue` creates the schema"
            )
        return
    if revision != SCHEMA_REVISION and not _known(revision):
        raise SchemaError(
            f"{where}: schema version {revision!r} is newer than this orchestrator knows "
            f"(it knows up to {SCHEMA_REVISION!r}); upgrade orchestrator"
        )
    if mode == "read" and revision != SCHEMA_REVISION:
        raise SchemaError(
            f"{where}: schema {revision} is not this orchestrator's ({SCHEMA_REVISION}); "
            "read-only commands never upgrade: run `orchestrator db upgrade` (with the "
            "workers stopped) first"
        )


def _known(revision: str) -> bool:
    """Whether ``revision`` is one of this orchestrator's migrations."""
    from alembic.script import ScriptDirectory

    try:
        ScriptDirectory.from_config(alembic_config()).get_revision(revision)
    except Exception:
        return False
    return True


def sqlite_facts(path: str) -> tuple[str | None, list[str]] | None:
    """(schema revision, table names) of an SQLite file, read without changing it
    (``store.reader.connect``: no WAL switch, no journal, nothing left beside it); None
    when there is no file."""
    if not os.path.exists(path):
        return None
    try:
        conn = connect(path)
    except sqlite3.Error as exc:
        raise StorageError(f"{path}: cannot open the database file ({exc})") from exc
    return _sqlite_facts(conn, path)


def _sqlite_facts(conn: Any, path: str) -> tuple[str | None, list[str]]:
    try:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        revision = None
        if "alembic_version" in tables:
            rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
            revision = rows[0][0] if rows else None
            tables.remove("alembic_version")
        return revision, tables
    except sqlite3.OperationalError as exc:
        raise StorageError(f"{path}: cannot read the database file ({exc})") from exc
    except sqlite3.DatabaseError as exc:
        raise StorageError(
            f"{path}: the file is not an orchestrator (SQLite) database ({exc})"
        ) from exc
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def check_sqlite(path: str, mode: str, *, adopt: bool = False) -> None:
    """What an open for ``mode`` checks of an SQLite file before anything else touches it:
    it exists (unless ``mode`` is ``create``), is a file, and holds what ``check_open``
    allows. Read with plain sqlite3, read-only: a refused file is left as it was."""
    facts = sqlite_facts(path)
    if facts is None:
        if mode != "create":
            raise missing_database(path)
        return
    check_open(mode, path, revision=facts[0], tables=facts[1], adopt=adopt)


def missing_database(path: str) -> StorageError:
    """A mistyped --db must not start an empty run: say where we looked, and why there."""
    env = os.environ.get("ORCHESTRATOR_DB")
    return StorageError(
        f"no database at {os.path.abspath(path)} (named by --db, else ORCHESTRATOR_DB "
        f"({env or 'unset'}), else ./{DEFAULT_DB}; relative to the working directory "
        f"{os.getcwd()}). Only `orchestrator enqueue` and `orchestrator db upgrade` create "
        "a database: check the path, or set ORCHESTRATOR_DB"
    )


async def database_facts(database: Database) -> tuple[str | None, list[str]]:
    """(schema revision, table names) through the engine (PostgreSQL: nothing changes)."""

    def facts(connection: Connection) -> tuple[str | None, list[str]]:
        from sqlalchemy import inspect

        tables = [t for t in inspect(connection).get_table_names() if t != "alembic_version"]
        return _current(connection), tables

    async with database.read() as conn:
        return await conn.run_sync(facts)


async def upgrade_database(db: str | None, *, adopt: bool = False) -> tuple[str | None, str, str]:
    """``orchestrator db upgrade``: the checks an open for ``create`` makes (``adopt``: into
    a database that holds another application's tables), then the schema brought to head.
    Returns (revision before, revision after, where)."""
    from orchestrator.store.engine import create_database, resolve_url  # lazy: sqlalchemy

    url = resolve_url(db)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        check_sqlite(str(url.database), "create", adopt=adopt)
    database = create_database(url)
    try:
        if not database.is_sqlite:
            revision, tables = await database_facts(database)
            check_open("create", database.where, revision=revision, tables=tables, adopt=adopt)
        before, after = await upgrade(database)
        return before, after, database.where
    finally:
        await database.close()
