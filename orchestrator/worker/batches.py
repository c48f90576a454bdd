"""A server's requests sent through its Batch API: packed, watched, answered, once.

An item claimed for a batch server is asked as online (``worker.call``), but its request
goes into the server's next batch instead of over HTTP: lines gather until the batch is
full (``BatchLimits.requests``, ``.bytes``) or no new one came for ``linger`` seconds;
the batch is written down with its lines (``store.batches``), uploaded, created with the
run's own id in its metadata, each id written as the provider gives it, then watched
with backoff until it ends. Its answers go back to the requests waiting for them and on
through the same checks and fenced writes as an online answer.

Never twice: before a request is packed, the store is asked whether the item's turn
already has a live line (a batch made by a worker that died, or by this one before a
shutdown); if so the request waits for that batch instead (adopted: polled where it is
known, looked up by its metadata where its create's answer was lost, given up where it
was never created). A line is settled only once its answer was written for its item;
a batch whose lines are all settled (or whose items ended otherwise) is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from orchestrator._util import procinfo
from orchestrator.errors import BatchUnanswered, ConfigError, PermanentError, TransientError
from orchestrator.inference.batchapi import (
    ENDED,
    BatchApi,
    BatchLimits,
    LineResult,
    input_line,
    read_results,
)
from orchestrator.inference.completions import Completion
from orchestrator.store import Database, Lease
from orchestrator.store import batches as records

log = structlog.get_logger("orchestrator.worker.batches")

T = TypeVar("T")

#: Tries at a step that costs nothing (an upload, a look, a download) before giving up.
_TRIES = 4
#: Seconds past a create call's own limit after which it surely did not land.
_DOUBT_MARGIN = 5.0
#: Seconds between two housekeeping rounds: settled lines written, finished batches closed.
_HOUSEKEEPING = 2.0


def custom_id(lease: Lease) -> str:
    """A line's id in its batch: the item and turn it asks for."""
    return f"i{lease.item_id}-t{lease.turn}"


@dataclass(slots=True)
class _Batch:
    """One batch of this worker's: gathering lines, then followed until its answers are
    in; the requests waiting for them."""

    key: str
    server: str
    endpoint: str
    lines: list[records.Line] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    size: int = 0
    first: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    provider_id: str | None = None
    results: dict[str, LineResult] | None = None
    failed: Exception | None = None
    cancelled: bool = False
    looks: int = 0  # at the provider's batch object, by this worker
    waiting: dict[str, list[asyncio.Future[LineResult]]] = field(default_factory=dict)

    def wait_for(self, line: str) -> asyncio.Future[LineResult]:
        future: asyncio.Future[LineResult] = asyncio.get_running_loop().create_future()
        if self.results is not None:
            future.set_result(self._result(line))
        else:
            self.waiting.setdefault(line, []).append(future)
        return future

    def _result(self, line: str) -> LineResult:
        assert self.results is not None
        if self.failed is not None:
            return LineResult(line, error=self.failed)
        found = self.results.get(line)
        if found is None:
            said = f"batch {self.key} ({self.provider_id}) ended without an answer for {line}"
            return LineResult(line, error=BatchUnanswered(said))
        return found

    def answer(self, results: dict[str, LineResult]) -> None:
        """The batch's answers are in (a line missing from them was not answered)."""
        self.results = results
        for line, futures in self.waiting.items():
            for future in futures:
                if not future.done():
                    future.set_result(self._result(line))
        self.waiting.clear()

    def fail(self, error: Exception) -> None:
        """Every line of the batch ends with ``error`` (it was never created, or lost)."""
        self.failed = error
        self.answer({})

    def describe(self) -> str:
        return f"batch {self.key}" + (f" ({self.provider_id})" if self.provider_id else "")


class Batches:
    """The batch servers' requests of one worker."""

    def __init__(
        self,
        database: Database,
        api: BatchApi,
        limits: BatchLimits,
        servers: frozenset[str],
        owner: str,
    ) -> None:
        self.database, self.api, self.limits = database, api, limits
        self.servers, self.owner = servers, owner
        self._packing: dict[tuple[str, str], _Batch] = {}
        self._batches: dict[str, _Batch] = {}
        self._lookups: dict[int, asyncio.Future[records.Wanted | None]] = {}
        self._lookup_task: asyncio.Task[None] | None = None
        self._delivered: dict[int, tuple[str, str]] = {}
        self._settled: list[tuple[str, str]] = []
        #: Lines settled here: not wanted any more, whatever the store says until the
        #: settling is written.
        self._spent: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cut: dict[str, int] = {}  # files read cut short, by id: how many times

    def serves(self, server: str) -> bool:
        return server in self.servers

    async def start(self) -> None:
        """Check that each batch server offers the Batch API (else the run cannot go),
        then keep the records."""
        for server in sorted(self.servers):
            missing = await self.api.offered(server)
            if missing is not None:
                raise ConfigError(
                    f"{missing}; run without --batch-api (or with batch_api=no for this "
                    "server in the servers file)"
                )
        # Follow every created batch of these servers left live by an earlier life of the
        # run: its answers are collected before its items are claimed, and one nobody
        # wants any more is cancelled. (One not yet created may be another live worker's,
        # about to be: it is looked at only once one of its items is claimed here.)
        for row in await records.listing(self.database, live=True, limit=10_000):
            if row.provider_id and row.server in self.servers:
                self._adopt(row.key, row.server, row.endpoint)
        self._spawn(self._keep())

    async def close(self) -> None:
        """Stop following (the provider's batches live on: the next run adopts them)."""
        tasks = [*self._tasks, *([self._lookup_task] if self._lookup_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await self._tidy()

    # ------------------------------------------------------------------ requests

    async def ask(
        self, server: str, lease: Lease, body: dict[str, Any], endpoint: str
    ) -> list[Completion]:
        """The answer to ``body`` for ``lease``'s item: from the live batch that already
        asks it, or from the next batch of ``server``; or the error it stands for."""
        started = time.monotonic()
        wanted = await self._lookup(lease.item_id)
        if wanted is not None and (wanted.batch_key, wanted.custom_id) in self._spent:
            wanted = None  # answered here already, its settling not yet written
        if wanted is not None and wanted.turn == lease.turn:
            batch, line = self._adopt(wanted.batch_key, server, endpoint), wanted.custom_id
        else:
            if wanted is not None:  # a line of an earlier turn, never settled
                self._settled.append((wanted.batch_key, wanted.custom_id))
            batch, line = self._pack(server, endpoint, lease, body), custom_id(lease)
        result = await batch.wait_for(line)
        self._delivered[lease.item_id] = (batch.key, line)
        if result.error is not None:
            raise result.error
        assert result.choices is not None
        latency = time.monotonic() - started
        return [
            dataclasses.replace(c, latency=latency, batch=batch.provider_id) for c in result.choices
        ]

    def written(self, item_id: int, accepted: bool) -> None:
        """The item's outcome was written (``accepted``) or fenced out: the line that
        answered it is settled, or stays wanted by whoever holds the item now."""
        delivered = self._delivered.pop(item_id, None)
        if delivered is not None and accepted:
            self._settled.append(delivered)
            self._spent.add(delivered)

    async def _lookup(self, item_id: int) -> records.Wanted | None:
        """The item's live line, if any: the lookups of one round go in one query."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[records.Wanted | None] = loop.create_future()
        self._lookups[item_id] = future
        if self._lookup_task is None or self._lookup_task.done():
            self._lookup_task = asyncio.create_task(self._run_lookups())
        return await future

    async def _run_lookups(self) -> None:
        await asyncio.sleep(0)
        while self._lookups:
            asked, self._lookups = self._lookups, {}
            try:
                found = await records.wanted(self.database, asked)
            except Exception as exc:
                for future in asked.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for item_id, future in asked.items():
                if not future.done():
                    future.set_result(found.get(item_id))

    # ------------------------------------------------------------------ packing

    def _pack(self, server: str, endpoint: str, lease: Lease, body: dict[str, Any]) -> _Batch:
        line = custom_id(lease)
        data = input_line(line, endpoint, body)
        slot = (server, endpoint)
        batch = self._packing.get(slot)
        if batch is not None and batch.size + len(data) > self.limits.bytes:
            self._send(slot)
            batch = None
        if batch is None:
            batch = _Batch(f"orch-{uuid.uuid4().hex}", server, endpoint)
            self._packing[slot] = self._batches[batch.key] = batch
            self._spawn(self._guarded(batch, self._linger(slot, batch)))
        batch.lines.append(records.Line(line, lease.item_id, lease.turn))
        batch.data.append(data)
        batch.size += len(data)
        batch.last = time.monotonic()
        if len(batch.lines) >= self.limits.requests:
            self._send(slot)
        return batch

    async def _linger(self, slot: tuple[str, str], batch: _Batch) -> None:
        """Send a batch short of the limits once no request joined it for ``linger``
        seconds (or, with requests trickling in, once it is ten lingers old)."""
        while self._packing.get(slot) is batch:
            now = time.monotonic()
            if now - batch.last >= self.limits.linger or now - batch.first >= 10 * (
                self.limits.linger
            ):
                self._send(slot)
                return
            await asyncio.sleep(min(self.limits.linger / 4, 0.5))

    def _send(self, slot: tuple[str, str]) -> None:
        batch = self._packing.pop(slot)
        self._spawn(self._guarded(batch, self._submit(batch)))

    async def _submit(self, batch: _Batch) -> None:
        """Write the batch down, upload it, create it, each step recorded; then follow it.
        A failure before the create is paid for nothing: its lines go back."""
        key, server = batch.key, batch.server
        data, batch.data = b"".join(batch.data), []
        try:
            await records.open_batch(
                self.database, key, server, batch.endpoint, batch.lines, len(data), self.owner
            )
            upload = await _tried(lambda: self.api.upload(server, f"{key}.jsonl", data))
            if not await records.record(
                self.database, key, self.owner, state=records.UPLOADED, input_file_id=upload["id"]
            ):
                raise self._taken(batch)
            doc = await self._create(batch, upload["id"])
        except Exception as exc:
            await self._abandon(batch, exc)
            return
        log.info(
            "batch_created", batch=key, provider_id=batch.provider_id, server=server,
            requests=len(batch.lines), bytes=len(data),
        )  # fmt: skip
        await self._follow(batch, doc)

    async def _create(self, batch: _Batch, file_id: str) -> dict[str, Any]:
        """Create the batch; a create whose answer was lost (a timeout, a reset) may have
        happened: it is looked for by its key before it is tried again."""
        for attempt in range(_TRIES):
            if not await records.mark_creating(self.database, batch.key, self.owner):
                raise self._taken(batch)
            try:
                doc = await self.api.create(
                    batch.server, file_id, batch.endpoint, batch.key, self.limits.window
                )
            except TransientError:
                if attempt == _TRIES - 1:
                    raise
                await asyncio.sleep(self.limits.poll_first * 2**attempt)
                found = await _tried(lambda: self._find(batch))
                if found is None:
                    continue
                doc = found
            await self._created(batch, doc)
            return doc
        raise AssertionError("unreachable")

    async def _find(self, batch: _Batch) -> dict[str, Any] | None:
        row = await records.get(self.database, batch.key)
        since = row.created_at if row is not None else time.time() - 86400
        return await self.api.find(batch.server, batch.key, since)

    def _taken(self, batch: _Batch) -> BatchUnanswered:
        """Another worker took the batch over (this one's leases ran out): it creates
        nothing more of it and writes none of its steps."""
        said = f"{batch.describe()} was taken over by another worker"
        return BatchUnanswered(said, released=False)

    async def _created(self, batch: _Batch, doc: dict[str, Any]) -> None:
        batch.provider_id = str(doc["id"])
        await records.record(
            self.database,
            batch.key,
            self.owner,
            state=records.CREATED,
            provider_id=batch.provider_id,
            status=doc.get("status"),
            expires_at=doc.get("expires_at"),
        )

    async def _abandon(self, batch: _Batch, error: Exception) -> None:
        """The batch was never created (or is lost): its lines go back to be asked again;
        a rejection (a wrong key, no such model) reaches each request as it is."""
        if not isinstance(error, PermanentError | BatchUnanswered):
            error = BatchUnanswered(
                f"{batch.describe()} could not be sent: {error}", released=False
            )
        log.error("batch_abandoned", batch=batch.key, server=batch.server, error=str(error))
        with contextlib.suppress(Exception):
            await records.record(
                self.database, batch.key, self.owner, state=records.ABANDONED,
                error=str(error)[:500],
            )  # fmt: skip
        batch.fail(error)
        self._batches.pop(batch.key, None)

    # ------------------------------------------------------------------ following

    def _adopt(self, key: str, server: str, endpoint: str) -> _Batch:
        """The batch ``key`` as this worker follows it: one made here, or one left live
        by a worker that stopped, found again."""
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(key, server, endpoint)
            self._spawn(self._guarded(batch, self._resume(batch)))
        return batch

    async def _guarded(self, batch: _Batch, step: Awaitable[None]) -> None:
        """A batch's task; one that breaks (a bug, the database gone) must not leave its
        requests waiting for ever: they end with its error, their attempt counted, and the
        batch's record stays as it was, for whoever asks them next to adopt it."""
        try:
            await step
        except Exception as exc:
            log.exception("batch_task_failed", batch=batch.key)
            said = f"{batch.describe()}: {type(exc).__name__}: {exc}"
            batch.fail(BatchUnanswered(said, released=False))
            if self._batches.get(batch.key) is batch:
                del self._batches[batch.key]

    async def _resume(self, batch: _Batch) -> None:
        """Follow a batch recorded by another life of the run: from its provider id, from
        its key in the provider's list, or given up where it never was created."""
        row = await _tried(lambda: records.get(self.database, batch.key))
        row = await self._take_over(batch, row)
        if row is None:
            await self._abandon(batch, BatchUnanswered(f"{batch.describe()} is gone"))
            return
        batch.server, batch.endpoint = row.server, row.endpoint
        if row.server not in self.servers:
            said = f"{batch.describe()} is at {row.server}, not a batch server of this run"
            await self._abandon(batch, BatchUnanswered(said, released=False))
            return
        batch.provider_id = row.provider_id
        if batch.provider_id is None:
            found = None
            if row.input_file_id is not None:
                found = await _tried(lambda: self._find(batch))
            if found is None:
                said = f"{batch.describe()} was never created"
                await self._abandon(batch, BatchUnanswered(said))
                return
            await self._created(batch, found)
            log.info("batch_found", batch=batch.key, provider_id=batch.provider_id)
        log.info("batch_adopted", batch=batch.key, provider_id=batch.provider_id)
        await self._follow(batch, None)

    async def _take_over(
        self, batch: _Batch, row: records.BatchRow | None
    ) -> records.BatchRow | None:
        """Hold the batch's record before acting on it (None: it is gone). A create its
        worker may still have in flight is waited out first: given up before it lands, the
        batch would be made twice and paid twice."""
        while row is not None and row.state in records.LIVE:
            if row.worker == self.owner:
                return row
            wait = self._in_doubt(row)
            if wait > 0:
                log.info(
                    "batch_create_in_doubt", batch=batch.key, worker=row.worker,
                    wait_s=round(wait, 1),
                )  # fmt: skip
                await asyncio.sleep(wait)
            elif await _tried(functools.partial(records.take_over, self.database, row, self.owner)):
                return row
            row = await _tried(lambda: records.get(self.database, batch.key))
        return None

    def _in_doubt(self, row: records.BatchRow) -> float:
        """Seconds until a create the row's worker may have asked is surely over (its
        call's time is up); 0 when none can be in flight (or its worker died here)."""
        if row.state != records.CREATING or row.worker is None:
            return 0.0
        if procinfo.is_dead_local(row.worker):
            return 0.0
        return row.updated_at + self.api.seconds + _DOUBT_MARGIN - time.time()

    async def _follow(self, batch: _Batch, doc: dict[str, Any] | None) -> None:
        """Look at the batch, with backoff, until it ends; then collect its answers."""
        delay = self.limits.poll_first
        seen: tuple[Any, ...] = ()
        while doc is None or doc.get("status") not in ENDED:
            if doc is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.limits.poll_max)
            batch.looks += 1
            try:
                assert batch.provider_id is not None
                doc = await _tried(lambda: self.api.get(batch.server, batch.provider_id or ""))
            except PermanentError as exc:
                said = f"{batch.describe()} is no longer at {batch.server}: {exc}"
                await self._abandon(batch, BatchUnanswered(said, released=False))
                return
            except Exception as exc:
                log.warning("batch_poll_failed", batch=batch.key, error=str(exc))
                doc = {"status": None}
                continue
            now = _seen(doc)
            if now != seen:
                seen = now
                await records.record(self.database, batch.key, self.owner, **_progress(doc))
        await self._collect(batch, doc)

    async def _collect(self, batch: _Batch, doc: dict[str, Any]) -> None:
        """Download the ended batch's output and error files and answer its lines."""
        raw = batch.endpoint == "completions"
        results: dict[str, LineResult] = {}
        problems = []
        for name in ("output_file_id", "error_file_id"):
            file_id = doc.get(name)
            if not file_id:
                continue
            try:
                found = await _tried(lambda fid=file_id: self._download(batch, fid, raw))
            except Exception as exc:
                problems.append(f"its {name.split('_')[0]} file {file_id}: {exc}")
                continue
            for result in found:
                results.setdefault(result.custom_id, result)
        status = doc.get("status")
        if status == "failed":
            said = _failure(doc)
            released = "token_limit_exceeded" in said
            error = BatchUnanswered(
                f"{batch.describe()} failed: {said}",
                released=released,
                # Refused for the tokens the live batches hold: asked again once one of
                # them may have ended (the longest wait between two looks).
                retry_after=self.limits.poll_max if released else None,
            )
            results = {ln: LineResult(ln, error=error) for ln in await self._lines(batch)}
        elif problems:
            log.error("batch_output_unreadable", batch=batch.key, problems=problems)
            error = BatchUnanswered(
                f"{batch.describe()}: could not read {'; '.join(problems)}", released=False
            )
            for line in await self._lines(batch):
                results.setdefault(line, LineResult(line, error=error))
        await records.record(self.database, batch.key, self.owner, state=records.COLLECTED)
        log.info(
            "batch_collected", batch=batch.key, provider_id=batch.provider_id, status=status,
            answered=sum(r.choices is not None for r in results.values()),
            lines=len(await self._lines(batch)), looks=batch.looks,
            followed_s=round(time.monotonic() - batch.first, 1),
        )  # fmt: skip
        batch.answer(results)

    async def _download(self, batch: _Batch, file_id: str, raw: bool) -> list[LineResult]:
        """A file's lines; one cut short (a line that is not whole JSON) is read again,
        and, still cut after the last try, its whole lines are kept and the rest is
        said."""
        data = await self.api.content(batch.server, file_id)
        results, unread = read_results(batch.server, data, raw=raw)
        if unread:
            said = f"{batch.describe()}: file {file_id} has {unread} unreadable line(s)"
            self._cut[file_id] = self._cut.get(file_id, 0) + 1
            if self._cut[file_id] < _TRIES:
                raise TransientError(said)
            log.error("batch_file_cut", batch=batch.key, file=file_id, unreadable=unread)
        return results

    async def _lines(self, batch: _Batch) -> list[str]:
        if not batch.lines:
            batch.lines = await _tried(lambda: records.lines_of(self.database, batch.key))
        return [line.custom_id for line in batch.lines]

    # ------------------------------------------------------------------ housekeeping

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING)
            try:
                await self._tidy()
            except Exception as exc:
                log.warning("batch_records_not_kept", error=str(exc))

    async def _tidy(self) -> None:
        """Write the lines settled since the last time; close the batches done with;
        cancel, at the provider, a running batch none of whose lines is wanted any more
        (its items requeued, say): it would be paid for, for nothing."""
        await self._write_settled()
        for key in await records.close_finished(self.database):
            self._batches.pop(key, None)
            log.info("batch_closed", batch=key)
        running = [
            b.key
            for b in self._batches.values()
            if b.provider_id and b.results is None and b.failed is None and not b.cancelled
        ]
        for key in await records.unwanted(self.database, running):
            batch = self._batches[key]
            batch.cancelled = True
            with contextlib.suppress(Exception):
                await self.api.cancel(batch.server, batch.provider_id or "")
                log.warning("batch_cancelled", batch=key, provider_id=batch.provider_id,
                            reason="none of its requests is wanted any more")  # fmt: skip

    async def _write_settled(self) -> None:
        settled, self._settled = self._settled, []
        try:
            await records.settle(self.database, settled)
        except BaseException:
            self._settled = settled + self._settled
            raise
        self._spent.difference_update(settled)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def live(self) -> int:
        """Batches this worker follows now."""
        return sum(1 for b in self._batches.values() if b.results is None)


async def _tried(step: Callable[[], Awaitable[T]]) -> T:
    """A step that costs nothing, tried again after a transient failure."""
    for attempt in range(_TRIES):
        try:
            return await step()
        except TransientError:
            if attempt == _TRIES - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _seen(doc: dict[str, Any]) -> tuple[Any, ...]:
    counts = doc.get("request_counts") or {}
    return (doc.get("status"), counts.get("completed"), counts.get("failed"))


def _progress(doc: dict[str, Any]) -> dict[str, Any]:
    """A look at the batch, as its record's fields."""
    counts = doc.get("request_counts") or {}
    values: dict[str, Any] = {
        "status": doc.get("status"),
        "completed": int(counts.get("completed") or 0),
        "failed": int(counts.get("failed") or 0),
        "output_file_id": doc.get("output_file_id"),
        "error_file_id": doc.get("error_file_id"),
    }
    if doc.get("expires_at"):
        values["expires_at"] = float(doc["expires_at"])
    return values


def _failure(doc: dict[str, Any]) -> str:
    """Why the provider failed a batch, in its words."""
    errors = (doc.get("errors") or {}).get("data") or []
    said = [f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict)]
    return "; ".join(said[:5]) or "no reason given"
