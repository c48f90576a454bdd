"""A worker's accounts of what it wrote: its counts, its metrics, and what it says when
nothing is left for it to claim (``exit_when_done``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import structlog

from orchestrator.errors import ItemsFailed, ItemsLeftPending, RunStopped
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker.config import WorkerStats
from orchestrator.worker.outcomes import Advance, Done, Failed, Failing, Outcome, Retry

if TYPE_CHECKING:
    from orchestrator.worker.metrics import WorkerMetrics

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


def count(stats: WorkerStats, entry: Outcome) -> bool:
    """Count an outcome the database took; True for an answer (it sizes the prefetch)."""
    if isinstance(entry, Done):
        stats.completed += 1
        stats.completion_tokens += (entry.output.usage or {}).get("completion_tokens") or 0
        return True
    if isinstance(entry, Retry):
        stats.retried += 1
    elif isinstance(entry, Failed):
        stats.failed += 1
        log.warning(
            "item_failed",
            item=entry.lease.item_id,
            key=entry.lease.key,
            error_class=entry.failure.error_class,
            error=entry.failure.message[:500],
        )
    else:
        stats.released += 1
    return False


def observe(metrics: WorkerMetrics, dataset: str, entry: Outcome) -> None:
    """An outcome written, in the worker's Prometheus metrics."""
    if isinstance(entry, Done | Advance):
        metrics.settled(dataset, entry.kind, None, entry.output.usage, entry.output.latency)
    elif isinstance(entry, Failing):
        metrics.settled(dataset, entry.kind, entry.failure.error_class, None, None)
