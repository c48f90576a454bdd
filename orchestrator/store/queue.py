"""The state machine. Every change of an item's state happens in this module.

    enqueue ──► pending ──claim──► running ──complete──► done
                  ▲   ▲               │ │ │
                  │   └─retry/release─┘ │ └──fail──► failed
                  │                     │               │
                  └──── reap (lease expired, holder dead) ─┘ requeue

* ``claim`` counts the attempt and hands out a fresh lease token.
* ``renew``, ``complete``, ``retry``, ``fail`` and ``release`` are *fenced*: they name the
  item *and* the lease token, touch only a row that is still running under that token,
  and report which rows they changed. A worker whose lease expired and was taken over
  changes nothing, and its output is never written.
* ``complete`` writes the output in the same transaction that marks the item done.
* ``release`` gives the attempt back (shutdown, server outage: not the item's fault).
* ``reap`` returns items whose lease expired, or whose holder on this host is dead, to
  pending, or to failed once their attempts are spent: an item that kills its worker
  every time still ends.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from orchestrator.store.engine import Database, insert_many
from orchestrator.store.schema import attempt_errors, datasets, items, outputs

# Bound parameter lists so one statement stays well under SQLite's variable limit.
_CHUNK = 400


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
    # Taken back from a worker that died or went silent while holding it: it may be
    # what killed that worker, so workers run such items one at a time.
    suspect: bool = False


@dataclass(frozen=True, slots=True)
class Output:
    """One generated answer, written with the transition to done."""

    message: dict[str, Any]
    content: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    latency: float
    server: str | None
    model: str | None
    response_id: str | None


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt did not produce an output."""

    error_class: str
    message: str


def _chunks(seq: Sequence[Any], size: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


def _fence(token: str, ids: Sequence[int]) -> sa.ColumnElement[bool]:
    """The fence: these rows, still running, under this lease token.

    A token is minted per claim, so the leases of one claim share it; the row ids then
    make primary-key lookups.
    """
    return sa.and_(
        items.c.id.in_(list(ids)), items.c.lease_token == token, items.c.state == "running"
    )


async def _fenced_update(
    conn: AsyncConnection, pairs: Sequence[tuple[int, str]], values: dict[str, Any]
) -> set[int]:
    """Apply ``values`` to the rows still held under these leases; return their ids."""
    by_token: dict[str, list[int]] = {}
    for item_id, token in pairs:
        by_token.setdefault(token, []).append(item_id)
    changed: set[int] = set()
    for token, ids in by_token.items():
        for chunk in _chunks(ids):
            result = await conn.execute(
                items.update().where(_fence(token, chunk)).values(**values).returning(items.c.id)
            )
            changed.update(result.scalars())
    return changed


# The error class of items taken back from a worker that died or stopped renewing.
LEASE_LOST = "lease_lost"

_CLEAR_LEASE = {"lease_token": None, "lease_owner": None, "lease_expires_at": None}


class Queue:
    """Transitions of items, each in one write transaction, each fenced where it must be."""

    def __init__(self, database: Database):
        self.db = database

    # ---------------------------------------------------------------- claim / renew

    async def claim(
        self,
        owner: str,
        want: int,
        *,
        lease_seconds: float,
        dataset_names: Sequence[str] | None = None,
        suspect_slots: int | None = None,
        now: float | None = None,
    ) -> list[Lease]:
        """Lease up to ``want`` items: higher priority first, then dataset, then position.

        A dataset's ``concurrency`` caps its running items across every worker sharing
        the database; paused datasets are skipped. At most ``suspect_slots`` (None: no
        limit) of the items
        are suspects (taken back from a dead worker): if one of them is a poison item
        that kills its worker, it takes only itself and fresh items down with it, so no
        innocent item is caught in crash after crash until its attempts run out.
        """
        if want <= 0:
            return []
        now = time.time() if now is None else now
        token = secrets.token_hex(16)
        expires = now + lease_seconds
        leases: list[Lease] = []
        async with self.db.write() as conn:
            query = (
                sa.select(datasets.c.id, datasets.c.concurrency)
                .where(datasets.c.paused == sa.false())
                .order_by(datasets.c.priority.desc(), datasets.c.id)
            )
            if dataset_names:
                query = query.where(datasets.c.name.in_(list(dataset_names)))
            candidates = (await conn.execute(query)).all()
            if not candidates:
                return []
            # Count running items only for capped datasets, one index range each.
            running = {
                dataset_id: (
                    await conn.execute(
                        sa.select(sa.func.count()).where(
                            items.c.dataset_id == dataset_id, items.c.state == "running"
                        )
                    )
                ).scalar_one()
                for dataset_id, concurrency in candidates
                if concurrency is not None
            }
            left = want
            for dataset_id, concurrency in candidates:
                n = left
                if concurrency is not None:
                    n = min(n, concurrency - running.get(dataset_id, 0))
                if n <= 0:
                    continue
                got: list[Lease] = []
                if suspect_slots is None:
                    got = await self._claim_from(
                        conn, dataset_id, n, None, token, owner, expires, now
                    )
                else:
                    if suspect_slots > 0:
                        got = await self._claim_from(
                            conn, dataset_id, min(n, suspect_slots), True, token, owner,
                            expires, now,
                        )  # fmt: skip
                        suspect_slots -= len(got)
                    got += await self._claim_from(
                        conn, dataset_id, n - len(got), False, token, owner, expires, now
                    )
                leases.extend(got)
                left -= len(got)
                if left <= 0:
                    break
        return leases

    async def _claim_from(
        self,
        conn: AsyncConnection,
        dataset_id: int,
        n: int,
        suspects: bool | None,
        token: str,
        owner: str,
        expires: float,
        now: float,
    ) -> list[Lease]:
        if n <= 0:
            return []
        """Claim ``n`` of a dataset's items: suspects only, none, or (None) any."""
        suspect = items.c.error_class == LEASE_LOST
        picked = (
            sa.select(items.c.id)
            .where(
                items.c.dataset_id == dataset_id,
                items.c.state == "pending",
                items.c.not_before <= now,
            )
            .order_by(items.c.position)
            .limit(n)
        )
        if suspects is not None:
            picked = picked.where(
                suspect if suspects else sa.or_(items.c.error_class.is_(None), ~suspect)
            )
        if conn.dialect.name == "postgresql":
            picked = picked.with_for_update(skip_locked=True)
        result = await conn.execute(
            items.update()
            .where(items.c.id.in_(picked.scalar_subquery()))
            .values(
                state="running",
                attempts=items.c.attempts + 1,
                lease_token=token,
                lease_owner=owner,
                lease_expires_at=expires,
                updated_at=now,
            )
            .returning(
                items.c.id,
                items.c.key,
                items.c.position,
                items.c.request,
                items.c.attempts,
                items.c.error_class,
            )
        )
        return [
            Lease(
                item_id=r.id,
                token=token,
                dataset_id=dataset_id,
                key=r.key,
                request=orjson.loads(r.request),
                attempt=r.attempts,
                expires_at=expires,
                suspect=bool(suspects) or (suspects is None and r.error_class == LEASE_LOST),
            )
            for r in sorted(result.all(), key=lambda r: r.position)
        ]

    async def renew(
        self, leases: Sequence[tuple[int, str]], *, lease_seconds: float, now: float | None = None
    ) -> set[int]:
        """Extend leases still held; the ids missing from the result were lost."""
        if not leases:
            return set()
        now = time.time() if now is None else now
        async with self.db.write() as conn:
            return await _fenced_update(
                conn, leases, {"lease_expires_at": now + lease_seconds, "updated_at": now}
            )

    # ---------------------------------------------------------------- outcomes

    async def complete(
        self, results: Sequence[tuple[Lease, Output]], *, now: float | None = None
    ) -> set[int]:
        """Mark items done and write their outputs, atomically; returns the ids accepted.

        A result whose lease was lost is dropped here: its row is not running under that
        token any more, so neither the state nor an output is written.
        """
        if not results:
            return set()
        now = time.time() if now is None else now
        async with self.db.write() as conn:
            accepted = await _fenced_update(
                conn,
                [(lease.item_id, lease.token) for lease, _ in results],
                {
                    "state": "done",
                    **_CLEAR_LEASE,
                    "error_class": None,
                    "last_error": None,
                    "finished_at": now,
                    "updated_at": now,
                },
            )
            rows = [
                _output_row(lease, out, now) for lease, out in results if lease.item_id in accepted
            ]
            if rows:
                await insert_many(conn, "outputs", _OUTPUT_COLUMNS, rows)
        return accepted

    async def retry(
        self,
        outcomes: Sequence[tuple[Lease, Failure, float]],
        *,
        now: float | None = None,
    ) -> set[int]:
        """Back to pending until ``not_before``; the attempt stays counted."""
        return await self._settle(outcomes, "retry", now=now)

    async def release(
        self, outcomes: Sequence[tuple[Lease, Failure, float]], *, now: float | None = None
    ) -> set[int]:
        """Back to pending with the attempt given back: the item was not at fault."""
        return await self._settle(outcomes, "released", now=now)

    async def fail(
        self, outcomes: Sequence[tuple[Lease, Failure]], *, now: float | None = None
    ) -> set[int]:
        """Failed for good, with the reason kept."""
        return await self._settle([(lease, f, 0.0) for lease, f in outcomes], "failed", now=now)

    async def _settle(
        self,
        outcomes: Sequence[tuple[Lease, Failure, float]],
        outcome: str,
        *,
        now: float | None,
    ) -> set[int]:
        if not outcomes:
            return set()
        now = time.time() if now is None else now
        changed: set[int] = set()
        async with self.db.write() as conn:
            for lease, failure, not_before in outcomes:
                values: dict[str, Any] = {
                    **_CLEAR_LEASE,
                    "error_class": failure.error_class,
                    "last_error": failure.message[:4000],
                    "updated_at": now,
                }
                if outcome == "failed":
                    values.update(state="failed", finished_at=now)
                else:
                    values.update(state="pending", not_before=not_before)
                if outcome == "released":
                    values["attempts"] = sa.case(
                        (items.c.attempts > 0, items.c.attempts - 1), else_=0
                    )
                changed |= await _fenced_update(conn, [(lease.item_id, lease.token)], values)
            log_rows = [
                {
                    "item_id": lease.item_id,
                    "dataset_id": lease.dataset_id,
                    "attempt": lease.attempt,
                    "error_class": failure.error_class,
                    "message": failure.message[:4000],
                    "outcome": outcome,
                    "created_at": now,
                }
                for lease, failure, _ in outcomes
                if lease.item_id in changed
            ]
            if log_rows:
                await conn.execute(attempt_errors.insert(), log_rows)
        return changed

    # ---------------------------------------------------------------- recovery

    async def reap(
        self,
        *,
        max_attempts: int,
        dead_owners: Sequence[str] = (),
        now: float | None = None,
    ) -> int:
        """Take back leases that expired or whose holder is known dead.

        The attempt the lost holder spent stays counted, so an item that crashes its
        worker every time fails after ``max_attempts`` instead of looping forever.
        """
        now = time.time() if now is None else now
        lost = sa.and_(
            items.c.state == "running",
            sa.or_(
                items.c.lease_expires_at < now,
                items.c.lease_owner.in_(list(dead_owners)) if dead_owners else sa.false(),
            ),
        )
        async with self.db.write() as conn:
            rows = (
                await conn.execute(
                    sa.select(
                        items.c.id, items.c.dataset_id, items.c.attempts, items.c.lease_expires_at
                    ).where(lost)
                )
            ).all()
            if not rows:
                return 0
            exhausted = [r.id for r in rows if r.attempts >= max_attempts]
            retry = [r.id for r in rows if r.attempts < max_attempts]
            message = "the worker holding this item died or stopped renewing its lease"
            for ids, state in ((exhausted, "failed"), (retry, "pending")):
                for chunk in _chunks(ids):
                    values: dict[str, Any] = {
                        "state": state,
                        **_CLEAR_LEASE,
                        "error_class": LEASE_LOST,
                        "last_error": message,
                        "updated_at": now,
                    }
                    if state == "failed":
                        values["finished_at"] = now
                        values["last_error"] = f"{message}, {max_attempts} attempts spent"
                    await conn.execute(
                        items.update()
                        .where(items.c.id.in_(list(chunk)), items.c.state == "running")
                        .values(**values)
                    )
            await conn.execute(
                attempt_errors.insert(),
                [
                    {
                        "item_id": r.id,
                        "dataset_id": r.dataset_id,
                        "attempt": r.attempts,
                        "error_class": LEASE_LOST,
                        "message": message,
                        "outcome": "failed" if r.attempts >= max_attempts else "retry",
                        "created_at": now,
                    }
                    for r in rows
                ],
            )
        return len(rows)

    async def remaining(self, dataset_names: Sequence[str] | None = None) -> int:
        """Items still to do in datasets that are not paused (pending or running)."""
        query = (
            sa.select(sa.func.count())
            .select_from(items.join(datasets, datasets.c.id == items.c.dataset_id))
            .where(items.c.state.in_(("pending", "running")), datasets.c.paused == sa.false())
        )
        if dataset_names:
            query = query.where(datasets.c.name.in_(list(dataset_names)))
        async with self.db.read() as conn:
            return (await conn.execute(query)).scalar_one()

    async def running_owners(self) -> list[str]:
        async with self.db.read() as conn:
            result = await conn.execute(
                sa.select(items.c.lease_owner).where(items.c.state == "running").distinct()
            )
            return [owner for owner in result.scalars() if owner]

    # ---------------------------------------------------------------- operator actions

    async def requeue(
        self,
        *,
        dataset_names: Sequence[str] | None = None,
        state: str = "failed",
        error_class: str | None = None,
        now: float | None = None,
    ) -> int:
        """Send failed (or done) items back to pending with their attempts reset.

        Requeuing done items deletes their outputs in the same transaction: they will be
        generated again.
        """
        if state not in ("failed", "done"):
            raise ValueError(f"can only requeue failed or done items, not {state!r}")
        now = time.time() if now is None else now
        where = [items.c.state == state]
        if dataset_names:
            where.append(
                items.c.dataset_id.in_(
                    sa.select(datasets.c.id).where(datasets.c.name.in_(list(dataset_names)))
                )
            )
        if error_class:
            where.append(items.c.error_class == error_class)
        async with self.db.write() as conn:
            if state == "done":
                await conn.execute(
                    outputs.delete().where(
                        outputs.c.item_id.in_(sa.select(items.c.id).where(*where))
                    )
                )
            result = await conn.execute(
                items.update()
                .where(*where)
                .values(
                    state="pending",
                    attempts=0,
                    not_before=0,
                    error_class=None,
                    last_error=None,
                    finished_at=None,
                    updated_at=now,
                )
            )
            return result.rowcount


_OUTPUT_COLUMNS = (
    "item_id",
    "dataset_id",
    "content",
    "reasoning",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "message",
    "usage",
    "latency",
    "server",
    "model",
    "response_id",
    "attempt",
    "created_at",
)


def _output_row(lease: Lease, out: Output, now: float) -> tuple[Any, ...]:
    """One ``outputs`` row, in ``_OUTPUT_COLUMNS`` order."""
    usage = out.usage or {}
    return (
        lease.item_id,
        lease.dataset_id,
        out.content,
        out.reasoning,
        out.finish_reason,
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
        orjson.dumps(out.message).decode(),
        orjson.dumps(out.usage).decode() if out.usage is not None else None,
        out.latency,
        out.server,
        out.model,
        out.response_id,
        lease.attempt,
        now,
    )
