"""The state machine, transition by transition, on a real SQLite file and on PostgreSQL.

Every test runs on both backends (``[sqlite]``, ``[postgresql]``), and on SQLite twice:
with the worker's hot statements as plain SQL on the sqlite3 driver (what a worker
uses), and as SQLAlchemy constructs (what PostgreSQL uses).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from orchestrator.formats import iter_records
from orchestrator.store import (
    Database,
    DatasetSpec,
    Failure,
    Lease,
    Output,
    Queue,
    crashes,
    enqueue,
)
from orchestrator.store import statements as sql_statements
from orchestrator.store.leases import Claim
from orchestrator.store.requeue import Selection, requeue
from orchestrator.store.rounds import Round
from orchestrator.store.schema import attempt_errors, item_turns, items, outputs
from tests.helpers import prompts, write_jsonl


@pytest.fixture(autouse=True, params=["driver-sql", "sqlalchemy"])
def statements(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "sqlalchemy":
        monkeypatch.setattr(sql_statements, "_sqlite_driver", lambda _conn: None)
    yield request.param


def answer(text: str = "hello") -> Output:
    return Output(
        message={"role": "assistant", "content": text},
        content=text,
        reasoning=None,
        finish_reason="stop",
        usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        latency=0.1,
        server="http://sim",
        model="sim-model",
        response_id="r1",
    )


async def load(
    database: Database, tmp_path: Path, n: int, name: str = "ds", **spec: object
) -> None:
    path = write_jsonl(tmp_path / f"{name}.jsonl", prompts(n, prefix=name))
    await enqueue(database, DatasetSpec(name, **spec), iter_records(path), path=str(path))  # type: ignore[arg-type]


async def rows(database: Database) -> dict[str, dict]:
    async with database.read() as conn:
        result = await conn.execute(sa.select(items))
        return {r.key: r._asdict() for r in result}


async def output_count(database: Database) -> int:
    async with database.read() as conn:
        return (await conn.execute(sa.select(sa.func.count()).select_from(outputs))).scalar_one()


async def test_claim_counts_attempt_and_leases(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 5)
    queue = Queue(database)
    leases = await queue.claim("w1", 3, lease_seconds=60)
    assert [lease.key for lease in leases] == ["ds000000", "ds000001", "ds000002"]
    state = await rows(database)
    for lease in leases:
        row = state[lease.key]
        assert row["state"] == "running"
        assert row["attempts"] == 1 == lease.attempt
        assert row["lease_token"] == lease.token
        assert row["lease_owner"] == "w1"
    assert state["ds000003"]["state"] == "pending"
    # The rest, then nothing.
    assert len(await queue.claim("w2", 10, lease_seconds=60)) == 2
    assert await queue.claim("w2", 10, lease_seconds=60) == []


async def test_complete_writes_output_in_same_transition(
    database: Database, tmp_path: Path
) -> None:
    await load(database, tmp_path, 2)
    queue = Queue(database)
    lease, other = await queue.claim("w1", 2, lease_seconds=60)
    accepted = await queue.complete([(lease, answer("first"))])
    assert accepted == {lease.item_id}
    state = await rows(database)
    assert state[lease.key]["state"] == "done"
    assert state[lease.key]["lease_token"] is None
    assert state[other.key]["state"] == "running"
    assert await output_count(database) == 1
    # A second completion under the same (now spent) lease is rejected, and writes nothing.
    assert await queue.complete([(lease, answer("again"))]) == set()
    assert await output_count(database) == 1


async def test_a_leftover_output_is_replaced_and_the_rest_of_the_round_written(
    database: Database, tmp_path: Path
) -> None:
    """A running item should have no output row; one left there anyway (an old undo's
    doing) gives way to the new answer instead of failing the round on the key."""
    await load(database, tmp_path, 4)
    queue = Queue(database)
    first, stuck, last = await queue.claim("w1", 3, lease_seconds=60)
    left = {
        "item_id": stuck.item_id, "dataset_id": stuck.dataset_id, "message": '{"old": 1}',
        "latency": 9.0, "attempt": 7, "created_at": 1.0,
    }  # fmt: skip
    async with database.write() as conn:
        await conn.execute(outputs.insert(), [left])
    with capture_logs() as logs:
        accepted = await queue.complete(
            [(first, answer("one")), (stuck, answer("two")), (last, answer("three"))]
        )
    assert accepted == {first.item_id, stuck.item_id, last.item_id}
    async with database.read() as conn:
        stored = dict((await conn.execute(sa.select(outputs.c.item_id, outputs.c.message))).all())
    assert {k: orjson.loads(v)["content"] for k, v in stored.items()} == {
        first.item_id: "one",
        stuck.item_id: "two",
        last.item_id: "three",
    }
    [warning] = [e for e in logs if e["event"] == "leftover_rows_replaced"]
    assert warning["items"] == [stuck.item_id]
    # The usual round, with nothing left behind, says nothing.
    [more] = await queue.claim("w1", 1, lease_seconds=60)
    with capture_logs() as quiet:
        assert await queue.complete([(more, answer("four"))]) == {more.item_id}
    assert not [e for e in quiet if e["event"] == "leftover_rows_replaced"]
    assert await output_count(database) == 4


async def test_a_write_round_is_whole_or_nothing_and_in_order(database: Database) -> None:
    """``run_write``, the hop of every round: a round that raises leaves nothing written
    and its error reaches the caller as raised; on SQLite, a round whose caller stopped
    waiting (a forced stop) is still finished on the writer thread, before the next."""

    def scratch(conn: sa.Connection) -> None:
        conn.execute(sa.text("CREATE TABLE scratch (n integer)"))

    def count(conn: sa.Connection) -> int:
        return int(conn.execute(sa.text("SELECT count(*) FROM scratch")).scalar_one())

    def refused(conn: sa.Connection) -> None:
        conn.execute(sa.text("INSERT INTO scratch VALUES (1)"))
        raise ValueError("round refused")

    await database.run_write(scratch)
    with pytest.raises(ValueError, match="round refused"):
        await database.run_write(refused)
    assert await database.run_write(count) == 0
    if not database.is_sqlite:
        return  # there, a cancelled round is rolled back with its connection
    started = threading.Event()

    def slow(conn: sa.Connection) -> None:
        started.set()
        time.sleep(0.3)
        conn.execute(sa.text("INSERT INTO scratch VALUES (2)"))

    task = asyncio.ensure_future(database.run_write(slow))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await database.run_write(count) == 1


async def test_late_completion_after_takeover_is_fenced(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 1)
    queue = Queue(database)
    [slow] = await queue.claim("slow-worker", 1, lease_seconds=5, now=time.time() - 10)
    # The lease expired; the reaper gives the item back and another worker takes it.
    assert await queue.reap() == 1
    [fast] = await queue.claim("fast-worker", 1, lease_seconds=60)
    # The death gave the attempt back (store.crashes).
    assert fast.item_id == slow.item_id and fast.token != slow.token and fast.attempt == 1
    # The slow worker wakes up: its renew, retry, fail and complete all change nothing.
    assert await queue.renew([(slow.item_id, slow.token)], lease_seconds=60) == set()
    assert await queue.retry([(slow, Failure("timeout", "late"), 0.0)]) == set()
    assert await queue.fail([(slow, Failure("timeout", "late"))]) == set()
    assert await queue.complete([(slow, answer("stale"))]) == set()
    stale_turn = await queue.write_round(Round(advance=[(slow, answer("stale turn"))]))
    assert stale_turn.accepted == {"advance": set()}
    assert await output_count(database) == 0
    async with database.read() as conn:
        turns = (await conn.execute(sa.select(sa.func.count()).select_from(item_turns))).scalar()
    assert turns == 0
    state = (await rows(database))["ds000000"]
    assert state["state"] == "running" and state["lease_owner"] == "fast-worker"
    # The current holder completes normally; exactly one output, from the holder.
    assert await queue.complete([(fast, answer("fresh"))]) == {fast.item_id}
    async with database.read() as conn:
        messages = (await conn.execute(sa.select(outputs.c.message))).scalars().all()
    assert [orjson.loads(m)["content"] for m in messages] == ["fresh"]


async def test_renew_extends_only_held_leases(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 2)
    queue = Queue(database)
    a, b = await queue.claim("w1", 2, lease_seconds=10)
    forged = Lease(b.item_id, "not-the-token", b.dataset_id, b.key, b.request, 1, 0)
    kept = await queue.renew(
        [(a.item_id, a.token), (forged.item_id, forged.token)], lease_seconds=600
    )
    assert kept == {a.item_id}
    state = await rows(database)
    assert state[a.key]["lease_expires_at"] > time.time() + 500
    assert state[b.key]["lease_expires_at"] < time.time() + 20


async def test_retry_sets_backoff_and_keeps_attempt(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 1)
    queue = Queue(database)
    [lease] = await queue.claim("w1", 1, lease_seconds=60)
    later = time.time() + 30
    assert await queue.retry([(lease, Failure("http_500", "HTTP 500: boom"), later)]) == {
        lease.item_id
    }
    row = (await rows(database))["ds000000"]
    assert (row["state"], row["attempts"], row["error_class"]) == ("pending", 1, "http_500")
    assert row["not_before"] == later and row["lease_token"] is None
    # Not claimable before not_before, claimable after.
    assert await queue.claim("w1", 1, lease_seconds=60) == []
    [again] = await queue.claim("w1", 1, lease_seconds=60, now=later + 1)
    assert again.attempt == 2


async def test_release_gives_the_attempt_back(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 1)
    queue = Queue(database)
    [lease] = await queue.claim("w1", 1, lease_seconds=60)
    await queue.release([(lease, Failure("connect", "refused"), 0.0)])
    row = (await rows(database))["ds000000"]
    assert (row["state"], row["attempts"]) == ("pending", 0)
    async with database.read() as conn:
        logged = (await conn.execute(sa.select(attempt_errors.c.outcome))).scalars().all()
    assert logged == ["released"]


async def test_fail_keeps_reason(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 1)
    queue = Queue(database)
    [lease] = await queue.claim("w1", 1, lease_seconds=60)
    await queue.fail([(lease, Failure("http_400", "HTTP 400: context too long"))])
    row = (await rows(database))["ds000000"]
    assert row["state"] == "failed"
    assert row["error_class"] == "http_400"
    assert row["last_error"] == "HTTP 400: context too long"
    assert row["finished_at"] is not None


async def test_a_death_gives_the_attempt_back_and_is_counted(
    database: Database, tmp_path: Path
) -> None:
    """Items that share crash after crash keep their attempts: none of them is known to
    be at fault, and none ran alone."""
    await load(database, tmp_path, 2)
    queue = Queue(database)
    past = time.time() - 100
    for _ in range(5):
        await queue.claim("crashy", 2, lease_seconds=1, now=past)
        await queue.reap()
    state = await rows(database)
    assert {r["state"] for r in state.values()} == {"pending"}
    assert all(r["error_class"] == "lease_lost" and r["attempts"] == 0 for r in state.values())
    assert [(r["deaths"], r["deaths_alone"]) for r in state.values()] == [(5, 0), (5, 0)]


async def test_an_item_that_dies_alone_twice_fails_as_poison(
    database: Database, tmp_path: Path
) -> None:
    """Once it has died twice an item runs in a group; the only suspect of its worker at
    two more deaths, it is what kills the worker, and it fails alone."""
    await load(database, tmp_path, 3)
    queue = Queue(database)
    for death in range(1, 5):
        [lease] = await queue.claim(f"w{death}", 1, lease_seconds=60, suspect_slots=8)
        assert lease.key == "ds000000" and lease.suspect == (death > 2)
        await queue.reap(dead_owners=[f"w{death}"])
    state = await rows(database)
    poison = state["ds000000"]
    assert (poison["state"], poison["error_class"]) == ("failed", "lease_lost")
    assert (poison["deaths"], poison["deaths_alone"], poison["attempts"]) == (4, 2, 0)
    assert "kills its worker" in poison["last_error"]
    assert crashes.most_deaths(1) == 4
    assert [state[k]["state"] for k in ("ds000001", "ds000002")] == ["pending", "pending"]


async def test_reap_dead_owner_without_waiting_for_expiry(
    database: Database, tmp_path: Path
) -> None:
    await load(database, tmp_path, 3)
    queue = Queue(database)
    await queue.claim("dead", 2, lease_seconds=3600)
    await queue.claim("alive", 1, lease_seconds=3600)
    assert await queue.reap(dead_owners=["dead"]) == 2
    state = await rows(database)
    assert sorted(r["state"] for r in state.values()) == ["pending", "pending", "running"]


async def test_dataset_concurrency_priority_and_pause(database: Database, tmp_path: Path) -> None:
    from orchestrator.store import set_paused

    await load(database, tmp_path, 10, name="low", priority=0)
    await load(database, tmp_path, 10, name="high", priority=5, concurrency=3)
    queue = Queue(database)
    first = await queue.claim("w1", 5, lease_seconds=60)
    # Higher priority first, but never more than its concurrency running at once...
    assert [lease.key[:4] for lease in first] == ["high"] * 3 + ["low0"] * 2
    # ...across workers too.
    second = await queue.claim("w2", 5, lease_seconds=60)
    assert all(lease.key.startswith("low") for lease in second)
    assert await set_paused(database, "low", True)
    assert await queue.claim("w3", 5, lease_seconds=60) == []
    assert await queue.remaining() == 10  # only "high" counts while "low" is paused
    await set_paused(database, "low", False)
    assert len(await queue.claim("w3", 5, lease_seconds=60, dataset_names=["low"])) == 3


async def test_requeue_failed_and_done(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 3)
    queue = Queue(database)
    a, b, c = await queue.claim("w1", 3, lease_seconds=60)
    await queue.fail([(a, Failure("http_400", "bad")), (b, Failure("timeout", "slow"))])
    await queue.complete([(c, answer())])
    assert await requeue(database, Selection(error_class="timeout")) == 1
    state = await rows(database)
    assert state[b.key]["state"] == "pending" and state[b.key]["attempts"] == 0
    assert state[a.key]["state"] == "failed"
    assert await requeue(database, Selection(state="done")) == 1
    assert await output_count(database) == 0
    assert (await rows(database))[c.key]["state"] == "pending"


async def test_running_row_always_has_a_lease(database: Database, tmp_path: Path) -> None:
    """The schema itself refuses a running row without a fence token."""
    import pytest

    from orchestrator.errors import StorageError

    await load(database, tmp_path, 1)
    with pytest.raises(StorageError, match=r"(?i)check constraint"):
        async with database.write() as conn:
            await conn.execute(items.update().values(state="running", lease_token=None))


async def test_a_row_holding_a_token_is_running(database: Database, tmp_path: Path) -> None:
    """The other half of the check, the one the fence leans on (it tests the token, not
    the state): no row but a running one keeps a lease token."""
    from orchestrator.errors import StorageError

    await load(database, tmp_path, 1)
    for state in ("pending", "done", "failed"):
        with pytest.raises(StorageError, match=r"(?i)check constraint"):
            async with database.write() as conn:
                await conn.execute(items.update().values(state=state, lease_token="f" * 32))


async def test_items_of_one_crash_run_side_by_side(database: Database, tmp_path: Path) -> None:
    """The items in flight at one death go back to work at full concurrency; those that
    died again come back as suspects, in groups that halve with each death."""
    await load(database, tmp_path, 8)
    queue = Queue(database)
    await queue.claim("dead", 6, lease_seconds=3600)
    await queue.reap(dead_owners=["dead"])
    leases = await queue.claim("w1", 8, lease_seconds=60, suspect_slots=8)
    assert [(lease.key, lease.suspect) for lease in leases] == [
        (f"ds{n:06d}", False) for n in range(8)
    ]
    await queue.reap(dead_owners=["w1"])
    # Twice dead: a group of 8 >> 1 = 4, the other four later; the one of a worker that
    # runs a group already (0) takes none; without groups (None) any.
    # (The two that died once, at the second death, run freely beside them.)
    first = await queue.claim("w2", 8, lease_seconds=60, suspect_slots=8)
    assert [(lease.key, lease.suspect) for lease in first] == [
        *((f"ds{n:06d}", True) for n in range(4)),
        ("ds000006", False),
        ("ds000007", False),
    ]
    assert await queue.claim("w3", 8, lease_seconds=60, suspect_slots=0) == []
    assert [lease.key for lease in await queue.claim("w3", 8, lease_seconds=60)] == [
        "ds000004",
        "ds000005",
    ]


_EXAMPLES = itertools.count()


@pytest.mark.parametrize("statements", ["driver-sql"], indirect=True)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    capacity=st.sampled_from([1, 2, 3, 8, 16, 64]),
    levels=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    want=st.integers(1, 80),
)
async def test_a_group_is_one_level_and_halves_with_each_death(
    database: Database, tmp_path: Path, capacity: int, levels: list[int], want: int
) -> None:
    """Whatever the deaths of the items left: a claim takes every item that died once or
    never as it comes, and of those that died more, one group: the level with the most
    deaths, at most ``max(1, capacity >> (deaths - 1))`` of it, in input order."""
    name = f"g{next(_EXAMPLES)}"  # a dataset of its own for each example
    await load(database, tmp_path, len(levels), name=name)
    async with database.write() as conn:
        for n, deaths in enumerate(levels):
            key = f"{name}{n:06d}"
            await conn.execute(items.update().where(items.c.key == key).values(deaths=deaths))
    queue = Queue(database)
    leases = await queue.claim(
        "w", want, lease_seconds=60, dataset_names=[name], suspect_slots=capacity
    )
    suspects = [int(lease.key[len(name) :]) for lease in leases if lease.suspect]
    others = [int(lease.key[len(name) :]) for lease in leases if not lease.suspect]
    grouped = [n for n, d in enumerate(levels) if d >= crashes.SUSPECT]
    free = [n for n, d in enumerate(levels) if d < crashes.SUSPECT]
    if grouped:
        top = max(levels)
        at_top = [n for n in grouped if levels[n] == top]
        size = min(want, crashes.group_size(capacity, top), len(at_top))
        assert suspects == at_top[:size]
        assert size == max(1, capacity >> (top - 1)) or size in (want, len(at_top))
    else:
        assert suspects == []
    assert others == free[: min(want - len(suspects), len(free))]


@pytest.mark.sqlite_only
async def test_checkpoint_folds_the_wal_back(database: Database, tmp_path: Path) -> None:
    """A long run's WAL must not grow for ever: the worker's checkpoints really happen."""
    await load(database, tmp_path, 3000)
    wal = Path(str(database.url.database) + "-wal")
    assert wal.stat().st_size > 0
    await database.checkpoint("TRUNCATE")
    assert wal.stat().st_size == 0


async def test_round_settles_first_then_claims(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, 5, concurrency=2)
    queue = Queue(database)
    a, b = await queue.claim("w1", 5, lease_seconds=60)
    assert await queue.claim("w1", 5, lease_seconds=60) == []  # the cap is reached
    # One transaction: a is done and b retried, which frees both places under the cap.
    result = await queue.write_round(
        Round(
            complete=[(a, answer())],
            retry=[(b, Failure("http_500", "HTTP 500: boom"), time.time() + 60)],
            claim=Claim("w1", 5, 60.0),
        )
    )
    assert result.accepted == {"complete": {a.item_id}, "retry": {b.item_id}}
    assert [lease.key for lease in result.leases] == ["ds000002", "ds000003"]
    state = await rows(database)
    assert [state[k]["state"] for k in sorted(state)] == [
        "done", "pending", "running", "running", "pending"
    ]  # fmt: skip


async def test_fence_sorts_a_mixed_batch(database: Database, tmp_path: Path) -> None:
    """Leases of several claims in one write: each row is judged by its own token."""
    await load(database, tmp_path, 3)
    queue = Queue(database)
    [lost] = await queue.claim("w1", 1, lease_seconds=5, now=time.time() - 10)
    b, c = await queue.claim("w1", 2, lease_seconds=60)
    assert await queue.reap() == 1
    [taken] = await queue.claim("w2", 1, lease_seconds=60)
    assert taken.item_id == lost.item_id
    # w1 still holds b and c (one claim) but not the first item any more.
    forged = Lease(c.item_id, taken.token, c.dataset_id, c.key, c.request, 1, 0)
    accepted = await queue.complete([(lost, answer()), (b, answer()), (forged, answer())])
    assert accepted == {b.item_id}
    state = await rows(database)
    assert state[lost.key]["lease_owner"] == "w2" and state[lost.key]["state"] == "running"
    assert state[c.key]["state"] == "running"
    assert await output_count(database) == 1


@pytest.mark.parametrize("statements", ["driver-sql"], indirect=True)
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    capacity=st.sampled_from([1, 2, 3, 8, 16, 32]),
    n=st.integers(1, 70),
    where=st.floats(0, 1, exclude_max=True),
)
async def test_a_poison_item_is_found_and_fails_alone(
    database: Database, tmp_path: Path, capacity: int, n: int, where: float
) -> None:
    """A worker of ``capacity`` slots claims a full load, and dies whenever the poison
    item is among it; started again at once, it goes on. In the end the poison item
    fails, within ``crashes.most_deaths(capacity)`` deaths, and every other item is
    done on its first attempt, whatever crashes it shared."""
    name = f"p{next(_EXAMPLES)}"
    await load(database, tmp_path, n, name=name)
    poison = f"{name}{int(where * n):06d}"
    queue = Queue(database)
    deaths = 0
    for life in range(10 * n + 20):
        owner = f"{name}-w{life}"
        leases = await queue.claim(
            owner, capacity, lease_seconds=60, dataset_names=[name], suspect_slots=capacity
        )
        if not leases:
            break
        if any(lease.key == poison for lease in leases):
            await queue.reap(dead_owners=[owner])
            deaths += 1
        else:
            assert await queue.complete([(lease, answer()) for lease in leases])
    state = {k: r for k, r in (await rows(database)).items() if k.startswith(name)}
    assert (state[poison]["state"], state[poison]["deaths"]) == ("failed", deaths)
    assert deaths <= crashes.most_deaths(capacity)
    innocent = [r for k, r in state.items() if k != poison]
    assert {(r["state"], r["attempts"]) for r in innocent} <= {("done", 1)}
    assert all(r["deaths_alone"] < crashes.ALONE_TWICE for r in innocent)
