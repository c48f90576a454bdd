"""The API's queue, ``async``: every call the command has, by its Python names.

Apart from the package's names (``orchestrator.api``) so that the blocking queue
(``api.sync_queue``) can build on it without importing the package.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import tempfile
import weakref
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from orchestrator.api.arguments import (
    DATASETS,
    DB,
    enqueue_body,
    export_options,
    flag_mask,
    launch_plan,
    launch_supervisor,
    listed,
    run_cap,
    run_configs,
)
from orchestrator.api.datasets import DatasetCalls
from orchestrator.api.enqueue import (
    EnqueueOptions,
    PlanFailed,
    Source,
    enqueue_plans,
    enqueue_source,
    skipped,
)
from orchestrator.api.results import CLOSED, Results, Status, unchanged
from orchestrator.api.running import RunOutcome, checked_outcome, run_worker
from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.export import export_database, line_batches
from orchestrator.formats.readers.columns import Columns
from orchestrator.formats.readers.huggingface import INSTALL
from orchestrator.monitor.status import snapshot
from orchestrator.runfile import load_run
from orchestrator.settings.checks import (
    DATASET_NAME,
    FLAG,
    PATH,
    SERVERS,
    WINDOW,
    Choice,
    Integer,
    OrNone,
    Text,
    checked,
)
from orchestrator.settings.prices import Prices, run_prices, status_cost
from orchestrator.settings.run import RUN, RunSettings
from orchestrator.store import access, check_datasets, open_database, set_paused
from orchestrator.store import requeue as requeues
from orchestrator.store.item_detail import STATES, checked_selection, inspect_items

if TYPE_CHECKING:
    from orchestrator.formats.options import ExportReport
    from orchestrator.store import Database, EnqueueReport
    from orchestrator.store.item_detail import ItemRecord
    from orchestrator.store.requeue import UndoReport

T = TypeVar("T")
R = TypeVar("R")


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
        checked("db", db, DB)
        self._db = None if db is None else os.fspath(db)
        self._database: Database | None = None
        self._closed = False
        self._runs: set[asyncio.Task[Any]] = set()
        self._results: weakref.WeakSet[Results[Any]] = weakref.WeakSet()

    async def __aenter__(self) -> Queue:
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
                await results._end(CLOSED)
        if self._database is not None:
            database, self._database = self._database, None
            self._closed = True
            await database.close()

    @property
    def database(self) -> Database:
        """The store's handle, for what the API does not cover yet."""
        if self._database is None:
            if self._closed:
                raise ConfigError(CLOSED)
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
        history_reasoning: str | None = None,
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
        token_ids: bool = False,
    ) -> EnqueueReport:
        """Add records to ``dataset``: ``enqueue``'s options by their Python names
        (``--hf-config`` is ``config``). All or nothing, unless ``skip_invalid``.

        ``records`` is what the command's SOURCE is (a JSONL, Parquet, CSV or Arrow file, a
        folder, a glob, ``hf://ORG/NAME``), a ``datasets.Dataset`` / ``IterableDataset``
        (a ``DatasetDict`` with ``split``), a ``pyarrow.Table`` / ``RecordBatchReader``, a
        pandas ``DataFrame``, or dicts in any input format; ``json_schema``: a dict.

        ``endpoint="completions"`` sends each row's plain prompt to ``/v1/completions``;
        ``logprobs=K`` keeps each answer's token logprobs with K alternatives per token
        (and the token ids where the server gives them); ``token_ids=True`` keeps the
        server's own prompt and generated ids of every turn (``export --format tokens``).
        """
        checked("skip_invalid", skip_invalid, FLAG)
        named = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        body = enqueue_body(params, model, named, json_schema)
        policies = {"on_truncated": on_truncated, "on_invalid": on_invalid, "samples": samples}
        policies["sample_requests"], policies["seeds"] = sample_requests, seeds
        given = {**named, "params": params or None, "concurrency": concurrency, **policies}
        given |= {"regenerate": regenerate, "on_overflow": on_overflow, "json_schema": json_schema}
        given |= {"logprobs": logprobs, "history_reasoning": history_reasoning}
        given["token_ids"] = token_ids or None
        columns = Columns(
            prompt_column=prompt_column, messages_column=messages_column, template=template,
            template_file=template_file, system=system, id_column=id_column,
            tools_column=tools_column,
        )  # fmt: skip
        options = EnqueueOptions(
            dataset=dataset, params=body, concurrency=concurrency, priority=priority,
            format=format, regenerate=regenerate, on_overflow=on_overflow, **policies,
            history_reasoning=history_reasoning,
            passthrough=passthrough, update=update, columns=columns, split=split,
            config=config, endpoint=endpoint, logprobs=logprobs, token_ids=token_ids,
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
        batch_api: bool = False,
        batch_requests: int = 10_000,
        batch_mb: float = 200.0,
        batch_poll: float = 60.0,
        budget: float | None = None,
        price_input: float | None = None,
        price_cached_input: float | None = None,
        price_output: float | None = None,
        batch_discount: float | None = None,
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
        ``batch_api`` sends the requests through the servers' Batch API in batches of
        at most ``batch_requests`` requests and ``batch_mb`` MiB, looked at at most
        every ``batch_poll`` seconds, as ``run --batch-api`` does.
        ``budget``: most USD to spend at the token prices (``price_input``, ...), as
        ``run --budget``: the run stops claiming before it would pass it and raises
        ``BudgetSpent`` once the work in flight is written.
        """
        checked("until_done", until_done, RUN["exit_when_done"])
        given = {**locals(), "exit_when_done": until_done, "concurrency": run_cap(concurrency)}
        settings = RunSettings.given({**given, "datasets": listed("datasets", datasets, DATASETS)})
        database = self.database
        supervisor = launch_supervisor(launch_plan(given), database)
        launched = supervisor.server_specs() if supervisor is not None else []
        config, client_config = run_configs(servers, api_key, settings, launched)
        run = run_worker(database, config, client_config, launch=supervisor)
        return checked_outcome(await self._track(run))

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
        price_cached_input: float | None = None,
        batch_discount: float | None = None,
        servers: int = 1,
    ) -> Status:
        """Progress, rates, errors, tokens thrown away and ETA: the figures of
        ``orchestrator status --json``; with a price, its ``cost`` (``servers`` of them
        at ``gpu_hour_cost`` each, docs/STATUS.md "Cost")."""
        checked("window", window, WINDOW)
        checked("servers", servers, SERVERS)
        default = Prices(
            gpu_hour_cost, price_input, price_output, price_cached_input, batch_discount
        )
        prices = run_prices(default, [Prices()] * servers)
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
        names = listed("dataset", dataset, DATASETS)
        more = {"per_turn": per_turn, "parsed": parsed}
        more |= {"logprobs": logprobs, "token_ids": token_ids}
        more["group_samples"] = group_samples
        chosen = export_options(format, reasoning, exclude_flags, provenance, **more)
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
        names = listed("dataset", dataset, DATASETS)
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
            flags=flag_mask("flags", flags),
            sample=sample,
            seed=seed,
        )
        produce = functools.partial(inspect_items, selection=selection)
        return self._held(Results(access.read_batches(self.database, produce), unchanged))

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
        merge_turns: bool = False,
    ) -> ExportReport:
        """Write done items to ``out`` as ``orchestrator export`` does (all files, or none).
        ``report.summary`` names the rows ``format="specforge"`` skipped, by reason;
        ``parsed``: each line gets its structured answer's JSON value (``export --parsed``);
        ``logprobs`` and ``token_ids`` add each answer's token columns
        (``orchestrator.items.tokens.row_fields``); ``format="tokens"`` writes each
        generated turn's ``input_ids`` and ``loss_mask`` (``merge_turns``: a conversation
        in one row where its ids chain)."""
        checked("out", out, PATH)
        names = listed("datasets", datasets, DATASETS)
        more = {"split": split, "include_failed": include_failed, "per_turn": per_turn}
        more["parsed"] = parsed
        more |= {"shard_rows": shard_rows, "card": card}
        more |= {"logprobs": logprobs, "token_ids": token_ids}
        more |= {"group_samples": group_samples, "merge_turns": merge_turns}
        chosen = export_options(format, reasoning, exclude_flags, provenance, **more)
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
        try:
            import datasets as hf
        except ImportError:
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
        names = listed("datasets", datasets, DATASETS)
        mask = flag_mask("flags", flags)
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
        checked("dry_run", dry_run, FLAG)
        names = listed("datasets", datasets, DATASETS)
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
        checked("dataset", dataset, DATASET_NAME)
        if not await set_paused(self.database, dataset, paused):
            raise ConfigError(f"no such dataset: {dataset}")
