"""Scouting: a few items of every dataset first, so each answers within the first minute."""

from __future__ import annotations

from pathlib import Path

from orchestrator.store import Database, Queue
from orchestrator.store.leases import Claim
from orchestrator.store.rounds import Round
from tests.test_queue import answer, load


async def test_every_dataset_gets_its_scouts_before_priority_order(
    database: Database, tmp_path: Path
) -> None:
    await load(database, tmp_path, 20, name="first", priority=5)
    await load(database, tmp_path, 20, name="second")
    await load(database, tmp_path, 20, name="capped", concurrency=1)
    queue = Queue(database)
    started: set[int] = set()

    def claim(want: int) -> Round:
        return Round(claim=Claim("w", want, 60.0, scouts=3, started=started))

    got = (await queue.write_round(claim(10))).leases
    by_name = [lease.key.rstrip("0123456789") for lease in got]
    # Three of each dataset never claimed from (one of "capped", its cap), the rest by
    # priority: "first" is the highest.
    assert by_name.count("second") == 3 and by_name.count("capped") == 1
    assert by_name.count("first") == 6
    assert [lease.key for lease in got if lease.key.startswith("second")] == [
        "second000000",
        "second000001",
        "second000002",
    ]
    assert len(started) == 0  # none was started before this claim

    # "capped" has had one of its three, its cap allowing one at a time: it gets the next
    # one first; the others have had theirs, and go by priority again.
    settle = [(lease, answer()) for lease in got]
    done = await queue.write_round(Round(complete=settle, claim=claim(20).claim))
    assert len(done.accepted["complete"]) == 10
    names = [lease.key.rstrip("0123456789") for lease in done.leases]
    assert names == ["capped"] + ["first"] * 14 + ["second"] * 5
    assert len(started) == 2  # "first" and "second": no more look-ups for them


async def test_no_scouts_unless_asked(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 10, name="first", priority=5)
    await load(database, tmp_path, 10, name="second")
    got = await Queue(database).claim("w", 5, lease_seconds=60)
    assert all(lease.key.startswith("first") for lease in got)


async def test_a_dataset_smaller_than_its_scouts_is_looked_up_once(
    database: Database, tmp_path: Path
) -> None:
    await load(database, tmp_path, 10, name="big", priority=5)
    await load(database, tmp_path, 2, name="tiny")
    queue = Queue(database)
    started: set[int] = set()
    got = await queue.write_round(Round(claim=Claim("w", 20, 60.0, scouts=4, started=started)))
    names = [lease.key.rstrip("0123456789") for lease in got.leases]
    assert names.count("tiny") == 2 and names.count("big") == 10
    # "tiny" gave all it had: it is not looked up again. "big" had its four, which
    # the next round finds (and then stops looking too).
    assert len(started) == 1
    await queue.write_round(Round(claim=Claim("w", 5, 60.0, scouts=4, started=started)))
    assert len(started) == 2
