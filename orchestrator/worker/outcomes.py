"""What became of one attempt at an item: one type per kind, each written by the committer
in the round that settles it (``Rejected`` is decided by the run guard first).

``kind`` is the store's name for the transition (``Round``'s lists, ``RoundResult``'s
``accepted``) and the metrics' outcome label.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

from orchestrator.store import Failure, Lease, Output
from orchestrator.store.leases import Claim
from orchestrator.store.rounds import Round


@dataclass(slots=True)
class Outcome:
    """An outcome waiting for the committer. ``failures`` counts its writes alone that
    failed while other outcomes were written (see Committer)."""

    kind: ClassVar[str]
    lease: Lease
    failures: int = field(default=0, kw_only=True)

    def written(self, accepted: bool) -> None:
        """The committer wrote it (``accepted``: its lease still held) or gave it up."""


@dataclass(slots=True)
class Done(Outcome):
    """The item's last answer: it is done."""

    kind: ClassVar[str] = "complete"
    output: Output


@dataclass(slots=True)
class Advance(Outcome):
    """A turn of a multi-turn item answered: the next one starts once this is written."""

    kind: ClassVar[str] = "advance"
    output: Output
    landed: asyncio.Future[bool] | None = None

    def written(self, accepted: bool) -> None:
        if self.landed is not None and not self.landed.done():
            self.landed.set_result(accepted)


@dataclass(slots=True)
class BackToPending(Outcome):
    """Back to pending until ``not_before``, for the reason ``failure`` gives."""

    failure: Failure
    not_before: float


@dataclass(slots=True)
class Retry(BackToPending):
    """Back to pending after a backoff; the attempt stays counted."""

    kind: ClassVar[str] = "retry"


@dataclass(slots=True)
class Release(BackToPending):
    """Back to pending with the attempt given back: the item was not at fault."""

    kind: ClassVar[str] = "release"


@dataclass(slots=True)
class Failed(Outcome):
    """Final: the item fails with this error class and reason."""

    kind: ClassVar[str] = "fail"
    failure: Failure


@dataclass(slots=True)
class Rejected(Outcome):
    """A server refused the request for good: held for the run guard, which fails it or,
    if the rejection is the run's rather than the item's, releases it."""

    kind: ClassVar[str] = "hold"
    server: str
    message: str
    failure: Failure
    #: The hash of the dataset's parameters the request was asked with.
    settings: str


#: Outcomes that carry a failure (an error class and a reason).
Failing = Retry | Release | Failed


def to_round(batch: list[Outcome], claim: Claim | None) -> Round:
    """The store's transaction for these outcomes and this claim."""
    work = Round(claim=claim)
    for entry in batch:
        if isinstance(entry, Done):
            work.complete.append((entry.lease, entry.output))
        elif isinstance(entry, Advance):
            work.advance.append((entry.lease, entry.output))
        elif isinstance(entry, Failed):
            work.fail.append((entry.lease, entry.failure))
        elif isinstance(entry, Retry):
            work.retry.append((entry.lease, entry.failure, entry.not_before))
        elif isinstance(entry, Release):
            work.release.append((entry.lease, entry.failure, entry.not_before))
        else:
            raise TypeError(f"{type(entry).__name__} is not written by the committer")
    return work
