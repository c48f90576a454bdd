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
* ``reopen`` (requeue) and ``restore`` (its undo) move items no worker holds; they are
  fenced by the state the item is in, under a lock on its row (:func:`hold`).

An item has an ``outputs`` row exactly while it is done: every transition into done
writes it, every transition out of done sets it aside, in the same transaction.
"""

from __future__ import annotations

import functools
import math
import secrets
import sqlite3
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
import sqlalchemy as sa
import structlog

from orchestrator.items.answer import Answer
from orchestrator.items.answer_length import Expected
from orchestrator.items.tokens import Tokens, pack
from orchestrator.store import crashes
from orchestrator.store import waste as wasted
from orchestrator.store.engine import Database, insert_rows
from orchestrator.store.schema import (
    attempt_errors,
    datasets,
    item_turns,
    items,
    metadata,
    outputs,
    requeued_items,
    superseded_outputs,
    superseded_turns,
)

log = structlog.get_logger("orchestrator.store")

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


def _chunks(seq: Sequence[Any], size: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), size):
        yield seq[start : start + size]


class _Statements:
    """Plain SQL, written once, in a write transaction the caller holds.

    On SQLite through pysqlite the worker's rounds (claim, complete, renew) run on the
    sqlite3 connection under ``conn``: for statements this small, binding them through
    the SQL layer costs more than SQLite takes to run them. Every other backend runs the
    same text through SQLAlchemy. Parameters are ``:name``, which both take.
    """

    def __init__(self, conn: sa.Connection):
        self.conn = conn
        self.raw = _sqlite_driver(conn)
        self.postgres = conn.dialect.name == "postgresql"

    def among(self, column: str, ids: Sequence[int]) -> tuple[str, dict[str, Any]]:
        """``column`` is one of the item ids ``ids``: on PostgreSQL one array parameter
        (``:fi``), so the text is the same for any number of ids and the driver prepares
        it once, not once per size; elsewhere ``IN`` a list of parameters (``:i0``…)."""
        if self.postgres:
            return f"{column} = ANY({_INTS})", {"fi": list(ids)}
        listed, params = _names("i", ids)
        return f"{column} IN ({listed})", params

    def rows(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        if self.raw is not None:
            return self.raw.execute(sql, params).fetchall()
        result = self.conn.execute(_text(sql), params)
        return [tuple(r) for r in result] if result.returns_rows else []


@functools.lru_cache(maxsize=256)
def _text(sql: str) -> sa.TextClause:
    """A statement's text as SQLAlchemy takes it, parsed for its ``:name`` parameters
    once per text rather than once per execution."""
    return sa.text(sql)


def _sqlite_driver(conn: sa.Connection) -> sqlite3.Connection | None:
    """The sqlite3 connection under ``conn``, when there is one."""
    if conn.dialect.name == "sqlite" and conn.dialect.driver == "pysqlite":
        return conn.connection.driver_connection  # type: ignore[return-value]
    return None


def _names(prefix: str, values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``:p0, :p1, …`` for a list of values, and their parameters."""
    params = {f"{prefix}{n}": v for n, v in enumerate(values)}
    return ", ".join(f":{k}" for k in params), params


@dataclass(frozen=True, slots=True)
class _Expr:
    """A value computed from the row: its SQL, and the same rule applied to a row read
    out of the database (``db copy`` puts items back with it)."""

    sql: str
    apply: Callable[[Mapping[str, Any]], Any]


def _fence(st: _Statements, pairs: Sequence[tuple[int, str]]) -> tuple[str, dict[str, Any]]:
    """The fence: these rows, still running, each under its own lease token.

    ``id IN (…)`` makes the lookup a primary-key search; the ``(id, token)`` row values
    then keep only the rows whose lease is still the one the caller holds (SQLite takes
    a row-value list as VALUES, PostgreSQL as a list of rows). A row holding a token is
    running (the ``lease_iff_running`` check), so the state is not tested again: a test
    of it lets PostgreSQL's planner read ``ix_items_running`` too, whose entries for
    rows no longer running pile up between vacuums (20,000 read per round after a
    20,000-item run, where the primary key reads the round's own).
    """
    among, params = st.among("id", [item_id for item_id, _ in pairs])
    if st.postgres:  # the pairs as two arrays, for the same reason as ``among``'s
        listed = f"SELECT * FROM unnest({_INTS}, CAST(:ft AS varchar[]))"
        tokens: dict[str, Any] = {"ft": [token for _, token in pairs]}
    else:
        listed = "VALUES " + ", ".join(f"(:i{n}, :t{n})" for n in range(len(pairs)))
        tokens = {f"t{n}": token for n, (_, token) in enumerate(pairs)}
    where = f"{among} AND (id, lease_token) IN ({listed})"
    return where, params | tokens


#: Item ids as one PostgreSQL array parameter (``_Statements.among``, the fence).
_INTS = "CAST(:fi AS integer[])"


def _fenced_update(
    conn: sa.Connection, pairs: Sequence[tuple[int, str]], values: Mapping[str, Any]
) -> set[int]:
    """Apply ``values`` to the rows still held under these leases; return their ids.

    Every transition of a leased item goes through here: the state machine's one gate.
    """
    st = _Statements(conn)
    assignments = ", ".join(
        f"{column} = {v.sql}" if isinstance(v, _Expr) else f"{column} = :v_{column}"
        for column, v in values.items()
    )
    bound = {f"v_{c}": v for c, v in values.items() if not isinstance(v, _Expr)}
    changed: set[int] = set()
    for chunk in _chunks(pairs, _CHUNK // 2):
        where, params = _fence(st, chunk)
        sql = f"UPDATE items SET {assignments} WHERE {where} RETURNING id"
        changed.update(row[0] for row in st.rows(sql, bound | params))
    return changed


# The error class of items taken back from a worker that died or stopped renewing.
LEASE_LOST = "lease_lost"

_CLEAR_LEASE = {"lease_token": None, "lease_owner": None, "lease_expires_at": None}
# How a running item is put back when it was not at fault (release, and ``db copy`` of
# an item that was running): pending, its lease cleared and its attempt given back.
_PUT_BACK: dict[str, Any] = {
    "state": "pending",
    **_CLEAR_LEASE,
    "attempts": _Expr(
        "CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END",
        lambda row: max((row["attempts"] or 0) - 1, 0),
    ),
}


def put_back(row: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a running item (as read, by name) once put back by the release rule."""
    return {
        column: value.apply(row) if isinstance(value, _Expr) else value
        for column, value in _PUT_BACK.items()
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


@dataclass(slots=True)
class Round:
    """What one worker writes in one transaction: its outcomes, then a claim for more.

    Folding the claim into the transaction that settles the previous items halves the
    write transactions of a busy worker, and the slots freed by the outcomes are refilled
    without waiting for a second turn at the write lock.
    """

    complete: list[tuple[Lease, Output]] = field(default_factory=list)
    advance: list[tuple[Lease, Output]] = field(default_factory=list)
    retry: list[tuple[Lease, Failure, float]] = field(default_factory=list)
    release: list[tuple[Lease, Failure, float]] = field(default_factory=list)
    fail: list[tuple[Lease, Failure]] = field(default_factory=list)
    claim: Claim | None = None


@dataclass(slots=True)
class RoundResult:
    """Which items each kind of outcome changed (the rest had lost their lease), and the
    leases claimed."""

    accepted: dict[str, set[int]]
    leases: list[Lease]


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
                accepted["complete"] = _complete(conn, work.complete, at)
            if work.advance:
                accepted["advance"] = _advance(conn, work.advance, at)
            if work.retry:
                accepted["retry"] = _settle(conn, work.retry, "retry", at)
            if work.release:
                accepted["release"] = _settle(conn, work.release, "released", at)
            if work.fail:
                failed = [(lease, failure, 0.0) for lease, failure in work.fail]
                accepted["fail"] = _settle(conn, failed, "failed", at)
            wasted.add(conn, _thrown_away(work, accepted), at)
            if work.claim is not None and work.claim.want > 0:
                leases = _claim(conn, work.claim, at)
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
        return await self.db.run_write(lambda conn: _fenced_update(conn, leases, values))

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
        result = await self.write_round(Round(complete=list(results)), now=now)
        return result.accepted["complete"]

    async def retry(
        self,
        outcomes: Sequence[tuple[Lease, Failure, float]],
        *,
        now: float | None = None,
    ) -> set[int]:
        """Back to pending until ``not_before``; the attempt stays counted."""
        if not outcomes:
            return set()
        result = await self.write_round(Round(retry=list(outcomes)), now=now)
        return result.accepted["retry"]

    async def release(
        self, outcomes: Sequence[tuple[Lease, Failure, float]], *, now: float | None = None
    ) -> set[int]:
        """Back to pending with the attempt given back: the item was not at fault."""
        if not outcomes:
            return set()
        result = await self.write_round(Round(release=list(outcomes)), now=now)
        return result.accepted["release"]

    async def fail(
        self, outcomes: Sequence[tuple[Lease, Failure]], *, now: float | None = None
    ) -> set[int]:
        """Failed for good, with the reason kept."""
        if not outcomes:
            return set()
        result = await self.write_round(Round(fail=list(outcomes)), now=now)
        return result.accepted["fail"]

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
                    **_CLEAR_LEASE,
                    "attempts": sa.case((items.c.attempts > 0, items.c.attempts - 1), else_=0),
                    "error_class": LEASE_LOST,
                    "last_error": crashes.DIED,
                    "updated_at": now,
                    "deaths": items.c.deaths + 1,
                    "deaths_alone": items.c.deaths_alone + int(alone),
                }
                if poison:
                    values |= {"state": "failed", "finished_at": now, "last_error": crashes.POISON}
                for chunk in _chunks(ids):
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


_OUTPUT_COLUMNS = (
    "item_id",
    "dataset_id",
    "content",
    "reasoning",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "message",
    "usage",
    "latency",
    "server",
    "model",
    "response_id",
    "attempt",
    "created_at",
    "flags",
    "params_hash",
    "tokens",
)

_TURN_COLUMNS = (
    "item_id",
    "turn",
    "message",
    "finish_reason",
    "usage",
    "flags",
    "latency",
    "server",
    "model",
    "params_hash",
    "created_at",
)


def storable(text: str | None) -> str | None:
    """Text as a plain-text column can hold it on every backend: U+0000 becomes U+FFFD.

    PostgreSQL text cannot hold a NUL, and both backends store the same, so a ``db copy``
    changes nothing. Only the plain-text columns (error messages, identifiers) lose the
    NUL: the JSON columns (message, usage) keep it escaped, ``\\u0000``, so the answer
    exports exactly as the model emitted it, flagged ``nul`` (orchestrator.items.quality).
    """
    if text is None or "\x00" not in text:
        return text
    return text.replace("\x00", "\ufffd")


def _output_row(lease: Lease, out: Output, now: float) -> tuple[Any, ...]:
    """One ``outputs`` row, in ``_OUTPUT_COLUMNS`` order.

    For a multi-turn item the tokens and the latency count every turn, and the flags
    gather theirs. The ``content`` and ``reasoning`` columns are left empty (rows written
    before they were kept their copies): the message JSON holds both, and an answer of
    many megabytes would otherwise be stored twice.
    """
    usage = out.usage or {}
    completion_tokens = usage.get("completion_tokens")
    if lease.turns > 1 and completion_tokens is not None:
        completion_tokens += lease.generated_tokens
    return (
        lease.item_id,
        lease.dataset_id,
        None,  # content and reasoning live in ``message``: each text is stored once
        None,
        storable(out.finish_reason),
        usage.get("prompt_tokens"),
        completion_tokens,
        usage.get("cached_tokens"),
        orjson.dumps(out.message).decode(),
        orjson.dumps(out.usage).decode() if out.usage is not None else None,
        out.latency + lease.generated_latency,
        storable(out.server),
        storable(out.model),
        storable(out.response_id),
        lease.attempt,
        now,
        out.flags | lease.generated_flags,
        out.params_hash,
        pack(out.tokens) if out.tokens is not None else None,
    )


def _turn_row(lease: Lease, out: Output, now: float) -> tuple[Any, ...]:
    """One ``item_turns`` row, in ``_TURN_COLUMNS`` order."""
    return (
        lease.item_id,
        lease.turn,
        orjson.dumps(out.message).decode(),
        storable(out.finish_reason),
        orjson.dumps(out.usage).decode() if out.usage is not None else None,
        out.flags,
        out.latency,
        storable(out.server),
        storable(out.model),
        out.params_hash,
        now,
    )


# -------------------------------------------------------------------- transitions
# Each runs inside a write transaction the caller holds.


def _claim(conn: sa.Connection, claim: Claim, now: float) -> list[Lease]:
    """Scouts first (``Claim.scouts``), then priority by priority, longest first."""
    lease = _LeaseOf(claim.owner, secrets.token_hex(16), now + claim.lease_seconds, now)
    candidates, running = _claimable_datasets(conn, claim.dataset_names)
    leases = _scouts(conn, claim, candidates, running, lease) if claim.scouts > 0 else []
    left = claim.want - len(leases)
    suspect_slots = claim.suspect_slots
    for level in _levels(candidates):
        if left <= 0:
            break
        room = {
            dataset_id: left if cap is None else min(left, cap - running.get(dataset_id, 0))
            for dataset_id, cap, _ in level
        }
        room = {dataset_id: n for dataset_id, n in room.items() if n > 0}
        if len(room) == 1:
            [(dataset_id, n)] = room.items()
            sequence = [dataset_id] * n
        else:
            sequence = _longest_first(conn, room, left, claim.lengths, now)
        caps = {dataset_id: cap for dataset_id, cap, _ in level}
        got: dict[int, deque[Lease]] = {}
        for dataset_id, n in Counter(sequence).items():
            together = _together(claim, dataset_id, caps[dataset_id], running)
            taken, suspect_slots = _take(conn, claim, dataset_id, n, lease, suspect_slots, together)
            got[dataset_id] = _prompts(taken)
            left -= len(taken)
        # In rank order across the datasets: the worker starts them in this order, a
        # prompt's samples one after another.
        for dataset_id in sequence:
            if got[dataset_id]:
                leases.extend(got[dataset_id].popleft())
        for rest in got.values():
            leases.extend(each for group in rest for each in group)
    return leases


class _Together(NamedTuple):
    """How a dataset's prompts are claimed: with their ``samples`` (0: one by one) when
    asked in one request, at most ``most`` items in all (its cap's room; None: no cap)."""

    samples: int = 0
    most: int | None = None

    def after(self, taken: int) -> _Together:
        return self if self.most is None else self._replace(most=self.most - taken)


_ALONE = _Together()


def _together(
    claim: Claim, dataset_id: int, cap: int | None, running: Mapping[int, int]
) -> _Together:
    """How the claim takes this dataset's prompts: its samples per prompt if they are
    asked together, within the room its cap leaves."""
    room = None if cap is None else cap - running.get(dataset_id, 0)
    return _Together(claim.together.get(dataset_id, 0), room)


def _take(
    conn: sa.Connection,
    claim: Claim,
    dataset_id: int,
    n: int,
    lease: _LeaseOf,
    suspect_slots: int | None,
    together: _Together,
) -> tuple[list[Lease], int | None]:
    """``n`` items of one dataset, never put back first for a trial, a group of suspects
    if there is room for one; those taken and the room for suspects still left."""
    taken: list[Lease] = []
    if suspect_slots is None:
        if claim.fresh_first:
            taken = _claim_from(conn, dataset_id, n, None, lease, fresh=True, together=together)
        more = _claim_from(
            conn, dataset_id, n - len(taken), None, lease, together=together.after(len(taken))
        )
        return taken + more, None
    if suspect_slots > 0:
        taken = _claim_group(conn, dataset_id, n, suspect_slots, lease)
        suspect_slots = 0 if taken else suspect_slots
    more = _claim_from(
        conn, dataset_id, n - len(taken), False, lease, together=together.after(len(taken))
    )
    return taken + more, suspect_slots


def _claim_group(
    conn: sa.Connection, dataset_id: int, n: int, capacity: int, lease: _LeaseOf
) -> list[Lease]:
    """Up to ``n`` of a dataset's suspects, of its level with the most deaths, as many
    as a group of that level holds for a worker of ``capacity`` slots."""
    st = _Statements(conn)
    found = st.rows(crashes.LEVEL_SQL, {"dataset": dataset_id, "now": lease.now})
    if not found:
        return []
    level = int(found[0][0])
    size = min(n, crashes.group_size(capacity, level))
    return _claim_from(conn, dataset_id, size, True, lease, level=level)


def _prompts(leases: Sequence[Lease]) -> deque[list[Lease]]:
    """Leases in runs of one prompt's consecutive samples (each its own run but for the
    samples of a prompt claimed together)."""
    runs: deque[list[Lease]] = deque()
    for lease in leases:
        last = runs[-1][-1] if runs else None
        if last is not None and last.key == lease.key and lease.sample == last.sample + 1:
            runs[-1].append(lease)
        else:
            runs.append([lease])
    return runs


@dataclass(frozen=True, slots=True)
class _LeaseOf:
    """What every lease of one claim shares."""

    owner: str
    token: str
    expires: float
    now: float


def _levels(
    candidates: Sequence[tuple[int, int | None, int]],
) -> Iterator[list[tuple[int, int | None, int]]]:
    """The candidate datasets (best first) grouped by priority."""
    level: list[tuple[int, int | None, int]] = []
    for candidate in candidates:
        if level and candidate[2] != level[0][2]:
            yield level
            level = []
        level.append(candidate)
    if level:
        yield level


_HEADS = (
    "SELECT predicted_tokens FROM items WHERE dataset_id = :dataset AND state = 'pending'"
    " AND not_before <= :now ORDER BY predicted_tokens DESC, position LIMIT :n"
)


def _longest_first(
    conn: sa.Connection,
    room: Mapping[int, int],
    want: int,
    lengths: Mapping[int, Expected],
    now: float,
) -> list[int]:
    """The datasets of one priority to take the next ``want`` items from, in turn: the
    longest ranked answers among the first ``room`` of each (an index range of
    ``ix_items_longest``); ties go to the dataset listed first."""
    st = _Statements(conn)
    ranked: list[tuple[float, int, int]] = []
    for order, (dataset_id, n) in enumerate(room.items()):
        rank = lengths.get(dataset_id, _AS_PREDICTED).rank
        heads = st.rows(_HEADS, {"dataset": dataset_id, "now": now, "n": n})
        ranked.extend((-rank(row[0]), order, dataset_id) for row in heads)
    ranked.sort()
    return [dataset_id for _, _, dataset_id in ranked[:want]]


_AS_PREDICTED = Expected()


def _scouts(
    conn: sa.Connection,
    claim: Claim,
    candidates: Sequence[tuple[int, int | None, int]],
    running: dict[int, int],
    lease: _LeaseOf,
) -> list[Lease]:
    """The first few items of each dataset that has had fewer, in input order: a fair
    sample of its answers for the ETA and the ranking, whatever their lengths."""
    leases: list[Lease] = []
    left = claim.want
    for dataset_id, concurrency, _ in candidates:
        if left <= 0:
            break
        if dataset_id in claim.started:
            continue
        taken = _taken(conn, dataset_id, claim.scouts)
        if taken >= claim.scouts:
            claim.started.add(dataset_id)
            continue
        n = min(left, claim.scouts - taken)
        if concurrency is not None:
            n = min(n, concurrency - running.get(dataset_id, 0))
        # A dataset whose every item is back to pending may hold the items a dead
        # worker was on: scouts are never those, when suspects are rationed.
        fresh = None if claim.suspect_slots is None else False
        together = _together(claim, dataset_id, concurrency, running)
        if together.samples:  # n samples' worth of prompts, each with its samples
            n = max(1, n // together.samples)
        got = _claim_from(conn, dataset_id, n, fresh, lease, in_input_order=True, together=together)
        if len(got) < n:
            # Nothing more to take now (a small dataset, or items in backoff):
            # looking again every round would find nothing either.
            claim.started.add(dataset_id)
        running[dataset_id] = running.get(dataset_id, 0) + len(got)
        leases.extend(got)
        left -= len(got)
    return leases


_TAKEN = (
    "SELECT count(*) FROM (SELECT 1 FROM items WHERE dataset_id = :dataset"
    " AND state IN ('running', 'done', 'failed') LIMIT :most) AS taken"
)


def _taken(conn: sa.Connection, dataset_id: int, most: int) -> int:
    """How many of the dataset's items were claimed (or stored done), counting up to
    ``most``: a bounded read of the (dataset, state) index."""
    return int(_Statements(conn).rows(_TAKEN, {"dataset": dataset_id, "most": most})[0][0])


_RUNNING = "SELECT count(*) FROM items WHERE dataset_id = :dataset AND state = 'running'"


def _claimable_datasets(
    conn: sa.Connection, names: Sequence[str] | None
) -> tuple[list[tuple[int, int | None, int]], dict[int, int]]:
    """Datasets to claim from, best first, as (id, concurrency cap, priority), and the
    running count of each capped one."""
    st = _Statements(conn)
    sql = "SELECT id, concurrency, priority FROM datasets WHERE NOT paused AND NOT passthrough"
    listed, params = _names("n", list(names or ()))
    if names:
        sql += f" AND name IN ({listed})"
    candidates = [(r[0], r[1], r[2]) for r in st.rows(sql + " ORDER BY priority DESC, id", params)]
    capped = sorted(dataset_id for dataset_id, cap, _ in candidates if cap is not None)
    if capped and st.postgres:
        # Claims from many processes at once: a capped dataset's count and its claim
        # happen under a lock on its row, so that two claims cannot both see room for
        # the same slot. FOR NO KEY UPDATE: enqueue's inserts (a key share, for the
        # foreign key) go on meanwhile. Taken in id order, so claims never deadlock.
        ids, locked = _names("c", capped)
        st.rows(
            f"SELECT id FROM datasets WHERE id IN ({ids}) ORDER BY id FOR NO KEY UPDATE", locked
        )
    # Count running items only for capped datasets, one index range each.
    running = {
        dataset_id: st.rows(_RUNNING, {"dataset": dataset_id})[0][0] for dataset_id in capped
    }
    return candidates, running


@functools.lru_cache(maxsize=32)
def _claim_sql(
    suspects: bool | None,
    postgres: bool,
    in_input_order: bool = False,
    fresh: bool = False,
    siblings: bool = False,
) -> str:
    """Take up to :n pending items of a dataset, longest predicted answer first (or in
    input order): suspects only (those of ``:level`` deaths), none, or (None) any;
    ``fresh``: only items never put back (no error kept); ``siblings``: the later
    samples of one prompt (its ``:predicted`` and ``:position``, past ``:sample``, an
    ``ix_items_longest`` range). Suspects go in input order (``ix_items_suspect``).

    On PostgreSQL rows another claim has locked are skipped, not waited for; a row
    claimed and committed since this statement's snapshot is re-checked under the lock
    and dropped (it is no longer pending). There the ids taken go to the UPDATE as an
    array (``= ANY(ARRAY(…))``), which it reads by primary key whatever the plan: the
    statement is prepared once with ``:n`` unknown, and ``IN (…)`` let the planner
    expect a tenth of the table and join it by a scan of every row (25 ms a claim at
    100,000 items).
    """
    only = ""
    if suspects is not None:
        only = (
            f" AND deaths > 0 AND deaths >= {crashes.SUSPECT} AND deaths = :level"
            if suspects
            else f" AND deaths < {crashes.SUSPECT}"
        )
    if fresh:
        only += " AND error_class IS NULL"
    if siblings:
        only += " AND predicted_tokens = :predicted AND position = :position AND sample > :sample"
    lock = " FOR UPDATE SKIP LOCKED" if postgres else ""
    # Input order by id for scouts: ix_items_dataset_state holds it (its entries end in
    # the row id), where ordering by position would sort every pending row.
    order = (
        "position"
        if suspects
        else "id"
        if in_input_order
        else "predicted_tokens DESC, position, sample"
    )
    chosen = (
        "SELECT id FROM items WHERE dataset_id = :dataset AND state = 'pending'"
        f" AND not_before <= :now{only} ORDER BY {order} LIMIT :n{lock}"
    )
    return (
        "UPDATE items SET state = 'running', attempts = attempts + 1, lease_token = :token,"
        " lease_owner = :owner, lease_expires_at = :expires, updated_at = :now"
        f" WHERE {f'id = ANY(ARRAY({chosen}))' if postgres else f'id IN ({chosen})'}"
        " RETURNING id, key, position, request, attempts, error_class, turn, turns,"
        " last_error, predicted_tokens, sample, deaths"
    )


def _claim_from(
    conn: sa.Connection,
    dataset_id: int,
    n: int,
    suspects: bool | None,
    lease: _LeaseOf,
    *,
    in_input_order: bool = False,
    fresh: bool = False,
    together: _Together = _ALONE,
    level: int = 0,
) -> list[Lease]:
    """Claim ``n`` of a dataset's items: suspects only (of ``level`` deaths), none, or
    (None) any; ``fresh``: only those never put back; the leases in the order they were ranked. With
    ``together.samples`` (a dataset's samples per prompt, asked in one request) each
    prompt claimed comes with its later pending samples, after it, beyond ``n`` but
    within ``together.most``."""
    if n <= 0:
        return []
    st = _Statements(conn)
    params: dict[str, Any] = {
        "token": lease.token,
        "owner": lease.owner,
        "expires": lease.expires,
        "now": lease.now,
        "dataset": dataset_id,
        "n": n,
    }
    if suspects:
        params["level"] = level
    rows = st.rows(_claim_sql(suspects, st.postgres, in_input_order, fresh), params)
    if suspects or in_input_order:
        rows.sort(key=lambda r: (r[2], r[10]))
    else:
        rows.sort(key=lambda r: (-r[9], r[2], r[10]))
    if together.samples > 1:
        rows = _with_siblings(st, rows, params, together)
    resumed = _generated_turns(conn, [r[0] for r in rows if r[6] > 0])
    token, expires = lease.token, lease.expires
    leases = []
    for item_id, key, _, request, attempts, error_class, turn, turns, last_error, *rest in rows:
        _, sample, deaths = rest
        before = resumed.get(item_id, _NOTHING_GENERATED)
        leases.append(
            Lease(
                item_id=item_id,
                token=token,
                dataset_id=dataset_id,
                key=key,
                request=orjson.loads(request),
                attempt=attempts,
                expires_at=expires,
                suspect=deaths >= crashes.SUSPECT,
                turn=turn,
                turns=turns,
                generated=before.messages,
                generated_tokens=before.tokens,
                generated_flags=before.flags,
                generated_latency=before.latency,
                last_failure=Failure(error_class, last_error or "") if error_class else None,
                sample=sample,
            )
        )
    return leases


def _with_siblings(
    st: _Statements, rows: list[tuple[Any, ...]], params: dict[str, Any], together: _Together
) -> list[tuple[Any, ...]]:
    """``rows`` with each prompt's later pending samples claimed too, after its last one
    (a statement only for a prompt whose last sample is not among them), as far as the
    dataset's cap lets."""
    claimed = {(r[2], r[10]) for r in rows}
    sql = _claim_sql(None, st.postgres, siblings=True)
    spare = math.inf if together.most is None else together.most - len(rows)
    out: list[tuple[Any, ...]] = []
    for row in rows:
        out.append(row)
        position, predicted, sample = row[2], row[9], row[10]
        if spare <= 0 or sample >= together.samples - 1 or (position, sample + 1) in claimed:
            continue
        more = st.rows(
            sql,
            {**params, "n": min(spare, together.samples - 1 - sample), "predicted": predicted,
             "position": position, "sample": sample},
        )  # fmt: skip
        spare -= len(more)
        out.extend(sorted(more, key=lambda r: r[10]))
    return out


@dataclass(frozen=True, slots=True)
class _Generated:
    messages: tuple[dict[str, Any], ...] = ()
    tokens: int = 0
    flags: int = 0
    latency: float = 0.0


_NOTHING_GENERATED = _Generated()


def _generated_turns(conn: sa.Connection, ids: Sequence[int]) -> dict[int, _Generated]:
    """The turns already generated for conversations resuming mid-way."""
    found: dict[int, _Generated] = {}
    for chunk in _chunks(ids):
        rows = conn.execute(
            sa.select(
                item_turns.c.item_id,
                item_turns.c.message,
                item_turns.c.usage,
                item_turns.c.flags,
                item_turns.c.latency,
            )
            .select_from(item_turns.join(items, items.c.id == item_turns.c.item_id))
            .where(item_turns.c.item_id.in_(list(chunk)), item_turns.c.turn < items.c.turn)
            .order_by(item_turns.c.item_id, item_turns.c.turn)
        )
        for item_id, message, usage, flags, latency in rows:
            before = found.get(item_id, _Generated())
            used = orjson.loads(usage) if usage else {}
            found[item_id] = _Generated(
                (*before.messages, orjson.loads(message)),
                before.tokens + (used.get("completion_tokens") or 0),
                before.flags | flags,
                before.latency + latency,
            )
    return found


def _complete(conn: sa.Connection, results: Sequence[tuple[Lease, Output]], now: float) -> set[int]:
    accepted = _fenced_update(
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
    done = [(lease, out) for lease, out in results if lease.item_id in accepted]
    if done:
        stale = _clear_leftovers(conn, [lease for lease, _ in done])
        stale += _put_outputs(conn, [_output_row(lease, out, now) for lease, out in done])
        _report_leftovers(stale)
        turns = [(lease, out) for lease, out in done if lease.turns > 1]
        if turns:
            insert_rows(conn, "item_turns", _TURN_COLUMNS, [_turn_row(*t, now) for t in turns])
    return accepted


# Rows a running item cannot have, there anyway: an output (only done items have one), or
# turns from the one being written on (the lease's earlier turns are all it has). The
# transitions keep both true; such a row (left by an undo of an earlier version, which
# put answers back under items a worker had claimed) would fail the round on a duplicate
# key, every time the item is run again. It is replaced, and logged.


def _clear_leftovers(conn: sa.Connection, leases: Sequence[Lease]) -> list[int]:
    """Drop the turns left from the one each lease is on; the items that had some."""
    st = _Statements(conn)
    stale: list[int] = []
    for lease in leases:
        if lease.turns > 1:
            sql = "DELETE FROM item_turns WHERE item_id = :i AND turn >= :t RETURNING item_id"
            stale += [row[0] for row in st.rows(sql, {"i": lease.item_id, "t": lease.turn})]
    return stale


def _put_outputs(conn: sa.Connection, rows: list[tuple[Any, ...]]) -> list[int]:
    """Insert these ``outputs`` rows, each replacing one left under its item; the items
    whose row was replaced.

    On PostgreSQL the rows go in as one statement of column arrays, and only those that
    clash on the primary key (none, but for leftovers) are deleted and written again: a
    DELETE probe first is planned once, as a prepared statement, against the table's
    size at the run's start, and reads the whole table each round once it has grown
    (2.3 ms of the server's CPU per round of 50 at 20,000 rows). Elsewhere the probe is
    a primary-key search per id, and the rows go in by executemany.
    """
    st = _Statements(conn)
    if st.postgres:
        sql, params = _array_insert(conn.dialect, "outputs", _OUTPUT_COLUMNS, rows)
        written = {row[0] for row in st.rows(sql, params)}
        clashed = [row for row in rows if row[0] not in written]
        if not clashed:
            return []
    else:
        clashed = rows
    stale: list[int] = []
    for chunk in _chunks([row[0] for row in clashed]):
        among, params = st.among("item_id", chunk)
        sql = f"DELETE FROM outputs WHERE {among} RETURNING item_id"
        stale += [row[0] for row in st.rows(sql, params)]
    insert_rows(conn, "outputs", _OUTPUT_COLUMNS, clashed)
    return stale


def _array_insert(
    dialect: sa.Dialect, table: str, columns: tuple[str, ...], rows: Sequence[tuple[Any, ...]]
) -> tuple[str, dict[str, Any]]:
    """PostgreSQL: insert ``rows`` as one array per column, skipping a row whose key is
    taken, and return the keys inserted (the first column)."""
    params = {f"a{n}": [row[n] for row in rows] for n in range(len(columns))}
    return _array_insert_sql(dialect, table, columns), params


@functools.lru_cache(maxsize=8)
def _array_insert_sql(dialect: sa.Dialect, table: str, columns: tuple[str, ...]) -> str:
    types = [metadata.tables[table].c[name].type.compile(dialect=dialect) for name in columns]
    arrays = ", ".join(f"CAST(:a{n} AS {kind}[])" for n, kind in enumerate(types))
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) SELECT * FROM unnest({arrays})"
        f" ON CONFLICT ({columns[0]}) DO NOTHING RETURNING {columns[0]}"
    )


def _report_leftovers(stale: Sequence[int]) -> None:
    if stale:
        log.warning("leftover_rows_replaced", items=sorted(set(stale)))


def _advance(conn: sa.Connection, results: Sequence[tuple[Lease, Output]], now: float) -> set[int]:
    """A turn of a multi-turn item is done: keep it, and move the item to its next turn.

    The item stays running under the same lease, so the worker goes on with the next
    turn at once; a crash from here resumes at that turn. The attempts count restarts:
    attempts are per turn.
    """
    accepted: set[int] = set()
    for lease, _ in results:
        accepted |= _fenced_update(
            conn,
            [(lease.item_id, lease.token)],
            {"turn": lease.turn + 1, "attempts": 1, "updated_at": now},
        )
    kept = [(lease, out) for lease, out in results if lease.item_id in accepted]
    if kept:
        _report_leftovers(_clear_leftovers(conn, [lease for lease, _ in kept]))
        insert_rows(conn, "item_turns", _TURN_COLUMNS, [_turn_row(*t, now) for t in kept])
    return accepted


def _settle(
    conn: sa.Connection,
    outcomes: Sequence[tuple[Lease, Failure, float]],
    outcome: str,
    now: float,
) -> set[int]:
    changed: set[int] = set()
    for lease, failure, not_before in outcomes:
        values: dict[str, Any] = {
            **_CLEAR_LEASE,
            "error_class": failure.error_class,
            "last_error": storable(failure.message[:4000]),
            "updated_at": now,
        }
        if outcome == "failed":
            values.update(state="failed", finished_at=now)
        elif outcome == "released":
            values.update(_PUT_BACK, not_before=not_before)
        else:
            values.update(state="pending", not_before=not_before)
        changed |= _fenced_update(conn, [(lease.item_id, lease.token)], values)
    log_rows = [
        {
            "item_id": lease.item_id,
            "dataset_id": lease.dataset_id,
            "attempt": lease.attempt,
            "error_class": failure.error_class,
            "message": storable(failure.message[:4000]),
            "outcome": outcome,
            "created_at": now,
            "server": storable(failure.server),
        }
        for lease, failure, _ in outcomes
        if lease.item_id in changed
    ]
    if log_rows:
        conn.execute(attempt_errors.insert(), log_rows)
    return changed


_KILLED = wasted.Waste(wasted.KILLED)


def _thrown_away(work: Round, accepted: Mapping[str, set[int]]) -> list[wasted.Wasted]:
    """The round's work thrown away: answers fenced out (their lease was lost, so they
    are never written) and accepted failures that carry what their attempt generated."""
    entries: list[tuple[int, wasted.Waste]] = []
    for kind, results in (("complete", work.complete), ("advance", work.advance)):
        took = accepted.get(kind, set())
        for lease, out in results:
            if lease.item_id not in took:
                tokens = (out.usage or {}).get("completion_tokens")
                fenced = wasted.Waste(wasted.FENCED, tokens if isinstance(tokens, int) else None)
                entries.append((lease.dataset_id, fenced))
    failing = [
        ("retry", work.retry),
        ("release", work.release),
        ("fail", [(lease, failure, 0.0) for lease, failure in work.fail]),
    ]
    for kind, outcomes in failing:
        took = accepted.get(kind, set())
        for lease, failure, _ in outcomes:
            if failure.waste is not None and lease.item_id in took:
                entries.append((lease.dataset_id, failure.waste))
    return wasted.tally(entries)


# -------------------------------------------------------------------- requeue and undo
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
    for chunk in _chunks(ids):
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
    for chunk in _chunks(changed):
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
    for chunk in _chunks(ids):
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
    for chunk in _chunks(done):
        for live, kept in ((outputs, superseded_outputs), (item_turns, superseded_turns)):
            conn.execute(live.delete().where(live.c.item_id.in_(list(chunk))))
            where = sa.and_(kept.c.requeue_id == requeue_id, kept.c.item_id.in_(list(chunk)))
            _move(conn, kept, live, where, requeue_id, aside=False)
    others = [item_id for item_id, state in changed if state != "done"]
    for chunk in _chunks(others):
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
    for chunk in _chunks(ids):
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
