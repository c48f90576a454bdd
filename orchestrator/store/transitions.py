"""Requeue and its undo: the moves of items no worker holds, fenced by the state they
are in, under a lock on their rows.

Apart from ``store.queue`` (whose transitions are fenced by a lease) and used by
``store.requeue``, which decides what to move and keeps the record of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from orchestrator.store import waste as wasted
from orchestrator.store.schema import (
    item_turns,
    items,
    outputs,
    requeued_items,
    superseded_outputs,
    superseded_turns,
)
from orchestrator.store.statements import chunks

# Items no worker holds (pending, done, failed) have no lease to fence them by. A requeue
# or an undo holds their rows first, then changes those in the state it expects, in one
# transaction: a claim (SKIP LOCKED) passes a held row by, and a row a claim took first
# is running when the hold re-reads it, so it is not held. On SQLite the write
# transaction (BEGIN IMMEDIATE) holds the whole file.

#: The states an undo takes an item back from: not claimed since the requeue, or claimed
#: and failed (the answer it had is worth more than the failure).
RESTORABLE = ("pending", "failed")


def hold(conn: sa.Connection, query: sa.Select[Any]) -> list[sa.Row[Any]]:
    """The rows of ``query`` (which selects from ``items``), locked on PostgreSQL until
    the transaction ends, in id order (two holders never deadlock)."""
    query = query.order_by(items.c.id)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(of=items, key_share=True)
    return list(conn.execute(query))


def reopen(
    conn: sa.Connection,
    ids: Sequence[int],
    state: str,
    values: Mapping[str, Any],
    *,
    requeue_id: int,
) -> set[int]:
    """Held items still in ``state`` (done or failed) back to pending, for a requeue.

    Their output moves to ``superseded_outputs`` under ``requeue_id`` (a failed item has
    none, unless an earlier version left one); a done item's generated turns move too,
    since it starts again from the first turn, while a failed one resumes from its own.
    """
    changed: list[int] = []
    for chunk in chunks(ids):
        changed += conn.execute(
            items.update()
            .where(items.c.id.in_(list(chunk)), items.c.state == state)
            .values(**values)
            .returning(items.c.id)
        ).scalars()
    moves = [(outputs, superseded_outputs)]
    if state == "done":
        moves.append((item_turns, superseded_turns))
    _count_set_aside(conn, changed, values.get("updated_at"), sign=1)
    for chunk in chunks(changed):
        for live, kept in moves:
            _move(conn, live, kept, live.c.item_id.in_(list(chunk)), requeue_id, aside=True)
    return set(changed)


def restore(conn: sa.Connection, requeue_id: int, ids: Sequence[int], now: float) -> set[int]:
    """Held items of a requeue, still pending or failed, given back what the requeue
    recorded of them (``requeued_items``): state, attempts, error, turn, request, and a
    done item's answer and turns from the superseded tables.

    A failed item keeps the turns before its own; the rest are the failed run's.
    """
    former = requeued_items
    values: dict[str, Any] = {
        name: former.c[name]
        for name in ("state", "attempts", "error_class", "last_error", "finished_at", "turn")
    }
    values |= {
        "request": sa.func.coalesce(former.c.request, items.c.request),
        "not_before": 0,
        "updated_at": now,
    }
    # A done item comes back only with its answer: done with no output is no state.
    answer_kept = (
        sa.select(superseded_outputs.c.item_id)
        .where(
            superseded_outputs.c.requeue_id == requeue_id,
            superseded_outputs.c.item_id == former.c.item_id,
        )
        .exists()
    )
    changed: list[tuple[int, str]] = []
    for chunk in chunks(ids):
        changed += conn.execute(
            items.update()
            .where(
                items.c.id == former.c.item_id,
                former.c.requeue_id == requeue_id,
                items.c.id.in_(list(chunk)),
                items.c.state.in_(RESTORABLE),
                sa.or_(former.c.state != "done", answer_kept),
            )
            .values(values)
            .returning(items.c.id, items.c.state)
        ).all()
    done = [item_id for item_id, state in changed if state == "done"]
    _count_set_aside(conn, done, now, sign=-1, requeue_id=requeue_id)
    for chunk in chunks(done):
        for live, kept in ((outputs, superseded_outputs), (item_turns, superseded_turns)):
            conn.execute(live.delete().where(live.c.item_id.in_(list(chunk))))
            where = sa.and_(kept.c.requeue_id == requeue_id, kept.c.item_id.in_(list(chunk)))
            _move(conn, kept, live, where, requeue_id, aside=False)
    others = [item_id for item_id, state in changed if state != "done"]
    for chunk in chunks(others):
        later = sa.select(items.c.turn).where(items.c.id == item_turns.c.item_id)
        conn.execute(
            item_turns.delete().where(
                item_turns.c.item_id.in_(list(chunk)), item_turns.c.turn >= later.scalar_subquery()
            )
        )
    return {item_id for item_id, _ in changed}


def _count_set_aside(
    conn: sa.Connection,
    ids: Sequence[int],
    now: float | None,
    *,
    sign: int,
    requeue_id: int | None = None,
) -> None:
    """Answers a requeue sets aside count as thrown away (``sign`` 1), until an undo
    gives them back (-1): read from the live outputs before they move, or from the
    superseded ones of ``requeue_id`` before they come back."""
    table = outputs if requeue_id is None else superseded_outputs
    found: dict[int, list[int]] = {}
    for chunk in chunks(ids):
        query = sa.select(
            table.c.dataset_id,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(table.c.completion_tokens), 0),
            sa.func.count(table.c.completion_tokens),
        ).where(table.c.item_id.in_(list(chunk)))
        if requeue_id is not None:
            query = query.where(table.c.requeue_id == requeue_id)
        for dataset_id, n, tokens, said in conn.execute(query.group_by(table.c.dataset_id)):
            slot = found.setdefault(dataset_id, [0, 0, 0])
            slot[0] += n
            slot[1] += int(tokens)
            slot[2] += n - said
    rows = [
        wasted.Wasted(d, wasted.REQUEUED, sign * n, sign * tokens, sign * unknown)
        for d, (n, tokens, unknown) in sorted(found.items())
    ]
    wasted.add(conn, rows, time.time() if now is None else now)


def _move(
    conn: sa.Connection,
    source: sa.Table,
    target: sa.Table,
    where: sa.ColumnElement[bool],
    requeue_id: int,
    *,
    aside: bool,
) -> None:
    """Rows from a live table to its superseded twin (``aside``) or back, then gone from
    where they were."""
    live = source if aside else target
    names = [c.name for c in live.columns]
    if aside:
        picked = sa.select(sa.literal(requeue_id, sa.Integer), *[source.c[n] for n in names])
        names = ["requeue_id", *names]
    else:
        picked = sa.select(*[source.c[n] for n in names])
    conn.execute(target.insert().from_select(names, picked.where(where)))
    conn.execute(source.delete().where(where))
