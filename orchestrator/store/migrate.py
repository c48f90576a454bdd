"""Schema versions: applied by alembic on first use, refused when newer than this code."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from orchestrator.errors import SchemaError
from orchestrator.store.engine import Database

_OUR_TABLES = {"datasets", "items", "outputs"}


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(files("orchestrator.migrations")))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def _check_known(connection: Connection, current: str | None, where: str) -> None:
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
    head = head_revision()

    def _upgrade(connection: Connection) -> str | None:
        before = _current(connection)
        _check_known(connection, before, database.where)
        if before != head:
            command.upgrade(alembic_config(connection), "head")
        return before

    async with database.write() as conn:
        before = await conn.run_sync(_upgrade)
    return before, head


async def ensure_schema(database: Database) -> None:
    """Cheap check on every open; upgrade only when behind."""
    head = head_revision()

    def _check(connection: Connection) -> Any:
        current = _current(connection)
        _check_known(connection, current, database.where)
        return current

    async with database.read() as conn:
        current = await conn.run_sync(_check)
    if current != head:
        await upgrade(database)
