"""Loading records into the queue: one transaction per file, batched, idempotent.

A million lines must load in seconds. On SQLite, reading and checking lines (Python, in
this thread) and inserting them (SQLite, in the driver's thread, without the GIL) run at
the same time, one batch apart. Each batch is one multi-row INSERT of the lines as the
reader prepared them, which SQLite runs in half the time of an ``executemany``. Keys are
not looked up beforehand: a new dataset has none to collide with, so only a batch whose
INSERT hits the unique key (a repeated line, a file enqueued again) is sorted out line by
line, and while a file keeps overlapping stored items, batches are checked first.

Datasets that regenerate every assistant turn store the turn count too, bound the same
way (``each``: an item per turn, each of one). Pass-through datasets store a done state
and an output row per line and take the portable path: they are rarely the million-line
sets.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, islice
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import aiosqlite
import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.errors import ConfigError, InputError
from orchestrator.items.records import Prepared, PreparedItem, Record
from orchestrator.store.datasets import Change, DatasetInfo, DatasetSpec, declare, pending_count
from orchestrator.store.engine import Database, insert_many, storage_error
from orchestrator.store.schema import items

T = TypeVar("T")

BATCH = 2000
"""Lines per statement: big enough that a statement's fixed costs and the hand-over to the
driver's thread vanish per line, small enough to keep memory flat."""


@dataclass(slots=True)
class EnqueueReport:
    dataset: str
    created: bool
    added: int = 0
    already_present: int = 0
    invalid: list[InputError] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)
    mode: str = "last"
    """``last``, ``all`` or ``passthrough`` (its items are stored as done)."""
    turns: int = 0
    """Assistant turns to generate for the items added (``added`` unless ``all``)."""
    samples: int = 1
    """Samples per prompt of the dataset (``items.sample``)."""
    samples_added: int = 0
    """Sample rows added: ``added`` times ``samples``, plus those added to prompts
    already present when ``samples`` grew."""
    changed: list[Change] = field(default_factory=list)
    """Settings of an existing dataset this enqueue changed (``update``, knobs)."""
    pending: int = 0
    """The dataset's pending items afterwards, when settings changed: what they apply to."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def enqueue(
    database: Database,
    spec: DatasetSpec,
    records: Iterable[Record] | Iterable[Prepared] | Iterable[PreparedItem],
    *,
    path: str,
    on_invalid: Callable[[InputError], None] | None = None,
    progress: Callable[[int], None] | None = None,
    update: bool = False,
    hash_source: bool = True,
    source_sha256: str | None = None,
    place: Place | None = None,
) -> EnqueueReport:
    """Insert every record of one file, or nothing; then every prompt's missing samples.

    A key already in the dataset with the same content is skipped (enqueue is
    idempotent); with other content it is an error, as is a key repeated within the
    file. ``on_invalid`` given: such lines are reported to it and skipped instead.
    ``records`` may be ``Record``s or, cheaper, ``Prepared`` tuples
    (``formats.iter_prepared``) read the way the dataset needs: for ``regenerate="all"``
    or pass-through (``ConfigError`` otherwise, before anything is written). Pass-through
    rows are stored done, each with an empty output row, and are never claimed.
    ``update``: see ``datasets.declare``. ``hash_source=False``: ``path`` names the
    records, ``source_sha256`` is their digest. ``place``: where a record's ``line`` is."""
    now = time.time()
    sha = file_sha256(path) if hash_source else source_sha256
    async with database.write() as conn:
        baseline = (
            await conn.execute(sa.select(sa.func.coalesce(sa.func.max(items.c.id), 0)))
        ).scalar_one()
        rows = _prepared(records)
        first = next(rows, None)
        changed: list[Change] = []
        info, created = await declare(
            conn,
            spec,
            source_path=str(path),
            source_sha256=sha,
            input_format=first[2] if first is not None else None,
            now=now,
            update=update,
            changed=changed,
        )
        mode = "passthrough" if info.passthrough else info.regenerate
        report = EnqueueReport(dataset=spec.name, created=created, mode=mode, changed=changed)
        seen = 0
        if first is not None:
            _check_mode(info, mode, first)
            # A second file in the same dataset is ordered after the first.
            base = (
                await conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(items.c.position), 0)).where(
                        items.c.dataset_id == info.id
                    )
                )
            ).scalar_one()
            context = _Context(info, baseline, base, now, path, report, on_invalid, mode, place)
            writer = await _writer(conn, database, context)
            seen = await _write_all(writer, first, rows, report, progress)
        if progress:
            progress(seen)
        await _add_samples(conn, info, report, now, str(path))
        if changed:
            report.pending = await pending_count(conn, info.id)
    if report.added or report.samples_added:
        await database.refresh_statistics("items")
    return report


async def _write_all(
    writer: _Writer,
    first: Any,
    rows: Iterator[Any],
    report: EnqueueReport,
    progress: Callable[[int], None] | None,
) -> int:
    """Write ``first`` and the rest of ``rows`` in the writer's batches; the rows seen."""
    size, seen = writer.batch_size, 0
    try:
        batch = [first, *islice(rows, size - 1)]
        while batch:
            formats = report.formats
            for fmt, n in Counter(map(itemgetter(2), batch)).items():
                formats[fmt] = formats.get(fmt, 0) + n
            await writer.write(batch)
            seen += len(batch)
            if progress:
                progress(seen)
            # Read and check the next lines while SQLite inserts these.
            batch = list(islice(rows, size))
        await writer.flush()
    except InputError:
        # A bad line in the batch still being written comes first in the file.
        await writer.flush()
        raise
    finally:
        await writer.close()
    return seen


async def _seeded_line(conn: AsyncConnection, dataset_id: int) -> str | None:
    """The key of a prompt whose request sets ``seed``, if any: the few bodies holding
    the text are parsed (a tool's parameter may be called seed too)."""
    rows = await conn.stream(
        sa.select(items.c.key, items.c.request).where(
            items.c.dataset_id == dataset_id,
            items.c.sample == 0,
            items.c.request.like('%"seed":%'),
        )
    )
    async for key, request in rows:
        if "seed" in orjson.loads(request):
            return str(key)
    return None


_MISSING_SAMPLE = (
    'INSERT INTO items (dataset_id, "key", position, request, digest, created_at, updated_at,'
    " predicted_tokens, turns, sample)"
    ' SELECT dataset_id, "key", position, request, digest, :now, :now, predicted_tokens, turns,'
    " :sample FROM items AS first WHERE dataset_id = :dataset AND sample = 0 AND NOT EXISTS"
    " (SELECT 1 FROM items AS other WHERE other.dataset_id = first.dataset_id"
    ' AND other."key" = first."key" AND other.sample = :sample)'
)


async def _add_samples(
    conn: AsyncConnection, info: DatasetInfo, report: EnqueueReport, now: float, path: str
) -> None:
    """Every prompt of the dataset gets the samples it lacks, 1 to ``samples - 1``: the
    lines just added, and the prompts already there when the count grew. Each sample is
    a copy of sample 0 (the same key, position and request), pending; none is ever
    added twice (the unique key and the NOT EXISTS). A fixed seed in the parameters or
    in a line would make every sample the same draw: refused."""
    report.samples = info.samples
    report.samples_added = report.added
    if info.samples <= 1:
        return
    if info.passthrough:
        raise ConfigError(f"dataset {info.name!r} is pass-through: it cannot have samples")
    if "seed" in info.params:
        raise ConfigError(
            f"dataset {info.name!r}: a seed in the parameters would make its "
            f"{info.samples} samples the same draw; give each its own with --seeds"
        )
    key = await _seeded_line(conn, info.id)
    if key is not None:
        raise InputError(
            f"key {key!r} sets its own seed: its {info.samples} samples would be the same "
            "draw (drop the line's seed, or give each sample one with --seeds)",
            path=path,
        )
    for sample in range(1, info.samples):
        params = {"now": now, "sample": sample, "dataset": info.id}
        added = await conn.execute(sa.text(_MISSING_SAMPLE), params)
        report.samples_added += max(added.rowcount or 0, 0)


def _prepared(
    records: Iterable[Record] | Iterable[Prepared] | Iterable[PreparedItem],
) -> Iterator[Any]:
    """The records as ``Prepared`` (or ``PreparedItem``) tuples, encoding each request once
    if need be."""
    it = iter(records)
    first = next(it, None)
    if first is None:
        return iter(())
    if isinstance(first, tuple):
        return chain((first,), it)
    if getattr(first, "mode", "last") == "last":
        return (
            (r.line, r.key, r.fmt, r.digest, orjson.dumps(r.request).decode(), r.predicted_tokens)
            for r in chain((first,), it)  # type: ignore[union-attr]
        )
    return (
        (
            r.line,
            r.key,
            r.fmt,
            r.digest,
            orjson.dumps(r.request).decode(),
            r.mode,
            r.turns,
            r.prompt_tokens,
            r.completion_tokens,
            r.predicted_tokens,
        )
        for r in chain((first,), it)  # type: ignore[union-attr]
    )


_MODE_NAMES = {
    "last": "regenerates the final answer",
    "all": "regenerates every assistant turn",
    "each": "regenerates each assistant turn on its own",
    "passthrough": "is pass-through",
}
_READ_AS = {
    "last": "as prompts",
    "all": 'with regenerate="all"',
    "each": 'with regenerate="each"',
    "passthrough": "with passthrough=True",
}


def _check_mode(info: DatasetInfo, mode: str, first: tuple[Any, ...]) -> None:
    """Lines read for another kind of dataset would be stored wrong: refuse them."""
    read = first[5] if len(first) > 6 else "last"  # a PreparedItem names its mode
    if read != mode:
        raise ConfigError(
            f"dataset {info.name!r} {_MODE_NAMES[mode]}, but the lines were read for a "
            f"dataset that {_MODE_NAMES[read]}: read them {_READ_AS[mode]}"
        )


Place = Callable[[int], tuple[str, int | None, int | None]]
"""A record's ``line`` to where it is: ``(path, line, row)`` as ``InputError`` takes them."""


@dataclass(slots=True)
class _Context:
    """What every batch of one file shares."""

    info: DatasetInfo
    baseline: int
    """Largest item id before this file: a key found above it was added by this file."""
    base: int
    """Largest position in the dataset before this file; line N goes at ``base + N``."""
    now: float
    path: str
    report: EnqueueReport
    on_invalid: Callable[[InputError], None] | None
    mode: str = "last"
    place: Place | None = None

    def error(self, reason: str, line: int) -> InputError:
        """``reason`` for the record at ``line``, named where it is."""
        if self.place is None:
            return InputError(reason, path=self.path, line=line)
        path, at_line, row = self.place(line)
        return InputError(reason, path=path, line=at_line, row=row)

    def first(self, line: int) -> str:
        """Where the first record with a repeated key is: ``line 3``, or its file and row."""
        if self.place is None:
            return f"line {line}"
        path, at_line, row = self.place(line)
        if row is None:
            return f"line {at_line}" if path == self.path else f"{path}:{at_line}"
        return f"{path}:row {row}"

    def reject(self, error: InputError) -> None:
        if self.on_invalid is None:
            raise error
        self.on_invalid(error)
        self.report.invalid.append(error)


class _Existing(NamedTuple):
    id: int
    key: str
    digest: str
    position: int


async def _writer(conn: AsyncConnection, database: Database, context: _Context) -> _Writer:
    if database.is_sqlite and context.mode != "passthrough":
        driver = (await conn.get_raw_connection()).driver_connection
        if isinstance(driver, aiosqlite.Connection):
            limit = await _in_driver_thread(driver, _variable_limit)
            # The statement binds 3 + 6 (or 7) per line, the key lookup 1 + 1 per line.
            width = _WIDTHS[context.mode]
            return _SqliteWriter(context, driver, database, min(BATCH, (limit - 3) // width))
    return _Writer(context, conn)


def _variable_limit(raw: sqlite3.Connection) -> int:
    return raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)


class _Writer:
    """Checks each batch against the keys already stored, then inserts what is new.

    The portable way: one SELECT and one executemany per batch, in turn with reading.
    """

    def __init__(
        self, context: _Context, conn: AsyncConnection | None = None, batch_size: int = 0
    ) -> None:
        self.context = context
        self.conn = conn
        self.batch_size = batch_size or BATCH

    async def write(self, batch: list[Any]) -> None:
        fresh = await self._fresh(batch)
        if not fresh:
            return
        c = self.context
        dataset_id, base, now = c.info.id, c.base, c.now
        assert self.conn is not None
        if c.mode == "last":
            rows = [(dataset_id, r[1], base + r[0], r[4], r[3], now, now, r[5]) for r in fresh]
            await insert_many(self.conn, "items", (*_INSERT_COLUMNS, "predicted_tokens"), rows)
            c.report.turns += len(rows)
        elif c.mode in _TURNED:
            rows = [
                (dataset_id, r[1], base + r[0], r[4], r[3], now, now, r[9], r[6]) for r in fresh
            ]
            columns = (*_INSERT_COLUMNS, "predicted_tokens", "turns")
            await insert_many(self.conn, "items", columns, rows)
            c.report.turns += sum(r[6] for r in fresh)
        else:
            rows = [
                (dataset_id, r[1], base + r[0], r[4], r[3], now, now, "done", now) for r in fresh
            ]
            await insert_many(self.conn, "items", (*_INSERT_COLUMNS, "state", "finished_at"), rows)
            await self._passed_outputs(fresh)
        c.report.added += len(rows)

    async def _passed_outputs(self, fresh: list[Any]) -> None:
        """The output rows of pass-through items just inserted: done, nothing generated."""
        c = self.context
        ids = {row.key: row.id for row in await self._existing([r[1] for r in fresh])}
        model = c.info.params.get("model")
        model = model if isinstance(model, str) else None
        rows = [(ids[r[1]], c.info.id, "{}", 0, 0.0, 0, c.now, model, r[7], r[8]) for r in fresh]
        assert self.conn is not None
        await insert_many(self.conn, "outputs", _PASSED_OUTPUT_COLUMNS, rows)

    async def flush(self) -> None:
        """Finish the batch in flight, if any."""

    async def close(self) -> None:
        """Leave nothing running, whatever happened."""

    async def _existing(self, keys: list[str]) -> list[_Existing]:
        assert self.conn is not None
        result = await self.conn.execute(
            sa.select(items.c.id, items.c.key, items.c.digest, items.c.position).where(
                items.c.dataset_id == self.context.info.id, items.c.key.in_(keys)
            )
        )
        return [_Existing(*row) for row in result.all()]

    async def _fresh(self, batch: list[Any]) -> list[Any]:
        """The lines of ``batch`` to insert; the others are present already or rejected."""
        c = self.context
        existing = {row.key: row for row in await self._existing([r[1] for r in batch])}
        in_batch: dict[str, int] = {}
        fresh = []
        for record in batch:
            line, key, _fmt, digest = record[:4]
            old = existing.get(key)
            first_line = in_batch.get(key)
            if first_line is None and old is not None and old.id > c.baseline:
                first_line = old.position - c.base
            if first_line is not None:
                first = c.first(first_line)
                at = "on" if first.startswith("line ") else "at"
                c.reject(c.error(f"duplicate key {key!r} (first {at} {first})", line))
                continue
            if old is not None:
                if old.digest != digest:
                    c.reject(c.error(_changed(key, line, c.info.name), line))
                else:
                    c.report.already_present += 1
                continue
            in_batch[key] = line
            fresh.append(record)
        return fresh


def _changed(key: str, line: int, dataset: str) -> str:
    """Why a line is refused whose key the dataset holds with other content, and what to
    do: a line without an ``id`` is keyed by its line number, so that key is shared by
    every such file (a second id-less file does not fit in the same dataset)."""
    message = f"key {key!r} is already enqueued in dataset {dataset!r} with different content"
    if key != str(line):
        return message
    return (
        f'{message}. A line without an "id" is keyed by its line number, so line {line} '
        f'of any id-less file has key {key!r}: give every line an "id" (or '
        '"custom_id"), or enqueue this file into a dataset of its own'
    )


class _SqliteWriter(_Writer):
    """Inserts a batch in the driver's thread while the caller prepares the next one.

    One batch at a time is in flight, and batches finish in file order, so a duplicate
    key is always reported on its second line, naming the first.
    """

    def __init__(
        self,
        context: _Context,
        driver: aiosqlite.Connection,
        database: Database,
        batch_size: int,
    ) -> None:
        super().__init__(context, batch_size=batch_size)
        self.driver = driver
        self.database = database
        self.checked = False
        """Look keys up before inserting, while the file overlaps stored items."""
        self._pending: asyncio.Future[Any] | None = None
        self._batch: list[Prepared] = []

    async def write(self, batch: list[Any]) -> None:
        await self.flush()
        if self.context.mode in _TURNED:
            # (line, key, fmt, digest, body, predicted_tokens, turns): what it binds.
            batch = [(*r[:5], r[9], r[6]) for r in batch]
        if self.checked:
            present = self.context.report.already_present
            batch = await self._fresh(batch)
            self.checked = self.context.report.already_present > present
            if not batch:
                return
        self._batch = batch
        started = threading.Event()
        sql = _insert_sql(len(batch), _WIDTHS[self.context.mode])
        self._pending = asyncio.ensure_future(self._run(sql, batch, started))
        # One turn of the loop hands the INSERT to the driver's thread. Then let that thread
        # have the GIL until SQLite takes over (it gives the GIL up for the statement):
        # left to the interpreter, it would wait a whole switch interval (5 ms) for it,
        # about as long as preparing the next batch takes, and nothing would overlap.
        await asyncio.sleep(0)
        started.wait(_HANDOVER_TIMEOUT)

    async def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        batch = self._batch
        report = self.context.report
        try:
            try:
                await pending
            except sqlite3.IntegrityError:
                # Some key is taken (the statement inserted nothing): sort the lines out.
                present = report.already_present
                batch = await self._fresh(batch)
                if batch:
                    await self._run(_insert_sql(len(batch), _WIDTHS[self.context.mode]), batch)
                self.checked = report.already_present > present
        except sqlite3.Error as exc:
            raise storage_error(exc, self.database.url) from exc
        report.added += len(batch)
        report.turns += sum(r[6] for r in batch) if self.context.mode in _TURNED else len(batch)

    async def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            # The transaction is being abandoned: wait for the statement, drop its outcome.
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()

    async def _run(
        self, sql: str, batch: list[Prepared], started: threading.Event | None = None
    ) -> None:
        c = self.context
        params = [c.info.id, c.now, c.base, *chain.from_iterable(batch)]
        await _in_driver_thread(self.driver, partial(_insert_in_thread, sql, params, started))

    async def _existing(self, keys: list[str]) -> list[_Existing]:
        sql = (
            'SELECT id, "key", digest, position FROM items WHERE dataset_id = ? AND "key" IN '
            f"({', '.join('?' * len(keys))})"
        )
        try:
            rows = await self.driver.execute_fetchall(sql, [self.context.info.id, *keys])
        except sqlite3.Error as exc:
            raise storage_error(exc, self.database.url) from exc
        return [_Existing(*row) for row in rows]


_HANDOVER_TIMEOUT = 1.0
"""Seconds to hold back for the driver's thread at most (it only matters for speed)."""


async def _in_driver_thread(
    driver: aiosqlite.Connection, fn: Callable[[sqlite3.Connection], T]
) -> T:
    """Run ``fn`` on the sqlite3 connection, in the aiosqlite thread that owns it.

    aiosqlite has no public way to do this; ``_execute`` and ``_conn`` are what its own
    ``execute`` uses (and SQLAlchemy's aiosqlite dialect relies on the same internals).
    """
    return await driver._execute(fn, driver._conn)


def _insert_in_thread(
    sql: str, params: list[Any], started: threading.Event | None, raw: sqlite3.Connection
) -> None:
    if started is not None:
        started.set()
    raw.execute(sql, params)


@functools.lru_cache(maxsize=8)
def _insert_sql(n: int, width: int = 6) -> str:
    """A multi-row INSERT of ``n`` prepared lines bound as they are.

    Parameters: ?1 dataset id, ?2 now, ?3 base position, then each line's
    ``(line, key, fmt, digest, body, predicted_tokens)``, plus ``turns`` when ``width``
    is 7; the format is bound but not stored.
    """
    turns = width == 7
    values = ", ".join(
        f"(?1, ?{p + 1}, ?3 + ?{p}, ?{p + 4}, ?{p + 3}, ?2, ?2, ?{p + 5}"
        + (f", ?{p + 6})" if turns else ")")
        for p in range(4, 4 + width * n, width)
    )
    names = (*_INSERT_COLUMNS, "predicted_tokens", *(("turns",) if turns else ()))
    columns = ", ".join(f'"{c}"' for c in names)
    return f"INSERT INTO items ({columns}) VALUES {values}"


_WIDTHS = {"last": 6, "all": 7, "each": 7}
"""Parameters bound per line by the SQLite writer, by mode."""
_TURNED = ("all", "each")
"""Modes whose rows are ``PreparedItem``s and store their turn count (1 for ``each``)."""


# An output row for a pass-through item (the rest stay NULL): message "{}", flags 0,
# attempt 0, latency 0, the dataset's model, the row's own token counts if any.
_PASSED_OUTPUT_COLUMNS = (
    "item_id",
    "dataset_id",
    "message",
    "flags",
    "latency",
    "attempt",
    "created_at",
    "model",
    "prompt_tokens",
    "completion_tokens",
)

# New pending rows; state, attempts and not_before take their column defaults.
_INSERT_COLUMNS = (
    "dataset_id",
    "key",
    "position",
    "request",
    "digest",
    "created_at",
    "updated_at",
)
