"""The figures behind ``status``: counts, rates, token lengths, errors, ETA, workers.

Everything is computed from committed rows, so every process sees the same numbers and
they survive restarts. The shape of :func:`snapshot`'s result is the documented
``status --json`` format (see ``docs/STATUS.md``); fields are only ever added.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import sqlalchemy as sa

from orchestrator.store.engine import Database
from orchestrator.store.schema import STATES, attempt_errors, datasets, items, outputs, workers

STATUS_VERSION = 1
WINDOW_SECONDS = 300.0
# A worker that has not written a heartbeat for this long is reported as silent.
SILENT_AFTER = 120.0


def _rate(count: float, seconds: float) -> float:
    return round(count / seconds, 4) if seconds > 0 else 0.0


async def snapshot(
    database: Database, *, now: float | None = None, window: float = WINDOW_SECONDS
) -> dict[str, Any]:
    now = time.time() if now is None else now
    since = now - window
    async with database.read() as conn:
        ds_rows = (await conn.execute(sa.select(datasets).order_by(datasets.c.name))).all()
        counts = (
            await conn.execute(
                sa.select(items.c.dataset_id, items.c.state, sa.func.count()).group_by(
                    items.c.dataset_id, items.c.state
                )
            )
        ).all()
        overall = (
            await conn.execute(
                sa.select(
                    outputs.c.dataset_id,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(outputs.c.completion_tokens), 0),
                    sa.func.min(outputs.c.created_at - outputs.c.latency),
                    sa.func.max(outputs.c.created_at),
                ).group_by(outputs.c.dataset_id)
            )
        ).all()
        recent = (
            await conn.execute(
                sa.select(
                    outputs.c.dataset_id,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(outputs.c.completion_tokens), 0),
                )
                .where(outputs.c.created_at >= since)
                .group_by(outputs.c.dataset_id)
            )
        ).all()
        errors = (
            await conn.execute(
                sa.select(
                    attempt_errors.c.dataset_id,
                    attempt_errors.c.error_class,
                    attempt_errors.c.outcome,
                    sa.func.count(),
                ).group_by(
                    attempt_errors.c.dataset_id,
                    attempt_errors.c.error_class,
                    attempt_errors.c.outcome,
                )
            )
        ).all()
        failed = (
            await conn.execute(
                sa.select(items.c.dataset_id, items.c.error_class, sa.func.count())
                .where(items.c.state == "failed")
                .group_by(items.c.dataset_id, items.c.error_class)
            )
        ).all()
        worker_rows = (
            await conn.execute(
                sa.select(workers)
                .where(sa.or_(workers.c.stopped_at.is_(None), workers.c.stopped_at >= since))
                .order_by(workers.c.started_at)
            )
        ).all()

    state_counts: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(STATES, 0))
    for dataset_id, state, n in counts:
        state_counts[dataset_id][state] = n
    overall_by = {r[0]: r[1:] for r in overall}
    recent_by = {r[0]: r[1:] for r in recent}
    errors_by: dict[int, dict[str, dict[str, int]]] = defaultdict(dict)
    for dataset_id, error_class, outcome, n in errors:
        entry = errors_by[dataset_id].setdefault(
            error_class, {"retried": 0, "released": 0, "failed": 0}
        )
        entry[{"retry": "retried"}.get(outcome, outcome)] = n
    failed_by: dict[int, dict[str, int]] = defaultdict(dict)
    for dataset_id, error_class, n in failed:
        failed_by[dataset_id][error_class or "unknown"] = n

    entries = []
    for ds in ds_rows:
        entry = _dataset_figures(
            state_counts[ds.id],
            overall_by.get(ds.id),
            recent_by.get(ds.id),
            now=now,
            window=window,
        )
        entries.append(
            {
                "name": ds.name,
                "paused": bool(ds.paused),
                "concurrency": ds.concurrency,
                "priority": ds.priority,
                **entry,
                "errors": errors_by.get(ds.id, {}),
                "failed_by_class": failed_by.get(ds.id, {}),
            }
        )
    return {
        "version": STATUS_VERSION,
        "generated_at": now,
        "database": database.where,
        "window_seconds": window,
        "totals": _totals(entries, now=now, window=window),
        "datasets": entries,
        "workers": [
            {
                "id": w.id,
                "host": w.host,
                "pid": w.pid,
                "started_at": w.started_at,
                "heartbeat_age_s": round(now - w.heartbeat_at, 1),
                "stopped": w.stopped_at is not None,
                "silent": w.stopped_at is None and now - w.heartbeat_at > SILENT_AFTER,
                "in_flight": w.in_flight,
                "completed": w.completed,
            }
            for w in worker_rows
        ],
    }


def _span(start: float | None, end: float, now: float, window: float) -> float:
    """Seconds of the recent window during which this work was actually going on.

    A run that began two minutes ago, or finished an hour ago, must not have its rate
    diluted over a five-minute window it was not running in.
    """
    if start is None:
        return 0.0
    return max(min(end, now) - max(start, now - window), 0.0)


def _dataset_figures(
    counts: dict[str, int],
    overall: tuple[Any, ...] | None,
    recent: tuple[Any, ...] | None,
    *,
    now: float,
    window: float,
) -> dict[str, Any]:
    total = sum(counts.values())
    out_count, out_tokens, first_start, last_done = overall or (0, 0, None, None)
    recent_count, recent_tokens = recent or (0, 0)
    remaining = counts["pending"] + counts["running"]
    end = now if remaining else (last_done or now)
    elapsed = max(end - first_start, 0.0) if first_start is not None else 0.0
    span = _span(first_start, end, now, window)
    mean_tokens = out_tokens / out_count if out_count else None
    recent_rps = _rate(recent_count, span)
    eta = None
    if remaining == 0:
        eta = 0.0
    elif recent_rps > 0:
        eta = round(remaining / recent_rps, 1)
    return {
        "counts": {**counts, "total": total},
        "progress": round((counts["done"] + counts["failed"]) / total, 6) if total else 0.0,
        "recent": {
            "done": recent_count,
            "seconds": round(span, 1),
            "requests_per_s": recent_rps,
            "tokens_per_s": _rate(recent_tokens, span),
        },
        "overall": {
            "done": out_count,
            "started_at": first_start,
            "last_done_at": last_done,
            "elapsed_s": round(elapsed, 1),
            "requests_per_s": _rate(out_count, elapsed),
            "tokens_per_s": _rate(out_tokens, elapsed),
        },
        "completion_tokens": {
            "total": int(out_tokens),
            "mean": round(mean_tokens, 1) if mean_tokens is not None else None,
        },
        "eta_seconds": eta,
    }


def _totals(entries: list[dict[str, Any]], *, now: float, window: float) -> dict[str, Any]:
    counts = {s: sum(e["counts"][s] for e in entries) for s in (*STATES, "total")}
    starts = [e["overall"]["started_at"] for e in entries if e["overall"]["started_at"]]
    ends = [e["overall"]["last_done_at"] for e in entries if e["overall"]["last_done_at"]]
    done = sum(e["overall"]["done"] for e in entries)
    tokens = sum(e["completion_tokens"]["total"] for e in entries)
    remaining = counts["pending"] + counts["running"]
    first = min(starts) if starts else None
    end = now if remaining or not ends else max(ends)
    elapsed = max(end - first, 0.0) if first is not None else 0.0
    span = _span(first, end, now, window)
    recent_done = sum(e["recent"]["done"] for e in entries)
    recent_tokens = sum(e["recent"]["tokens_per_s"] * e["recent"]["seconds"] for e in entries)
    recent_tokens_per_s = _rate(recent_tokens, span)
    # Work left, in tokens: each dataset's remaining items times its own mean length,
    # divided by the current token throughput. Datasets with long answers weigh more.
    known_means = [
        e["completion_tokens"]["mean"] for e in entries if e["completion_tokens"]["mean"]
    ]
    fallback_mean = sum(known_means) / len(known_means) if known_means else None
    eta = None
    if remaining == 0:
        eta = 0.0
    elif recent_tokens_per_s > 0 and fallback_mean is not None:
        left_tokens = sum(
            (e["counts"]["pending"] + e["counts"]["running"])
            * (e["completion_tokens"]["mean"] or fallback_mean)
            for e in entries
        )
        eta = round(left_tokens / recent_tokens_per_s, 1)
    errors: dict[str, dict[str, int]] = {}
    for e in entries:
        for cls, by_outcome in e["errors"].items():
            slot = errors.setdefault(cls, {"retried": 0, "released": 0, "failed": 0})
            for k, v in by_outcome.items():
                slot[k] = slot.get(k, 0) + v
    failed_by: dict[str, int] = {}
    for e in entries:
        for cls, n in e["failed_by_class"].items():
            failed_by[cls] = failed_by.get(cls, 0) + n
    return {
        "counts": counts,
        "progress": round((counts["done"] + counts["failed"]) / counts["total"], 6)
        if counts["total"]
        else 0.0,
        "recent": {
            "done": recent_done,
            "seconds": round(span, 1),
            "requests_per_s": _rate(recent_done, span),
            "tokens_per_s": recent_tokens_per_s,
        },
        "overall": {
            "done": done,
            "started_at": first,
            "last_done_at": max(ends) if ends else None,
            "elapsed_s": round(elapsed, 1),
            "requests_per_s": _rate(done, elapsed),
            "tokens_per_s": _rate(tokens, elapsed),
        },
        "completion_tokens": {
            "total": int(tokens),
            "mean": round(tokens / done, 1) if done else None,
        },
        "eta_seconds": eta,
        "errors": errors,
        "failed_by_class": failed_by,
    }
