"""The durable queue: schema, migrations, and every transition of an item's state.

Nothing here knows about HTTP; the worker composes this with the inference client.

Names are loaded on first use: the engine pulls in SQLAlchemy's asyncio layer, and a
read-only command on an SQLite file (``status``, ``export``) gets by with
``store.reader`` and never needs it.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from orchestrator._util.lazy import exports
from orchestrator.store.migrate import check_open, check_sqlite, database_facts, ensure_schema

if TYPE_CHECKING:
    from orchestrator.store.datasets import DatasetInfo, DatasetSpec, list_datasets, set_paused
    from orchestrator.store.engine import Database, create_database, resolve_url
    from orchestrator.store.leases import Failure, Lease, Output
    from orchestrator.store.loading import EnqueueReport, enqueue
    from orchestrator.store.migrate import upgrade
    from orchestrator.store.outputs import DoneItem, check_datasets, iter_done
    from orchestrator.store.queue import Queue

_SOURCES = {
    "DatasetInfo": "datasets",
    "DatasetSpec": "datasets",
    "list_datasets": "datasets",
    "set_paused": "datasets",
    "Database": "engine",
    "create_database": "engine",
    "resolve_url": "engine",
    "EnqueueReport": "loading",
    "enqueue": "loading",
    "ensure_schema": "migrate",
    "upgrade": "migrate",
    "DoneItem": "outputs",
    "check_datasets": "outputs",
    "iter_done": "outputs",
    "Failure": "leases",
    "Lease": "leases",
    "Output": "leases",
    "Queue": "queue",
}


__getattr__ = exports(__name__, _SOURCES)


class _Package(types.ModuleType):
    """Keeps an exported name bound to the export when its submodule is imported.

    Importing ``orchestrator.store.loading`` sets the package's ``enqueue`` to the
    module; with eager imports the function was bound after that, and callers of
    ``from orchestrator.store import enqueue`` rely on getting the function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
            and _SOURCES.get(name) == name
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


async def open_database(
    db: str | None = None, *, mode: str = "create", adopt: bool = False
) -> Database:
    """Open the database named by a path or URL, as ``mode`` allows.

    ``create`` (enqueue, db upgrade, the library's default) creates a missing SQLite file
    and installs or upgrades the schema; ``write`` refuses a missing or empty database
    and upgrades an older schema; ``read`` refuses anything not at this schema and never
    changes the database. See :func:`orchestrator.store.migrate.check_open`.
    """
    from orchestrator.store.engine import create_database, resolve_url  # lazy: sqlalchemy

    url = resolve_url(db)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        check_sqlite(str(url.database), mode, adopt=adopt)
    database = create_database(url, read_only=mode == "read")
    try:
        if not database.is_sqlite:
            revision, tables = await database_facts(database)
            check_open(mode, database.where, revision=revision, tables=tables, adopt=adopt)
        if mode != "read":
            await ensure_schema(database)
    except BaseException:
        await database.close()
        raise
    return database


__all__ = [
    "Database",
    "DatasetInfo",
    "DatasetSpec",
    "DoneItem",
    "EnqueueReport",
    "Failure",
    "Lease",
    "Output",
    "Queue",
    "check_datasets",
    "create_database",
    "enqueue",
    "ensure_schema",
    "iter_done",
    "list_datasets",
    "open_database",
    "resolve_url",
    "set_paused",
    "upgrade",
]
