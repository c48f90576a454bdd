"""The figures behind ``status``: counts, rates, token lengths, errors, workers.

Everything is computed from committed rows, so every process sees the same numbers and
they survive restarts. :func:`snapshot`'s document is the documented ``status --json``
format (see ``docs/STATUS.md``; fields are only ever added) with its ETA left for
``monitor.status`` to forecast from the facts it hands over.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.items.answer_length import MEASURED_AFTER
from orchestrator.items.error_classes import limited_for
from orchestrator.items.quality import ALL_FLAGS
from orchestrator.items.structured import INVALID_FLAGS, expected_format
from orchestrator.store import crashes, hosted, liveness

if TYPE_CHECKING:
    from orchestrator.store.reader import Rows

STATUS_VERSION = 1
WINDOW_SECONDS = 300.0
# schema.STATES, spelled out: importing the schema loads SQLAlchemy, which the sqlite3
# path of status never needs. A test keeps the two equal.
STATES = ("pending", "running", "done", "failed")

# Plain SQL that SQLite and PostgreSQL read alike, so that the SQLAlchemy path and the
# sqlite3 path of ``status`` run the very same statements. Each is served by an index
# (migration 0002): none reads the wide output rows, and the failed count reads only
# the partial index of failed items (hence the literal 'failed': a bound parameter
# would not match the index's WHERE).
_QUERIES: dict[str, str] = {
    "datasets": (
        "SELECT id, name, paused, concurrency, priority, passthrough, params, samples"
        " FROM datasets ORDER BY name"
    ),
    # Prompts of datasets with several samples each, and those whose every sample is
    # done; read only for such datasets (one row per prompt and sample).
    "prompts": (
        "SELECT p.dataset_id, count(*), sum(CASE WHEN p.done = d.samples THEN 1 ELSE 0 END)"
        " FROM (SELECT dataset_id, sum(CASE WHEN state = 'done' THEN 1 ELSE 0 END) AS done"
        " FROM items WHERE dataset_id IN (SELECT id FROM datasets WHERE samples > 1)"
        ' GROUP BY dataset_id, "key") AS p JOIN datasets AS d ON d.id = p.dataset_id'
        " GROUP BY p.dataset_id"
    ),
    "counts": "SELECT dataset_id, state, count(*) FROM items GROUP BY dataset_id, state",
    "overall": (
        "SELECT dataset_id, count(*), coalesce(sum(completion_tokens), 0)"
        " FROM outputs GROUP BY dataset_id"
    ),
    # Prompt tokens, those a prefix cache served, and the answers that said (a server
    # that never says is not a cache that never hits), from ix_outputs_cache.
    "cache": (
        "SELECT dataset_id, coalesce(sum(prompt_tokens), 0), coalesce(sum(cached_tokens), 0),"
        " coalesce(sum(CASE WHEN cached_tokens IS NOT NULL THEN prompt_tokens END), 0)"
        " FROM outputs GROUP BY dataset_id"
    ),
    # First answer's start and last answer's end: one index seek each per dataset,
    # where a min() over every row would cost as much as the count above.
    "span": (
        "SELECT d.id,"
        " (SELECT min(o.created_at - o.latency) FROM outputs AS o WHERE o.dataset_id = d.id),"
        " (SELECT max(o.created_at) FROM outputs AS o WHERE o.dataset_id = d.id)"
        " FROM datasets AS d"
    ),
    # Led by datasets, so that each dataset's window is an index range, not a scan.
    "recent": (
        "SELECT d.id, count(*), coalesce(sum(o.completion_tokens), 0)"
        " FROM datasets AS d JOIN outputs AS o"
        " ON o.dataset_id = d.id AND o.created_at >= :since GROUP BY d.id"
    ),
    "errors": (
        "SELECT dataset_id, error_class, outcome, count(*) FROM attempt_errors"
        " GROUP BY dataset_id, error_class, outcome"
    ),
    "failed": (
        "SELECT dataset_id, error_class, count(*) FROM items WHERE state = 'failed'"
        " GROUP BY dataset_id, error_class"
    ),
    # Quality flags: the partial index of flagged outputs (migration 0004) holds only those,
    # by dataset and mask; the literal 0 is what lets the planner use it.
    "flags": (
        "SELECT dataset_id, flags, count(*) FROM outputs WHERE flags != 0"
        " GROUP BY dataset_id, flags"
    ),
    # Predicted answer lengths of the items left (migration 0009): the pending ones along
    # the partial index ix_items_longest, which holds the prediction, led by datasets
    # (CROSS JOIN keeps SQLite's order) so that each is a range of predicted rows, none
    # read when nothing was predicted (24-40 ms at 1M items as a scan of the index);
    # the running ones along ix_items_running, a few rows. ``+dataset_id`` keeps SQLite
    # from grouping along ix_items_dataset_state instead, a walk of every item (76 ms at
    # 1M items, 16 ms along the running ones).
    "predicted_pending": (
        "SELECT d.id, count(*), coalesce(sum(i.predicted_tokens), 0) FROM datasets AS d"
        " CROSS JOIN items AS i WHERE i.dataset_id = d.id AND i.state = 'pending'"
        " AND i.predicted_tokens > 0 GROUP BY d.id"
    ),
    "predicted_running": (
        "SELECT +dataset_id, count(*), coalesce(sum(predicted_tokens), 0) FROM items"
        " WHERE state = 'running' AND predicted_tokens > 0 GROUP BY +dataset_id"
    ),
    # Items left that were in flight when a worker died (migration 0018).
    "after_crash": crashes.AFTER_CRASH_SQL,
    # Tokens thrown away (migration 0013): a row per dataset and cause, read whole.
    "wasted": "SELECT dataset_id, cause, requests, tokens, unknown FROM wasted_tokens",
    # What the providers billed (migration 0022, store.spend): a handful of rows a dataset.
    "spend": hosted.SPEND_SQL,
    "workers": (
        f"SELECT {liveness.COLUMNS} FROM workers"
        " WHERE stopped_at IS NULL OR stopped_at >= :since ORDER BY started_at"
    ),
    # A provider's batches (migration 0021): the live ones, and a count by state.
    **hosted.BATCH_SQL,
}

# Completion lengths of a dataset's latest answers, for p50/p90: newest first along
# ix_outputs_totals (dataset_id, created_at, completion_tokens), so a bounded read of
# index entries whatever the size of the run.
LENGTH_SAMPLE = 5000
_LENGTHS = (
    "SELECT completion_tokens FROM outputs WHERE dataset_id = :dataset"
    " AND completion_tokens IS NOT NULL ORDER BY created_at DESC LIMIT :limit"
)

# What a dataset's latest answers cost, for the ETA: a bounded read of the newest rows,
# each with its item's predicted length (a primary-key lookup): the seconds per predicted
# token of those that had one.
COST_SAMPLE = 200
_COSTS = (
    "SELECT count(*), coalesce(sum(latency), 0), coalesce(sum(completion_tokens), 0),"
    " count(CASE WHEN predicted > 0 THEN 1 END),"
    " coalesce(sum(CASE WHEN predicted > 0 THEN latency END), 0),"
    " coalesce(sum(predicted), 0) FROM"
    " (SELECT o.latency, o.completion_tokens, i.predicted_tokens AS predicted"
    " FROM outputs AS o JOIN items AS i ON i.id = o.item_id WHERE o.dataset_id = :dataset"
    " ORDER BY o.created_at DESC LIMIT :limit) AS latest"
)

# The latest messages of each error class, so that why items are retried is visible
# without SQL: per (dataset, class, outcome) group of the "errors" count, its newest rows
# along ix_attempt_errors_class, whose entries end in the row id (a seek, not a sort),
# each with its item's key (a primary-key lookup). Of those, the newest few distinct
# messages are shown: a burst of one error repeats one message.
MESSAGE_SAMPLE = 20
MESSAGES_SHOWN = 3
_OUTCOME = {"retry": "retried"}  # as the keys of "errors" name it
MESSAGE_CHARS = 500
_MESSAGES = (
    "SELECT e.id, e.message, e.created_at, i.key FROM attempt_errors AS e"
    " LEFT JOIN items AS i ON i.id = e.item_id WHERE e.dataset_id = :dataset"
    " AND e.error_class = :cls AND e.outcome = :outcome ORDER BY e.id DESC LIMIT :limit"
)

# Servers that have answered nothing but 429 past the worker's --rate-limited-warn-after:
# the newest 429s of each dataset that has any, along ix_attempt_errors_class (its
# entries end in the row id: a seek, not a sort), of which the newest of each server
# whose message says how long (error_classes.limited_message). Rare, so the answers
# each such server gave since are then counted for it alone.
LIMITED_SAMPLE = 200
_LIMITED = (
    "SELECT server, created_at, message FROM attempt_errors WHERE dataset_id = :dataset"
    " AND error_class = 'rate_limited' AND outcome = 'released' ORDER BY id DESC LIMIT :limit"
)
_ANSWERED_SINCE = (
    "SELECT count(*) FROM datasets AS d JOIN outputs AS o ON o.dataset_id = d.id"
    " AND o.created_at > :at WHERE o.server = :server"
)

Found = dict[str, Sequence[Sequence[Any]]]
Messages = dict[tuple[int, str], list[tuple[Any, ...]]]


def _message_keys(rows: Found) -> list[dict[str, Any]]:
    return [
        {"dataset": d, "cls": c, "outcome": o, "limit": MESSAGE_SAMPLE}
        for d, c, o, _ in rows["errors"]
    ]


def _add_messages(messages: Messages, key: dict[str, Any], found: Sequence[Any]) -> None:
    messages.setdefault((key["dataset"], key["cls"]), []).extend(
        (row_id, text, at, key["dataset"], item, key["outcome"]) for row_id, text, at, item in found
    )


def _rate(count: float, seconds: float) -> float:
    return round(count / seconds, 4) if seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The status document with its ETA left blank, and what a forecast needs to fill it.

    ``work`` holds, per dataset that has answers to learn from, the keyword arguments of
    ``orchestrator.monitor.eta.Work``; ``ids`` are the dataset ids in the document's order. The
    forecast is made above the store (``monitor.status``), from these facts alone.
    """

    document: dict[str, Any]
    ids: list[int]
    work: list[dict[str, Any]]
    live_in_flight: int


def snapshot(rows: Rows, *, now: float | None = None, window: float = WINDOW_SECONDS) -> Snapshot:
    """The status figures, read in one transaction through either adapter (``store.access``)."""
    now = time.time() if now is None else now
    params = {"since": now - window}
    found: Found = {name: rows.fetch(sql, params) for name, sql in _QUERIES.items()}
    lengths: dict[int, list[int]] = {}
    costs: dict[int, Sequence[Any]] = {}
    for dataset_id, *_ in found["datasets"]:
        sample = {"dataset": dataset_id, "limit": LENGTH_SAMPLE}
        lengths[dataset_id] = [n for (n,) in rows.fetch(_LENGTHS, sample)]
        costs[dataset_id] = rows.fetch(_COSTS, {"dataset": dataset_id, "limit": COST_SAMPLE})[0]
    messages: Messages = {}
    for key in _message_keys(found):
        _add_messages(messages, key, rows.fetch(_MESSAGES, key))
    snap = _document(found, lengths, costs, messages, where=rows.where, now=now, window=window)
    snap.document["rate_limited"] = _rate_limited(rows, found["errors"], params["since"], now)
    _add_after_crash(snap, crashes.after_crash(found["after_crash"]))
    return snap


def _add_after_crash(snap: Snapshot, by_dataset: dict[int, dict[str, int]]) -> None:
    """Each dataset's items left that were in flight at a worker's death, and those
    rationed among them (``store.crashes``); the totals sum them. The rationed are left
    out of the ETA's work: a group at a time, they go at no pace the forecast knows."""
    none = {"items": 0, "rationed": 0}
    for work in snap.work:
        rationed = by_dataset.get(work["dataset_id"], none)["rationed"]
        work["pending"] = max(work["pending"] - rationed, 0)
    for dataset_id, entry in zip(snap.ids, snap.document["datasets"], strict=True):
        entry["after_crash"] = dict(by_dataset.get(dataset_id, none))
    entries = snap.document["datasets"]
    snap.document["totals"]["after_crash"] = {
        k: sum(e["after_crash"][k] for e in entries) for k in none
    }


def _rate_limited(rows: Rows, errors: Sequence[Sequence[Any]], since: float, now: float) -> Any:
    """Servers answering only 429 for longer than the worker's warning time, with no
    answer since: how long as of their latest 429 in the window, and how long ago."""
    newest: dict[str, tuple[float, int]] = {}
    for dataset_id in {d for d, cls, outcome, _ in errors if cls == "rate_limited"}:
        params = {"dataset": dataset_id, "limit": LIMITED_SAMPLE}
        for server, at, message in rows.fetch(_LIMITED, params):
            seconds = limited_for(message)
            later = at >= since and at > newest.get(server, (0.0, 0))[0]
            if server and seconds is not None and later:
                newest[server] = (at, seconds)
    found = []
    for server, (at, seconds) in newest.items():
        if rows.fetch(_ANSWERED_SINCE, {"at": at, "server": server})[0][0]:
            continue
        found.append(
            {"server": server, "limited_for_s": seconds, "last_429_age_s": round(now - at, 1)}
        )
    return sorted(found, key=lambda s: s["server"])


def _percentiles(values: list[int]) -> dict[str, Any]:
    """p50 and p90 (nearest rank) of the latest answers' completion lengths."""
    if not values:
        return {"p50": None, "p90": None, "sample": 0}
    ordered = sorted(values)

    def rank(q: int) -> int:
        return ordered[max(0, -(-len(ordered) * q // 100) - 1)]

    return {"p50": rank(50), "p90": rank(90), "sample": len(ordered)}


def _busy(entries: list[dict[str, Any]], now: float, window: float) -> float:
    """The seconds of the recent window the run was going on: requests in flight are
    averaged over these, finished datasets included (they held slots too)."""
    starts = [e["overall"]["started_at"] for e in entries if e["overall"]["started_at"]]
    return _span(min(starts), now, now, window) if starts else 0.0


def _document(
    rows: Found,
    lengths: dict[int, list[int]],
    costs: dict[int, Sequence[Any]],
    messages: Messages,
    *,
    where: str,
    now: float,
    window: float,
) -> Snapshot:
    state_counts, errors_by, failed_by, flags_by = _by_dataset(rows)
    predicted_by = _predicted_by(rows)
    span_by = {r[0]: tuple(r[1:]) for r in rows["span"]}
    overall_by = {r[0]: (*r[1:], *span_by.get(r[0], (None, None))) for r in rows["overall"]}
    recent_by = {r[0]: tuple(r[1:]) for r in rows["recent"]}
    cache_by = {r[0]: tuple(r[1:]) for r in rows["cache"]}
    wasted_by = _wasted_by(rows)
    billed_by = hosted.billed_by(rows["spend"])
    names = {row[0]: row[1] for row in rows["datasets"]}
    entries = []
    work: list[dict[str, Any]] = []
    for ds_id, name, paused, concurrency, priority, passthrough, ds_params, _ in rows["datasets"]:
        entry = _dataset_figures(
            state_counts[ds_id],
            overall_by.get(ds_id),
            recent_by.get(ds_id),
            now=now,
            window=window,
        )
        entry["completion_tokens"].update(_percentiles(lengths.get(ds_id, [])))
        entry["prompt_tokens"] = _cache_figures(*cache_by.get(ds_id, (0, 0, 0)))
        entry["wasted"] = wasted_figures(wasted_by[ds_id], entry["completion_tokens"]["total"])
        entry["billed"] = billed_by.get(ds_id, [])
        if not passthrough:  # stored done at enqueue: no answer time to learn from
            work.append(
                {"dataset_id": ds_id, "entry": entry, "cost": costs.get(ds_id), "params": ds_params}
                | {"paused": paused, "cap": concurrency, "priority": priority}
                | {"predicted": predicted_by.get(ds_id, {})}
            )
        entries.append(
            {
                "name": name,
                "paused": bool(paused),
                "concurrency": concurrency,
                "priority": priority,
                **entry,
                "errors": errors_by.get(ds_id, {}),
                "error_messages": _error_messages(
                    errors_by.get(ds_id, {}),
                    {c: m for (d, c), m in messages.items() if d == ds_id},
                    names,
                ),
                "failed_by_class": failed_by.get(ds_id, {}),
                "flags": flags_by[ds_id],
                "structured": _structured(ds_id, ds_params, rows["flags"], state_counts[ds_id]),
            }
        )
    _count_prompts(entries, rows)
    workers = [liveness.worker(row, now) for row in rows["workers"]]
    live = sum(w["in_flight"] for w in workers if liveness.is_live(w))
    busy = _busy(entries, now, window)
    totals = _all_totals(entries, lengths, messages, names, now=now, window=window)
    totals.update(liveness.outage(workers))
    document = {
        "version": STATUS_VERSION,
        "generated_at": now,
        "database": where,
        "window_seconds": window,
        "totals": totals,
        "datasets": entries,
        "workers": workers,
    }
    shown = hosted.batch_section(rows["batches"], rows["batch_states"], now)
    if shown is not None:
        document["batches"] = shown
    ids = [row[0] for row in rows["datasets"]]
    return Snapshot(document, ids, [_work(**w, busy=busy) for w in work], live)


def _all_totals(
    entries: list[dict[str, Any]],
    lengths: dict[int, list[int]],
    messages: Messages,
    names: dict[int, str],
    *,
    now: float,
    window: float,
) -> dict[str, Any]:
    """The run's totals over its datasets' figures."""
    totals = _totals(entries, now=now, window=window)
    totals["eta_slots"] = None  # with eta_seconds, filled by the forecast
    totals["prompt_tokens"] = _cache_figures(
        *(sum(e["prompt_tokens"][k] for e in entries) for k in ("total", "cached", "said"))
    )
    totals["completion_tokens"].update(
        _percentiles([n for sample in lengths.values() for n in sample])
    )
    totals["error_messages"] = _error_messages(totals["errors"], _by_class(messages), names)
    return totals


def _count_prompts(entries: list[dict[str, Any]], rows: Found) -> None:
    """Items are samples: each entry says its samples per prompt and counts its prompts
    (done: every sample done), which differ from its items only with several samples."""
    prompts_by = {r[0]: {"total": r[1], "done": int(r[2] or 0)} for r in rows["prompts"]}
    for entry, row in zip(entries, rows["datasets"], strict=True):
        counts = entry["counts"]
        entry["samples"] = row[7] or 1
        entry["prompts"] = prompts_by.get(
            row[0], {"total": counts["total"], "done": counts["done"]}
        )


def _predicted_by(rows: Found) -> dict[int, dict[str, Any]]:
    """Items still to answer and their predicted tokens, per dataset id and state."""
    predicted_by: dict[int, dict[str, Any]] = defaultdict(dict)
    for state in ("pending", "running"):
        for ds_id, n, tokens in rows[f"predicted_{state}"]:
            predicted_by[ds_id][f"predicted_{state}"] = n
            predicted_by[ds_id][f"predicted_{state}_tokens"] = int(tokens)
    return predicted_by


def _by_class(messages: Messages) -> dict[str, list[tuple[Any, ...]]]:
    """The datasets' latest error messages, pooled by class for the totals."""
    by_class: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for (_, cls), found in messages.items():
        by_class[cls].extend(found)
    return by_class


def _by_dataset(rows: Found) -> tuple[Any, Any, Any, Any]:
    """The grouped counts, per dataset id: by state, by error class and outcome, failed
    items by class, and answers by quality flag."""
    state_counts: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(STATES, 0))
    for dataset_id, state, n in rows["counts"]:
        state_counts[dataset_id][state] = n
    errors_by: dict[int, dict[str, dict[str, int]]] = defaultdict(dict)
    for dataset_id, error_class, outcome, n in rows["errors"]:
        entry = errors_by[dataset_id].setdefault(
            error_class, {"retried": 0, "released": 0, "failed": 0}
        )
        entry[{"retry": "retried"}.get(outcome, outcome)] = n
    failed_by: dict[int, dict[str, int]] = defaultdict(dict)
    for dataset_id, error_class, n in rows["failed"]:
        failed_by[dataset_id][error_class or "unknown"] = n
    flags_by: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(ALL_FLAGS, 0))
    for dataset_id, mask, n in rows["flags"]:
        counts = flags_by[dataset_id]
        for name, bit in ALL_FLAGS.items():
            if mask & bit:
                counts[name] += n
    return state_counts, errors_by, failed_by, flags_by


def _structured(
    dataset_id: int, params_json: str | None, flag_rows: Any, counts: dict[str, int]
) -> dict[str, Any] | None:
    """Structured output: the done answers that are not the JSON asked for, and their
    share of the done ones. None for a dataset that asks for no JSON and has none."""
    invalid = sum(n for ds, mask, n in flag_rows if ds == dataset_id and mask & INVALID_FLAGS)
    try:
        params = json.loads(params_json or "{}")
    except ValueError:
        params = {}
    asked = isinstance(params, dict) and expected_format(params) is not None
    if not asked and not invalid:
        return None
    done = counts["done"]
    return {"invalid": invalid, "invalid_share": round(invalid / done, 4) if done else None}


def _error_messages(
    errors: dict[str, dict[str, int]],
    found: dict[str, list[tuple[Any, ...]]],
    names: dict[int, str],
) -> dict[str, dict[str, Any]]:
    """Per error class: its attempts, and its latest messages, newest first."""
    out: dict[str, dict[str, Any]] = {}
    for cls, by_outcome in errors.items():
        shown: list[dict[str, Any]] = []
        seen: set[str] = set()
        newest = sorted(found.get(cls, []), key=lambda r: r[0], reverse=True)
        for _, text, at, dataset_id, item, o in newest:
            message = (text or "")[:MESSAGE_CHARS]
            if message in seen:
                continue
            seen.add(message)
            outcome = _OUTCOME.get(o, o)
            where = {"dataset": names.get(dataset_id), "item": item}
            shown.append({"message": message, "at": at, **where, "outcome": outcome})
            if len(shown) == MESSAGES_SHOWN:
                break
        out[cls] = {
            "count": sum(by_outcome.values()),
            "last_message": shown[0]["message"] if shown else None,
            "last_at": shown[0]["at"] if shown else None,
            "latest": shown,
        }
    return out


_NO_COST = (0, 0.0, 0, 0, 0.0, 0)


def _work(
    dataset_id: int,
    entry: dict[str, Any],
    cost: Sequence[Any] | None,
    params: str | None,
    paused: bool,
    cap: int | None,
    priority: int,
    predicted: dict[str, Any],
    *,
    busy: float,
) -> dict[str, Any]:
    """What the ETA needs of a dataset: items left (and their predicted lengths), its
    latest answers' cost, its cap."""
    sample, seconds, tokens, measured, predicted_seconds, predicted_tokens = cost or _NO_COST
    mean_seconds = seconds / sample if sample else None
    try:
        max_tokens = json.loads(params or "{}").get("max_tokens")
    except (ValueError, AttributeError):
        max_tokens = None
    return {
        "dataset_id": dataset_id,
        "pending": entry["counts"]["pending"],
        "running": entry["counts"]["running"],
        "priority": priority,
        "cap": cap,
        "paused": bool(paused),
        "seconds": mean_seconds,
        "tokens": tokens / sample if sample else None,
        "sample": sample,
        "max_tokens": max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None,
        # Little's law: requests in flight = answer rate x time in the system.
        "in_flight": _rate(entry["recent"]["done"], busy) * (mean_seconds or 0.0),
        **predicted,
        "seconds_per_predicted": (
            predicted_seconds / predicted_tokens
            if measured >= MEASURED_AFTER and predicted_tokens
            else None
        ),
    }


def _span(start: float | None, end: float, now: float, window: float) -> float:
    """Seconds of the recent window during which this work was actually going on.

    A run that began two minutes ago, or finished an hour ago, must not have its rate
    diluted over a five-minute window it was not running in.
    """
    if start is None:
        return 0.0
    return max(min(end, now) - max(start, now - window), 0.0)


def _cache_figures(total: int, cached: int, said: int) -> dict[str, Any]:
    """Prompt tokens and the share a prefix cache served, over the answers whose server
    said (None: none did, which is not a cache that never hits)."""
    share = round(int(cached) / int(said), 4) if said else None
    return {"total": int(total), "cached": int(cached), "said": int(said), "cached_share": share}


def wasted_figures(by_cause: dict[str, tuple[int, int, int]], stored: int) -> dict[str, Any]:
    """Tokens thrown away, per cause and in all, as a share of every token generated
    (``stored``, the answers kept, plus those thrown away). ``unknown``: attempts whose
    tokens nobody counted (a worker killed mid-request), in ``requests`` not ``tokens``."""
    tokens = sum(t for _, t, _ in by_cause.values())
    generated = int(stored) + tokens

    def share(n: int) -> float | None:
        return round(n / generated, 4) if generated else None

    causes = {
        cause: {"requests": r, "tokens": t, "unknown": u, "share": share(t)}
        for cause, (r, t, u) in sorted(by_cause.items())
    }
    return {
        "requests": sum(r for r, _, _ in by_cause.values()),
        "tokens": tokens,
        "unknown": sum(u for _, _, u in by_cause.values()),
        "generated_tokens": generated,
        "share": share(tokens),
        "by_cause": causes,
    }


def _wasted_by(rows: Found) -> dict[int, dict[str, tuple[int, int, int]]]:
    """(requests, tokens, unknown) thrown away, per dataset id and cause."""
    by: dict[int, dict[str, tuple[int, int, int]]] = defaultdict(dict)
    for ds_id, cause, requests, tokens, unknown in rows["wasted"]:
        by[ds_id][cause] = (int(requests), int(tokens), int(unknown))
    return by


def _pooled(entries: list[dict[str, Any]], stored: int) -> dict[str, Any]:
    """The datasets' tokens thrown away, summed per cause."""
    pooled: dict[str, tuple[int, int, int]] = {}
    for entry in entries:
        for cause, f in entry["wasted"]["by_cause"].items():
            r, t, u = pooled.get(cause, (0, 0, 0))
            pooled[cause] = (r + f["requests"], t + f["tokens"], u + f["unknown"])
    return wasted_figures(pooled, stored)


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
        "eta_seconds": None,
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
    flags = {name: sum(e["flags"][name] for e in entries) for name in ALL_FLAGS}
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
        "eta_seconds": None,
        "errors": errors,
        "failed_by_class": failed_by,
        "flags": flags,
        "wasted": _pooled(entries, tokens),
    }


# ---------------------------------------------------------------------- dataset card

# What a dataset card says of one dataset (formats.writers.card), in the export's read
# transaction. The token figures are over the answers exported (those whose flags share
# no bit with :mask), from histograms (a token count has few distinct values), so the
# percentiles are exact at any size; the flag and failure counts are over every answer.
_CARD_MASK = " AND (flags & :mask) = 0"
_CARD: dict[str, str] = {
    # What the providers billed (migration 0022): for the answers kept, and thrown away.
    "billed": "SELECT kind = 'kept', sum(requests), sum(prompt_tokens), sum(cached_tokens),"
    " sum(completion_tokens) FROM spend WHERE dataset_id = :d GROUP BY kind = 'kept'",
    "states": "SELECT state, count(*) FROM items WHERE dataset_id = :d GROUP BY state",
    "failed": (
        "SELECT error_class, count(*) FROM items WHERE dataset_id = :d AND state = 'failed'"
        " GROUP BY error_class"
    ),
    "flags": (
        "SELECT flags, count(*) FROM outputs WHERE dataset_id = :d AND flags != 0 GROUP BY flags"
    ),
    "times": "SELECT min(created_at), max(created_at) FROM outputs WHERE dataset_id = :d",
    # The answers exported, by model and parameters, and of those the ones with
    # reasoning: one pass over the dataset's outputs. The stored message is orjson's
    # encoding, so a "reasoning_content" (or newer vLLM's "reasoning") key with a non-empty
    # string value reads exactly so (quotes inside strings are escaped).
    "answers": (
        "SELECT model, params_hash, count(*), count(CASE WHEN (message LIKE :has ESCAPE '!'"
        " AND message NOT LIKE :empty ESCAPE '!') OR (message LIKE :has2 ESCAPE '!'"
        " AND message NOT LIKE :empty2 ESCAPE '!') THEN 1 END)"
        " FROM outputs WHERE dataset_id = :d{mask} GROUP BY model, params_hash"
    ),
    "prompt_tokens": (
        "SELECT prompt_tokens, count(*) FROM outputs WHERE dataset_id = :d"
        " AND prompt_tokens IS NOT NULL{mask} GROUP BY prompt_tokens"
    ),
    "completion_tokens": (
        "SELECT completion_tokens, count(*) FROM outputs WHERE dataset_id = :d"
        " AND completion_tokens IS NOT NULL{mask} GROUP BY completion_tokens"
    ),
}
_PARAMS = "SELECT hash, params FROM param_sets"
_HAS_REASONING = '%"reasoning!_content":"%'
_EMPTY_REASONING = '%"reasoning!_content":""%'
_HAS_REASONING2 = '%"reasoning":"%'
_EMPTY_REASONING2 = '%"reasoning":""%'


def card_figures(rows: Rows, dataset_id: int, *, exclude_flags: int = 0) -> dict[str, Any]:
    """One dataset's figures for its card: items by state, failures by class, answers
    by quality flag, the model and parameters of the answers, token percentiles and the
    share of answers with reasoning, the first and last answer's times."""
    params = {"d": dataset_id, "mask": exclude_flags, "has": _HAS_REASONING}
    params |= {"empty": _EMPTY_REASONING, "has2": _HAS_REASONING2, "empty2": _EMPTY_REASONING2}
    mask = _CARD_MASK if exclude_flags else ""
    found = {name: rows.fetch(sql.format(mask=mask), params) for name, sql in _CARD.items()}
    flags = dict.fromkeys(ALL_FLAGS, 0)
    for bits, n in found["flags"]:
        for name, bit in ALL_FLAGS.items():
            if bits & bit:
                flags[name] += n
    params_of = dict(rows.fetch(_PARAMS))
    models: dict[tuple[Any, Any], int] = {}
    for model, params_hash, n, _ in found["answers"]:
        key = (model, params_of.get(params_hash))
        models[key] = models.get(key, 0) + n
    first, last = found["times"][0]
    return {
        "billed": _card_billed(found["billed"]),
        "counts": {**dict.fromkeys(STATES, 0), **dict(found["states"])},
        "failed_by_class": {(c or "unknown"): n for c, n in sorted(found["failed"], key=_name)},
        "flags": flags,
        "models": sorted(
            ({"model": m, "params": p, "answers": n} for (m, p), n in models.items()),
            key=lambda e: (-e["answers"], e["model"] or "", e["params"] or ""),
        ),
        "prompt_tokens": _histogram_percentiles(found["prompt_tokens"]),
        "completion_tokens": _histogram_percentiles(found["completion_tokens"]),
        "answers": sum(int(r[2]) for r in found["answers"]),
        "with_reasoning": sum(int(r[3] or 0) for r in found["answers"]),
        "first_answer_at": first,
        "last_answer_at": last,
    }


def _card_billed(found: Sequence[Sequence[Any]]) -> dict[str, dict[str, int]]:
    """The ledger's sums, ``kept`` and ``thrown_away``, for the card."""
    out = {kind: dict.fromkeys(hosted.BILLED, 0) for kind in ("kept", "thrown_away")}
    for kept, *sums in found:
        kind = "kept" if kept else "thrown_away"
        out[kind] = dict(zip(hosted.BILLED, map(int, sums), strict=True))
    return out


def _name(row: Sequence[Any]) -> str:
    return row[0] or ""


def _histogram_percentiles(counts: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """p50 and p90 (nearest rank, as :func:`_percentiles`) of values given with counts."""
    ordered = sorted((int(v), int(n)) for v, n in counts)
    total = sum(n for _, n in ordered)
    out: dict[str, Any] = {"p50": None, "p90": None, "count": total}
    for q in (50, 90):
        rank, seen = max(1, -(-total * q // 100)), 0
        for value, n in ordered:
            seen += n
            if total and seen >= rank:
                out[f"p{q}"] = value
                break
    return out
