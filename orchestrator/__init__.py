"""Durable, resumable batch generation against OpenAI-compatible inference servers.

The Python API (docs/API.md)::

    import orchestrator as orc

    async with orc.open("run.db") as q:
        await q.enqueue("prompts.jsonl", dataset="chat", model="Qwen/Qwen3-8B")
        await q.run(servers=["http://gpu:30000"])
        await q.export("train.jsonl")

The names in ``__all__`` are the stable surface. They are loaded on first use, so that
``import orchestrator`` (and with it every command's start) stays cheap: the read-only
commands never load SQLAlchemy or asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator._util.lazy import exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from orchestrator.api import Queue, Status, SyncQueue, open, open_sync
    from orchestrator.api.running import RunOutcome
    from orchestrator.errors import (
        ConfigError,
        InputError,
        ItemsFailed,
        ItemsLeftPending,
        OrchestratorError,
        RunStopped,
        StorageError,
    )
    from orchestrator.formats.options import ExportReport
    from orchestrator.store.item_detail import ItemRecord
    from orchestrator.store.loading import EnqueueReport
    from orchestrator.store.requeue import UndoReport
    from orchestrator.worker import WorkerStats

_SOURCES = {
    "open": "api",
    "open_sync": "api",
    "Queue": "api",
    "SyncQueue": "api",
    "Status": "api",
    "RunOutcome": "api.running",
    "WorkerStats": "worker",
    "EnqueueReport": "store.loading",
    "ItemRecord": "store.item_detail",
    "UndoReport": "store.requeue",
    "ExportReport": "formats.options",
    "OrchestratorError": "errors",
    "InputError": "errors",
    "ConfigError": "errors",
    "StorageError": "errors",
    "RunStopped": "errors",
    "ItemsFailed": "errors",
    "ItemsLeftPending": "errors",
}

__all__ = [
    "ConfigError",
    "EnqueueReport",
    "ExportReport",
    "InputError",
    "ItemRecord",
    "ItemsFailed",
    "ItemsLeftPending",
    "OrchestratorError",
    "Queue",
    "RunOutcome",
    "RunStopped",
    "Status",
    "StorageError",
    "SyncQueue",
    "UndoReport",
    "WorkerStats",
    "__version__",
    "open",
    "open_sync",
]


__getattr__ = exports(__name__, _SOURCES)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
