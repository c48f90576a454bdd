"""What the API's calls read back: the ``status`` figures and the rows of ``results``
and ``inspect``, a batch at a time in one read transaction.

Apart from the queue's calls so that the blocking queue (``api.sync_queue``) wraps the
same readers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    from orchestrator.store.access import Batches

T = TypeVar("T")
R = TypeVar("R")

CLOSED = "the queue is closed: open it again (orchestrator.open(db))"


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


def unchanged(row: R) -> R:
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
