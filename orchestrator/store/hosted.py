"""What status reads of a hosted provider's run: the ledger of what it billed
(``store.spend``) and its batches (``store.batches``).

Plain SQL text and pure functions over its rows, no SQLAlchemy: ``status`` reads through
plain sqlite3 on an SQLite file (``store.access``), and must not load the ORM to do it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: What status reads of the ledger: a handful of rows a dataset.
SPEND_SQL = (
    "SELECT dataset_id, server, model, batched, kind, requests, prompt_tokens,"
    " cached_tokens, completion_tokens FROM spend ORDER BY dataset_id, kind, server, model"
)
BILLED = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def billed_by(rows: Iterable[Sequence[Any]]) -> dict[int, list[dict[str, Any]]]:
    """The ledger's rows (:data:`SPEND_SQL`) by dataset, as ``datasets[].billed`` shows
    them."""
    by: dict[int, list[dict[str, Any]]] = {}
    for ds_id, server, model, batched, kind, *counts in rows:
        by.setdefault(ds_id, []).append(
            {"server": server or None, "model": model or None, "batched": bool(batched)}
            | {"kind": kind}
            | dict(zip(BILLED, (int(c) for c in counts), strict=True))
        )
    return by


#: What status reads of the batches: those live, and how many there were in each state.
BATCH_SQL = {
    "batches": (
        "SELECT key, provider_id, server, state, status, requests, completed, failed,"
        " created_at, expires_at, error FROM batches"
        " WHERE state IN ('packing', 'uploaded', 'creating', 'created', 'collected')"
        " ORDER BY id"
    ),
    "batch_states": (
        "SELECT state, count(*), coalesce(sum(requests), 0) FROM batches GROUP BY state"
    ),
}


def batch_section(
    live: Sequence[Sequence[Any]], states: Sequence[Sequence[Any]], now: float
) -> dict[str, Any] | None:
    """The status document's ``batches``: each live batch (its age and the time left in
    the provider's window) and the batches by state; None when the run made none."""
    if not states:
        return None
    names = ("key", "provider_id", "server", "state", "status", "requests", "completed",
             "failed", "created_at", "expires_at", "error")  # fmt: skip
    shown = []
    for row in live:
        entry = dict(zip(names, row, strict=True))
        entry["age_s"] = round(now - entry["created_at"], 1)
        expires = entry.pop("expires_at")
        entry["window_left_s"] = None if expires is None else round(expires - now, 1)
        shown.append(entry)
    by_state = {state: {"batches": n, "requests": int(r)} for state, n, r in states}
    return {"live": shown, "by_state": by_state}
