"""Items as a person reads them: the request as sent, every answer, every attempt.

``status`` counts; when a count looks wrong (retries, truncated answers) the next
question is about single items: what was sent, what came back, why it was tried again,
where the answer a requeue replaced went. This module answers it from the stored rows
alone, read-only, in one read transaction, over ``store.reader.Rows``: plain sqlite3 on
an SQLite file, the store's engine elsewhere (``store.access`` chooses).

Items are picked by dataset, key, state, error class and quality flag, or sampled at
random among those (seeded, so a sample can be shown again). The error class and the
flag look at an item's whole history: an attempt that failed with the class, whatever
the item became; an answer with the flag, the current one or one set aside by a requeue.

Each item is read with a handful of index lookups (its output, turns, attempts and
requeues by item id), ``BATCH`` items at a time, so showing every item of a large
selection streams without holding it.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.errors import ConfigError
from orchestrator.items.params import item_body
from orchestrator.items.quality import flag_names
from orchestrator.items.samples import seed_of, sent_as
from orchestrator.store.outputs import check_names

if TYPE_CHECKING:
    from orchestrator.store.reader import Rows

BATCH = 200
STATES = ("pending", "running", "done", "failed")
Json = dict[str, Any]

_DATASETS = (
    "SELECT id, name, params, regenerate, passthrough, samples, draw_seeds FROM datasets"
    " ORDER BY name"
)
# One seek per dataset on the (dataset_id, key) unique index.
_KEY = "SELECT id FROM items WHERE dataset_id = :dataset AND key = :key"
# The selection, in input order (ids grow with position within a dataset).
_MATCHING = "SELECT i.id FROM items AS i WHERE i.dataset_id = :dataset{where} ORDER BY i.id"
_BY_STATE = " AND i.state = :state"
# A key names a prompt: every sample of it (one item, for a dataset of one sample).
_BY_ID = ' AND i."key" = (SELECT "key" FROM items WHERE id = :item)'
# Any attempt that failed with the class (ix_attempt_errors_class), or the item's own
# class (a failed item, or one released or retried with it).
_BY_CLASS = (
    " AND (i.error_class = :error_class OR i.id IN (SELECT e.item_id FROM attempt_errors AS e"
    " WHERE e.dataset_id = :dataset AND e.error_class = :error_class))"
)
# The live answer's flags (the partial index of flagged outputs), or a set-aside one's.
_BY_FLAGS = (
    " AND (i.id IN (SELECT o.item_id FROM outputs AS o WHERE o.dataset_id = :dataset"
    " AND o.flags != 0 AND (o.flags & :flags) != 0)"
    " OR i.id IN (SELECT s.item_id FROM superseded_outputs AS s WHERE s.dataset_id = :dataset"
    " AND (s.flags & :flags) != 0))"
)
_ITEMS = (
    "SELECT i.id, i.dataset_id, i.key, i.position, i.request, i.state, i.attempts, i.turn,"
    " i.turns, i.error_class, i.last_error, i.lease_owner, i.lease_expires_at, i.not_before,"
    " i.created_at, i.updated_at, i.finished_at, w.heartbeat_at, i.sample"
    " FROM items AS i LEFT JOIN workers AS w ON w.id = i.lease_owner WHERE i.id IN {ids}"
)
_ANSWER_COLUMNS = (
    "message, finish_reason, usage, flags, model, server, response_id, attempt, latency,"
    " created_at, params_hash"
)
_OUTPUTS = f"SELECT item_id, {_ANSWER_COLUMNS} FROM outputs WHERE item_id IN {{ids}}"
_TURN_COLUMNS = "turn, message, finish_reason, usage, flags, model, server, latency, created_at"
_TURNS = (
    f"SELECT item_id, {_TURN_COLUMNS}, params_hash FROM item_turns WHERE item_id IN {{ids}}"
    " ORDER BY item_id, turn"
)
_ERRORS = (
    "SELECT item_id, attempt, error_class, message, outcome, server, created_at"
    " FROM attempt_errors WHERE item_id IN {ids} ORDER BY id"
)
_BATCH_LINES = (
    "SELECT e.item_id, b.key, b.provider_id, b.server, b.state, b.status, e.turn, e.settled,"
    " b.created_at FROM batch_entries AS e JOIN batches AS b ON b.id = e.batch_id"
    " WHERE e.item_id IN {ids} ORDER BY e.item_id, b.id"
)
_REQUEUES = (
    "SELECT r.item_id, r.requeue_id, q.created_at, r.state, r.attempts, r.error_class,"
    " r.last_error, r.finished_at, r.request FROM requeued_items AS r"
    " JOIN requeues AS q ON q.id = r.requeue_id WHERE r.item_id IN {ids}"
    " ORDER BY r.item_id, r.requeue_id"
)
# Set-aside answers and turns, found through requeued_items' item index: their own key
# leads with the requeue.
_SET_ASIDE = (
    "SELECT s.item_id, s.requeue_id, "
    + ", ".join(f"s.{c.strip()}" for c in _ANSWER_COLUMNS.split(","))
    + " FROM requeued_items AS r JOIN superseded_outputs AS s"
    " ON s.requeue_id = r.requeue_id AND s.item_id = r.item_id WHERE r.item_id IN {ids}"
)
_SET_ASIDE_TURNS = (
    "SELECT s.item_id, s.requeue_id, "
    + ", ".join(f"s.{c.strip()}" for c in _TURN_COLUMNS.split(","))
    + " FROM requeued_items AS r JOIN superseded_turns AS s"
    " ON s.requeue_id = r.requeue_id AND s.item_id = r.item_id WHERE r.item_id IN {ids}"
    " ORDER BY s.item_id, s.requeue_id, s.turn"
)
_PARAMS = "SELECT hash, params FROM param_sets WHERE hash IN {ids}"


# ---------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class BatchLineRecord:
    """A line that asked for the item in a provider's batch (``run --batch-api``):
    the batch (the run's key, the provider's id), its state and the provider's status,
    the turn asked, and whether its answer was written for the item (``settled``)."""

    batch: str
    provider_id: str | None
    server: str
    state: str
    status: str | None
    turn: int
    settled: bool
    at: float


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """An attempt that gave no answer: ``outcome`` is ``retry`` (tried again after a
    backoff), ``released`` (given back: the item was not at fault) or ``failed``."""

    attempt: int
    error_class: str
    message: str | None
    outcome: str
    server: str | None
    at: float


@dataclass(frozen=True, slots=True)
class Reply:
    """What an answer and a generated turn both hold: the assistant message as the server
    sent it (``content``, ``reasoning_content``, ``tool_calls``), and what came with it."""

    message: Json
    finish_reason: str | None
    usage: Json | None
    flags: list[str]
    model: str | None
    server: str | None


@dataclass(frozen=True, slots=True)
class TurnRecord(Reply):
    """One generated turn of a ``regenerate = "all"`` conversation (0-based ``turn``)."""

    turn: int
    latency: float
    created_at: float


@dataclass(frozen=True, slots=True)
class AnswerRecord(Reply):
    """An answer as stored, with the attempt and the parameters it was made with."""

    response_id: str | None
    attempt: int
    latency: float
    started_at: float
    created_at: float
    params_hash: str | None


@dataclass(frozen=True, slots=True)
class RequeueRecord:
    """A requeue that sent the item back, with what the item was before it; for a done
    item, the answer (and turns) it set aside, and the request that answer was made with."""

    requeue: int
    at: float
    state: str
    attempts: int
    error_class: str | None
    last_error: str | None
    finished_at: float | None
    request: Json
    answer: AnswerRecord | None
    generated: list[TurnRecord]


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """Who holds a running item, until when, and when that worker last wrote its
    heartbeat (None: it has no row in ``workers``)."""

    worker: str | None
    expires_at: float | None
    heartbeat_at: float | None


@dataclass(frozen=True, slots=True)
class ItemRecord:
    """One item. ``request`` is the body as the worker sends it (the dataset's parameter
    set, the item's own fields over it; a done item's is the set its answer was made
    with, ``params_hash``); ``errors`` every attempt that gave no answer, oldest first;
    ``requeues`` every requeue of it, oldest first, with the answers they set aside."""

    dataset: str
    key: str
    position: int
    state: str
    attempts: int
    turn: int
    turns: int
    regenerate: str
    passthrough: bool
    request: Json
    params_hash: str | None
    answer: AnswerRecord | None
    generated: list[TurnRecord]
    errors: list[AttemptRecord]
    requeues: list[RequeueRecord]
    error_class: str | None
    last_error: str | None
    lease: LeaseRecord | None
    created_at: float
    updated_at: float
    finished_at: float | None
    not_before: float | None
    draw: int = 0
    """Which of its prompt's samples the item is (``enqueue --samples``; 0 when one)."""
    choice: int | None = None
    """Which choice of the request its answer came in, when that request asked for
    several of its prompt's samples (``request`` holds the request's ``n`` and seed)."""
    batches: tuple[BatchLineRecord, ...] = ()
    """The provider batches that asked for it (``run --batch-api``), oldest first."""


# -------------------------------------------------------------------------- selection


@dataclass(frozen=True, slots=True)
class Spelling:
    """How a caller names the options in the messages: the command's or the API's."""

    dataset: str
    key: str
    sample: str
    seed: str

    def dataset_is(self, name: str) -> str:
        """``--dataset web`` or ``dataset='web'``."""
        return (
            f"{self.dataset} {name}" if self.dataset.startswith("-") else f"{self.dataset}={name!r}"
        )


COMMAND = Spelling("--dataset", "--id", "--sample", "--seed")
API = Spelling("dataset", "id", "sample", "seed")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which items to show. ``sample``: that many at random among the matching ones,
    drawn with ``seed`` (the same seed and rows, the same items)."""

    dataset_names: tuple[str, ...] = ()
    key: str | None = None
    state: str | None = None
    error_class: str | None = None
    flags: int = 0
    sample: int | None = None
    seed: int | None = None
    spelling: Spelling = API


def checked_selection(
    *,
    dataset_names: Sequence[str] = (),
    key: str | None = None,
    state: str | None = None,
    error_class: str | None = None,
    flags: int = 0,
    sample: int | None = None,
    seed: int | None = None,
    spelling: Spelling = API,
) -> Selection:
    """The selection, or ConfigError: a key and a sample exclude each other, and a seed
    belongs to a sample. A sample without a seed gets one at random (the selection says
    which, so that the same items can be shown again)."""
    if state is not None and state not in STATES:
        raise ConfigError(f"state must be one of {', '.join(STATES)}, not {state!r}")
    if key is not None and sample is not None:
        raise ConfigError(
            f"{spelling.key} names one item and {spelling.sample} draws several: give one"
        )
    if sample is not None and sample < 1:
        raise ConfigError(f"{spelling.sample}: must be at least 1, got {sample}")
    if seed is not None and sample is None:
        raise ConfigError(f"{spelling.seed} draws a sample: give {spelling.sample} N too")
    if sample is not None and seed is None:
        seed = secrets.randbelow(2**31)
    return Selection(
        dataset_names=tuple(dataset_names),
        key=key,
        state=state,
        error_class=error_class,
        flags=flags,
        sample=sample,
        seed=seed,
        spelling=spelling,
    )


@dataclass(frozen=True, slots=True)
class _Dataset:
    id: int
    name: str
    params: Json
    regenerate: str
    passthrough: bool
    samples: int = 1
    seeds: tuple[int, ...] | None = None


def inspect_items(
    rows: Rows,
    selection: Selection,
    *,
    matched: Callable[[int], None] | None = None,
    batch: int = BATCH,
) -> Iterator[list[ItemRecord]]:
    """The selected items, by dataset name then input order, ``batch`` at a time, from
    one read transaction. ``matched`` hears how many items matched the filters: before
    the first batch for a sample, after the last one otherwise. An unknown dataset or
    key raises ConfigError before anything is yielded."""
    check_names(rows, selection.dataset_names)
    everything = _datasets(rows)
    names = selection.dataset_names
    datasets = [d for d in everything if not names or d.name in names]
    by_id = {d.id: d for d in everything}
    pinned = _resolve_key(rows, everything, selection) if selection.key is not None else None
    if pinned is not None:
        datasets = [pinned[0]]
    if selection.sample is not None:
        chosen, total = _sample(rows, datasets, selection, batch)
        if matched is not None:
            matched(total)
        for start in range(0, len(chosen), batch):
            yield _records(rows, chosen[start : start + batch], by_id)
        return
    total = 0
    for dataset in datasets:
        params = _params(dataset.id, selection, pinned[1] if pinned else None)
        for part in rows.stream(_matching_sql(selection, pinned is not None), params, batch):
            total += len(part)
            yield _records(rows, [r[0] for r in part], by_id)
    if matched is not None:
        matched(total)


def _datasets(rows: Rows) -> list[_Dataset]:
    return [
        _Dataset(
            i,
            n,
            orjson.loads(p),
            r or "last",
            bool(pt),
            s or 1,
            tuple(orjson.loads(d)) if d else None,
        )
        for i, n, p, r, pt, s, d in rows.fetch(_DATASETS)
    ]


def _resolve_key(
    rows: Rows, everything: list[_Dataset], selection: Selection
) -> tuple[_Dataset, int]:
    """The one item with the selection's key in the datasets named (any, when none is),
    or ConfigError: where it is not and where it is instead, or, when no dataset was
    named, every dataset that has it."""
    key, names, spelling = selection.key, selection.dataset_names, selection.spelling
    hits = [
        (d, hit[0][0])
        for d in everything
        if (hit := rows.fetch(_KEY, {"dataset": d.id, "key": key}))
    ]
    found = [(d, i) for d, i in hits if not names or d.name in names]
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(d.name for d, _ in found)
        raise ConfigError(
            f"item key {key!r} is in {len(found)} datasets ({listed}): say which, e.g. "
            f"{spelling.dataset_is(found[0][0].name)}"
        )
    if not names:
        raise ConfigError(f"no item has the key {key!r} in any dataset")
    where = f"dataset {names[0]!r}" if len(names) == 1 else f"datasets {', '.join(names)}"
    message = f"no item has the key {key!r} in {where}"
    if hits:
        elsewhere = ", ".join(d.name for d, _ in hits)
        message += f"; it is in {elsewhere} ({spelling.dataset_is(hits[0][0].name)})"
    raise ConfigError(message)


def _matching_sql(selection: Selection, pinned: bool) -> str:
    where = _BY_ID if pinned else ""
    if selection.state is not None:
        where += _BY_STATE
    if selection.error_class is not None:
        where += _BY_CLASS
    if selection.flags:
        where += _BY_FLAGS
    return _MATCHING.format(where=where)


def _params(dataset_id: int, selection: Selection, item: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"dataset": dataset_id}
    if item is not None:
        params["item"] = item
    if selection.state is not None:
        params["state"] = selection.state
    if selection.error_class is not None:
        params["error_class"] = selection.error_class
    if selection.flags:
        params["flags"] = selection.flags
    return params


def _sample(
    rows: Rows, datasets: list[_Dataset], selection: Selection, batch: int
) -> tuple[list[int], int]:
    """``selection.sample`` item ids drawn evenly from the matching ones (reservoir
    sampling over the ids in their order, so nothing but the chosen is held), back in
    that order; and how many matched."""
    size = selection.sample or 0
    draw = random.Random(selection.seed)
    chosen: list[tuple[int, int]] = []  # (place in the walk, id)
    seen = 0
    for dataset in datasets:
        params = _params(dataset.id, selection, None)
        for part in rows.stream(_matching_sql(selection, False), params, batch):
            for (item_id,) in part:
                if seen < size:
                    chosen.append((seen, item_id))
                else:
                    slot = draw.randrange(seen + 1)
                    if slot < size:
                        chosen[slot] = (seen, item_id)
                seen += 1
    return [item_id for _, item_id in sorted(chosen)], seen


# ---------------------------------------------------------------------------- reading


def _in(values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``(:v0, :v1, …)`` and its parameters (never empty: ``(NULL)`` matches nothing)."""
    params = {f"v{n}": v for n, v in enumerate(values)}
    marks = ", ".join(f":{k}" for k in params) or "NULL"
    return f"({marks})", params


def _fetch_in(rows: Rows, sql: str, values: Sequence[Any]) -> list[tuple[Any, ...]]:
    marks, params = _in(values)
    return rows.fetch(sql.format(ids=marks), params)


def _loads(text: str | None) -> Any:
    return orjson.loads(text) if text else None


def _reply(columns: Sequence[Any]) -> dict[str, Any]:
    """What an answer and a turn both hold, from their columns message to server."""
    message, finish, usage, flags, model, server = columns
    return {
        "message": orjson.loads(message),
        "finish_reason": finish,
        "usage": _loads(usage),
        "flags": flag_names(flags or 0),
        "model": model,
        "server": server,
    }


def _answer(row: Sequence[Any]) -> AnswerRecord:
    """An ``outputs`` (or ``superseded_outputs``) row, from its message column on."""
    *said, response_id, attempt, latency, at, ph = row
    return AnswerRecord(
        **_reply(said),
        response_id=response_id,
        attempt=attempt,
        latency=latency,
        started_at=at - latency,
        created_at=at,
        params_hash=ph,
    )


def _turn(row: Sequence[Any]) -> TurnRecord:
    turn, *said, latency, at = row
    return TurnRecord(
        turn=turn,
        **_reply(said),
        latency=latency,
        created_at=at,
    )


@dataclass(slots=True)
class _Found:
    """Every row read for one batch of items, by item id."""

    items: list[tuple[Any, ...]]
    answers: dict[int, AnswerRecord] = field(default_factory=dict)
    turns: dict[int, list[TurnRecord]] = field(default_factory=dict)
    errors: dict[int, list[AttemptRecord]] = field(default_factory=dict)
    requeues: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    set_aside: dict[tuple[int, int], AnswerRecord] = field(default_factory=dict)
    set_aside_turns: dict[tuple[int, int], list[TurnRecord]] = field(default_factory=dict)
    params: dict[str, Json] = field(default_factory=dict)
    batches: dict[int, list[BatchLineRecord]] = field(default_factory=dict)


def _read(rows: Rows, ids: Sequence[int]) -> _Found:
    found = _Found(items=_fetch_in(rows, _ITEMS, ids))
    for item_id, *rest in _fetch_in(rows, _OUTPUTS, ids):
        found.answers[item_id] = _answer(rest)
    for item_id, *rest, _hash in _fetch_in(rows, _TURNS, ids):
        found.turns.setdefault(item_id, []).append(_turn(rest))
    for item_id, attempt, cls, message, outcome, server, at in _fetch_in(rows, _ERRORS, ids):
        found.errors.setdefault(item_id, []).append(
            AttemptRecord(attempt, cls, message, outcome, server, at)
        )
    for item_id, *line in _fetch_in(rows, _BATCH_LINES, ids):
        found.batches.setdefault(item_id, []).append(BatchLineRecord(*line))
    for row in _fetch_in(rows, _REQUEUES, ids):
        found.requeues.setdefault(row[0], []).append(row[1:])
    for item_id, requeue_id, *rest in _fetch_in(rows, _SET_ASIDE, ids):
        found.set_aside[(item_id, requeue_id)] = _answer(rest)
    for item_id, requeue_id, *rest in _fetch_in(rows, _SET_ASIDE_TURNS, ids):
        found.set_aside_turns.setdefault((item_id, requeue_id), []).append(_turn(rest))
    hashes = {a.params_hash for a in [*found.answers.values(), *found.set_aside.values()]}
    known = sorted(h for h in hashes if h)
    found.params = {h: orjson.loads(p) for h, p in _fetch_in(rows, _PARAMS, known)} if known else {}
    return found


def _records(rows: Rows, ids: Sequence[int], datasets: Mapping[int, _Dataset]) -> list[ItemRecord]:
    """The records of ``ids``, in that order."""
    found = _read(rows, ids)
    by_id = {row[0]: row for row in found.items}
    return [_record(by_id[i], found, datasets) for i in ids if i in by_id]


def _record(row: Sequence[Any], found: _Found, datasets: Mapping[int, _Dataset]) -> ItemRecord:
    item_id, dataset_id, key, position, request, state, attempts, turn, turns = row[:9]
    error_class, last_error, owner, expires, not_before, created, updated, finished = row[9:17]
    heartbeat, draw = row[17], row[18]
    dataset = datasets[dataset_id]
    answer = found.answers.get(item_id)
    item_request = orjson.loads(request)
    requeues = _requeues(item_id, item_request, found, dataset, key, draw)
    choice = sent_as(answer.usage) if answer is not None else None
    lease = LeaseRecord(owner, expires, heartbeat) if state == "running" else None
    return ItemRecord(
        dataset=dataset.name,
        key=key,
        position=position,
        state=state,
        attempts=attempts,
        turn=turn,
        turns=turns,
        regenerate=dataset.regenerate,
        passthrough=dataset.passthrough,
        request=_sent(item_request, answer, found, dataset, key, draw),
        params_hash=_params_hash(answer, found),
        answer=answer,
        generated=found.turns.get(item_id, []),
        errors=found.errors.get(item_id, []),
        requeues=requeues,
        error_class=error_class,
        last_error=last_error,
        lease=lease,
        created_at=created,
        updated_at=updated,
        finished_at=finished,
        not_before=not_before if state == "pending" and not_before else None,
        draw=draw,
        choice=choice[0] if choice is not None else None,
        batches=tuple(found.batches.get(item_id, ())),
    )


def _params_hash(answer: AnswerRecord | None, found: _Found) -> str | None:
    if answer is not None and answer.params_hash in found.params:
        return answer.params_hash
    return None


def _seed(dataset: _Dataset, key: str, draw: int) -> int | None:
    """The seed a sample is sent with, as the worker gives it (``worker.call.seed``)."""
    if dataset.samples <= 1 and not dataset.seeds:
        return None
    return seed_of(key, draw, dataset.seeds)


def _sent(
    request: Json,
    answer: AnswerRecord | None,
    found: _Found,
    dataset: _Dataset,
    key: str,
    draw: int,
) -> Json:
    """The body the answer was asked with (its parameter set, when known), or the one the
    next attempt sends (the dataset's parameters now), with the sample's seed. An answer
    that came as choice ``c`` of an ``n`` request was asked with that request's body: the
    seed of the sample ``c`` before it, and ``n``."""
    params = dataset.params
    if answer is not None and answer.params_hash in found.params:
        params = found.params[answer.params_hash]
    choice = sent_as(answer.usage) if answer is not None else None
    if choice is None:
        return item_body(params, request, _seed(dataset, key, draw))
    body = item_body(params, request, _seed(dataset, key, draw - choice[0]))
    body["n"] = choice[1]
    return body


def _requeues(
    item_id: int, request: Json, found: _Found, dataset: _Dataset, key: str, draw: int
) -> list[RequeueRecord]:
    """The item's requeues, oldest first. A requeue that changed the request kept the one
    before it: walking them newest first, the request of each is the one the next kept,
    or the item's own."""
    out: list[RequeueRecord] = []
    then = request
    for requeue_id, at, state, attempts, cls, last, finished, kept in reversed(
        found.requeues.get(item_id, [])
    ):
        if kept is not None:
            then = orjson.loads(kept)
        answer = found.set_aside.get((item_id, requeue_id))
        out.append(
            RequeueRecord(
                requeue=requeue_id,
                at=at,
                state=state,
                attempts=attempts,
                error_class=cls,
                last_error=last,
                finished_at=finished,
                request=_sent(then, answer, found, dataset, key, draw),
                answer=answer,
                generated=found.set_aside_turns.get((item_id, requeue_id), []),
            )
        )
    return out[::-1]


__all__ = [
    "API",
    "COMMAND",
    "AnswerRecord",
    "AttemptRecord",
    "ItemRecord",
    "LeaseRecord",
    "RequeueRecord",
    "Selection",
    "Spelling",
    "TurnRecord",
    "checked_selection",
    "inspect_items",
]
