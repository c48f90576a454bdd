"""Adding prompts to a dataset: the one way both ``orchestrator enqueue`` and the Python
API (``orchestrator.api``) do it, so a file, a Parquet folder, a Hub dataset and a list of
dicts get the same checks.

The options a dataset is made with are settled here against what the database already
holds (a file added to an existing dataset is read the way the dataset was made).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError, InputError, OrchestratorError
from orchestrator.formats import iter_prepared
from orchestrator.items.params import logprob_params, token_id_params
from orchestrator.settings.checks import DATASET, RECORDS, OrNone, check_all, checked
from orchestrator.store import DatasetSpec
from orchestrator.store import enqueue as do_enqueue
from orchestrator.store.datasets import KNOBS, get_dataset, key_digest, refusals

if TYPE_CHECKING:
    from orchestrator.formats.readers.columns import Columns
    from orchestrator.formats.readers.rows import Reading
    from orchestrator.runfile import DatasetPlan
    from orchestrator.store import Database, EnqueueReport

#: What ``enqueue`` takes: a path (a JSONL, Parquet, CSV or Arrow file, a folder of them, a
#: glob, ``-``, ``hf://ORG/NAME``), a table (``datasets``, ``pyarrow``, pandas), or rows
#: (dicts in any input format). ``orchestrator.formats.readers.source.open_source`` reads them.
Source = str | os.PathLike[str] | Iterable[Any] | Any


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueOptions:
    """One dataset's settings, as the ``enqueue`` command's options give them.

    Checked by the rules of ``orchestrator.settings.checks.DATASET``, which the command's options
    and a run file's keys take theirs from too. ``sampling`` names the request options
    the caller set, in the caller's own words (``--max-tokens`` or ``max_tokens``): a
    pass-through dataset sends no request, so they are refused for it by those names.
    """

    dataset: str
    params: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = None
    priority: int | None = None
    format: str = "auto"
    regenerate: str | None = None
    on_truncated: str | None = None
    on_invalid: str | None = None
    on_overflow: str | None = None
    history_reasoning: str | None = None
    """``keep`` (the default) or ``drop`` the reasoning of earlier turns in the history."""
    passthrough: bool = False
    update: bool = False
    sampling: tuple[str, ...] = ()
    samples: int | None = None
    """Answers per prompt (None: the dataset's, 1 for a new one); ``seeds`` one each."""
    seeds: Sequence[int] | None = None
    sample_requests: str | None = None
    """``n`` (one request with n choices) or ``seeds`` (one per sample)."""
    columns: Columns | None = None
    """How rows are read by their columns (prompt, messages, template, id, tools)."""
    split: str | None = None
    config: str | None = None
    """A Hub dataset's (or DatasetDict's) split, and a Hub dataset's configuration."""
    endpoint: str | None = None
    """chat or completions (``/v1/completions``, plain prompts); None: the dataset's, else
    chat. Fixed when the dataset is created."""
    logprobs: int | None = None
    """Keep each answer's token logprobs and this many top alternatives per token."""
    token_ids: bool = False
    """Keep the server's own prompt and generated token ids of every turn."""
    spelling: Mapping[str, str] = field(default_factory=dict)
    """Option names in the caller's words for messages (``prompt_column`` ->
    ``--prompt-column``); the key itself where absent."""

    def __post_init__(self) -> None:
        check_all({name: getattr(self, name) for name in DATASET}, DATASET)


def is_path(source: Source) -> bool:
    """A path names a file, a folder, a glob, ``-`` or ``hf://``; anything else is rows."""
    return isinstance(source, str | os.PathLike)


def source_name(source: Source) -> str:
    """How errors and the report name the source: the path, or ``<records>``."""
    return os.fsdecode(source) if is_path(source) else "<records>"  # type: ignore[arg-type]


def read(
    source: Source,
    *,
    fmt: str,
    regenerate: str,
    passthrough: bool,
    columns: Columns | None,
    split: str | None,
    config: str | None,
    spelling: Mapping[str, str] | None = None,
    on_invalid: Callable[[InputError], None] | None = None,
    endpoint: str = "chat",
) -> Reading[Any]:
    """``source`` opened and checked for a dataset read this way, its rows not read yet:
    the one reading every enqueue (a command's, the API's, a run file's) goes through."""
    names = spelling or {}
    return iter_prepared(
        source,
        on_invalid=on_invalid,
        fmt=fmt,
        regenerate=regenerate,
        passthrough=passthrough,
        columns=columns,
        split=split,
        config=config,
        say=lambda key: names.get(key, key),
        endpoint=endpoint,
    )


def _check_endpoint(
    name: str, endpoint: str, mode: str, passthrough: bool, logprobs: int | None
) -> None:
    """Raw completions are one prompt, one answer; a conversation's turns keep no logprobs
    (an item per turn, ``each``, does: each is one answer)."""
    if endpoint == "completions" and (passthrough or mode != "last"):
        kind = "pass-through" if passthrough else f"regenerate {mode}"
        raise ConfigError(
            f"dataset {name!r}: --endpoint completions sends one plain prompt per row; "
            f"it does not go with {kind}"
        )
    if logprobs is not None and mode == "all":
        raise ConfigError(
            f"dataset {name!r}: --logprobs keeps one answer's tokens; it does not go with "
            "regenerate all (each turn is a separate answer)"
        )


async def store_reading(
    database: Database,
    spec: DatasetSpec,
    reading: Reading[Any],
    *,
    on_invalid: Callable[[InputError], None] | None,
    progress: Callable[[int], None] | None,
    update: bool,
) -> EnqueueReport:
    """A reading's rows into the store, in one transaction, named by their places."""
    records = await _older_keys(database, spec.name, reading)
    return await do_enqueue(
        database,
        spec,
        records,
        path=reading.name,
        on_invalid=on_invalid,
        progress=progress,
        update=update,
        hash_source=False,
        source_sha256=reading.sha256(),
        place=reading.place,
    )


async def _older_keys(database: Database, name: str, reading: Reading[Any]) -> Iterable[Any]:
    """``reading``'s rows, keyed as an earlier version keyed them where the dataset holds
    them so: a table file named directly was keyed by its own name alone
    (``train.parquet:1``), now by its folder's too (``a/train.parquet:1``). Its first
    row's old key holding the same content says the file is in the dataset under the old
    keys, and enqueuing it again adds nothing."""
    older = getattr(reading.source, "older", None)
    info = await get_dataset(database, name) if older is not None else None
    if info is None:
        return reading
    rows = iter(reading)
    first = next(rows, None)
    if first is None:
        return ()
    prefix = f"{reading.source.files[0][1]}:"  # type: ignore[attr-defined]
    key, digest = first[1], first[3]
    if not key.startswith(prefix):
        return itertools.chain([first], rows)
    if await key_digest(database, info.id, f"{older}:{key[len(prefix) :]}") != digest:
        return itertools.chain([first], rows)
    return (_rekeyed(row, prefix, f"{older}:") for row in itertools.chain([first], rows))


def _rekeyed(row: Any, prefix: str, older: str) -> Any:
    key = row[1]
    return row._replace(key=older + key[len(prefix) :]) if key.startswith(prefix) else row


async def enqueue_source(
    database: Database,
    options: EnqueueOptions,
    source: Source,
    *,
    on_invalid: Callable[[InputError], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> EnqueueReport:
    """Read ``source`` the way its dataset is made and add its items in one transaction."""
    checked("records", source, RECORDS)
    name = options.dataset
    info = await get_dataset(database, name)
    passing = options.passthrough or bool(info and info.passthrough)
    if passing and options.sampling:
        raise ConfigError(
            f"dataset {name!r} is pass-through: its rows are stored as done and "
            f"no request is sent, so {', '.join(options.sampling)} do not apply"
        )
    mode = options.regenerate or (info.regenerate if info else "last")
    endpoint = options.endpoint or (info.endpoint if info else "chat")
    _check_endpoint(name, endpoint, mode, passing, options.logprobs)
    params = {**options.params, **logprob_params(endpoint, options.logprobs)}
    params |= token_id_params(options.token_ids)
    spec = _spec(
        options, name, params, regenerate=mode, passthrough=passing, endpoint=options.endpoint
    )
    reading = read(
        source,
        endpoint=endpoint,
        fmt=options.format,
        regenerate=mode,
        passthrough=passing,
        columns=options.columns,
        split=options.split,
        config=options.config,
        spelling=options.spelling,
        on_invalid=on_invalid,
    )
    return await store_reading(
        database, spec, reading, on_invalid=on_invalid, progress=progress, update=options.update
    )


def request_body(
    params: dict[str, Any] | None,
    *,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
) -> dict[str, Any]:
    """The request body every item of a dataset is sent with: ``params`` and the named
    fields given (a named field wins over the same key in ``params``)."""
    checked("params", params, OrNone(DATASET["params"]))
    named = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    return {**(params or {}), **{k: v for k, v in named.items() if v is not None}}


def skipped(invalid: list[InputError], report: EnqueueReport) -> list[InputError]:
    """Rows the reader rejected and rows the store rejected (duplicates), once each."""
    errors = {(e.line, str(e)): e for e in [*invalid, *report.invalid]}
    return list(errors.values())


@dataclass(slots=True)
class Enqueued:
    """One dataset of a run file, enqueued: its report and the rows it skipped."""

    plan: DatasetPlan
    report: EnqueueReport
    invalid: list[InputError]


@dataclass(slots=True)
class PlanFailed:
    """Why a run file's enqueue stopped: at ``plan``, after ``done`` were enqueued
    (each in its own transaction: they stay)."""

    plan: DatasetPlan
    error: OrchestratorError
    done: list[Enqueued]


async def enqueue_plans(
    database: Database,
    config: str | os.PathLike[str],
    plans: list[DatasetPlan],
    *,
    update: bool = False,
    skip_invalid: bool = False,
    progress: Callable[[DatasetPlan], Callable[[int], None] | None] | None = None,
    each: Callable[[Enqueued], None] | None = None,
) -> list[Enqueued] | PlanFailed:
    """Every dataset of a run file (``orchestrator.runfile.load_run``): all checked
    against the database first (nothing enqueued when one is refused), then one
    transaction per file, in the file's order.

    ``progress(plan)`` gives a file's progress callback; ``each`` hears of every dataset
    enqueued as it is. A dataset that fails stops there: the result says which.
    """
    specs = [_plan_spec(plan) for plan in plans]
    refused = await refusals(database, specs, update=update)
    if refused:
        lines = "".join(f"\n  {r}" for r in refused)
        raise ConfigError(
            f"{config}: nothing enqueued: {refused[0]}"
            if len(refused) == 1
            else f"{config}: nothing enqueued, {len(refused)} datasets refused:{lines}"
        )
    done: list[Enqueued] = []
    for plan, spec in zip(plans, specs, strict=True):
        invalid: list[InputError] = []
        on_invalid = invalid.append if skip_invalid else None
        shown = progress(plan) if progress is not None else None
        try:
            reading = read(plan.source, **plan.reading, on_invalid=on_invalid)
            report = await store_reading(
                database, spec, reading, on_invalid=on_invalid, progress=shown, update=update
            )
        except OrchestratorError as exc:
            return PlanFailed(plan, exc, done)
        entry = Enqueued(plan, report, invalid)
        done.append(entry)
        if each is not None:
            each(entry)
    return done


def _plan_spec(plan: DatasetPlan) -> DatasetSpec:
    _check_endpoint(plan.name, plan.endpoint, plan.regenerate, plan.passthrough, plan.logprobs)
    return _spec(
        plan,
        plan.name,
        plan.params,
        regenerate=plan.regenerate,
        passthrough=plan.passthrough,
        endpoint=plan.endpoint,
    )


#: The settings of a dataset that ``EnqueueOptions`` and a run file's ``DatasetPlan`` name
#: alike, as ``DatasetSpec`` takes them: its knobs, and its samples.
_SHARED = (*KNOBS, "samples")


def _spec(given: Any, name: str, params: dict[str, Any], **kind: Any) -> DatasetSpec:
    """The spec of a dataset from its options or its run file's plan, one way for both."""
    seeds = tuple(given.seeds) if given.seeds is not None else None
    shared = {key: getattr(given, key) for key in _SHARED}
    return DatasetSpec(
        name=name, params=params, seeds=seeds, draw_mode=given.sample_requests, **shared, **kind
    )
