"""After a crash: telling an item that kills its worker from the bystanders of a crash.

A worker that dies (SIGKILL, OOM, a segfault) takes every item it had in flight down with
it, and one of them may be what killed it. The evidence against an item is the number of
deaths it was present at (``items.deaths``), as SQS counts receives and Sidekiq counts
the deaths a job was in flight for:

* an item that died once runs again at full concurrency: an ordinary crash costs about
  one answer's time, its items going back to work side by side;
* items that died ``d >= 2`` times are *suspects*, claimed in groups of one level, at
  most ``max(1, capacity >> (d - 1))`` items, one group per worker at a time: each
  further death halves the group that holds a poison item, and an innocent item is
  never again in flight beside it at that level;
* a death gives the attempt back (the bystanders of a bisection keep their attempts),
  and an item that died as its worker's only suspect twice (``items.deaths_alone``) is
  failed as poison. A poison item on workers of capacity ``C`` dies at most
  ``max(2, 1 + ceil(log2 C)) + 2`` times: 7 at 16, 11 at 256.

A lease that expired (a worker on another host that died, or froze past its lease)
counts as a death: the two cannot be told apart from here. A graceful stop releases
its items and counts none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the sqlite3 path of ``status`` reads this module without SQLAlchemy
    import sqlalchemy as sa

    from orchestrator.store.engine import Database

#: Deaths from which an item is claimed in groups rather than freely.
SUSPECT = 2
#: Deaths as its worker's only suspect after which an item is failed as poison.
ALONE_TWICE = 2

DIED = "the worker holding this item died or stopped renewing its lease"
POISON = (
    "the worker holding this item died or stopped renewing its lease, twice while it was"
    " that worker's only item taken back from crashes: it kills its worker"
)


def group_size(capacity: int, deaths: int) -> int:
    """Suspects of ``deaths`` deaths a worker of ``capacity`` slots runs together."""
    return max(1, capacity >> max(deaths - 1, 0))


def most_deaths(capacity: int) -> int:
    """The most deaths a poison item costs workers of ``capacity`` slots (see above)."""
    return max(SUSPECT, 1 + (max(capacity, 1) - 1).bit_length()) + ALONE_TWICE


class Taken(NamedTuple):
    """A running item taken back from its holder, as the reaper read it."""

    id: int
    dataset_id: int
    attempts: int
    deaths: int
    deaths_alone: int
    lease_owner: str | None


class Verdict(NamedTuple):
    """What a death makes of an item: whether it died as its worker's only suspect,
    and whether it is failed as poison."""

    alone: bool
    poison: bool


def verdicts(taken: Iterable[Taken], suspects_held: Mapping[str | None, int]) -> dict[int, Verdict]:
    """Each item's verdict; ``suspects_held``: how many suspects each holder was running
    (its group, read before any is taken back)."""
    out: dict[int, Verdict] = {}
    for row in taken:
        alone = row.deaths >= SUSPECT and suspects_held.get(row.lease_owner, 0) == 1
        poison = alone and row.deaths_alone + 1 >= ALONE_TWICE
        out[row.id] = Verdict(alone, poison)
    return out


def by_verdict(verdicts: Mapping[int, Verdict]) -> dict[Verdict, list[int]]:
    """The items of each verdict, in id order."""
    out: dict[Verdict, list[int]] = {}
    for item_id, verdict in sorted(verdicts.items()):
        out.setdefault(verdict, []).append(item_id)
    return out


def suspects_held(conn: sa.Connection, taken: Sequence[Taken]) -> dict[str | None, int]:
    """How many suspects each holder of ``taken`` is running (before any is taken back)."""
    owners = sorted({row.lease_owner for row in taken if row.lease_owner is not None})
    if not owners:
        return {}
    import sqlalchemy as sa

    params = {f"o{n}": owner for n, owner in enumerate(owners)}
    sql = HELD_SQL.format(owners=", ".join(f":{k}" for k in params))
    return {owner: int(n) for owner, n in conn.execute(sa.text(sql), params)}


# The level of a dataset's suspects to claim next: the most deaths first, the group
# closest to its poison item (``ix_items_suspect``; the literal ``deaths > 0`` lets
# SQLite use that partial index).
LEVEL_SQL = (
    "SELECT deaths FROM items WHERE dataset_id = :dataset AND state = 'pending'"
    " AND deaths > 0 AND deaths >= 2 AND not_before <= :now ORDER BY deaths DESC LIMIT 1"
)

# Running items of these holders that are suspects: each holder's group.
HELD_SQL = (
    "SELECT lease_owner, count(*) FROM items WHERE state = 'running' AND deaths >= 2"
    " AND lease_owner IN ({owners}) GROUP BY lease_owner"
)

# Items left (pending or running) taken back from crashes, per dataset: all of them, and
# the suspects among them (the pending along ``ix_items_suspect``, the running along
# ``ix_items_running``, a few rows).
AFTER_CRASH_SQL = (
    "SELECT dataset_id, count(*), coalesce(sum(CASE WHEN deaths >= 2 THEN 1 ELSE 0 END), 0)"
    " FROM items WHERE state = 'pending' AND deaths > 0 GROUP BY dataset_id"
    " UNION ALL SELECT +dataset_id, count(*),"
    " coalesce(sum(CASE WHEN deaths >= 2 THEN 1 ELSE 0 END), 0)"
    " FROM items WHERE state = 'running' AND deaths > 0 GROUP BY +dataset_id"
)


def after_crash(rows: Iterable[Sequence[Any]]) -> dict[int, dict[str, int]]:
    """The rows of :data:`AFTER_CRASH_SQL` summed per dataset: the items left that were
    in flight at a death (``items``), and the suspects among them (``rationed``)."""
    out: dict[int, dict[str, int]] = {}
    for dataset_id, n, suspects in rows:
        slot = out.setdefault(dataset_id, {"items": 0, "rationed": 0})
        slot["items"] += int(n)
        slot["rationed"] += int(suspects)
    return out


async def left_after_crash(database: Database, names: Sequence[str] = ()) -> dict[str, int]:
    """Items left after crashes, and rationed, in the datasets named (none: all)."""
    import sqlalchemy as sa

    async with database.read() as conn:
        found = after_crash((await conn.execute(sa.text(AFTER_CRASH_SQL))).all())
        ids = dict((await conn.execute(sa.text("SELECT id, name FROM datasets"))).all())
    picked = [v for d, v in found.items() if not names or ids.get(d) in names]
    return {k: sum(v[k] for v in picked) for k in ("items", "rationed")}
