"""What the providers billed: the ledger of every answer that came back, kept or not.

An answer costs its prompt and completion tokens whether it is kept or thrown away (cut
at max_tokens and sampled again, fenced out, refused by its check), so each transition
that writes or throws away an answer adds its tokens here, in its own transaction: a
worker killed at any point neither loses an answer's bill nor counts it twice. The
``spend`` table holds one row per (dataset, server, model, batched, kind), where kind is
``kept`` or the cause the answer was thrown away for (``store.waste``); status prices
the rows (``orchestrator.settings.prices``) and a budget reads them before each claim.

A request asked for ``n`` samples is billed its prompt once, with its first choice; an
attempt whose usage nobody knows (a worker killed mid-request, a body without usage) is
not billed here (``wasted_tokens`` counts it as of unknown tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from orchestrator.items.answer import Answer
from orchestrator.items.samples import sent_as
from orchestrator.settings.prices import KEPT, RunPrices, budget_room
from orchestrator.store.statements import add_counts

__all__ = ["KEPT", "Bill", "Budget", "Spent", "Standing", "add", "bill_of", "read", "tally"]

#: The most tokens one count may say (as ``store.waste``): a larger one is no count.
MOST_TOKENS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Bill:
    """One request's tokens as its provider bills them, and who served it."""

    server: str
    model: str
    batched: bool
    requests: int
    prompt: int
    cached: int
    completion: int


def _count(value: object) -> int:
    return value if type(value) is int and 0 <= value <= MOST_TOKENS else 0


def bill_of(answer: Answer) -> Bill | None:
    """An answer's bill from its usage; None when the usage says no tokens at all.

    A later choice of an ``n`` request (``items.samples.as_choice``) bills its own
    completion tokens only: the request and its prompt are billed with choice 0.
    """
    usage = answer.usage
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int and type(completion) is not int:
        return None
    cached = min(_count(usage.get("cached_tokens")), _count(prompt))
    first = (sent_as(usage) or (0, 1))[0] == 0
    return Bill(
        server=(answer.server or "")[:500],
        model=(answer.model or "")[:200],
        batched=answer.batch is not None,
        requests=int(first),
        prompt=_count(prompt) if first else 0,
        cached=cached if first else 0,
        completion=_count(completion),
    )


@dataclass(frozen=True, slots=True)
class Spent:
    """Billed tokens of one (dataset, server, model, batched, kind), to add to the table."""

    dataset_id: int
    server: str
    model: str
    batched: bool
    kind: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def tally(entries: Iterable[tuple[int, str, Bill]]) -> list[Spent]:
    """Bills by (dataset, kind, server, model, batched) summed, in key order (writers
    then lock the table's rows in one order and never deadlock)."""
    sums: dict[tuple[int, str, str, str, bool], list[int]] = {}
    for dataset_id, kind, bill in entries:
        key = (dataset_id, kind, bill.server, bill.model, bill.batched)
        slot = sums.setdefault(key, [0, 0, 0, 0])
        slot[0] += bill.requests
        slot[1] += bill.prompt
        slot[2] += bill.cached
        slot[3] += bill.completion
    return [Spent(d, s, m, b, k, *sums[(d, k, s, m, b)]) for d, k, s, m, b in sorted(sums)]


def add(conn: sa.Connection, rows: Sequence[Spent], now: float) -> None:
    """Add to the ledger, in the caller's write transaction."""
    add_counts(conn, "spend", ("dataset_id", "server", "model", "batched", "kind"), rows, now)


#: The ledger as a budget reads it (``store.stats`` reads it too, for status).
READ_SQL = (
    "SELECT dataset_id, server, model, batched, kind, requests, prompt_tokens,"
    " cached_tokens, completion_tokens FROM spend"
)


def read(conn: sa.Connection) -> list[Spent]:
    """Every row of the ledger (a handful per dataset)."""
    return [_spent(row) for row in conn.execute(sa.text(READ_SQL))]


def _spent(row: Sequence[Any]) -> Spent:
    d, server, model, batched, kind, *counts = row
    return Spent(d, server, model, bool(batched), kind, *(int(c) for c in counts))


@dataclass(frozen=True, slots=True)
class Standing:
    """A budget as a claim found it: spent so far, the items running, the billed mean
    per request (None: nothing billed yet), and the items it let the claim take."""

    limit: float
    spent: float
    running: int
    per_request: float | None
    room: int


@dataclass(slots=True)
class Budget:
    """Most USD the run may spend at its token prices (``run --budget``). Each claim
    reads the ledger in its own transaction and takes no more items than the money left
    pays for, counting the items running (every worker's) at the billed mean; the last
    finding is kept in ``last`` for the worker."""

    limit: float
    prices: RunPrices
    datasets: tuple[str, ...] = ()
    last: Standing | None = None

    def standing(self, conn: sa.Connection, want: int) -> Standing:
        spent, requests = self._spent(conn)
        running = self._running(conn)
        per_request = spent / requests if requests else None
        room = budget_room(self.limit, spent, per_request, running, want)
        self.last = Standing(self.limit, spent, running, per_request, room)
        return self.last

    def _scope(self) -> tuple[str, dict[str, Any]]:
        if not self.datasets:
            return "", {}
        names = {f"n{i}": name for i, name in enumerate(self.datasets)}
        listed = ", ".join(f":{key}" for key in names)
        return f" WHERE dataset_id IN (SELECT id FROM datasets WHERE name IN ({listed}))", names

    def _spent(self, conn: sa.Connection) -> tuple[float, int]:
        where, params = self._scope()
        rows = conn.execute(sa.text(READ_SQL + where), params).all()
        spent = 0.0
        requests = 0
        for row in rows:
            s = _spent(row)
            bill = self.prices.of(s.server or None)
            spent += bill.billed(s.prompt_tokens, s.cached_tokens, s.completion_tokens, s.batched)
            requests += s.requests
        return spent, requests

    def _running(self, conn: sa.Connection) -> int:
        where, params = self._scope()
        sql = "SELECT count(*) FROM items WHERE state = 'running'"
        if where:
            sql += " AND" + where.removeprefix(" WHERE")
        return int(conn.execute(sa.text(sql), params).scalar_one())
