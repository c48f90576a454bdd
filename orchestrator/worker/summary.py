"""What a worker says when nothing is left for it to claim (``exit_when_done``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from orchestrator.errors import ItemsFailed, ItemsLeftPending, RunStopped
from orchestrator.store.datasets import DatasetInfo

log = structlog.get_logger("orchestrator.worker")


def left_undone(
    counts: Mapping[tuple[str, str], int], names: Iterable[str], datasets: Iterable[DatasetInfo]
) -> RunStopped | None:
    """Done, or what is not (failed, or pending in paused datasets), over the datasets
    ``names`` (none: all of them); ``counts`` are items by (dataset, state)."""
    scope = set(names) or {name for name, _ in counts}
    by_state: dict[str, int] = {}
    for (name, state), n in counts.items():
        if name in scope:
            by_state[state] = by_state.get(state, 0) + n
    left = by_state.get("pending", 0) + by_state.get("running", 0)
    failed = by_state.get("failed", 0)
    log.info("all_done", done=by_state.get("done", 0), failed=failed, left_pending=left)
    summary = f"finished with {by_state.get('done', 0):,} done"
    if failed:
        return ItemsFailed(
            f"{summary}, {failed:,} failed (see `orchestrator status`; "
            "`orchestrator requeue` retries them)"
            + (f", {left:,} pending in paused datasets" if left else "")
        )
    if left:
        paused = sorted(d.name for d in datasets if d.paused and d.name in scope)
        return ItemsLeftPending(
            f"{summary}, {left:,} pending in paused datasets ({', '.join(paused)}): "
            "`orchestrator resume NAME`, then run again"
        )
    return None
