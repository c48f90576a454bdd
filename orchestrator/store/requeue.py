"""Requeue, its dry run, and its undo: sending items back to pending without losing answers.

A requeue of done items used to delete their answers: one ``requeue --state done`` without
a filter dropped a whole run's. Now every requeue is recorded (``requeues``), each item it
moved keeps its former state (``requeued_items``), and the answers and turns of done items
move to ``superseded_outputs`` / ``superseded_turns`` in the same transaction. ``undo``
puts back the latest requeue's items that have not been claimed since; the superseded
answers of items that were generated again stay where they are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.errors import ConfigError
from orchestrator.store.engine import Database
from orchestrator.store.schema import (
    datasets,
    item_turns,
    items,
    outputs,
    requeued_items,
    requeues,
    superseded_outputs,
    superseded_turns,
)

_CHUNK = 400


@dataclass(frozen=True, slots=True)
class Selection:
    """Which items a requeue moves."""

    state: str = "failed"
    dataset_names: Sequence[str] = ()
    error_class: str | None = None
    flags: int = 0

    def where(self) -> list[sa.ColumnElement[bool]]:
        if self.state not in ("failed", "done"):
            raise ValueError(f"can only requeue failed or done items, not {self.state!r}")
        if self.flags and self.state != "done":
            raise ValueError("quality flags belong to outputs: requeue done items by flag")
        where = [items.c.state == self.state]
        if self.dataset_names:
            names = list(self.dataset_names)
            where.append(
                items.c.dataset_id.in_(sa.select(datasets.c.id).where(datasets.c.name.in_(names)))
            )
        if self.error_class:
            where.append(items.c.error_class == self.error_class)
        if self.flags:
            flagged = sa.select(outputs.c.item_id).where(outputs.c.flags.op("&")(self.flags) != 0)
            where.append(items.c.id.in_(flagged))
        # Pass-through rows were never generated: there is nothing to do again.
        where.append(
            items.c.dataset_id.in_(
                sa.select(datasets.c.id).where(datasets.c.passthrough == sa.false())
            )
        )
        return where

    def as_json(self) -> str:
        return orjson.dumps(
            {
                "state": self.state,
                "datasets": list(self.dataset_names),
                "error_class": self.error_class,
                "flags": self.flags,
            }
        ).decode()


@dataclass(frozen=True, slots=True)
class Spelling:
    """How a caller names requeue's options in the guard's message: the command's flags
    or the API's keywords."""

    state_done: str
    filters: str
    everything: str
    hint: str = ""


COMMAND = Spelling(
    "--state done",
    "--dataset, --flag, --error-class",
    "--all",
    "; --dry-run shows what would move",
)
API = Spelling("state='done'", "datasets, flags, error_class", "all=True")


def checked_selection(
    state: str,
    *,
    dataset_names: Sequence[str] = (),
    error_class: str | None = None,
    flags: int = 0,
    everything: bool = False,
    spelling: Spelling = API,
) -> Selection:
    """The items a requeue may move, or ConfigError: quality flags imply done items, and
    done items (whose answers would be generated again) need a filter or ``everything``."""
    state = "done" if flags else state
    if state not in ("failed", "done"):
        raise ConfigError(f"requeue state must be failed or done, not {state!r}")
    if state == "done" and not (dataset_names or flags or error_class or everything):
        raise ConfigError(
            f"requeue {spelling.state_done} sends answers back to be generated again: name "
            f"which ({spelling.filters}), or say {spelling.everything}{spelling.hint}"
        )
    return Selection(
        state=state, dataset_names=tuple(dataset_names), error_class=error_class, flags=flags
    )


async def preview(database: Database, selection: Selection) -> dict[tuple[str, str], int]:
    """What a requeue would move: items by (dataset, state). Changes nothing."""
    query = (
        sa.select(datasets.c.name, items.c.state, sa.func.count())
        .select_from(items.join(datasets, datasets.c.id == items.c.dataset_id))
        .where(*selection.where())
        .group_by(datasets.c.name, items.c.state)
        .order_by(datasets.c.name)
    )
    async with database.read() as conn:
        return {(name, state): n for name, state, n in (await conn.execute(query)).all()}


def _pending_values(state: str, now: float) -> dict[str, Any]:
    values: dict[str, Any] = {
        "state": "pending",
        "attempts": 0,
        "not_before": 0,
        "error_class": None,
        "last_error": None,
        "finished_at": None,
        "updated_at": now,
    }
    if state == "done":
        values["turn"] = 0
    return values


def _keep(conn: sa.Connection, requeue_id: int, ids: list[int], state: str, changed: bool) -> None:
    """Record the items' former state, and set their answers aside (done items)."""
    rid = sa.literal(requeue_id, sa.Integer)
    kept = [c.name for c in requeued_items.columns if c.name not in ("requeue_id", "request")]
    request = items.c.request if changed else sa.null()
    conn.execute(
        requeued_items.insert().from_select(
            ["requeue_id", *kept, "request"],
            sa.select(rid, *[items.c[c if c != "item_id" else "id"] for c in kept], request).where(
                items.c.id.in_(ids)
            ),
        )
    )
    if state != "done":
        return
    for source, target in ((outputs, superseded_outputs), (item_turns, superseded_turns)):
        names = [c.name for c in source.columns]
        conn.execute(
            target.insert().from_select(
                ["requeue_id", *names],
                sa.select(rid, *source.columns).where(source.c.item_id.in_(ids)),
            )
        )
        conn.execute(source.delete().where(source.c.item_id.in_(ids)))


async def requeue(
    database: Database,
    selection: Selection,
    *,
    max_tokens: int | None = None,
    now: float | None = None,
) -> int:
    """Send the selected items back to pending with their attempts reset; returns how many.

    Done items start again from the first turn; their answers are kept aside until undone.
    A failed multi-turn item resumes at the turn that failed. ``max_tokens`` raises the
    requeued items' own limit (an item's fields win over its dataset's).
    """
    now = time.time() if now is None else now
    where = selection.where()

    def run(conn: sa.Connection) -> int:
        chosen = conn.execute(sa.select(items.c.id, items.c.request).where(*where)).all()
        if not chosen:
            return 0
        requeue_id = conn.execute(
            requeues.insert()
            .values(
                created_at=now,
                state=selection.state,
                selection=selection.as_json(),
                items=len(chosen),
            )
            .returning(requeues.c.id)
        ).scalar_one()
        values = _pending_values(selection.state, now)
        for start in range(0, len(chosen), _CHUNK):
            chunk = chosen[start : start + _CHUNK]
            ids = [item_id for item_id, _ in chunk]
            _keep(conn, requeue_id, ids, selection.state, max_tokens is not None)
            conn.execute(items.update().where(items.c.id.in_(ids)).values(**values))
            if max_tokens is not None:
                for item_id, request in chunk:
                    body = orjson.loads(request)
                    body.pop("max_completion_tokens", None)
                    body["max_tokens"] = max_tokens
                    conn.execute(
                        items.update()
                        .where(items.c.id == item_id)
                        .values(request=orjson.dumps(body).decode())
                    )
        return len(chosen)

    async with database.write() as conn:
        return await conn.run_sync(run)


@dataclass(frozen=True, slots=True)
class UndoReport:
    """What ``requeue --undo`` took back (or, in a dry run, would): the requeue's id
    (None: no requeue since the last undo), its items given their state and answers back,
    and those claimed since, left as they are."""

    requeue_id: int | None
    restored: int = 0
    # Items claimed since the requeue: generated again (or being), so left as they are.
    kept: int = 0


async def undo(database: Database, *, now: float | None = None) -> UndoReport:
    """Take back the latest requeue not yet undone: its items that are still pending get
    their former state, attempts, errors and (done items) answers back."""
    now = time.time() if now is None else now

    def run(conn: sa.Connection) -> UndoReport:
        requeue_id, rows = _latest(conn)
        if requeue_id is None:
            return UndoReport(None)
        back = [r for r in rows if r.now_state == "pending"]
        for start in range(0, len(back), _CHUNK):
            _restore(conn, requeue_id, back[start : start + _CHUNK], now)
        conn.execute(requeues.update().where(requeues.c.id == requeue_id).values(undone_at=now))
        return UndoReport(requeue_id, restored=len(back), kept=len(rows) - len(back))

    async with database.write() as conn:
        return await conn.run_sync(run)


async def undo_preview(database: Database) -> UndoReport:
    """What :func:`undo` would do now. Changes nothing."""

    def run(conn: sa.Connection) -> UndoReport:
        requeue_id, rows = _latest(conn)
        back = sum(r.now_state == "pending" for r in rows)
        return UndoReport(requeue_id, restored=back, kept=len(rows) - back)

    async with database.read() as conn:
        return await conn.run_sync(run)


def _latest(conn: sa.Connection) -> tuple[int | None, Sequence[Any]]:
    """The latest requeue not undone, and its items with the state each is in now.

    An item still pending was not claimed since: it can have its former state back.
    """
    requeue_id = conn.execute(
        sa.select(requeues.c.id)
        .where(requeues.c.undone_at.is_(None))
        .order_by(requeues.c.id.desc())
        .limit(1)
    ).scalar()
    if requeue_id is None:
        return None, []
    rows = conn.execute(
        sa.select(requeued_items, items.c.state.label("now_state"))
        .join(items, items.c.id == requeued_items.c.item_id)
        .where(requeued_items.c.requeue_id == requeue_id)
    ).all()
    return requeue_id, rows


def _restore(conn: sa.Connection, requeue_id: int, rows: Sequence[Any], now: float) -> None:
    ids = [r.item_id for r in rows]
    done = [r.item_id for r in rows if r.state == "done"]
    if done:
        for live, kept in ((outputs, superseded_outputs), (item_turns, superseded_turns)):
            names = [c.name for c in live.columns]
            conn.execute(live.delete().where(live.c.item_id.in_(done)))
            conn.execute(
                live.insert().from_select(
                    names,
                    sa.select(*[kept.c[n] for n in names]).where(
                        kept.c.requeue_id == requeue_id, kept.c.item_id.in_(done)
                    ),
                )
            )
            conn.execute(
                kept.delete().where(kept.c.requeue_id == requeue_id, kept.c.item_id.in_(done))
            )
    for r in rows:
        values: dict[str, Any] = {
            "state": r.state,
            "attempts": r.attempts,
            "error_class": r.error_class,
            "last_error": r.last_error,
            "finished_at": r.finished_at,
            "turn": r.turn,
            "not_before": 0,
            "updated_at": now,
        }
        if r.request is not None:
            values["request"] = r.request
        conn.execute(
            items.update().where(items.c.id == r.item_id, items.c.state == "pending").values(values)
        )
    conn.execute(
        requeued_items.delete().where(
            requeued_items.c.requeue_id == requeue_id, requeued_items.c.item_id.in_(ids)
        )
    )


__all__ = ["Selection", "UndoReport", "preview", "requeue", "undo", "undo_preview"]
