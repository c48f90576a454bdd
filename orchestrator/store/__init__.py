"""The durable queue: schema, migrations, and every transition of an item's state.

Nothing here knows about HTTP; the worker composes this with the inference client.
"""

from orchestrator.store.datasets import DatasetInfo, DatasetSpec, list_datasets, set_paused
from orchestrator.store.engine import Database, create_database, resolve_url
from orchestrator.store.enqueue import EnqueueReport, enqueue
from orchestrator.store.migrate import ensure_schema, upgrade
from orchestrator.store.outputs import DoneItem, check_datasets, iter_done
from orchestrator.store.queue import Failure, Lease, Output, Queue
from orchestrator.store.stats import snapshot


async def open_database(db: str | None = None) -> Database:
    """Open (and create or upgrade) the database named by a path or URL."""
    database = create_database(db)
    try:
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
    "snapshot",
    "upgrade",
]
