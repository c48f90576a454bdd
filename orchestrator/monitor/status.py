"""The status document (``docs/STATUS.md``): the store's figures with the ETA forecast.

The store reads the figures and the facts a forecast needs (``store.stats``); the
forecast itself (``orchestrator.monitor.eta``) is a model of how the run goes on, not a query,
so it is made here, above the store. Every view of the status (``status``, ``watch``,
the dashboard, ``Queue.status()``) goes through :func:`document`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from orchestrator.monitor.eta import Work, forecast
from orchestrator.store import access, stats

if TYPE_CHECKING:
    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

WINDOW_SECONDS = stats.WINDOW_SECONDS


def document(snap: stats.Snapshot) -> dict[str, Any]:
    """The status document of a snapshot, its ETA filled in."""
    outlook = forecast([Work(**w) for w in snap.work], live_in_flight=snap.live_in_flight)
    doc = snap.document
    # No server answers: the pace of the minutes before says nothing of the end, and an
    # ETA counted down from it would fall while nothing is done.
    waiting = doc["totals"].get("waiting_for_server")
    for dataset_id, entry in zip(snap.ids, doc["datasets"], strict=True):
        eta = outlook.datasets.get(dataset_id, 0.0)
        entry["eta_seconds"] = None if waiting and _left(entry) else _round(eta)
    doc["totals"]["eta_seconds"] = None if waiting else _round(outlook.total)
    doc["totals"]["eta_slots"] = round(outlook.slots, 1)
    return doc


def read(rows: Rows, *, now: float | None = None, window: float = WINDOW_SECONDS) -> dict[str, Any]:
    """The status document from one read transaction, through either adapter."""
    return document(stats.snapshot(rows, now=now, window=window))


async def snapshot(
    database: Database, *, now: float | None = None, window: float = WINDOW_SECONDS
) -> dict[str, Any]:
    """The status document of an open database (plain sqlite3 on an SQLite file)."""
    return await access.read(database, lambda rows: read(rows, now=now, window=window))


def snapshot_fast(
    db: str | os.PathLike[str] | None, *, window: float = WINDOW_SECONDS
) -> dict[str, Any] | None:
    """The status document through plain sqlite3, or None where that path does not apply."""
    return access.read_fast(db, lambda rows: read(rows, window=window))


def _left(entry: dict[str, Any]) -> int:
    return int(entry["counts"]["pending"] + entry["counts"]["running"])


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)
