"""Datasets: their request parameters, limits, and the pause switch."""

from __future__ import annotations

import hashlib
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.errors import ConfigError
from orchestrator.items.params import request_settings
from orchestrator.settings import dataset_options as allowed
from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets, items, param_sets


def params_hash(params: dict[str, Any]) -> str:
    """The name of a parameter set: outputs record it, ``param_sets`` holds the values."""
    return hashlib.sha256(_dumps(params).encode()).hexdigest()


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
    # None: keep the stored value (or the default for a new dataset).
    regenerate: str | None = None
    on_truncated: str | None = None
    passthrough: bool = False
    on_invalid: str | None = None
    on_overflow: str | None = None
    history_reasoning: str | None = None
    # chat | completions; None: keep the stored value (chat for a new dataset).
    endpoint: str | None = None

    # Answers per prompt (None: keep the stored number, 1 for a new dataset); it may only
    # grow. ``seeds``: one per sample, all different (None: derived from each key).
    samples: int | None = None
    seeds: tuple[int, ...] | None = None
    draw_mode: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in (None, *allowed.ENDPOINTS):
            raise ConfigError(
                f"dataset {self.name}: endpoint must be one of {', '.join(allowed.ENDPOINTS)}"
            )
        _check_draws(self)
        if not self.name or len(self.name) > 200:
            raise ConfigError("dataset name must be 1 to 200 characters")
        if self.concurrency is not None and not 1 <= self.concurrency <= allowed.INT_MAX:
            raise ConfigError(f"dataset {self.name}: concurrency must be 1 to {allowed.INT_MAX}")
        if self.priority is not None and not -allowed.INT_MAX <= self.priority <= allowed.INT_MAX:
            raise ConfigError(
                f"dataset {self.name}: priority must be -{allowed.INT_MAX} to {allowed.INT_MAX}"
            )
        if self.regenerate not in (None, *allowed.REGENERATE):
            raise ConfigError(
                f"dataset {self.name}: regenerate must be one of {', '.join(allowed.REGENERATE)}"
            )
        for key, value, valid in (
            ("on_truncated", self.on_truncated, allowed.ON_TRUNCATED),
            ("on_invalid", self.on_invalid, allowed.ON_INVALID),
            ("on_overflow", self.on_overflow, allowed.ON_OVERFLOW),
            ("history_reasoning", self.history_reasoning, allowed.HISTORY_REASONING),
        ):
            if value not in (None, *valid):
                raise ConfigError(f"dataset {self.name}: {key} must be one of {', '.join(valid)}")


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
    regenerate: str = "last"
    on_truncated: str = "keep"
    passthrough: bool = False
    on_invalid: str = "keep"
    on_overflow: str = "fail"
    history_reasoning: str = "keep"
    updated_at: float = 0.0
    params_hash: str = ""
    endpoint: str = "chat"
    samples: int = 1
    draw_seeds: tuple[int, ...] | None = None
    draw_mode: str = "n"

    @property
    def settings(self) -> dict[str, Any]:
        """The request settings items are sent with (``items.params.item_body``)."""
        return request_settings(self.params, self.history_reasoning)


DRAW_MODES = ("n", "seeds")
"""How a dataset's samples are asked for: one request with ``n`` choices, or a request
per sample, each with its own seed."""

MAX_SAMPLES = 1024


def _check_draws(spec: DatasetSpec) -> None:
    """Samples are distinct draws: a count in range, seeds all different and one each."""
    where = f"dataset {spec.name}"
    if spec.samples is not None and not 1 <= spec.samples <= MAX_SAMPLES:
        raise ConfigError(f"{where}: samples must be 1 to {MAX_SAMPLES}, got {spec.samples}")
    if spec.draw_mode not in (None, *DRAW_MODES):
        raise ConfigError(f"{where}: sample requests must be one of {', '.join(DRAW_MODES)}")
    if spec.seeds is None:
        return
    if any(
        not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= allowed.INT_MAX
        for s in spec.seeds
    ):
        raise ConfigError(f"{where}: seeds must be integers from 0 to {allowed.INT_MAX}")
    repeated = sorted({s for s in spec.seeds if spec.seeds.count(s) > 1})
    if repeated:
        raise ConfigError(
            f"{where}: seed {repeated[0]} is given twice: every sample must be a distinct draw"
        )
    if spec.samples is not None and len(spec.seeds) != spec.samples:
        raise ConfigError(
            f"{where}: {len(spec.seeds)} seeds for {spec.samples} samples: give one per sample"
        )


def _info(row: sa.Row[Any]) -> DatasetInfo:
    """The row's columns as they are, but the parameters parsed and the flags as booleans."""
    values = dict(row._mapping)
    params = orjson.loads(values["params"])
    values.update(
        params=params,
        params_hash=params_hash(request_settings(params, values["history_reasoning"])),
        paused=bool(values["paused"]),
        passthrough=bool(values["passthrough"]),
        draw_seeds=tuple(orjson.loads(values["draw_seeds"])) if values["draw_seeds"] else None,
    )
    return DatasetInfo(**values)


def _dumps(params: dict[str, Any]) -> str:
    return orjson.dumps(params, option=orjson.OPT_SORT_KEYS).decode()


def _param_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


@dataclass(frozen=True, slots=True)
class Change:
    """One setting of a dataset changed: ``max_tokens 2048 → 4096`` (None: unset)."""

    setting: str
    old: Any
    new: Any

    def __str__(self) -> str:
        def shown(value: Any) -> str:
            return "unset" if value is None else orjson.dumps(value).decode()

        return f"{self.setting} {shown(self.old)} → {shown(self.new)}"


KNOBS = (
    "concurrency",
    "priority",
    "on_truncated",
    "on_invalid",
    "on_overflow",
    "history_reasoning",
)
"""Operational settings that may change under enqueued items."""


async def declare(
    conn: AsyncConnection,
    spec: DatasetSpec,
    *,
    source_path: str | None,
    source_sha256: str | None,
    input_format: str | None,
    now: float,
    update: bool = False,
    changed: list[Change] | None = None,
) -> tuple[DatasetInfo, bool]:
    """Create the dataset, or check that an existing one asks for the same requests.

    A parameter ``spec`` does not name keeps its stored value: adding a file to a dataset
    needs none of them repeated. Changing one under enqueued items would mix outputs made
    with different settings in one dataset, so it is refused unless ``update`` is given:
    then the items not done yet are sent with the new value, and every output records
    the set it was made with. Whether a dataset regenerates its last turn or all of
    them, and whether it is pass-through, decide what its items are: they never change.
    Concurrency, priority, the truncation, invalid-answer and overflow policies and
    whether history keeps its reasoning are knobs and may (the last is named in the
    hash outputs record, as parameters are). What changed is appended to ``changed``.
    """
    row = (await conn.execute(sa.select(datasets).where(datasets.c.name == spec.name))).first()
    source = {"source_path": source_path, "source_sha256": source_sha256}
    if row is None:
        return await _create(conn, spec, source, input_format, now), True
    info = _info(row)
    _check_kind(info, spec)
    params = {**info.params, **spec.params}
    differences = _param_differences(info.params, params)
    if differences and not update:
        wanted = {k: v for k, v in spec.params.items() if info.params.get(k) != v}
        raise ConfigError(
            f"dataset {spec.name!r} already exists with other request parameters ("
            + "; ".join(differences)
            + f"); to change them for the items not done yet: `{_set_command(spec.name, wanted)}` "
            "(or pass --update), or use another dataset name"
        )
    knobs = {key: getattr(spec, key) for key in KNOBS}
    extra: dict[str, Any] = {**source, **_draws(spec, info)}
    if input_format and info.input_format and input_format != info.input_format:
        extra["input_format"] = "mixed"
    elif input_format:
        extra["input_format"] = input_format
    found = await _apply(conn, info, params, knobs, extra, now)
    if changed is not None:
        changed.extend(found)
    if found or extra.keys() & {"samples", "draw_seeds", "draw_mode"}:
        info = await _read(conn, info.id)
    return info, False


def _set_command(name: str, params: dict[str, Any]) -> str:
    """The ``dataset set`` command that makes the change ``declare`` refused."""
    words = ["orchestrator", "dataset", "set", name]
    for key, value in sorted(params.items()):
        if key in ("model", "max_tokens", "temperature", "top_p") and value is not None:
            words += [f"--{key.replace('_', '-')}", str(value)]
        else:
            words += ["--param", f"{key}={orjson.dumps(value).decode()}"]
    return shlex.join(words)


async def _apply(
    conn: AsyncConnection,
    info: DatasetInfo,
    params: dict[str, Any],
    knobs: dict[str, Any],
    extra: dict[str, Any],
    now: float,
) -> list[Change]:
    """Write a dataset's new parameters and knobs (None: kept), and ``extra`` columns;
    the one place both ``enqueue`` and ``dataset set`` change a dataset."""
    found = [
        Change(key, info.params.get(key), params.get(key))
        for key in sorted(set(info.params) | set(params))
        if info.params.get(key) != params.get(key)
    ]
    found += [
        Change(key, getattr(info, key), value)
        for key, value in knobs.items()
        if value is not None and value != getattr(info, key)
    ]
    values: dict[str, Any] = {**extra, "updated_at": now}
    values |= {key: value for key, value in knobs.items() if value is not None}
    if params != info.params:
        values["params"] = _dumps(params)
    history = knobs.get("history_reasoning") or info.history_reasoning
    if params != info.params or history != info.history_reasoning:
        await _record_params(conn, request_settings(params, history), now)
    await conn.execute(datasets.update().where(datasets.c.id == info.id).values(**values))
    return found


def _draws(spec: DatasetSpec, info: DatasetInfo | None) -> dict[str, Any]:
    """The sample columns ``spec`` sets (all of them for a new dataset, ``info`` None).

    Samples only grow (fewer would mean deleting answers: requeue does what can be
    undone), and the seeds of samples already there stay theirs: new seeds must extend
    the stored ones.
    """
    samples = spec.samples or (len(spec.seeds) if spec.seeds else None)
    seeds = list(spec.seeds) if spec.seeds is not None else None
    if info is None:
        return {
            "samples": samples or 1,
            "draw_seeds": orjson.dumps(seeds).decode() if seeds else None,
            "draw_mode": spec.draw_mode or "n",
        }
    changes: dict[str, Any] = {}
    if samples is not None and samples != info.samples:
        if samples < info.samples:
            raise ConfigError(
                f"dataset {spec.name!r} has {info.samples} samples per prompt; it cannot "
                f"have fewer ({samples})"
            )
        changes["samples"] = samples
    if seeds is not None and tuple(seeds) != info.draw_seeds:
        stored = list(info.draw_seeds or ())
        if info.samples > 1 and seeds[: len(stored)] != stored:
            raise ConfigError(
                f"dataset {spec.name!r} was enqueued with seeds {stored}: seeds given "
                "again must start with those (the samples drawn with them keep them)"
            )
        changes["draw_seeds"] = orjson.dumps(seeds).decode()
    elif info.draw_seeds is not None and samples is not None and samples > info.samples:
        raise ConfigError(
            f"dataset {spec.name!r} has seeds {list(info.draw_seeds)}: give one for each "
            f"of the {samples} samples (--seeds)"
        )
    if spec.draw_mode is not None and spec.draw_mode != info.draw_mode:
        changes["draw_mode"] = spec.draw_mode
    return changes


async def _read(conn: AsyncConnection, dataset_id: int) -> DatasetInfo:
    row = (await conn.execute(sa.select(datasets).where(datasets.c.id == dataset_id))).one()
    return _info(row)


async def _create(
    conn: AsyncConnection,
    spec: DatasetSpec,
    source: dict[str, str | None],
    input_format: str | None,
    now: float,
) -> DatasetInfo:
    """A new dataset; the settings it leaves unset take their defaults."""
    values = {
        "name": spec.name,
        "params": _dumps(spec.params),
        "concurrency": spec.concurrency,
        "priority": spec.priority or 0,
        "paused": False,
        "regenerate": spec.regenerate or "last",
        "on_truncated": spec.on_truncated or "keep",
        "on_invalid": spec.on_invalid or "keep",
        "on_overflow": spec.on_overflow or "fail",
        "history_reasoning": spec.history_reasoning or "keep",
        "passthrough": spec.passthrough,
        "endpoint": spec.endpoint or "chat",
        **_draws(spec, None),
        **source,
        "input_format": input_format,
        "created_at": now,
        "updated_at": now,
    }
    new_id = (
        await conn.execute(datasets.insert().values(**values).returning(datasets.c.id))
    ).scalar_one()
    await _record_params(conn, request_settings(spec.params, values["history_reasoning"]), now)
    return await _read(conn, new_id)


def _check_kind(info: DatasetInfo, spec: DatasetSpec) -> None:
    """Another kind of dataset (regenerate, passthrough, endpoint) is always refused."""
    fixed = [
        f"{key}: {old!r} -> {new!r}"
        for key, old, new in (
            ("regenerate", info.regenerate, spec.regenerate),
            ("passthrough", info.passthrough, spec.passthrough),
            ("endpoint", info.endpoint, spec.endpoint),
        )
        if new is not None and new != old
    ]
    if fixed:
        raise ConfigError(
            f"dataset {spec.name!r} already exists as another kind of dataset ("
            + "; ".join(fixed)
            + "); use another dataset name"
        )


async def _record_params(conn: AsyncConnection, params: dict[str, Any], now: float) -> None:
    digest = params_hash(params)
    known = await conn.execute(sa.select(param_sets.c.hash).where(param_sets.c.hash == digest))
    if known.first() is None:
        await conn.execute(
            param_sets.insert().values(hash=digest, params=_dumps(params), created_at=now)
        )


@dataclass(frozen=True, slots=True)
class SettingsReport:
    """What a change of a dataset's settings did: each change, and the items it applies
    to (pending ones; running ones finish as sent, done ones keep their answers)."""

    dataset: str
    changed: tuple[Change, ...]
    pending: int
    done: int


async def change_settings(
    database: Database,
    spec: DatasetSpec,
    *,
    unset: Sequence[str] = (),
) -> SettingsReport:
    """Change the settings ``spec`` names of an existing dataset, and only those: its
    ``params`` are merged over the stored ones, ``unset`` keys removed, its knobs set
    where given. Anything else (``enqueue``'s source, template, the other parameters)
    stays as it is."""
    async with database.write() as conn:
        row = (await conn.execute(sa.select(datasets).where(datasets.c.name == spec.name))).first()
        if row is None:
            raise ConfigError(f"no such dataset: {spec.name}")
        info = _info(row)
        if info.passthrough and (spec.params or unset):
            raise ConfigError(
                f"dataset {spec.name!r} is pass-through: it sends no request, so it has no "
                "request parameters to change"
            )
        missing = sorted(set(unset) - set(info.params))
        if missing:
            held = ", ".join(sorted(info.params)) or "none"
            raise ConfigError(
                f"dataset {spec.name!r} does not set {', '.join(missing)} (it sets: {held})"
            )
        params = {k: v for k, v in {**info.params, **spec.params}.items() if k not in unset}
        knobs = {key: getattr(spec, key) for key in KNOBS}
        found = await _apply(conn, info, params, knobs, {}, time.time())
        counts = dict(
            (
                await conn.execute(
                    sa.select(items.c.state, sa.func.count())
                    .where(items.c.dataset_id == info.id)
                    .group_by(items.c.state)
                )
            ).all()
        )
    return SettingsReport(spec.name, tuple(found), counts.get("pending", 0), counts.get("done", 0))


async def pending_count(conn: AsyncConnection, dataset_id: int) -> int:
    """The dataset's items not claimed yet: those a change of its settings applies to."""
    query = sa.select(sa.func.count()).where(
        items.c.dataset_id == dataset_id, items.c.state == "pending"
    )
    return int((await conn.execute(query)).scalar_one())


async def list_datasets(database: Database) -> list[DatasetInfo]:
    async with database.read() as conn:
        rows = (await conn.execute(sa.select(datasets).order_by(datasets.c.name))).all()
    return [_info(r) for r in rows]


class _DryRun(Exception):
    """Raised to roll back ``refusals``' transaction."""


async def refusals(
    database: Database, specs: Sequence[DatasetSpec], *, update: bool = False
) -> list[str]:
    """What ``declare`` would refuse of each spec, with nothing written.

    A run file declares many datasets: one whose parameters changed (without ``update``)
    or whose kind changed must stop the run file before its first dataset is enqueued,
    not after. Runs ``declare`` itself in a transaction that is rolled back, so the
    answer is exactly what enqueuing would meet.
    """
    found: list[str] = []
    try:
        async with database.write() as conn:
            for spec in specs:
                try:
                    await declare(
                        conn,
                        spec,
                        source_path=None,
                        source_sha256=None,
                        input_format=None,
                        now=time.time(),
                        update=update,
                    )
                except ConfigError as exc:
                    found.append(str(exc))
            raise _DryRun
    except _DryRun:
        pass
    return found


async def get_dataset(database: Database, name: str) -> DatasetInfo | None:
    """One dataset by name: what a file added to it must be read as (regenerate, passthrough)."""
    async with database.read() as conn:
        row = (await conn.execute(sa.select(datasets).where(datasets.c.name == name))).first()
    return _info(row) if row is not None else None


async def key_digest(database: Database, dataset_id: int, key: str) -> str | None:
    """The digest of the dataset's item ``key`` (its first sample), or None: whether a
    source's rows are already in the dataset under that key."""
    query = sa.select(items.c.digest).where(
        items.c.dataset_id == dataset_id, items.c.key == key, items.c.sample == 0
    )
    async with database.read() as conn:
        return (await conn.execute(query)).scalar_one_or_none()


async def set_draw_mode(database: Database, dataset_id: int, mode: str) -> None:
    """How the dataset's samples are asked for from now on (``DRAW_MODES``)."""
    async with database.write() as conn:
        await conn.execute(
            datasets.update()
            .where(datasets.c.id == dataset_id)
            .values(draw_mode=mode, updated_at=time.time())
        )


async def set_paused(database: Database, name: str, paused: bool) -> bool:
    """Pause or resume a dataset; returns False when there is no such dataset."""
    async with database.write() as conn:
        result = await conn.execute(
            datasets.update()
            .where(datasets.c.name == name)
            .values(paused=paused, updated_at=time.time())
        )
        return result.rowcount > 0
