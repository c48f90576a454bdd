"""Requeue, its dry run, and its undo: sending items back to pending without losing answers.

A requeue of done items used to delete their answers: one ``requeue --state done`` without
a filter dropped a whole run's. Now every requeue is recorded (``requeues``), each item it
moved keeps its former state (``requeued_items``), and the answers and turns of done items
move to ``superseded_outputs`` / ``superseded_turns`` in the same transaction. ``undo``
puts back the latest requeue's items that are pending (not claimed since) or failed (run
again, and failed: the answer they had comes back); the superseded answers of items
generated again stay where they are.

Both hold the item rows they move while workers claim and complete around them
(``store.transitions``: the state changes themselves are there).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.items.error_classes import is_known, unknown
from orchestrator.items.params import expected, shown
from orchestrator.store import batches
from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets, items, outputs, requeued_items, requeues
from orchestrator.store.transitions import RESTORABLE, hold, reopen, restore

_CHUNK = 400


@dataclass(frozen=True, slots=True)
class Selection:
    """Which items a requeue moves."""

    state: str = "failed"
    dataset_names: Sequence[str] = ()
    error_class: str | None = None
    flags: int = 0
    # Only these prompts (keys), and of them only these samples (``items.sample``).
    keys: Sequence[str] = ()
    samples: Sequence[int] = ()

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
        if self.keys:
            where.append(items.c.key.in_(list(self.keys)))
        if self.samples:
            where.append(items.c.sample.in_(list(self.samples)))
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
                **({"keys": list(self.keys)} if self.keys else {}),
                **({"samples": list(self.samples)} if self.samples else {}),
            }
        ).decode()


@dataclass(frozen=True, slots=True)
class Spelling:
    """How a caller names requeue's options in the guard's message: the command's flags
    or the API's keywords."""

    state_done: str
    filters: str
    everything: str
    max_tokens: str
    hint: str = ""


COMMAND = Spelling(
    "--state done",
    "--dataset, --flag, --error-class, --key",
    "--all",
    "--max-tokens",
    "; --dry-run shows what would move",
)
API = Spelling("state='done'", "datasets, flags, error_class, keys", "all=True", "max_tokens")


def checked_selection(
    state: str,
    *,
    dataset_names: Sequence[str] = (),
    error_class: str | None = None,
    flags: int = 0,
    everything: bool = False,
    max_tokens: int | None = None,
    spelling: Spelling = API,
    keys: Sequence[str] = (),
    samples: Sequence[int] = (),
) -> Selection:
    """The items a requeue may move, or ConfigError: quality flags imply done items, and
    done items (whose answers would be generated again) need a filter or ``everything``.
    An error class no item can have and a ``max_tokens`` no server takes are refused
    here, for the command and the API alike, dry run or not."""
    state = "done" if flags else state
    if state not in ("failed", "done"):
        raise ConfigError(f"requeue state must be failed or done, not {state!r}")
    if error_class is not None and not is_known(error_class):
        raise ConfigError(unknown(error_class))
    if max_tokens is not None and (want := expected("max_tokens", max_tokens)):
        raise ConfigError(f"{spelling.max_tokens}: must be {want}, got {shown(max_tokens)}")
    if state == "done" and not (dataset_names or flags or error_class or keys or everything):
        raise ConfigError(
            f"requeue {spelling.state_done} sends answers back to be generated again: name "
            f"which ({spelling.filters}), or say {spelling.everything}{spelling.hint}"
        )
    return Selection(
        state=state,
        dataset_names=tuple(dataset_names),
        error_class=error_class,
        flags=flags,
        keys=tuple(keys),
        samples=tuple(samples),
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
        # A fresh start: the deaths it was in flight for are forgotten too (store.crashes).
        "deaths": 0,
        "deaths_alone": 0,
        "not_before": 0,
        "error_class": None,
        "last_error": None,
        "finished_at": None,
        "updated_at": now,
    }
    if state == "done":
        values["turn"] = 0
    return values


def _record(conn: sa.Connection, requeue_id: int, ids: list[int], changed: bool) -> None:
    """Record the held items' former state (and request, when ``changed``)."""
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
    requeued items' own limit (an item's fields win over its dataset's). The items are
    held first: one another requeue or an undo moved meanwhile is not moved twice.
    """
    now = time.time() if now is None else now
    where = selection.where()

    def run(conn: sa.Connection) -> int:
        chosen = hold(conn, sa.select(items.c.id, items.c.request).where(*where))
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
            _record(conn, requeue_id, ids, max_tokens is not None)
            batches.settle_items(conn, ids)
            reopen(conn, ids, selection.state, values, requeue_id=requeue_id)
            if max_tokens is not None:
                _set_max_tokens(conn, chunk, max_tokens)
        return len(chosen)

    async with database.write() as conn:
        return await conn.run_sync(run)


def _set_max_tokens(conn: sa.Connection, chosen: Sequence[Any], max_tokens: int) -> None:
    for item_id, request in chosen:
        body = orjson.loads(request)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = max_tokens
        conn.execute(
            items.update()
            .where(items.c.id == item_id, items.c.state == "pending")
            .values(request=orjson.dumps(body).decode())
        )


class UndoConflict(OrchestratorError):
    """Another undo took the same requeue back while this one waited for it."""


@dataclass(frozen=True, slots=True)
class UndoReport:
    """What ``requeue --undo`` took back (or, in a dry run, would).

    ``requeue_id`` is None when there is nothing to undo (for the datasets named: then
    ``latest`` and ``latest_datasets`` say which requeue is the latest, and what it moved).
    """

    requeue_id: int | None
    #: Items given their state and answers back.
    restored: int = 0
    #: Items claimed since and answered again, or running: left as they are.
    kept: int = 0
    #: Of ``restored``: items that were run again and failed.
    refailed: int = 0
    #: Undo by dataset: the requeue's items of other datasets, still requeued.
    left: int = 0
    latest: int | None = None
    latest_datasets: tuple[str, ...] = ()


async def undo(
    database: Database, *, dataset_names: Sequence[str] = (), now: float | None = None
) -> UndoReport:
    """Take back the latest requeue not yet undone (of these datasets' items, when named):
    its items still pending, or failed since, get their former state, attempts, errors,
    request and (done items) answers back. The rest were answered again, or are being.

    Raises :class:`UndoConflict` when another undo took the same requeue back meanwhile.
    """
    now = time.time() if now is None else now

    def run(conn: sa.Connection) -> UndoReport:
        found = _target(conn, dataset_names)
        if found.requeue_id is None:
            return found
        _hold_requeue(conn, found.requeue_id, dataset_names)
        return _take_back(conn, found.requeue_id, dataset_names, now)

    async with database.write() as conn:
        return await conn.run_sync(run)


def _hold_requeue(conn: sa.Connection, requeue_id: int, names: Sequence[str]) -> None:
    """Lock the requeue's row (PostgreSQL; SQLite's write transaction holds the file) and
    check that no other undo took it, or these datasets' part of it, back meanwhile."""
    lock = sa.select(requeues.c.id).where(
        requeues.c.id == requeue_id, requeues.c.undone_at.is_(None)
    )
    if conn.dialect.name == "postgresql":
        lock = lock.with_for_update()
    gone = conn.execute(lock).first() is None
    if not gone and names:
        gone = conn.execute(_items_of(requeue_id, names).limit(1)).first() is None
    if gone:
        raise UndoConflict(
            f"requeue #{requeue_id} was taken back by another undo at the same time; nothing "
            "changed (`orchestrator requeue --undo --dry-run` shows what an undo would take now)"
        )


def _take_back(
    conn: sa.Connection, requeue_id: int, names: Sequence[str], now: float
) -> UndoReport:
    """The undo of a held requeue: its restorable items held and restored, its record of
    them dropped, and the requeue marked undone once no item of it is left."""
    mine = _items_of(requeue_id, names)
    held = hold(
        conn,
        sa.select(items.c.id, items.c.state).where(
            items.c.id.in_(mine), items.c.state.in_(RESTORABLE)
        ),
    )
    put_back = restore(conn, requeue_id, [item_id for item_id, _ in held], now)
    recorded = requeued_items.c.requeue_id == requeue_id
    considered = conn.execute(
        sa.select(sa.func.count())
        .select_from(requeued_items)
        .where(recorded, requeued_items.c.item_id.in_(mine))
    ).scalar_one()
    conn.execute(requeued_items.delete().where(recorded, requeued_items.c.item_id.in_(mine)))
    left = _left(conn, requeue_id)
    if not left:
        conn.execute(requeues.update().where(requeues.c.id == requeue_id).values(undone_at=now))
    return UndoReport(
        requeue_id,
        restored=len(put_back),
        kept=considered - len(put_back),
        refailed=sum(state == "failed" for item_id, state in held if item_id in put_back),
        left=left,
    )


async def undo_preview(database: Database, *, dataset_names: Sequence[str] = ()) -> UndoReport:
    """What :func:`undo` would do now. Changes nothing."""
    async with database.read() as conn:
        return await conn.run_sync(lambda c: _target(c, dataset_names))


def _dataset_ids(names: Sequence[str]) -> sa.Select[Any]:
    return sa.select(datasets.c.id).where(datasets.c.name.in_(list(names)))


def _items_of(requeue_id: int, names: Sequence[str]) -> sa.Select[Any]:
    """The ids of the requeue's items still recorded (of these datasets, when named)."""
    query = sa.select(requeued_items.c.item_id).where(requeued_items.c.requeue_id == requeue_id)
    if names:
        query = query.where(
            requeued_items.c.item_id.in_(
                sa.select(items.c.id).where(items.c.dataset_id.in_(_dataset_ids(names)))
            )
        )
    return query


def _left(conn: sa.Connection, requeue_id: int) -> int:
    return conn.execute(
        sa.select(sa.func.count())
        .select_from(requeued_items)
        .where(requeued_items.c.requeue_id == requeue_id)
    ).scalar_one()


def _target(conn: sa.Connection, names: Sequence[str]) -> UndoReport:
    """The requeue an undo takes back, with what it would do now; or (None) what the
    latest requeue is, when none touched the datasets named.

    The latest not undone, or with ``names`` the latest not undone with items of them
    still recorded. An item still pending was not claimed since; one failed was claimed
    and failed: both can have their former state back.
    """
    open_ = sa.select(requeues.c.id).where(requeues.c.undone_at.is_(None))
    if names:
        touched = sa.select(requeued_items.c.requeue_id).where(
            requeued_items.c.item_id.in_(
                sa.select(items.c.id).where(items.c.dataset_id.in_(_dataset_ids(names)))
            )
        )
        chosen = open_.where(requeues.c.id.in_(touched))
    else:
        chosen = open_
    requeue_id = conn.execute(chosen.order_by(requeues.c.id.desc()).limit(1)).scalar()
    if requeue_id is None:
        latest = conn.execute(open_.order_by(requeues.c.id.desc()).limit(1)).scalar()
        return UndoReport(None, latest=latest, latest_datasets=_touched(conn, latest))
    now_states = dict(
        conn.execute(
            sa.select(items.c.state, sa.func.count())
            .where(items.c.id.in_(_items_of(requeue_id, names)))
            .group_by(items.c.state)
        ).all()
    )
    restored = sum(now_states.get(state, 0) for state in RESTORABLE)
    return UndoReport(
        requeue_id,
        restored=restored,
        kept=sum(now_states.values()) - restored,
        refailed=now_states.get("failed", 0),
        left=_left(conn, requeue_id) - sum(now_states.values()) if names else 0,
    )


def _touched(conn: sa.Connection, requeue_id: int | None) -> tuple[str, ...]:
    """The datasets whose items a requeue still holds, by name."""
    if requeue_id is None:
        return ()
    query = (
        sa.select(datasets.c.name)
        .distinct()
        .select_from(
            requeued_items.join(items, items.c.id == requeued_items.c.item_id).join(
                datasets, datasets.c.id == items.c.dataset_id
            )
        )
        .where(requeued_items.c.requeue_id == requeue_id)
        .order_by(datasets.c.name)
    )
    return tuple(conn.execute(query).scalars())


__all__ = [
    "Selection",
    "UndoConflict",
    "UndoReport",
    "checked_selection",
    "preview",
    "requeue",
    "undo",
    "undo_preview",
]
