"""Tokens generated and thrown away: what a run paid for and kept nothing of.

Each transition that throws an answer (or a request's work) away adds it here in its own
transaction (``store.queue``): the ``wasted_tokens`` table holds one row per dataset and
cause, so status reads a handful of rows whatever the size of the run. An attempt whose
token count nobody knows (a worker killed mid-request, a body without usage) counts as a
request in ``unknown``, never as zero tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from orchestrator.store.spend import Bill
from orchestrator.store.statements import add_counts

#: In-flight requests lost with a worker killed (SIGKILL, a crash, a power cut): found
#: when another worker takes the dead one's leases back; their tokens are not known.
KILLED = "killed"
#: In-flight requests cancelled when a worker stopped (SIGTERM past the grace period).
STOPPED = "stopped"
#: Answers that came back after their lease was lost: fenced out, never written.
FENCED = "fenced"
#: Answers cut at max_tokens and sampled again (``on_truncated`` retry) or failed.
TRUNCATED = "truncated"
#: Answers not the JSON asked for, sampled again (``on_invalid`` retry) or failed.
INVALID = "invalid"
#: Answers whose body could not be read or stored, retried.
BAD_RESPONSE = "bad_response"
#: Answers set aside by ``requeue`` (kept in superseded_outputs; an undo takes them back).
REQUEUED = "requeued"

CAUSES = (KILLED, STOPPED, FENCED, TRUNCATED, INVALID, BAD_RESPONSE, REQUEUED)


@dataclass(frozen=True, slots=True)
class Waste:
    """One attempt's work thrown away: why, its completion tokens (None: not known), and
    what its provider billed for it (``store.spend``; None: no usage to bill from)."""

    cause: str
    tokens: int | None = None
    bill: Bill | None = None


@dataclass(frozen=True, slots=True)
class Wasted:
    """Work thrown away for one dataset and cause, to add to (or, negative, take off)."""

    dataset_id: int
    cause: str
    requests: int
    tokens: int
    unknown: int


def tally(entries: Iterable[tuple[int, Waste]]) -> list[Wasted]:
    """Attempts by (dataset, cause), summed, in key order (so two writers lock the rows
    of the table in the same order and never deadlock)."""
    sums: dict[tuple[int, str], list[int]] = {}
    for dataset_id, waste in entries:
        slot = sums.setdefault((dataset_id, waste.cause), [0, 0, 0])
        slot[0] += 1
        if _count(waste.tokens) is None:
            slot[2] += 1
        else:
            slot[1] += waste.tokens  # type: ignore[operator]
    return [Wasted(d, c, *sums[(d, c)]) for d, c in sorted(sums)]


#: Most tokens one answer may be said to have: a server's usage beyond it (or not a whole
#: number) is not a count to add up, so the attempt counts as of unknown tokens.
MOST_TOKENS = 2**31 - 1


def _count(tokens: object) -> int | None:
    if type(tokens) is int and 0 <= tokens <= MOST_TOKENS:
        return tokens
    return None


def add(conn: sa.Connection, rows: Sequence[Wasted], now: float) -> None:
    """Add to the table, in the caller's write transaction."""
    add_counts(conn, "wasted_tokens", ("dataset_id", "cause"), rows, now)


_READ = "SELECT dataset_id, cause, requests, tokens, unknown FROM wasted_tokens"


def read(conn: sa.Connection) -> list[Wasted]:
    """Every row of the table."""
    return [Wasted(*row) for row in conn.execute(sa.text(_READ))]
