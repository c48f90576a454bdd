"""Loading records into the queue: one transaction per file, batched, idempotent."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.errors import InputError
from orchestrator.store.datasets import DatasetInfo, DatasetSpec, declare
from orchestrator.store.engine import Database, insert_many
from orchestrator.store.schema import items

BATCH = 2000


class RecordLike(Protocol):
    """What the store needs of an input record (``orchestrator.formats.Record``)."""

    @property
    def line(self) -> int: ...
    @property
    def key(self) -> str: ...
    @property
    def request(self) -> dict: ...
    @property
    def digest(self) -> str: ...
    @property
    def fmt(self) -> str: ...


@dataclass(slots=True)
class EnqueueReport:
    dataset: str
    created: bool
    added: int = 0
    already_present: int = 0
    invalid: list[InputError] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def enqueue(
    database: Database,
    spec: DatasetSpec,
    records: Iterable[RecordLike],
    *,
    path: str,
    on_invalid: Callable[[InputError], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> EnqueueReport:
    """Insert every record of one file, or nothing.

    A key already in the dataset with the same content is skipped (enqueue is
    idempotent); with other content it is an error, as is a key repeated within the
    file. ``on_invalid`` given: such lines are reported to it and skipped instead.
    """
    now = time.time()
    sha = file_sha256(path)
    async with database.write() as conn:
        baseline = (
            await conn.execute(sa.select(sa.func.coalesce(sa.func.max(items.c.id), 0)))
        ).scalar_one()
        info: DatasetInfo | None = None
        report: EnqueueReport | None = None
        batch: list[RecordLike] = []
        seen = 0
        base = 0

        def reject(error: InputError) -> None:
            if on_invalid is None:
                raise error
            on_invalid(error)
            assert report is not None
            report.invalid.append(error)

        for record in records:
            if info is None:
                info, created = await declare(
                    conn,
                    spec,
                    source_path=str(path),
                    source_sha256=sha,
                    input_format=record.fmt,
                    now=now,
                )
                report = EnqueueReport(dataset=spec.name, created=created)
                # A second file in the same dataset is ordered after the first.
                base = (
                    await conn.execute(
                        sa.select(sa.func.coalesce(sa.func.max(items.c.position), 0)).where(
                            items.c.dataset_id == info.id
                        )
                    )
                ).scalar_one()
            assert report is not None
            report.formats[record.fmt] = report.formats.get(record.fmt, 0) + 1
            batch.append(record)
            seen += 1
            if len(batch) >= BATCH:
                await _insert_batch(conn, info, batch, baseline, base, report, reject, path, now)
                batch = []
                if progress:
                    progress(seen)
        if info is None:
            # Every line was invalid and skipped: record the dataset all the same.
            info, created = await declare(
                conn, spec, source_path=str(path), source_sha256=sha, input_format=None, now=now
            )
            report = EnqueueReport(dataset=spec.name, created=created)
        assert report is not None
        if batch:
            await _insert_batch(conn, info, batch, baseline, base, report, reject, path, now)
        if progress:
            progress(seen)
    return report


async def _insert_batch(
    conn: AsyncConnection,
    info: DatasetInfo,
    batch: list[RecordLike],
    baseline: int,
    base: int,
    report: EnqueueReport,
    reject: Callable[[InputError], None],
    path: str,
    now: float,
) -> None:
    existing = {
        row.key: row
        for row in (
            await conn.execute(
                sa.select(items.c.id, items.c.key, items.c.digest, items.c.position).where(
                    items.c.dataset_id == info.id, items.c.key.in_([r.key for r in batch])
                )
            )
        ).all()
    }
    in_batch: dict[str, int] = {}
    rows = []
    for record in batch:
        old = existing.get(record.key)
        first_line = in_batch.get(record.key)
        if first_line is None and old is not None and old.id > baseline:
            first_line = old.position - base
        if first_line is not None:
            reject(
                InputError(
                    f"duplicate key {record.key!r} (first on line {first_line})",
                    path=path,
                    line=record.line,
                )
            )
            continue
        if old is not None:
            if old.digest != record.digest:
                reject(
                    InputError(
                        f"key {record.key!r} is already enqueued in dataset {info.name!r} "
                        "with different content",
                        path=path,
                        line=record.line,
                    )
                )
            else:
                report.already_present += 1
            continue
        in_batch[record.key] = record.line
        rows.append(
            (
                info.id,
                record.key,
                base + record.line,
                orjson.dumps(record.request).decode(),
                record.digest,
                now,
                now,
            )
        )
    if rows:
        await insert_many(conn, "items", _INSERT_COLUMNS, rows)
        report.added += len(rows)


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
