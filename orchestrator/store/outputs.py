"""Reading committed outputs back, in a stable order, for export."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.errors import ConfigError
from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets, items, outputs


@dataclass(frozen=True, slots=True)
class DoneItem:
    dataset: str
    key: str
    request: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str | None
    usage: dict[str, Any] | None


async def check_datasets(database: Database, names: Sequence[str]) -> None:
    if not names:
        return
    async with database.read() as conn:
        known = set(
            (
                await conn.execute(
                    sa.select(datasets.c.name).where(datasets.c.name.in_(list(names)))
                )
            ).scalars()
        )
    missing = [n for n in names if n not in known]
    if missing:
        raise ConfigError(f"no such dataset: {', '.join(missing)}")


async def iter_done(
    database: Database, dataset_names: Sequence[str] | None = None, *, batch: int = 2000
) -> AsyncIterator[DoneItem]:
    """Done items with their outputs, by dataset name then input position.

    One read transaction: the export is a consistent snapshot even while workers commit.
    Within a dataset, row ids grow with input position (enqueue inserts lines in order,
    and a later file is placed after the earlier ones), so walking the (dataset, state)
    index in id order yields input order without sorting a million rows.
    """
    async with database.read() as conn:
        query = sa.select(datasets.c.id, datasets.c.name).order_by(datasets.c.name)
        if dataset_names:
            query = query.where(datasets.c.name.in_(list(dataset_names)))
        for dataset_id, name in (await conn.execute(query)).all():
            rows = (
                sa.select(items.c.key, items.c.request, outputs.c.message,
                          outputs.c.finish_reason, outputs.c.usage)
                .select_from(items.join(outputs, outputs.c.item_id == items.c.id))
                .where(items.c.dataset_id == dataset_id, items.c.state == "done")
                .order_by(items.c.id)
            )  # fmt: skip
            result = await conn.stream(rows.execution_options(yield_per=batch))
            async for row in result:
                yield DoneItem(
                    dataset=name,
                    key=row.key,
                    request=orjson.loads(row.request),
                    message=orjson.loads(row.message),
                    finish_reason=row.finish_reason,
                    usage=orjson.loads(row.usage) if row.usage else None,
                )
