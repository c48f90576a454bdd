"""The Python API: the queue from a program or a notebook, with the command's behaviour.

Every call goes through the same functions the ``orchestrator`` command uses
(``orchestrator.api.enqueue``, ``orchestrator.api.running``, the store, the exporters), so a
dataset enqueued here is the dataset ``orchestrator enqueue`` would have made, and
errors are the ``orchestrator.errors`` tree with the same file:line messages.

Options are keyword-only, so that new ones (sources, samples per prompt, run-order
policies) can be added without breaking a call. Every argument is checked before anything
is read or written, by the rules of ``orchestrator.settings.checks`` that the command's options
follow too: a wrong type or an impossible value is a ``ConfigError`` naming the argument
and what it got. docs/API.md shows it in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson

from orchestrator.api.datasets import DatasetCalls, SyncDatasetCalls, check_body
from orchestrator.api.enqueue import (
    EnqueueOptions,
    Source,
    enqueue_source,
    request_body,
    skipped,
)
from orchestrator.api.running import RunOutcome
from orchestrator.errors import ConfigError, InputError, ItemsFailed, ItemsLeftPending
from orchestrator.settings.checks import (
    DATASET_NAME,
    FLAG,
    PATH,
    SERVERS,
    WINDOW,
    Choice,
    Integer,
    Names,
    Number,
    OrNone,
    PathName,
    Text,
    checked,
)
from orchestrator.settings.run import RUN, RunSettings

if TYPE_CHECKING:
    from orchestrator.formats.options import ExportOptions, ExportReport
    from orchestrator.store import Database, EnqueueReport
    from orchestrator.store.access import Batches
    from orchestrator.store.item_detail import ItemRecord
    from orchestrator.store.requeue import UndoReport

T = TypeVar("T")
R = TypeVar("R")

_DB = OrNone(PathName("a path or a database URL"))
_DATASETS = Names("a dataset name")
_FLAGS = Names("a quality flag name")
_SERVERS = Names("a server URL")
_LAUNCH = Names("a server command")
_CLOSED = "the queue is closed: open it again (orchestrator.open(db))"

__all__ = ["Queue", "RunOutcome", "Status", "SyncQueue", "open", "open_sync"]


@dataclass(frozen=True, slots=True)
class Status:
    """``status --json`` (docs/STATUS.md) with its two main parts at hand: ``totals``
    and ``datasets`` by name. ``document`` is the whole document, version field included."""

    totals: dict[str, Any]
    datasets: dict[str, dict[str, Any]]
    document: dict[str, Any]

    @property
    def counts(self) -> dict[str, int]:
        """Items by state over every dataset, and their total."""
        return dict(self.totals["counts"])

    @property
    def finished(self) -> bool:
        """Nothing pending or running: every item is done or failed."""
        counts = self.totals["counts"]
        return counts["pending"] == 0 and counts["running"] == 0


def open(db: str | os.PathLike[str] | None = None) -> Queue:
    """The queue in ``db`` (a SQLite path or an SQLAlchemy URL; default as the command:
    env ORCHESTRATOR_DB, else ./orchestrator.db), for ``async with``.

    A missing SQLite file is created and the schema installed or upgraded, as
    ``orchestrator enqueue`` does.
    """
    return Queue(db)


class Queue(DatasetCalls):
    """An open queue. Use it as ``async with orchestrator.open(db) as q``: leaving the
    block stops any ``run`` still going (its leases released), ends the ``results``
    still being read and closes the database."""

    def __init__(self, db: str | os.PathLike[str] | None) -> None:
        checked("db", db, _DB)
        self._db = None if db is None else os.fspath(db)
        self._database: Database | None = None
        self._closed = False
        self._runs: set[asyncio.Task[Any]] = set()
        self._results: weakref.WeakSet[Results[Any]] = weakref.WeakSet()

    async def __aenter__(self) -> Queue:
        from orchestrator.store import open_database

        if self._database is None:
            self._database = await open_database(self._db)
            self._closed = False
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the runs still going, end the results still being read (a later ``next``
        raises ``ConfigError``), then close the database. Calls after it raise
        ``ConfigError``."""
        runs = list(self._runs)
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.gather(*runs, return_exceptions=True)
        for results in list(self._results):
            with contextlib.suppress(Exception):
                await results._end(_CLOSED)
        if self._database is not None:
            database, self._database = self._database, None
            self._closed = True
            await database.close()

    @property
    def database(self) -> Database:
        """The store's handle, for what the API does not cover yet."""
        if self._database is None:
            if self._closed:
                raise ConfigError(_CLOSED)
            raise ConfigError("the queue is not open: use `async with orchestrator.open(db)`")
        return self._database

    async def enqueue(
        self,
        records: Source,
        *,
        dataset: str,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        params: dict[str, Any] | None = None,
        concurrency: int | None = None,
        priority: int | None = None,
        format: str = "auto",
        regenerate: str | None = None,
        on_truncated: str | None = None,
        on_invalid: str | None = None,
        on_overflow: str | None = None,
        json_schema: dict[str, Any] | None = None,
        passthrough: bool = False,
        samples: int | None = None,
        seeds: Sequence[int] | None = None,
        sample_requests: str | None = None,
        update: bool = False,
        skip_invalid: bool = False,
        prompt_column: str | None = None,
        messages_column: str | None = None,
        template: str | None = None,
        template_file: str | os.PathLike[str] | None = None,
        system: str | None = None,
        id_column: str | None = None,
        tools_column: str | None = None,
        split: str | None = None,
        config: str | None = None,
        endpoint: str | None = None,
        logprobs: int | None = None,
    ) -> EnqueueReport:
        """Add records to ``dataset``: ``enqueue``'s options by their Python names
        (``--hf-config`` is ``config``). All or nothing, unless ``skip_invalid``.

        ``records`` is what the command's SOURCE is (a JSONL, Parquet, CSV or Arrow file, a
        folder, a glob, ``hf://ORG/NAME``), a ``datasets.Dataset`` / ``IterableDataset``
        (a ``DatasetDict`` with ``split``), a ``pyarrow.Table`` / ``RecordBatchReader``, a
        pandas ``DataFrame``, or dicts in any input format; ``json_schema``: a dict.

        ``endpoint="completions"`` sends each row's plain prompt to ``/v1/completions``;
        ``logprobs=K`` keeps each answer's token logprobs with K alternatives per token
        (and the token ids where the server gives them).
        """
        from orchestrator.formats.readers.columns import Columns

        checked("skip_invalid", skip_invalid, FLAG)
        named = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        body = _enqueue_body(params, model, named, json_schema)
        policies = {"on_truncated": on_truncated, "on_invalid": on_invalid, "samples": samples}
        policies["sample_requests"], policies["seeds"] = sample_requests, seeds
        given = {**named, "params": params or None, "concurrency": concurrency, **policies}
        given |= {"regenerate": regenerate, "on_overflow": on_overflow, "json_schema": json_schema}
        given |= {"logprobs": logprobs}
        columns = Columns(
            prompt_column=prompt_column, messages_column=messages_column, template=template,
            template_file=template_file, system=system, id_column=id_column,
            tools_column=tools_column,
        )  # fmt: skip
        options = EnqueueOptions(
            dataset=dataset, params=body, concurrency=concurrency, priority=priority,
            format=format, regenerate=regenerate, on_overflow=on_overflow, **policies,
            passthrough=passthrough, update=update, columns=columns, split=split,
            config=config, endpoint=endpoint, logprobs=logprobs,
            sampling=tuple(name for name, value in given.items() if value is not None),
        )  # fmt: skip
        invalid: list[InputError] = []
        skip = invalid.append if skip_invalid else None
        report = await enqueue_source(self.database, options, records, on_invalid=skip)
        report.invalid = skipped(invalid, report)
        return report

    async def enqueue_config(
        self, config: str | os.PathLike[str], *, update: bool = False, skip_invalid: bool = False
    ) -> list[EnqueueReport]:
        """Every dataset of a run file (docs/CONFIG.md), as ``enqueue --config``: checked
        as a whole first, then one transaction per file. A file that fails raises its
        error; the datasets before it stay enqueued."""
        from orchestrator.api.enqueue import PlanFailed, enqueue_plans
        from orchestrator.runfile import load_run

        checked("config", config, PATH)
        checked("update", update, FLAG)
        checked("skip_invalid", skip_invalid, FLAG)
        database = self.database
        plans = load_run(config)
        result = await enqueue_plans(
            database, config, plans, update=update, skip_invalid=skip_invalid
        )
        if isinstance(result, PlanFailed):
            raise result.error
        for entry in result:
            entry.report.invalid = skipped(entry.invalid, entry.report)
        return [entry.report for entry in result]

    async def run(
        self,
        *,
        servers: Sequence[str] = (),
        launch: Sequence[str] = (),
        replicas: int | None = None,
        gpus_per_server: int | None = None,
        startup_timeout: float = 1800.0,
        launch_dir: str | os.PathLike[str] | None = None,
        engine: str | None = None,
        engine_model: str | None = None,
        tp: int = 1,
        engine_args: str = "",
        engine_bin: str | None = None,
        served_model_name: str | None = None,
        restart_backoff: float = 5.0,
        max_server_deaths: int = 5,
        server_death_window: float = 3600.0,
        concurrency: int | str = 64,
        datasets: Sequence[str] = (),
        until_done: bool = True,
        give_up_after: float | None = None,
        request_timeout: float = 3600.0,
        lease_seconds: float = 120.0,
        max_attempts: int = 8,
        retry_backoff: float = 2.0,
        grace: float = 30.0,
        stream: bool = False,
        stream_idle_timeout: float = 120.0,
        api_key: str | None = None,
        max_response_mb: float = 64.0,
        rpm: int | None = None,
        tpm: int | None = None,
        rate_limited_warn_after: float = 600.0,
        stream_usage: bool = False,
    ) -> RunOutcome:
        """Work on the queue as ``orchestrator run`` does, until every item is done or
        failed (``until_done``) or the task running it is cancelled.

        Items failed or left pending in paused datasets are in the outcome's
        ``stopped``; a run that cannot go on (no server, a model the servers do not
        serve, answers the database did not take) raises its ``RunStopped`` or
        ``StorageError``. Cancelled, it stops at once and releases its leases.

        ``launch``: server commands (each with ``{port}``) the run starts, as ``run
        --launch`` does, ``replicas`` or ``gpus_per_server`` times; ready before the
        first claim, restarted when they die, stopped when the run ends (``ServersLost``
        when none stays up); ``engine`` with ``engine_model`` (and ``tp``,
        ``engine_args``, ``engine_bin``, ``served_model_name``) launches a known
        engine's server as ``run --engine`` does; ``restart_backoff``,
        ``max_server_deaths`` and ``server_death_window`` as the command's options.
        ``rpm``/``tpm`` pace each server under a hosted API's requests and tokens a
        minute (``--rpm``/``--tpm``); without them its ``x-ratelimit-*`` headers do.
        """
        checked("until_done", until_done, RUN["exit_when_done"])
        given = {**locals(), "exit_when_done": until_done, "concurrency": _cap(concurrency)}
        settings = RunSettings.given({**given, "datasets": _names("datasets", datasets, _DATASETS)})
        database = self.database
        supervisor = _supervisor(_launch_plan(given), database)
        launched = supervisor.server_specs() if supervisor is not None else []
        config, client_config = _configs(servers, api_key, settings, launched)
        run = _run(database, config, client_config, supervisor)
        return _checked_outcome(await self._track(run))

    async def _track(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in a task of its own that ``close`` can stop."""
        task = asyncio.ensure_future(coro)
        self._runs.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            self._runs.discard(task)

    async def status(
        self,
        *,
        window: float = 300.0,
        gpu_hour_cost: float | None = None,
        price_input: float | None = None,
        price_output: float | None = None,
        servers: int = 1,
    ) -> Status:
        """Progress, rates, errors, tokens thrown away and ETA: the figures of
        ``orchestrator status --json``; with a price, its ``cost`` (``servers`` of them
        at ``gpu_hour_cost`` each, docs/STATUS.md "Cost")."""
        from orchestrator.monitor.status import snapshot
        from orchestrator.settings.prices import Prices, run_prices, status_cost

        checked("window", window, WINDOW)
        checked("servers", servers, SERVERS)
        prices = run_prices(Prices(gpu_hour_cost, price_input, price_output), [Prices()] * servers)
        document = await snapshot(self.database, window=window)
        cost = status_cost(document, prices)
        if cost is not None:
            document["cost"] = cost
        by_name = {d["name"]: d for d in document.get("datasets", [])}
        return Status(totals=document["totals"], datasets=by_name, document=document)

    def results(
        self,
        *,
        dataset: str | Sequence[str] = (),
        format: str = "messages",
        reasoning: str = "separate",
        exclude_flags: str | Sequence[str] = (),
        provenance: bool = False,
        per_turn: bool = False,
        parsed: bool = False,
        logprobs: bool = False,
        token_ids: bool = False,
        group_samples: bool = False,
    ) -> Results[dict[str, Any]]:
        """Done items as plain dicts, each the line ``export`` would write, in its order:
        an async iterator over one read transaction (:class:`Results`)."""
        from orchestrator.formats.export import line_batches

        names = _names("dataset", dataset, _DATASETS)
        more = {"per_turn": per_turn, "parsed": parsed}
        more |= {"logprobs": logprobs, "token_ids": token_ids}
        more["group_samples"] = group_samples
        chosen = _export_options(format, reasoning, exclude_flags, provenance, **more)
        batches = line_batches(self.database, dataset_names=names, options=chosen)
        return self._held(Results(batches, orjson.loads))

    def inspect(
        self,
        *,
        dataset: str | Sequence[str] = (),
        id: str | None = None,
        sample: int | None = None,
        seed: int | None = None,
        flags: str | Sequence[str] = (),
        error_class: str | None = None,
        state: str | None = None,
    ) -> Results[ItemRecord]:
        """Items whole, as ``orchestrator inspect`` shows them: the request as sent, the
        answer (every turn), every attempt, requeues and the answers they set aside, as
        :class:`~orchestrator.store.item_detail.ItemRecord`; by dataset, then input order.
        An async iterator over one read transaction (:class:`Results`). ``id`` picks one
        item by key (``dataset`` says which when several datasets have it); ``sample``
        that many at random among the matching, drawn with ``seed`` (reproducible)."""
        import functools

        from orchestrator.store import access
        from orchestrator.store.item_detail import STATES, checked_selection, inspect_items

        names = _names("dataset", dataset, _DATASETS)
        checked("id", id, OrNone(Text()))
        checked("sample", sample, OrNone(Integer(1)))
        checked("seed", seed, OrNone(Integer()))
        checked("error_class", error_class, OrNone(Text()))
        checked("state", state, OrNone(Choice(STATES)))
        selection = checked_selection(
            dataset_names=names,
            key=id,
            state=state,
            error_class=error_class,
            flags=_flags("flags", flags),
            sample=sample,
            seed=seed,
        )
        produce = functools.partial(inspect_items, selection=selection)
        return self._held(Results(access.read_batches(self.database, produce), _same))

    def _held(self, results: Results[R]) -> Results[R]:
        """``results``, ended when the queue closes."""
        self._results.add(results)
        return results

    async def export(
        self,
        out: str | os.PathLike[str],
        *,
        datasets: str | Sequence[str] = (),
        format: str = "messages",
        reasoning: str = "separate",
        split: bool = False,
        exclude_flags: str | Sequence[str] = (),
        include_failed: str | os.PathLike[str] | None = None,
        provenance: bool = False,
        per_turn: bool = False,
        parsed: bool = False,
        shard_rows: int | None = None,
        card: str | os.PathLike[str] | None = None,
        logprobs: bool = False,
        token_ids: bool = False,
        group_samples: bool = False,
    ) -> ExportReport:
        """Write done items to ``out`` as ``orchestrator export`` does (all files, or none).
        ``report.summary`` names the rows ``format="specforge"`` skipped, by reason;
        ``parsed``: each line gets its structured answer's JSON value (``export --parsed``);
        ``logprobs`` and ``token_ids`` add each answer's token columns
        (``orchestrator.items.tokens.row_fields``)."""
        from orchestrator.formats.export import export_database

        checked("out", out, PATH)
        names = _names("datasets", datasets, _DATASETS)
        more = {"split": split, "include_failed": include_failed, "per_turn": per_turn}
        more["parsed"] = parsed
        more |= {"shard_rows": shard_rows, "card": card}
        more |= {"logprobs": logprobs, "token_ids": token_ids}
        more["group_samples"] = group_samples
        chosen = _export_options(format, reasoning, exclude_flags, provenance, **more)
        return await export_database(self.database, Path(out), dataset_names=names, options=chosen)

    async def to_dataset(
        self,
        *,
        datasets: str | Sequence[str] = (),
        reasoning: str = "separate",
        exclude_flags: str | Sequence[str] = (),
        provenance: bool = False,
    ) -> Any:
        """Done items as a ``datasets.Dataset`` (the ``hf`` extra): the rows and columns of
        ``export(format="parquet")``, in its order, without a file to manage.

        The rows go through a Parquet file in a temporary folder, which ``datasets``
        turns into Arrow files in its cache (``HF_DATASETS_CACHE``) and maps: memory
        stays bounded by a row group at any size, as the export's does.
        """
        import tempfile

        try:
            import datasets as hf
        except ImportError:
            from orchestrator.formats.readers.huggingface import INSTALL

            raise ConfigError(f"to_dataset needs the datasets library: {INSTALL}") from None
        with tempfile.TemporaryDirectory(prefix="orchestrator-dataset-") as folder:
            out = Path(folder) / "rows.parquet"
            await self.export(
                out,
                datasets=datasets,
                format="parquet",
                reasoning=reasoning,
                exclude_flags=exclude_flags,
                provenance=provenance,
            )
            return await asyncio.to_thread(hf.Dataset.from_parquet, str(out))

    async def requeue(
        self,
        *,
        state: str = "failed",
        datasets: str | Sequence[str] = (),
        error_class: str | None = None,
        flags: str | Sequence[str] = (),
        max_tokens: int | None = None,
        all: bool = False,
        dry_run: bool = False,
        keys: Sequence[str] = (),
        samples: Sequence[int] = (),
    ) -> int | dict[tuple[str, str], int]:
        """Send items back to pending, as ``orchestrator requeue``: the number moved, or
        with ``dry_run`` what would move per (dataset, state). Done items need a filter
        or ``all=True``; their answers are kept aside for ``requeue --undo``."""
        from orchestrator.store import check_datasets
        from orchestrator.store import requeue as requeues

        names = _names("datasets", datasets, _DATASETS)
        mask = _flags("flags", flags)
        checked("error_class", error_class, OrNone(Text()))
        checked("max_tokens", max_tokens, OrNone(Integer()))  # its range is requeue's own
        checked("all", all, FLAG)
        checked("dry_run", dry_run, FLAG)
        selection = requeues.checked_selection(
            state,
            dataset_names=names,
            error_class=error_class,
            flags=mask,
            everything=all,
            max_tokens=max_tokens,
            keys=tuple(keys),
            samples=tuple(samples),
        )
        await check_datasets(self.database, names)
        if dry_run:
            return await requeues.preview(self.database, selection)
        return await requeues.requeue(self.database, selection, max_tokens=max_tokens)

    async def undo_requeue(
        self, *, datasets: str | Sequence[str] = (), dry_run: bool = False
    ) -> UndoReport:
        """Take back the latest requeue, as ``orchestrator requeue --undo`` (with
        ``datasets``: the latest that moved their items, and only those): its items not
        claimed since, or failed since, get their state and answers back. ``requeue_id``
        is None when there is nothing to undo; with ``dry_run`` the report says what would
        be put back. Raises ``UndoConflict`` (an ``OrchestratorError``) when another undo
        took it back meanwhile."""
        from orchestrator.store import check_datasets
        from orchestrator.store import requeue as requeues

        checked("dry_run", dry_run, FLAG)
        names = _names("datasets", datasets, _DATASETS)
        await check_datasets(self.database, names)
        if dry_run:
            return await requeues.undo_preview(self.database, dataset_names=names)
        return await requeues.undo(self.database, dataset_names=names)

    async def pause(self, dataset: str) -> None:
        """Stop claiming items of ``dataset`` (in-flight ones finish)."""
        await self._set_paused(dataset, True)

    async def resume(self, dataset: str) -> None:
        """Claim items of ``dataset`` again."""
        await self._set_paused(dataset, False)

    async def _set_paused(self, dataset: str, paused: bool) -> None:
        from orchestrator.store import set_paused

        checked("dataset", dataset, DATASET_NAME)
        if not await set_paused(self.database, dataset, paused):
            raise ConfigError(f"no such dataset: {dataset}")


def _enqueue_body(
    params: dict[str, Any] | None,
    model: str | None,
    named: dict[str, Any],
    json_schema: dict[str, Any] | None,
) -> dict[str, Any]:
    """The dataset's request body, checked; a schema becomes its ``response_format``."""
    from orchestrator.items.structured import response_format_for

    body = request_body(params, model=model, **named)
    check_body(body, {"model": model, **named})
    if json_schema is not None:
        body["response_format"] = response_format_for(json_schema, source="json_schema")
    return body


def _names(name: str, value: str | Sequence[str], rule: Names) -> tuple[str, ...]:
    """One name or several, as a tuple; a lone string is one name, not its letters."""
    checked(name, value, rule)
    return (value,) if isinstance(value, str) else tuple(value)


def _flags(name: str, value: str | Sequence[str]) -> int:
    from orchestrator.items.quality import parse_flags

    mask = 0
    for spec in _names(name, value, _FLAGS):
        try:
            mask |= parse_flags(spec)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return mask


def _export_options(
    fmt: str, reasoning: str, exclude_flags: str | Sequence[str], provenance: bool, **more: Any
) -> ExportOptions:
    from orchestrator.formats.options import ExportOptions

    mask = _flags("exclude_flags", exclude_flags)
    return ExportOptions(
        format=fmt, reasoning=reasoning, exclude_flags=mask, provenance=provenance, **more
    )


def _cap(concurrency: int | str) -> int | str:
    """``"8"`` and ``"auto"`` as the command's option takes them; anything else is left
    to ``RunSettings``' rule, which says what it must be."""
    from orchestrator.inference.servers_file import parse_cap

    if isinstance(concurrency, str):
        with contextlib.suppress(ValueError):
            return parse_cap(concurrency)
    return concurrency


def _launch_plan(given: dict[str, Any]) -> Any:
    """The launch arguments of a ``run`` call as the command's ``LaunchPlan``."""
    from dataclasses import fields

    from orchestrator.inference.launch.plan import LaunchPlan

    names = {f.name for f in fields(LaunchPlan)} - {"file_launches"}
    plan = {name: given[name] for name in names if name in given}
    plan["launch"] = _names("launch", given["launch"], _LAUNCH)
    return LaunchPlan(**plan)


def _supervisor(plan: Any, database: Database) -> Any:
    """The supervisor of the servers ``run(launch=...)`` starts; None without any."""
    from orchestrator.inference.launch.plan import supervisor

    checked("launch", tuple(plan.launch), _LAUNCH)
    for name, value in (("replicas", plan.replicas), ("gpus_per_server", plan.gpus_per_server)):
        checked(name, value, OrNone(Integer(1)))
    checked("startup_timeout", plan.startup_timeout, Number(0, above=True))
    checked("launch_dir", plan.launch_dir, OrNone(PATH))
    path = str(database.url.database) if database.is_sqlite and database.url.database else None
    return supervisor(plan, path, source="launch")


def _configs(
    servers: Sequence[str], api_key: str | None, settings: Any, launched: Sequence[Any] = ()
) -> tuple[Any, Any]:
    """The worker's and the client's configuration as the command makes them, from the
    servers as given (each through the check of every server source) and those the
    run launches."""
    from orchestrator._util.urls import api_key as checked_key
    from orchestrator.api.running import configs, without_credentials
    from orchestrator.inference.servers_file import ServerSpec, check_server_url

    urls = _names("servers", servers, _SERVERS)
    checked("api_key", api_key, OrNone(Text()))
    if not urls and not launched:
        raise ConfigError("run needs at least one server URL (servers=[...]) or launch=[...]")
    specs = [ServerSpec(check_server_url(url, "servers")[0]) for url in urls]
    specs += list(launched)
    key = checked_key(api_key, "api_key")
    specs, auth = without_credentials(specs, key)
    return configs(specs, auth, key, settings)


async def _run(
    database: Database, config: Any, client_config: Any, launch: Any = None
) -> RunOutcome:
    from orchestrator.api.running import run_worker

    return await run_worker(database, config, client_config, launch=launch)


def _checked_outcome(outcome: RunOutcome) -> RunOutcome:
    """Raise what stopped a run short for a reason to act on; return the rest."""
    from orchestrator.errors import StorageError

    if outcome.stats.dropped:
        raise StorageError(
            f"{outcome.stats.dropped:,} answers could not be written before the stop and "
            "were dropped (their items run again once their leases expire)"
        )
    for reason in outcome.stopped:
        if not isinstance(reason, ItemsFailed | ItemsLeftPending):
            raise reason
    return outcome


def _same(row: R) -> R:
    return row


class Results(Generic[T]):
    """``Queue.results`` (the export's lines as dicts) and ``Queue.inspect`` (items as
    records): rows read in one read transaction, a batch at a time.

    The transaction ends with the last row, with ``aclose()`` (or the end of ``async
    with``), when the queue closes (a later ``next`` raises ``ConfigError``: the rows
    are not all there), or as soon as the iterator is dropped: a loop left with
    ``break`` holds nothing, and prints nothing.
    """

    def __init__(self, batches: Batches[list[Any]], decode: Callable[[Any], T]) -> None:
        self._batches = batches
        self._decode = decode
        self._rows: Iterator[Any] = iter(())
        self._ended: str | None = None

    def __aiter__(self) -> Results[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            row = next(self._rows, None)
            if row is not None:
                return self._decode(row)
            if self._ended is not None:
                raise ConfigError(self._ended)
            self._rows = iter(await self._batches.__anext__())

    async def aclose(self) -> None:
        """End the read now; the iteration stops."""
        self._rows = iter(())
        await self._batches.aclose()

    async def __aenter__(self) -> Results[T]:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _end(self, why: str) -> None:
        """Ended from outside (the queue closed): a later ``next`` raises, with ``why``."""
        self._ended = why
        await self.aclose()


# ---------------------------------------------------------------------------- sync


async def _next(rows: AsyncIterator[T]) -> T:
    """A coroutine for the loop's thread (an async iterator's step is only awaitable)."""
    return await rows.__anext__()


async def _made(make: Callable[..., T], **options: Any) -> T:
    """``make(**options)`` on the loop's thread."""
    return make(**options)


def open_sync(db: str | os.PathLike[str] | None = None) -> SyncQueue:
    """The same queue without ``await``, for scripts and notebooks.

    Its calls run on an event loop of its own, in a background thread, so it works in
    a Jupyter kernel (whose loop is already running) as well as in a plain script.
    """
    return SyncQueue(db)


class SyncQueue(SyncDatasetCalls):
    """``Queue``'s calls, blocking. Use ``with orchestrator.open_sync(db) as q`` (or call
    ``close``). Ctrl-C during ``run`` stops the run cleanly, as cancelling it would.
    Calls after ``close`` raise ``ConfigError``."""

    def __init__(self, db: str | os.PathLike[str] | None) -> None:
        self._queue = Queue(db)  # its arguments checked before any thread starts
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="orchestrator-api", daemon=True
        )
        self._thread.start()
        try:
            self._submit(self._queue.__aenter__())
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise

    def __enter__(self) -> SyncQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the loop; on a closed queue, ConfigError before any
        coroutine is made (none is left unawaited)."""
        if self._closed:
            raise ConfigError(_CLOSED)
        return self._submit(fn(*args, **kwargs))

    def _submit(self, coro: Awaitable[T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            with contextlib.suppress(BaseException):  # interrupted already: wait it out
                future.result()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        """Stop what runs, end the results being read, close the database and the
        loop's thread. Again: nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self._queue.close())
        finally:
            self._stop_loop()

    def enqueue(self, records: Source, **options: Any) -> EnqueueReport:
        """``Queue.enqueue``."""
        return self._call(self._queue.enqueue, records, **options)

    def enqueue_config(self, config: str | os.PathLike[str], **options: Any) -> list[EnqueueReport]:
        """``Queue.enqueue_config``."""
        return self._call(self._queue.enqueue_config, config, **options)

    def run(self, **options: Any) -> RunOutcome:
        """``Queue.run``."""
        return self._call(self._queue.run, **options)

    def status(self, **options: Any) -> Status:
        """``Queue.status``."""
        return self._call(self._queue.status, **options)

    def results(self, **options: Any) -> SyncResults[dict[str, Any]]:
        """``Queue.results``, one row at a time from the loop's thread."""
        return SyncResults(self, self._call(_made, self._queue.results, **options))

    def inspect(self, **options: Any) -> SyncResults[ItemRecord]:
        """``Queue.inspect``, one item at a time from the loop's thread."""
        return SyncResults(self, self._call(_made, self._queue.inspect, **options))

    def export(self, out: str | os.PathLike[str], **options: Any) -> ExportReport:
        """``Queue.export``."""
        return self._call(self._queue.export, out, **options)

    def to_dataset(self, **options: Any) -> Any:
        """``Queue.to_dataset``."""
        return self._call(self._queue.to_dataset, **options)

    def requeue(self, **options: Any) -> int | dict[tuple[str, str], int]:
        """``Queue.requeue``."""
        return self._call(self._queue.requeue, **options)

    def undo_requeue(self, **options: Any) -> UndoReport:
        """``Queue.undo_requeue``."""
        return self._call(self._queue.undo_requeue, **options)

    def pause(self, dataset: str) -> None:
        """``Queue.pause``."""
        self._call(self._queue.pause, dataset)

    def resume(self, dataset: str) -> None:
        """``Queue.resume``."""
        self._call(self._queue.resume, dataset)


class SyncResults(Generic[T]):
    """``SyncQueue.results`` and ``SyncQueue.inspect``: :class:`Results` a row at a time.
    ``close()`` (or ``with``) ends the read early, as dropping the iterator does."""

    def __init__(self, queue: SyncQueue, results: Results[T]) -> None:
        self._queue = queue
        self._results = results

    def __iter__(self) -> SyncResults[T]:
        return self

    def __next__(self) -> T:
        try:
            return self._queue._call(_next, self._results)
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """End the read now (nothing to do once the queue is closed: it ended it)."""
        if not self._queue._closed:
            self._queue._call(self._results.aclose)

    def __enter__(self) -> SyncResults[T]:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
