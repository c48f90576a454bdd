"""Reading committed outputs back, in a stable order, for export.

Rows come back as the stored JSON text (request, message, usage), not parsed: export
writes them out again, and a parse and a re-encode per row cost more than reading it.
Every reader is written once, over ``store.reader.Rows``: plain sqlite3 on an SQLite
file, the store's engine elsewhere (``store.access`` chooses). Both give the same rows,
so both give the same export bytes.

Two shapes of done row: :data:`DoneRow`, the five columns the default export needs (its
fast path), and :data:`FullRow`, with what the other formats, quality filters and
provenance need on top.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.errors import ConfigError
from orchestrator.store import access

if TYPE_CHECKING:
    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

# key, request JSON, message JSON, finish_reason, usage JSON (or None)
DoneRow = tuple[str, str, str, str | None, str | None]
# item id, key, request, message, finish_reason, usage, flags, model, response_id,
# created_at, latency, server, params_hash, params JSON (param_sets; None when unknown),
# tokens (packed, orchestrator.items.tokens; None when the server gave none),
# sample (items.sample)
FullRow = tuple[
    int,
    str,
    str,
    str,
    str | None,
    str | None,
    int,
    str | None,
    str | None,
    float,
    float,
    str | None,
    str | None,
    str | None,
    bytes | None,
    int,
]
# key, error_class, last_error, attempts, turn, turns, sample
FailedRow = tuple[str, str | None, str | None, int, int, int, int]

BATCH = 2000

_DATASETS = "SELECT id, name FROM datasets ORDER BY name"
_DATASET_REFS = (
    "SELECT id, name, regenerate, passthrough, endpoint, samples FROM datasets ORDER BY name"
)
# Within a dataset, row ids grow with input position (enqueue inserts lines in order, and
# a later file is placed after the earlier ones), so walking the (dataset, state) index
# in id order yields input order without sorting a million rows.
_DONE = (
    "SELECT items.key, items.request, outputs.message, outputs.finish_reason, outputs.usage"
    " FROM items JOIN outputs ON outputs.item_id = items.id"
    " WHERE items.dataset_id = :dataset_id AND items.state = 'done' ORDER BY items.id"
)
# The same walk with each answer's quality flags (the Parquet export's plain rows).
_DONE_FLAGGED = (
    "SELECT items.key, items.request, outputs.message, outputs.finish_reason, outputs.usage,"
    " outputs.flags FROM items JOIN outputs ON outputs.item_id = items.id"
    " WHERE items.dataset_id = :dataset_id AND items.state = 'done' ORDER BY items.id"
)
# The same walk, wider; param_sets is one primary-key lookup per row.
_DONE_FULL = (
    "SELECT items.id, items.key, items.request, outputs.message, outputs.finish_reason,"
    " outputs.usage, outputs.flags, outputs.model, outputs.response_id, outputs.created_at,"
    " outputs.latency, outputs.server, outputs.params_hash, param_sets.params, outputs.tokens,"
    " items.sample"
    " FROM items JOIN outputs ON outputs.item_id = items.id"
    " LEFT JOIN param_sets ON param_sets.hash = outputs.params_hash"
    " WHERE items.dataset_id = :dataset_id AND items.state = 'done' ORDER BY items.id"
)
# A dataset of several samples per prompt: samples added later have later ids, so its
# rows are sorted, by prompt then sample.
_DONE_SAMPLES = _DONE_FULL.replace("ORDER BY items.id", "ORDER BY items.position, items.sample")
# The generated turns of a batch of multi-turn items: primary-key lookups.
_TURNS = "SELECT item_id, message FROM item_turns WHERE item_id IN {ids} ORDER BY item_id, turn"
# The token rows' walk: each done answer's ids and what the server counted, and, for a
# multi-turn dataset, each turn's (primary-key lookups).
_TOKEN_ROWS = (
    "SELECT items.id, items.key, items.sample, outputs.usage, outputs.ids, outputs.flags,"
    " outputs.model, outputs.params_hash, outputs.server, outputs.created_at"
    " FROM items JOIN outputs ON outputs.item_id = items.id"
    " WHERE items.dataset_id = :dataset_id AND items.state = 'done' ORDER BY items.id"
)
_TOKEN_TURNS = (
    "SELECT item_id, usage, ids, flags, model, params_hash, server, created_at FROM item_turns"
    " WHERE item_id IN {ids} ORDER BY item_id, turn"
)
# What the latest answers take in the database, for doctor's disk estimate.
_BYTES = (
    "SELECT avg(n) FROM (SELECT coalesce(length(content), 0) + coalesce(length(reasoning), 0)"
    " + length(message) + coalesce(length(usage), 0) + coalesce(length(tokens), 0) AS n"
    " FROM outputs"
    " ORDER BY item_id DESC LIMIT :limit) AS recent"
)
_FAILED = (
    "SELECT key, error_class, last_error, attempts, turn, turns, sample FROM items"
    " WHERE dataset_id = :dataset_id AND state = 'failed' ORDER BY position, sample"
)


@dataclass(frozen=True, slots=True)
class DoneItem:
    dataset: str
    key: str
    request: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str | None
    usage: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class DatasetRef:
    """What export must know of a dataset to shape its lines."""

    id: int
    name: str
    regenerate: str  # last | all | each
    passthrough: bool
    endpoint: str = "chat"  # chat | completions
    samples: int = 1  # per prompt (orchestrator.formats.writers.sample_groups)


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A done answer's (or one turn's) ids and what the server counted; ``turns``: a
    multi-turn item's turns in order (``ids`` and the rest the last turn's, then)."""

    key: str
    sample: int
    usage: str | None
    ids: bytes | None
    flags: int
    model: str | None
    params_hash: str | None
    server: str | None
    created_at: float
    turns: list[TokenRow] | None = None


# A batch of full rows and, for multi-turn datasets, each item's turn messages in order.
FullBatch = tuple[list[FullRow], dict[int, list[str]]]


def _missing(names: Sequence[str], datasets: Sequence[tuple[Any, ...]]) -> None:
    known = {row[1] for row in datasets}
    missing = [n for n in names if n not in known]
    if missing:
        raise ConfigError(f"no such dataset: {', '.join(missing)}")


def _chosen(
    datasets: Sequence[tuple[int, str]], names: Sequence[str] | None
) -> list[tuple[int, str]]:
    return [(i, n) for i, n in datasets if not names or n in names]


def _refs(rows: Sequence[Sequence[Any]], names: Sequence[str]) -> list[DatasetRef]:
    _missing(names, [tuple(r) for r in rows])
    return [
        DatasetRef(
            id=r[0],
            name=r[1],
            regenerate=r[2] or "last",
            passthrough=bool(r[3]),
            endpoint=r[4] or "chat",
            samples=r[5] or 1,
        )
        for r in rows
        if not names or r[1] in names
    ]


def _group_turns(rows: Sequence[Sequence[Any]]) -> dict[int, list[str]]:
    turns: dict[int, list[str]] = {}
    for item_id, message in rows:
        turns.setdefault(item_id, []).append(message)
    return turns


def check_names(rows: Rows, names: Sequence[str]) -> None:
    """An unknown dataset name is an error."""
    if names:
        _missing(names, rows.fetch(_DATASETS))


async def check_datasets(database: Database, names: Sequence[str]) -> None:
    """:func:`check_names` on an open database."""
    if names:
        await access.read(database, lambda rows: check_names(rows, names))


def dataset_refs(rows: Rows, names: Sequence[str] = ()) -> list[DatasetRef]:
    """The datasets to export, by name; an unknown name is an error."""
    return _refs(rows.fetch(_DATASET_REFS), names)


def done_rows(rows: Rows, dataset_id: int, *, batch: int = BATCH) -> Iterator[list[DoneRow]]:
    """One dataset's done rows in input order, ``batch`` at a time."""
    return rows.stream(_DONE, {"dataset_id": dataset_id}, batch)  # type: ignore[return-value]


def flagged_rows(
    rows: Rows, dataset_id: int, *, batch: int = BATCH
) -> Iterator[list[tuple[str, str, str, str | None, str | None, int]]]:
    """:func:`done_rows` with each answer's quality flags as a sixth column."""
    return rows.stream(_DONE_FLAGGED, {"dataset_id": dataset_id}, batch)  # type: ignore[return-value]


def done_batches(
    rows: Rows, dataset_names: Sequence[str] | None = None, *, batch: int = BATCH
) -> Iterator[tuple[str, list[DoneRow]]]:
    """(dataset name, rows) in export order, from one read transaction."""
    for dataset_id, name in _chosen(rows.fetch(_DATASETS), dataset_names):
        for part in done_rows(rows, dataset_id, batch=batch):
            yield name, part


def full_batches(
    rows: Rows, dataset: DatasetRef, *, turns: bool = False, batch: int = BATCH
) -> Iterator[FullBatch]:
    """A dataset's done rows as :data:`FullRow`, with their turns when ``turns``."""
    sql = _DONE_SAMPLES if dataset.samples > 1 else _DONE_FULL
    for part in rows.stream(sql, {"dataset_id": dataset.id}, batch):
        by_item: dict[int, list[str]] = {}
        if turns:
            ids = {f"i{n}": row[0] for n, row in enumerate(part)}
            sql = _TURNS.format(ids="(" + ", ".join(f":{k}" for k in ids) + ")")
            by_item = _group_turns(rows.fetch(sql, ids))
        yield part, by_item  # type: ignore[misc]


def token_batches(
    rows: Rows, dataset: DatasetRef, *, batch: int = BATCH
) -> Iterator[list[TokenRow]]:
    """A dataset's done answers with their token ids, in input order, ``batch`` at a time;
    a multi-turn dataset's with each turn's."""
    for part in rows.stream(_TOKEN_ROWS, {"dataset_id": dataset.id}, batch):
        turns: dict[int, list[TokenRow]] = {}
        if dataset.regenerate == "all":
            ids = {f"i{n}": row[0] for n, row in enumerate(part)}
            sql = _TOKEN_TURNS.format(ids="(" + ", ".join(f":{k}" for k in ids) + ")")
            for item_id, usage, blob, *rest in rows.fetch(sql, ids):
                turn = TokenRow("", 0, usage, _bytes(blob), *rest)
                turns.setdefault(item_id, []).append(turn)
        yield [
            TokenRow(key, sample, usage, _bytes(blob), flags, *more, turns=turns.get(item_id))
            for item_id, key, sample, usage, blob, flags, *more in part
        ]


def _bytes(value: Any) -> bytes | None:
    """A BLOB as bytes: sqlite3 and psycopg give bytes, memoryview or bytearray."""
    return bytes(value) if value is not None else None


def failed_rows(rows: Rows, dataset_id: int) -> list[FailedRow]:
    """A dataset's failed items in input order (few: they are read at once)."""
    return rows.fetch(_FAILED, {"dataset_id": dataset_id})  # type: ignore[return-value]


async def output_bytes(database: Database, sample: int) -> float:
    """The mean stored size of the latest ``sample`` answers (0 with none)."""
    found = await access.read(database, lambda rows: rows.fetch(_BYTES, {"limit": sample}))
    return float(found[0][0] or 0)


async def iter_done(
    database: Database, dataset_names: Sequence[str] | None = None, *, batch: int = BATCH
) -> AsyncIterator[DoneItem]:
    """Done items with their outputs parsed, by dataset name then input position.

    One read transaction throughout: a consistent snapshot even while workers commit.
    """
    produce = functools.partial(done_batches, dataset_names=dataset_names, batch=batch)
    async for name, rows in access.read_batches(database, produce):
        for key, request, message, finish_reason, usage in rows:
            yield DoneItem(
                dataset=name,
                key=key,
                request=orjson.loads(request),
                message=orjson.loads(message),
                finish_reason=finish_reason,
                usage=orjson.loads(usage) if usage else None,
            )
