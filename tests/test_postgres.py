"""PostgreSQL only: what SQLite's single writer gives for free must hold under concurrency.

Several connections (as from several processes) claim, settle and reap at the same time
against one PostgreSQL database: no row is claimed twice, a dataset's cap holds, and a
concurrent schema upgrade happens once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.formats import iter_records
from orchestrator.store import DatasetSpec, Queue, create_database, enqueue, open_database
from orchestrator.store.migrate import SCHEMA_REVISION
from tests.helpers import prompts, query, write_jsonl
from tests.test_queue import answer

pytestmark = pytest.mark.postgresql


async def test_concurrent_claims_never_share_a_row(
    pg_database: Callable[[], str], tmp_path: Path
) -> None:
    url = pg_database()
    first = await open_database(url)
    path = write_jsonl(tmp_path / "in.jsonl", prompts(600))
    await enqueue(first, DatasetSpec("free"), iter_records(path), path=str(path))
    capped = write_jsonl(tmp_path / "capped.jsonl", prompts(200, prefix="c"))
    spec = DatasetSpec("capped", concurrency=7, priority=1)
    await enqueue(first, spec, iter_records(capped), path=str(capped))
    # Eight "processes": each its own engine, so its own connections and write lock.
    databases = [first, *[await open_database(url) for _ in range(7)]]
    claimed: list[tuple[str, int, str]] = []
    most_capped = 0

    async def work(i: int) -> None:
        nonlocal most_capped
        queue = Queue(databases[i])
        while True:
            leases = await queue.claim(f"w{i}", 9, lease_seconds=60)
            if not leases:
                return
            claimed.extend((lease.key, lease.attempt, f"w{i}") for lease in leases)
            [(running,)] = await asyncio.to_thread(
                query,
                url,
                "SELECT count(*) FROM items i JOIN datasets d ON d.id = i.dataset_id"
                " WHERE d.name = 'capped' AND i.state = 'running'",
            )
            most_capped = max(most_capped, running)
            await asyncio.sleep(0)
            accepted = await queue.complete([(lease, answer()) for lease in leases])
            assert accepted == {lease.item_id for lease in leases}

    try:
        await asyncio.gather(*(work(i) for i in range(len(databases))))
    finally:
        for database in databases:
            await database.close()
    keys = [key for key, _, _ in claimed]
    assert len(keys) == len(set(keys)) == 800
    assert {attempt for _, attempt, _ in claimed} == {1}
    assert len({owner for _, _, owner in claimed}) > 1
    assert most_capped <= 7
    assert query(url, "SELECT count(*), count(DISTINCT item_id) FROM outputs") == [(800, 800)]


async def test_concurrent_reapers_take_each_row_back_once(
    pg_database: Callable[[], str], tmp_path: Path
) -> None:
    url = pg_database()
    databases = [await open_database(url) for _ in range(4)]
    try:
        path = write_jsonl(tmp_path / "in.jsonl", prompts(300))
        await enqueue(databases[0], DatasetSpec("d"), iter_records(path), path=str(path))
        await Queue(databases[0]).claim("dead", 300, lease_seconds=60)
        counts = await asyncio.gather(*(Queue(db).reap(dead_owners=["dead"]) for db in databases))
    finally:
        for database in databases:
            await database.close()
    assert sum(counts) == 300
    assert query(url, "SELECT count(*) FROM attempt_errors") == [(300,)]
    assert query(url, "SELECT state, count(*) FROM items GROUP BY state") == [("pending", 300)]


async def test_concurrent_first_opens_migrate_once(pg_database: Callable[[], str]) -> None:
    url = pg_database()
    databases = [create_database(url) for _ in range(5)]
    try:
        from orchestrator.store.migrate import ensure_schema

        await asyncio.gather(*(ensure_schema(db) for db in databases))
    finally:
        for database in databases:
            await database.close()
    assert query(url, "SELECT version_num FROM alembic_version") == [(SCHEMA_REVISION,)]
