"""The API's queue without ``await``: ``Queue``'s calls run on an event loop of its own,
in a background thread, for scripts and notebooks.

Apart from the ``async`` queue, which it wraps call for call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from orchestrator.api.async_queue import Queue
from orchestrator.api.datasets import SyncDatasetCalls
from orchestrator.api.results import CLOSED, Results, Status
from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    from orchestrator.api.enqueue import Source
    from orchestrator.api.running import RunOutcome
    from orchestrator.formats.options import ExportReport
    from orchestrator.store import EnqueueReport
    from orchestrator.store.item_detail import ItemRecord
    from orchestrator.store.requeue import UndoReport

T = TypeVar("T")


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
            raise ConfigError(CLOSED)
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
