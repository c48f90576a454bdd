"""The records of a provider's batches (``store.batches``), on both backends: which
lines are still wanted (what a restarted worker adopts), what settles them, when a batch
closes, and which running batches nobody wants any more."""

from __future__ import annotations

from pathlib import Path

from orchestrator.formats import iter_records
from orchestrator.store import Database, DatasetSpec, Queue, enqueue, hosted
from orchestrator.store import batches as records
from orchestrator.store.requeue import Selection, requeue
from tests.helpers import prompts, write_jsonl
from tests.test_queue import answer


async def _items(database: Database, tmp_path: Path, n: int) -> list[int]:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    await enqueue(database, DatasetSpec("d"), iter_records(path), path=str(path))  # type: ignore[arg-type]
    leases = await Queue(database).claim("w1", n, lease_seconds=60)
    return [lease.item_id for lease in leases]


def _lines(ids: list[int]) -> list[records.Line]:
    return [records.Line(f"i{i}-t0", i, 0) for i in ids]


async def test_a_batch_step_by_step(database: Database, tmp_path: Path) -> None:
    ids = await _items(database, tmp_path, 4)
    await records.open_batch(database, "k1", "http://s", "chat", _lines(ids), 400, "w1")
    wanted = await records.wanted(database, ids)
    assert sorted(wanted) == ids and {w.batch_key for w in wanted.values()} == {"k1"}
    await records.record(database, "k1", "w1", state=records.UPLOADED, input_file_id="file-1")
    await records.record(database, "k1", "w1", state=records.CREATED, provider_id="batch_1")
    row = await records.get(database, "k1")
    assert row is not None and (row.state, row.provider_id, row.requests) == (
        "created", "batch_1", 4,
    )  # fmt: skip
    assert await records.unwanted(database, ["k1"]) == []
    await records.record(database, "k1", "w1", state=records.COLLECTED, status="completed")
    await records.settle(database, [("k1", f"i{ids[0]}-t0")])
    assert sorted(await records.wanted(database, ids)) == ids[1:]
    assert await records.close_finished(database) == []  # three lines still wanted
    await records.settle(database, [("k1", f"i{i}-t0") for i in ids[1:]])
    assert await records.close_finished(database) == ["k1"]
    assert await records.wanted(database, ids) == {}
    assert [b.key for b in await records.listing(database, live=False)] == ["k1"]
    assert await records.listing(database) == []


async def test_a_batch_taken_over_keeps_its_old_worker_from_creating_or_writing(
    database: Database, tmp_path: Path
) -> None:
    """The fence two workers meet at over a batch not yet created: once the second took
    the record over, the first can neither mark a create nor write a step; a take-over
    from a record read before it changed fails."""
    ids = await _items(database, tmp_path, 2)
    await records.open_batch(database, "k1", "http://s", "chat", _lines(ids), 200, "w1")
    assert await records.record(database, "k1", "w1", state=records.UPLOADED, input_file_id="f")
    read = await records.get(database, "k1")
    assert read is not None
    assert await records.mark_creating(database, "k1", "w1")  # the record changed since
    assert not await records.take_over(database, read, "w2")
    creating = await records.get(database, "k1")
    assert creating is not None and creating.state == records.CREATING
    assert await records.take_over(database, creating, "w2")
    assert not await records.mark_creating(database, "k1", "w1")
    assert not await records.record(database, "k1", "w1", state=records.ABANDONED)
    row = await records.get(database, "k1")
    assert row is not None and (row.state, row.worker) == (records.CREATING, "w2")
    assert await records.record(database, "k1", "w2", state=records.CREATED, provider_id="b")


async def test_a_requeued_item_is_asked_anew_not_answered_from_its_old_batch(
    database: Database, tmp_path: Path
) -> None:
    """An answer written, its line's settling lost with a killed worker: the item done
    needs nothing, but requeued it must not take its old answer from the batch again."""
    ids = await _items(database, tmp_path, 2)
    await records.open_batch(database, "k1", "http://s", "chat", _lines(ids), 200, "w1")
    await records.record(database, "k1", "w1", state=records.CREATED, provider_id="batch_1")
    queue = Queue(database)
    leases = await queue.claim("w2", 2, lease_seconds=60)  # nothing pending: none
    assert leases == []
    await Queue(database).reap(now=10**10)  # the leases of w1 expire
    leases = await queue.claim("w2", 2, lease_seconds=60)
    await queue.complete([(leases[0], answer())])
    assert sorted(await records.wanted(database, ids)) == ids  # done, settling lost
    # Nothing wants the done item's line; the other item's still is.
    assert await records.unwanted(database, ["k1"]) == []
    await requeue(database, Selection(state="done", keys=(leases[0].key,)))
    assert sorted(await records.wanted(database, ids)) == [leases[1].item_id]
    await queue.complete([(leases[1], answer())])
    assert await records.unwanted(database, ["k1"]) == ["k1"]


def test_status_reads_the_live_batches_the_store_keeps() -> None:
    """``store.hosted`` (no SQLAlchemy, for ``status``) names the live states itself."""
    named = hosted.BATCH_SQL["batches"].split("IN (")[1].split(")")[0]
    assert {state.strip(" '") for state in named.split(",")} == set(records.LIVE)
