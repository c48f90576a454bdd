"""The Python API: the queue from a program or a notebook, with the command's behaviour.

Every call goes through the same functions the ``orchestrator`` command uses
(``orchestrator.enqueueing``, ``orchestrator.running``, the store, the exporters), so a
dataset enqueued here is the dataset ``orchestrator enqueue`` would have made, and
errors are the ``orchestrator.errors`` tree with the same file:line messages.

Options are keyword-only, so that new ones (sources, samples per prompt, run-order
policies) can be added without breaking a call. docs/API.md shows it in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from orchestrator.enqueueing import (
    EnqueueOptions,
    Source,
    enqueue_source,
    request_body,
    skipped,
)
from orchestrator.errors import ConfigError, InputError, ItemsFailed, ItemsLeftPending
from orchestrator.running import RunOutcome

if TYPE_CHECKING:
    from orchestrator.formats.export import ExportOptions, ExportReport
    from orchestrator.store import Database, EnqueueReport
    from orchestrator.store.requeue import UndoReport

T = TypeVar("T")

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
    return Queue(None if db is None else os.fspath(db))


class Queue:
    """An open queue. Use it as ``async with orchestrator.open(db) as q``: leaving the
    block stops any ``run`` still going (its leases released) and closes the database."""

    def __init__(self, db: str | None) -> None:
        self._db = db
        self._database: Database | None = None
        self._runs: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Queue:
        from orchestrator.store import open_database

        self._database = await open_database(self._db)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the runs still going, then close the database."""
        runs = list(self._runs)
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.gather(*runs, return_exceptions=True)
        if self._database is not None:
            database, self._database = self._database, None
            await database.close()

    @property
    def database(self) -> Database:
        """The store's handle, for what the API does not cover yet."""
        if self._database is None:
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
        passthrough: bool = False,
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
    ) -> EnqueueReport:
        """Add records to ``dataset``: ``orchestrator enqueue``'s options by their Python
        names (``--hf-config`` is ``config``). All or nothing, unless ``skip_invalid``:
        then bad rows are left out and listed in the report's ``invalid``.

        ``records`` is what the command's SOURCE is (a JSONL, Parquet, CSV or Arrow file, a
        folder, a glob, ``hf://ORG/NAME``), a ``datasets.Dataset`` / ``IterableDataset``
        (a ``DatasetDict`` with ``split``), a ``pyarrow.Table`` / ``RecordBatchReader``, a
        pandas ``DataFrame``, or dicts in any input format.
        """
        from orchestrator.formats.columns import Columns

        named = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        body = request_body(params, model=model, **named)
        _check_body(body)
        given = {**named, "params": params or None, "concurrency": concurrency}
        given |= {"regenerate": regenerate, "on_truncated": on_truncated}
        options = EnqueueOptions(
            dataset=dataset,
            params=body,
            concurrency=concurrency,
            priority=priority,
            format=format,
            regenerate=regenerate,
            on_truncated=on_truncated,
            passthrough=passthrough,
            update=update,
            sampling=tuple(name for name, value in given.items() if value is not None),
            columns=Columns(
                prompt_column=prompt_column,
                messages_column=messages_column,
                template=template,
                template_file=template_file,
                system=system,
                id_column=id_column,
                tools_column=tools_column,
            ),
            split=split,
            config=config,
        )
        invalid: list[InputError] = []
        on_invalid = invalid.append if skip_invalid else None
        report = await enqueue_source(self.database, options, records, on_invalid=on_invalid)
        report.invalid = skipped(invalid, report)
        return report

    async def enqueue_config(
        self, config: str | os.PathLike[str], *, update: bool = False, skip_invalid: bool = False
    ) -> list[EnqueueReport]:
        """Every dataset of a run file (docs/CONFIG.md), as ``enqueue --config``: checked
        as a whole first, then one transaction per file. A file that fails raises its
        error; the datasets before it stay enqueued."""
        from orchestrator.enqueueing import PlanFailed, enqueue_plans
        from orchestrator.runfile import load_run

        plans = load_run(config)
        result = await enqueue_plans(
            self.database, config, plans, update=update, skip_invalid=skip_invalid
        )
        if isinstance(result, PlanFailed):
            raise result.error
        for entry in result:
            entry.report.invalid = skipped(entry.invalid, entry.report)
        return [entry.report for entry in result]

    async def run(
        self,
        *,
        servers: Sequence[str],
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
    ) -> RunOutcome:
        """Work on the queue as ``orchestrator run`` does, until every item is done or
        failed (``until_done``) or the task running it is cancelled.

        Items failed or left pending in paused datasets are in the outcome's
        ``stopped``; a run that cannot go on (no server, a model the servers do not
        serve, answers the database did not take) raises its ``RunStopped`` or
        ``StorageError``. Cancelled, it stops at once and releases its leases.
        """
        from orchestrator.running import RunSettings

        settings = RunSettings(
            concurrency=_cap(concurrency),
            datasets=tuple(datasets),
            exit_when_done=until_done,
            give_up_after=give_up_after,
            request_timeout=request_timeout,
            lease_seconds=lease_seconds,
            max_attempts=max_attempts,
            retry_backoff=retry_backoff,
            grace=grace,
            stream=stream,
            stream_idle_timeout=stream_idle_timeout,
            max_response_mb=max_response_mb,
        )
        config, client_config = _configs(servers, api_key, settings)
        return _checked_outcome(await self._track(_run(self.database, config, client_config)))

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

    async def status(self, *, window: float = 300.0) -> Status:
        """Progress, rates, errors and ETA: the figures of ``orchestrator status --json``."""
        from orchestrator.monitor.status import snapshot

        document = await snapshot(self.database, window=window)
        by_name = {d["name"]: d for d in document.get("datasets", [])}
        return Status(totals=document["totals"], datasets=by_name, document=document)

    async def results(
        self,
        *,
        dataset: str | Sequence[str] = (),
        format: str = "messages",
        reasoning: str = "separate",
        exclude_flags: str | Sequence[str] = (),
        provenance: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Done items as plain dicts, each the line ``export`` would write, in its order."""
        from orchestrator.formats.export import iter_lines

        chosen = _export_options(format, reasoning, exclude_flags, provenance)
        async for line in iter_lines(self.database, dataset_names=_names(dataset), options=chosen):
            yield orjson.loads(line)

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
    ) -> ExportReport:
        """Write done items to ``out`` as ``orchestrator export`` does (all files, or none)."""
        from dataclasses import replace

        from orchestrator.formats.export import export_database

        chosen = _export_options(format, reasoning, exclude_flags, provenance)
        chosen = replace(chosen, split=split, include_failed=include_failed)
        return await export_database(
            self.database, Path(out), dataset_names=_names(datasets), options=chosen
        )

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
    ) -> int | dict[tuple[str, str], int]:
        """Send items back to pending, as ``orchestrator requeue``: the number moved, or
        with ``dry_run`` what would move per (dataset, state). Done items need a filter
        or ``all=True``; their answers are kept aside for ``requeue --undo``."""
        from orchestrator.store import check_datasets
        from orchestrator.store import requeue as requeues

        names = _names(datasets)
        selection = requeues.checked_selection(
            state, dataset_names=names, error_class=error_class, flags=_flags(flags), everything=all
        )
        await check_datasets(self.database, names)
        if dry_run:
            return await requeues.preview(self.database, selection)
        return await requeues.requeue(self.database, selection, max_tokens=max_tokens)

    async def undo_requeue(self, *, dry_run: bool = False) -> UndoReport:
        """Take back the latest requeue, as ``orchestrator requeue --undo``: its items not
        claimed since get their state and answers back. ``requeue_id`` is None when there
        is no requeue to undo; with ``dry_run`` the report says what would be put back."""
        from orchestrator.store import requeue as requeues

        if dry_run:
            return await requeues.undo_preview(self.database)
        return await requeues.undo(self.database)

    async def pause(self, dataset: str) -> None:
        """Stop claiming items of ``dataset`` (in-flight ones finish)."""
        await self._set_paused(dataset, True)

    async def resume(self, dataset: str) -> None:
        """Claim items of ``dataset`` again."""
        await self._set_paused(dataset, False)

    async def _set_paused(self, dataset: str, paused: bool) -> None:
        from orchestrator.store import set_paused

        if not await set_paused(self.database, dataset, paused):
            raise ConfigError(f"no such dataset: {dataset}")


def _check_body(body: dict[str, Any]) -> None:
    """The request body through the check every other source gets (``orchestrator.params``)."""
    from orchestrator.params import problems

    found = problems(body)
    if found:
        raise ConfigError("; ".join(f"{name}: {why}" for name, why in found))


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _flags(value: str | Sequence[str]) -> int:
    from orchestrator.quality import parse_flags

    mask = 0
    for spec in _names(value):
        mask |= parse_flags(spec)
    return mask


def _export_options(
    fmt: str, reasoning: str, exclude_flags: str | Sequence[str], provenance: bool
) -> ExportOptions:
    from orchestrator.formats.export import ExportOptions

    return ExportOptions(
        format=fmt, reasoning=reasoning, exclude_flags=_flags(exclude_flags), provenance=provenance
    )


def _cap(concurrency: int | str) -> int | str:
    from orchestrator.servers import parse_cap

    try:
        return parse_cap(str(concurrency))
    except ValueError as exc:
        raise ConfigError(f"concurrency: {exc}") from None


def _configs(servers: Sequence[str], api_key: str | None, settings: Any) -> tuple[Any, Any]:
    """The worker's and the client's configuration as the command makes them, from the
    servers as given (each through the check of every server source)."""
    from orchestrator.running import configs, without_credentials
    from orchestrator.servers import ServerSpec, check_server_url

    if isinstance(servers, str):
        servers = [servers]
    if not servers:
        raise ConfigError("run needs at least one server URL (servers=[...])")
    checked = [ServerSpec(check_server_url(url, "servers")[0]) for url in servers]
    specs, auth = without_credentials(checked, api_key, None)
    return configs(specs, auth, api_key, settings)


async def _run(database: Database, config: Any, client_config: Any) -> RunOutcome:
    from orchestrator.running import run_worker

    return await run_worker(database, config, client_config)


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


# ---------------------------------------------------------------------------- sync


async def _next(rows: AsyncIterator[T]) -> T:
    """A coroutine for the loop's thread (an async generator's step is only awaitable)."""
    return await rows.__anext__()


def open_sync(db: str | os.PathLike[str] | None = None) -> SyncQueue:
    """The same queue without ``await``, for scripts and notebooks.

    Its calls run on an event loop of its own, in a background thread, so it works in
    a Jupyter kernel (whose loop is already running) as well as in a plain script.
    """
    return SyncQueue(None if db is None else os.fspath(db))


class SyncQueue:
    """``Queue``'s calls, blocking. Use ``with orchestrator.open_sync(db) as q`` (or call
    ``close``). Ctrl-C during ``run`` stops the run cleanly, as cancelling it would."""

    def __init__(self, db: str | None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="orchestrator-api", daemon=True
        )
        self._thread.start()
        self._queue = Queue(db)
        try:
            self._call(self._queue.__aenter__())
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> SyncQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Awaitable[T]) -> T:
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
        """Stop what runs, close the database and the loop's thread."""
        if self._loop.is_closed():
            return
        try:
            self._call(self._queue.close())
        finally:
            self._stop_loop()

    def enqueue(self, records: Source, **options: Any) -> EnqueueReport:
        """``Queue.enqueue``."""
        return self._call(self._queue.enqueue(records, **options))

    def run(self, **options: Any) -> RunOutcome:
        """``Queue.run``."""
        return self._call(self._queue.run(**options))

    def status(self, **options: Any) -> Status:
        """``Queue.status``."""
        return self._call(self._queue.status(**options))

    def results(self, **options: Any) -> Iterator[dict[str, Any]]:
        """``Queue.results``, one row at a time from the loop's thread."""
        rows = self._queue.results(**options)
        try:
            while True:
                try:
                    yield self._call(_next(rows))
                except StopAsyncIteration:
                    return
        finally:
            self._call(rows.aclose())  # type: ignore[attr-defined]

    def export(self, out: str | os.PathLike[str], **options: Any) -> ExportReport:
        """``Queue.export``."""
        return self._call(self._queue.export(out, **options))

    def requeue(self, **options: Any) -> int | dict[tuple[str, str], int]:
        """``Queue.requeue``."""
        return self._call(self._queue.requeue(**options))

    def undo_requeue(self, **options: Any) -> UndoReport:
        """``Queue.undo_requeue``."""
        return self._call(self._queue.undo_requeue(**options))

    def pause(self, dataset: str) -> None:
        """``Queue.pause``."""
        self._call(self._queue.pause(dataset))

    def resume(self, dataset: str) -> None:
        """``Queue.resume``."""
        self._call(self._queue.resume(dataset))
