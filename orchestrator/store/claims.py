"""The claim: which pending items a worker leases next, in one write transaction.

Scouts first (a few items of each dataset not yet started), then priority by priority,
the longest predicted answers first; suspects of crashes in groups; a prompt's samples
asked in one request claimed together. Apart from ``store.queue`` because the order of
work is its own policy, written as SQL, and the largest part of a round.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import sqlalchemy as sa

from orchestrator.items.answer_length import Expected
from orchestrator.store import crashes
from orchestrator.store.leases import Claim, Failure, Lease
from orchestrator.store.schema import item_turns, items
from orchestrator.store.statements import Statements, chunks, placeholders


def claim_leases(conn: sa.Connection, claim: Claim, now: float) -> list[Lease]:
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
    st = Statements(conn)
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


HEADS = (
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
    st = Statements(conn)
    ranked: list[tuple[float, int, int]] = []
    for order, (dataset_id, n) in enumerate(room.items()):
        rank = lengths.get(dataset_id, _AS_PREDICTED).rank
        heads = st.rows(HEADS, {"dataset": dataset_id, "now": now, "n": n})
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
    return int(Statements(conn).rows(_TAKEN, {"dataset": dataset_id, "most": most})[0][0])


_RUNNING = "SELECT count(*) FROM items WHERE dataset_id = :dataset AND state = 'running'"


def _claimable_datasets(
    conn: sa.Connection, names: Sequence[str] | None
) -> tuple[list[tuple[int, int | None, int]], dict[int, int]]:
    """Datasets to claim from, best first, as (id, concurrency cap, priority), and the
    running count of each capped one."""
    st = Statements(conn)
    sql = "SELECT id, concurrency, priority FROM datasets WHERE NOT paused AND NOT passthrough"
    listed, params = placeholders("n", list(names or ()))
    if names:
        sql += f" AND name IN ({listed})"
    candidates = [(r[0], r[1], r[2]) for r in st.rows(sql + " ORDER BY priority DESC, id", params)]
    capped = sorted(dataset_id for dataset_id, cap, _ in candidates if cap is not None)
    if capped and st.postgres:
        # Claims from many processes at once: a capped dataset's count and its claim
        # happen under a lock on its row, so that two claims cannot both see room for
        # the same slot. FOR NO KEY UPDATE: enqueue's inserts (a key share, for the
        # foreign key) go on meanwhile. Taken in id order, so claims never deadlock.
        ids, locked = placeholders("c", capped)
        st.rows(
            f"SELECT id FROM datasets WHERE id IN ({ids}) ORDER BY id FOR NO KEY UPDATE", locked
        )
    # Count running items only for capped datasets, one index range each.
    running = {
        dataset_id: st.rows(_RUNNING, {"dataset": dataset_id})[0][0] for dataset_id in capped
    }
    return candidates, running


@functools.lru_cache(maxsize=32)
def claim_sql(
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
    st = Statements(conn)
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
    rows = st.rows(claim_sql(suspects, st.postgres, in_input_order, fresh), params)
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
    st: Statements, rows: list[tuple[Any, ...]], params: dict[str, Any], together: _Together
) -> list[tuple[Any, ...]]:
    """``rows`` with each prompt's later pending samples claimed too, after its last one
    (a statement only for a prompt whose last sample is not among them), as far as the
    dataset's cap lets."""
    claimed = {(r[2], r[10]) for r in rows}
    sql = claim_sql(None, st.postgres, siblings=True)
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
    for chunk in chunks(ids):
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
