"""The state machine. Every change of an item's state goes through the ``Queue`` here.

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
* ``reopen`` (requeue) and ``restore`` (its undo) move items no worker holds; they are
  fenced by the state the item is in, under a lock on its row (:func:`hold`).

An item has an ``outputs`` row exactly while it is done: every transition into done
writes it, every transition out of done sets it aside, in the same transaction.

The SQL lives beside it: the claim in ``store.claims``, the outcomes of a round in
``store.rounds``, the requeue moves in ``store.transitions``, the lease fence in
``store.statements``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
import structlog

from orchestrator.store import claims, crashes, rounds, spend
from orchestrator.store import waste as wasted
from orchestrator.store.engine import Database
from orchestrator.store.leases import CLEAR_LEASE, LEASE_LOST, Claim, Failure, Lease, Output
from orchestrator.store.rounds import Round, RoundResult
from orchestrator.store.schema import attempt_errors, datasets, items
from orchestrator.store.statements import chunks, fenced_update

log = structlog.get_logger("orchestrator.store")

_KILLED = wasted.Waste(wasted.KILLED)


class Queue:
    """Transitions of items, each in one write transaction, each fenced where it must be."""

    def __init__(self, database: Database):
        self.db = database

    async def write_round(self, work: Round, *, now: float | None = None) -> RoundResult:
        """Settle outcomes and claim new work, atomically, outcomes first.

        Outcomes go first so that a dataset's concurrency cap counts the items they just
        finished as free. The time is read once the transaction holds the write lock, so
        that an answer's ``created_at`` is its commit time give or take the transaction,
        however long the lock was waited for (the run's samples rely on it).
        """

        def run(conn: sa.Connection) -> RoundResult:
            at = time.time() if now is None else now
            accepted: dict[str, set[int]] = {}
            leases: list[Lease] = []
            if work.complete:
                accepted["complete"] = rounds.complete(conn, work.complete, at)
            if work.advance:
                accepted["advance"] = rounds.advance(conn, work.advance, at)
            if work.retry:
                accepted["retry"] = rounds.settle(conn, work.retry, "retry", at)
            if work.release:
                accepted["release"] = rounds.settle(conn, work.release, "released", at)
            if work.fail:
                failed = [(lease, failure, 0.0) for lease, failure in work.fail]
                accepted["fail"] = rounds.settle(conn, failed, "failed", at)
            wasted.add(conn, rounds.thrown_away(work, accepted), at)
            spend.add(conn, rounds.billed(work, accepted), at)
            claim = work.claim
            if claim is not None and claim.want > 0 and claim.budget is not None:
                # Read after this round's bills: the money left is what the claim may take.
                room = claim.budget.standing(conn, claim.want).room
                claim = dataclasses.replace(claim, want=room)
            if claim is not None and claim.want > 0:
                leases = claims.claim_leases(conn, claim, at)
            return RoundResult(accepted, leases)

        return await self.db.run_write(run)

    # ---------------------------------------------------------------- claim / renew

    async def wasted(self) -> list[wasted.Wasted]:
        """Tokens thrown away so far, by dataset id and cause (the whole small table)."""
        async with self.db.read() as conn:
            return await conn.run_sync(wasted.read)

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
        """Lease up to ``want`` items: higher priority first, then the longest predicted
        answers of the datasets of that priority (input order among equals).

        A dataset's ``concurrency`` caps its running items across every worker sharing
        the database; paused datasets are skipped. See :class:`Claim` for suspects.
        """
        if want <= 0:
            return []
        names = tuple(dataset_names) if dataset_names else None
        claim = Claim(owner, want, lease_seconds, names, suspect_slots)
        return (await self.write_round(Round(claim=claim), now=now)).leases

    async def renew(
        self, leases: Sequence[tuple[int, str]], *, lease_seconds: float, now: float | None = None
    ) -> set[int]:
        """Extend leases still held; the ids missing from the result were lost."""
        if not leases:
            return set()
        now = time.time() if now is None else now
        values = {"lease_expires_at": now + lease_seconds, "updated_at": now}
        return await self.db.run_write(lambda conn: fenced_update(conn, leases, values))

    # ---------------------------------------------------------------- outcomes

    async def complete(
        self, results: Sequence[tuple[Lease, Output]], *, now: float | None = None
    ) -> set[int]:
        """Mark items done and write their outputs, atomically; returns the ids accepted.

        A result whose lease was lost is dropped here: its row is not running under that
        token any more, so neither the state nor an output is written.
        """
        return await self._settle("complete", results, now)

    async def retry(
        self,
        outcomes: Sequence[tuple[Lease, Failure, float]],
        *,
        now: float | None = None,
    ) -> set[int]:
        """Back to pending until ``not_before``; the attempt stays counted."""
        return await self._settle("retry", outcomes, now)

    async def release(
        self, outcomes: Sequence[tuple[Lease, Failure, float]], *, now: float | None = None
    ) -> set[int]:
        """Back to pending with the attempt given back: the item was not at fault."""
        return await self._settle("release", outcomes, now)

    async def fail(
        self, outcomes: Sequence[tuple[Lease, Failure]], *, now: float | None = None
    ) -> set[int]:
        """Failed for good, with the reason kept."""
        return await self._settle("fail", outcomes, now)

    async def _settle(self, kind: str, outcomes: Sequence[Any], now: float | None) -> set[int]:
        """Write outcomes of one ``kind`` (a field of :class:`Round`) as a round of their
        own; the ids whose lease still held."""
        if not outcomes:
            return set()
        result = await self.write_round(Round(**{kind: list(outcomes)}), now=now)
        return result.accepted[kind]

    # ---------------------------------------------------------------- recovery

    async def reap(self, *, dead_owners: Sequence[str] = (), now: float | None = None) -> int:
        """Take back leases that expired or whose holder is known dead.

        Each item counts the death (``store.crashes``) and gets its attempt back, so the
        bystanders of crash after crash keep theirs; an item that died as its worker's
        only suspect twice is failed as poison instead.
        """
        now = time.time() if now is None else now
        lost = sa.and_(
            items.c.state == "running",
            sa.or_(
                items.c.lease_expires_at < now,
                items.c.lease_owner.in_(list(dead_owners)) if dead_owners else sa.false(),
            ),
        )
        picked = sa.select(
            items.c.id,
            items.c.dataset_id,
            items.c.attempts,
            items.c.deaths,
            items.c.deaths_alone,
            items.c.lease_owner,
        ).where(lost)
        if self.db.url.get_backend_name() == "postgresql":
            # Another worker reaping at the same time takes other rows (or none): a row
            # is taken back once, and never from a holder that claimed it since.
            picked = picked.with_for_update(skip_locked=True)
        async with self.db.write() as conn:
            rows = [crashes.Taken(*r) for r in (await conn.execute(picked)).all()]
            if not rows:
                return 0
            held = await conn.run_sync(lambda c: crashes.suspects_held(c, rows))
            verdicts = crashes.verdicts(rows, held)
            for (alone, poison), ids in crashes.by_verdict(verdicts).items():
                values: dict[str, Any] = {
                    "state": "pending",
                    **CLEAR_LEASE,
                    "attempts": sa.case((items.c.attempts > 0, items.c.attempts - 1), else_=0),
                    "error_class": LEASE_LOST,
                    "last_error": crashes.DIED,
                    "updated_at": now,
                    "deaths": items.c.deaths + 1,
                    "deaths_alone": items.c.deaths_alone + int(alone),
                }
                if poison:
                    values |= {"state": "failed", "finished_at": now, "last_error": crashes.POISON}
                for chunk in chunks(ids):
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
                        "message": crashes.POISON if verdicts[r.id].poison else crashes.DIED,
                        "outcome": "failed" if verdicts[r.id].poison else "retry",
                        "created_at": now,
                    }
                    for r in rows
                ],
            )
            # A dead holder's requests died with it, their tokens unknown; a live one
            # whose lease merely expired says what its answer cost if it comes (fenced).
            dead = set(dead_owners)
            killed = [(r.dataset_id, _KILLED) for r in rows if r.lease_owner in dead]
            await conn.run_sync(lambda c: wasted.add(c, wasted.tally(killed), now))
        poison = sorted(item_id for item_id, v in verdicts.items() if v.poison)
        if poison:
            log.warning("poison_items_failed", items=poison)
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

    async def counts(self) -> dict[tuple[str, str], int]:
        """Items by (dataset name, state): the queue-wide figures of a worker's metrics."""
        query = (
            sa.select(datasets.c.name, items.c.state, sa.func.count())
            .select_from(items.join(datasets, datasets.c.id == items.c.dataset_id))
            .group_by(datasets.c.name, items.c.state)
        )
        async with self.db.read() as conn:
            return {(name, state): n for name, state, n in (await conn.execute(query)).all()}

    async def running_owners(self) -> list[str]:
        async with self.db.read() as conn:
            result = await conn.execute(
                sa.select(items.c.lease_owner).where(items.c.state == "running").distinct()
            )
            return [owner for owner in result.scalars() if owner]

    # ---------------------------------------------------------------- operator actions
