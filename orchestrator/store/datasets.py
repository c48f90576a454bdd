"""Datasets: their request parameters, limits, and the pause switch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.errors import ConfigError
from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """What ``enqueue`` declares about a dataset.

    ``params`` are the request body fields every item of the dataset is sent with
    (model, max_tokens, temperature, top_p and any extra fields); an item's own fields
    win over them. ``concurrency`` caps the dataset's running items across all workers
    (None: only the worker's global limit applies).
    """

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 200:
            raise ConfigError("dataset name must be 1 to 200 characters")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"dataset {self.name}: concurrency must be at least 1")


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    id: int
    name: str
    params: dict[str, Any]
    concurrency: int | None
    priority: int
    paused: bool
    source_path: str | None
    source_sha256: str | None
    input_format: str | None
    created_at: float


def _info(row: sa.Row[Any]) -> DatasetInfo:
    return DatasetInfo(
        id=row.id,
        name=row.name,
        params=orjson.loads(row.params),
        concurrency=row.concurrency,
        priority=row.priority,
        paused=bool(row.paused),
        source_path=row.source_path,
        source_sha256=row.source_sha256,
        input_format=row.input_format,
        created_at=row.created_at,
    )


def _dumps(params: dict[str, Any]) -> str:
    return orjson.dumps(params, option=orjson.OPT_SORT_KEYS).decode()


def _param_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


async def declare(
    conn: AsyncConnection,
    spec: DatasetSpec,
    *,
    source_path: str | None,
    source_sha256: str | None,
    input_format: str | None,
    now: float,
) -> tuple[DatasetInfo, bool]:
    """Create the dataset, or check that an existing one asks for the same requests.

    Changing request parameters under enqueued items would mix outputs made with
    different settings in one dataset, so it is refused. Concurrency and priority are
    operational knobs and may change.
    """
    row = (await conn.execute(sa.select(datasets).where(datasets.c.name == spec.name))).first()
    if row is None:
        values = {
            "name": spec.name,
            "params": _dumps(spec.params),
            "concurrency": spec.concurrency,
            "priority": spec.priority or 0,
            "paused": False,
            "source_path": source_path,
            "source_sha256": source_sha256,
            "input_format": input_format,
            "created_at": now,
            "updated_at": now,
        }
        new_id = (
            await conn.execute(datasets.insert().values(**values).returning(datasets.c.id))
        ).scalar_one()
        row = (await conn.execute(sa.select(datasets).where(datasets.c.id == new_id))).one()
        return _info(row), True
    info = _info(row)
    differences = _param_differences(info.params, spec.params)
    if differences:
        raise ConfigError(
            f"dataset {spec.name!r} already exists with other request parameters ("
            + "; ".join(differences)
            + "); use another dataset name"
        )
    changes: dict[str, Any] = {
        "source_path": source_path,
        "source_sha256": source_sha256,
        "updated_at": now,
    }
    if spec.concurrency is not None:
        changes["concurrency"] = spec.concurrency
    if spec.priority is not None:
        changes["priority"] = spec.priority
    if input_format and info.input_format and input_format != info.input_format:
        changes["input_format"] = "mixed"
    elif input_format:
        changes["input_format"] = input_format
    await conn.execute(datasets.update().where(datasets.c.id == info.id).values(**changes))
    return info, False


async def list_datasets(database: Database) -> list[DatasetInfo]:
    async with database.read() as conn:
        rows = (await conn.execute(sa.select(datasets).order_by(datasets.c.name))).all()
    return [_info(r) for r in rows]


async def set_paused(database: Database, name: str, paused: bool) -> bool:
    """Pause or resume a dataset; returns False when there is no such dataset."""
    async with database.write() as conn:
        result = await conn.execute(
            datasets.update()
            .where(datasets.c.name == name)
            .values(paused=paused, updated_at=time.time())
        )
        return result.rowcount > 0
