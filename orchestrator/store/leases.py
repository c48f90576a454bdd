"""What a worker holds and reports: a lease, its output or failure, a claim for more,
and the lease columns a transition clears.

Apart from ``store.queue`` so that the claims and the write rounds, which the queue
composes, can name them without importing it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.items.answer import Answer
from orchestrator.items.answer_length import Expected
from orchestrator.items.tokens import Tokens
from orchestrator.store import waste as wasted
from orchestrator.store.spend import Budget
from orchestrator.store.statements import Expr


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed item: what a worker needs to call the server and to report back."""

    item_id: int
    token: str
    dataset_id: int
    key: str
    request: dict[str, Any]
    attempt: int
    expires_at: float
    # In flight at two deaths of its worker or more: it may be what killed them, so it
    # runs in a group of its level, one group per worker (``store.crashes``).
    suspect: bool = False
    # Multi-turn regeneration: the turn to generate (of ``turns``), and the assistant
    # messages already generated for the turns before it, in order.
    turn: int = 0
    turns: int = 1
    generated: tuple[dict[str, Any], ...] = ()
    # Completion tokens, quality flags and seconds of the turns already generated (the
    # output counts every turn's tokens and time, and carries every turn's flags).
    generated_tokens: int = 0
    generated_flags: int = 0
    generated_latency: float = 0.0
    # The error the item was last put back to pending with (a retry, or a release: the
    # run guard's, when it stopped a run while holding it), as stored; None: none.
    last_failure: Failure | None = None
    # Which of its prompt's samples the item is (``items.sample``; 0 when one).
    sample: int = 0

    @property
    def log_fields(self) -> dict[str, Any]:
        """How every log line names the item: its id, and its key to find its row."""
        return {"item": self.item_id, "key": self.key}


@dataclass(frozen=True, slots=True)
class Output(Answer):
    """One generated answer, written with the transition to done, with the hash of the
    parameters it was asked with."""

    params_hash: str | None = None
    #: The token ids and logprobs the server gave (``orchestrator.items.tokens``), kept packed.
    tokens: Tokens | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt did not produce an output, and the server it was sent to (None: it
    was sent to none, or the caller does not say)."""

    error_class: str
    message: str
    server: str | None = None
    #: The work the attempt threw away (an answer cut at max_tokens, a bad body, a
    #: request cancelled at shutdown), counted when the transition is written; None:
    #: nothing was generated, or nothing is known to have been.
    waste: wasted.Waste | None = None


# The error class of items taken back from a worker that died or stopped renewing.
LEASE_LOST = "lease_lost"

CLEAR_LEASE = {"lease_token": None, "lease_owner": None, "lease_expires_at": None}
# How a running item is put back when it was not at fault (release, and ``db copy`` of
# an item that was running): pending, its lease cleared and its attempt given back.
PUT_BACK: dict[str, Any] = {
    "state": "pending",
    **CLEAR_LEASE,
    "attempts": Expr(
        "CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END",
        lambda row: max((row["attempts"] or 0) - 1, 0),
    ),
}


def put_back(row: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a running item (as read, by name) once put back by the release rule."""
    return {
        column: value.apply(row) if isinstance(value, Expr) else value
        for column, value in PUT_BACK.items()
    }


@dataclass(frozen=True, slots=True)
class Claim:
    """A request for work: up to ``want`` items for ``owner``.

    ``suspect_slots`` is the worker's room for one group of suspects (items that died
    twice or more, ``store.crashes``): the group of level ``d`` takes at most
    ``max(1, suspect_slots >> (d - 1))``; 0: none (the worker runs a group already);
    None: any item, without groups.
    """

    owner: str
    want: int
    lease_seconds: float
    dataset_names: tuple[str, ...] | None = None
    suspect_slots: int | None = None
    #: Items to take first from each dataset that fewer have been claimed from, whatever
    #: its priority: every dataset then answers early, so a bad template or
    #: ``max_tokens`` shows at once and the ETA knows every dataset's answer length.
    #: ``started`` caches the datasets found to have had theirs, across claims.
    scouts: int = 0
    started: set[int] = field(default_factory=set)
    #: Take items never put back (no error kept) before any other: a dataset's trial
    #: item is then not one the run guard held when an earlier run stopped.
    fresh_first: bool = False
    #: How each dataset's items rank (``orchestrator.items.answer_length``): the datasets of one
    #: priority are claimed from together, the longest answers first. A dataset not
    #: listed ranks its items by their prediction alone.
    lengths: Mapping[int, Expected] = field(default_factory=dict)
    #: Datasets whose samples of a prompt are asked in one request (``n``), with their
    #: samples per prompt: a prompt's pending samples are claimed together, one after
    #: another, so that no claim cuts a request in two.
    together: Mapping[int, int] = field(default_factory=dict)
    #: The run's budget (``run --budget``): the claim takes no more items than the money
    #: left pays for, read from the ledger in the claim's transaction; None: no budget.
    budget: Budget | None = None
