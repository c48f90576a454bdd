"""The committer: a worker's one writer.

Each of its rounds writes every outcome queued since the last one and claims work for the
free slots, in a single transaction, fenced by each item's lease token: a busy worker
writes many items per transaction and the database has one writer per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable

import structlog
from sqlalchemy import exc as sa_exc

from orchestrator.errors import StorageError
from orchestrator.store import Lease, Queue
from orchestrator.store.leases import Claim
from orchestrator.worker.outcomes import Outcome, to_round

log = structlog.get_logger("orchestrator.worker")

# An outcome that fails alone this many times while others are written is at fault.
_ALONE_FAILURES = 3


class Committer:
    """The one writer of a worker: each round settles every queued outcome and claims
    work for the free slots, in one transaction.

    Rounds run back to back while there is work, so they grow with the load: a busy
    worker writes many outcomes per transaction instead of one transaction per item.

    A round that fails is written again one outcome at a time, so that one outcome the
    database cannot take (a value it cannot bind or hold) stops nobody else: that one is
    handed to ``unstorable``, which says what to write instead (the item retried or
    failed as ``bad_response``, with the reason). A storage fault (disk full, file locked
    for too long) fails every write; those outcomes are kept and written again with
    backoff until they land, their leases are gone, or the shutdown deadline passes:
    then they are dropped, counted in ``dropped``, and their leases left to expire.
    """

    def __init__(
        self,
        queue: Queue,
        *,
        plan: Callable[[], Claim | None],
        deliver: Callable[[list[Lease], Claim], None],
        settled: Callable[[Outcome, bool], None],
        idle_poll: float,
        unstorable: Callable[[Outcome, str], Outcome | None] | None = None,
    ):
        self.queue = queue
        self._plan = plan
        self._deliver = deliver
        self._settled = settled
        self._unstorable = unstorable or (lambda _entry, _reason: None)
        self._idle_poll = idle_poll
        self._items: list[Outcome] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._deadline: float | None = None
        self._deadline_moved = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="committer")

    def submit(self, outcome: Outcome) -> None:
        self._items.append(outcome)
        self._wake.set()

    def poke(self) -> None:
        """Something changed that may allow a claim (a free slot, a server back)."""
        self._wake.set()

    def give_up_at(self, deadline: float) -> None:
        """Once closing, drop what still cannot be written after ``deadline`` (monotonic
        seconds): a stop must not hang on a database that takes nothing."""
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            self._deadline_moved.set()

    @property
    def backlog(self) -> int:
        return len(self._items)

    async def close(self) -> None:
        """Write what is queued, claim nothing more, and stop."""
        self._closing = True
        self._wake.set()
        self._deadline_moved.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        delay = 0.5
        while True:
            claim = None if self._closing else self._plan()
            if not self._items and claim is None:
                if self._closing:
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._idle_poll)
                continue
            batch, self._items = self._items, []
            try:
                result = await self.queue.write_round(to_round(batch, claim))
            except Exception as exc:
                kept, error = await self._isolate(batch, exc) if batch else ([], exc)
                if batch and not kept:
                    delay = 0.5
                    continue  # each outcome was written, or replaced, alone
                # Keep them and try again: the fault (a full disk, a lock held too long)
                # may be fixed, and fencing keeps a late write harmless.
                log.error(
                    "commit_failed",
                    error=str(error),
                    error_type=type(error).__name__,
                    batch=len(kept),
                    retry_in_s=delay,
                    exc_info=not isinstance(error, StorageError),
                )
                self._items[:0] = kept
                if self._past_deadline():
                    self._drop(str(error))
                    return
                with contextlib.suppress(Exception):
                    # A full disk may be the WAL's doing: fold it back and truncate it.
                    await self.queue.db.checkpoint("TRUNCATE")
                await self._pause(delay)
                if self._past_deadline():
                    self._drop(str(error))
                    return
                delay = min(delay * 2, 30.0)
                continue
            delay = 0.5
            for entry in batch:
                self._settled(entry, entry.lease.item_id in result.accepted.get(entry.kind, ()))
            if claim is not None:
                self._deliver(result.leases, claim)

    async def _isolate(
        self, batch: list[Outcome], error: Exception
    ) -> tuple[list[Outcome], Exception]:
        """After a failed round: write each outcome alone. Returns those still unwritten
        (a storage fault: every write fails) and the last error seen."""
        if len(batch) == 1 and not _is_data_fault(error):
            return batch, error
        failed: list[tuple[Outcome, Exception]] = []
        wrote = False
        for entry in batch:
            try:
                result = await self.queue.write_round(to_round([entry], None))
            except Exception as exc:
                error = exc
                if _is_data_fault(exc):
                    await self._replace(entry, exc)
                else:
                    failed.append((entry, exc))
                continue
            wrote = True
            self._settled(entry, entry.lease.item_id in result.accepted.get(entry.kind, ()))
        kept: list[Outcome] = []
        for entry, exc in failed:
            # Others were written meanwhile: an outcome failing alone again and again is
            # at fault whatever the driver calls its error; a full disk or a lock is not.
            if wrote and not _is_fault_of(exc, _STORAGE_FAULTS):
                entry.failures += 1
            if entry.failures >= _ALONE_FAILURES:
                await self._replace(entry, exc)
            else:
                kept.append(entry)
        return kept, error

    async def _replace(self, entry: Outcome, error: Exception) -> None:
        """Write what ``unstorable`` says instead of an outcome that cannot be stored."""
        reason = f"{type(error).__name__}: {error}"
        log.error(
            "outcome_unstorable",
            **entry.lease.log_fields,
            kind=entry.kind,
            error=reason[:500],
        )
        entry.written(False)  # the next turn must not start from it
        instead = self._unstorable(entry, reason)
        if instead is not None:
            try:
                result = await self.queue.write_round(to_round([instead], None))
            except Exception as exc:
                if not _is_data_fault(exc):
                    self._items.append(instead)  # the database's fault: try again later
                    return
                log.error("outcome_dropped", item=entry.lease.item_id, error=str(exc)[:500])
            else:
                accepted = instead.lease.item_id in result.accepted.get(instead.kind, ())
                self._settled(instead, accepted)
                return
        # Nothing could be written for it: its lease expires and the item is taken back.
        self._settled(entry, False)

    def _past_deadline(self) -> bool:
        return self._closing and self._deadline is not None and time.monotonic() >= self._deadline

    async def _pause(self, delay: float) -> None:
        """Sleep before the next try; a stop deadline passing cuts it short."""
        until = time.monotonic() + delay
        while (left := until - time.monotonic()) > 0 and not self._past_deadline():
            if self._closing and self._deadline is not None:
                left = min(left, max(self._deadline - time.monotonic(), 0.0))
            self._deadline_moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_moved.wait(), left)

    def _drop(self, error: str) -> None:
        """Stop trying: drop what is unwritten, in one log line; the leases expire."""
        dropped, self._items = self._items, []
        for entry in dropped:
            entry.written(False)
        self.dropped += len(dropped)
        log.error("outcomes_dropped", outcomes=len(dropped), error=error[:500])


def _is_data_fault(exc: BaseException) -> bool:
    """The error is about the values written, not the database: a value the driver
    cannot bind, or the database cannot hold (a NUL in PostgreSQL text, a number out of
    range, a constraint)."""
    return _is_fault_of(exc, _DATA_FAULTS, binding=True)


def _is_fault_of(
    exc: BaseException, kinds: tuple[type[BaseException], ...], *, binding: bool = False
) -> bool:
    """Whether ``exc`` or an error under it (its cause, the driver's own) is one of
    ``kinds`` (or, with ``binding``, a parameter the driver could not bind)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, kinds):
            return True
        driver_error = isinstance(current, sa_exc.DBAPIError | sqlite3.Error)
        if binding and driver_error and "binding" in str(current):
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


# Disk full, locks, I/O errors, a lost connection: the database's state, not the data's.
_STORAGE_FAULTS = (sa_exc.OperationalError, sqlite3.OperationalError)

_DATA_FAULTS = (
    sa_exc.DataError,
    sa_exc.IntegrityError,
    sqlite3.DataError,
    sqlite3.IntegrityError,
    TypeError,
    ValueError,
    OverflowError,
)
