"""``orchestrator db copy``: a run half done on SQLite moves to PostgreSQL, finishes there,
and comes back, without losing or repeating a row."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from orchestrator.store import Failure, Queue, open_database
from orchestrator.store.rounds import Round
from tests.chaos.test_scenarios import SimFactory
from tests.helpers import cli, db_snapshot, prompts, query, start_worker, write_jsonl
from tests.test_queue import answer

USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}

# Everything copied as stored: a done row's output must come out byte for byte.
OUTPUTS = (
    "SELECT i.key, o.content, o.reasoning, o.finish_reason, o.prompt_tokens,"
    " o.completion_tokens, o.message, o.usage, o.latency, o.server, o.model, o.response_id,"
    " o.attempt, o.created_at, o.flags, o.params_hash"
    " FROM outputs o JOIN items i ON i.id = o.item_id ORDER BY o.item_id"
)
TURNS = (
    "SELECT i.key, t.turn, t.message, t.usage, t.latency, t.created_at FROM item_turns t"
    " JOIN items i ON i.id = t.item_id ORDER BY t.item_id, t.turn"
)
ITEMS = "SELECT key, state, attempts, turn, lease_token, error_class FROM items ORDER BY id"


def export(db: str, out: Path) -> dict[str, bytes]:
    result = cli("export", str(out), "--db", db)
    assert result.returncode == 0, result.stderr
    lines = out.read_bytes().splitlines()
    by_key = {orjson.loads(line)["id"]: line for line in lines}
    assert len(by_key) == len(lines), "a key exported twice"
    return by_key


async def half_done(db: str, tmp_path: Path) -> None:
    """Done (with outputs), pending, running, failed and retried items, and conversations
    between turns (item_turns kept, still running) and finished."""
    single = write_jsonl(tmp_path / "a.jsonl", prompts(40, prefix="a"))
    multi = write_jsonl(
        tmp_path / "m.jsonl",
        [{"id": f"m{i}", "messages": [USER, ANSWER, USER, ANSWER]} for i in range(8)],
    )
    for path, name, extra in ((single, "a", ()), (multi, "m", ("--regenerate", "all"))):
        result = cli("enqueue", str(path), "-d", name, "--db", db, *extra)
        assert result.returncode == 0, result.stderr
    database = await open_database(db)
    try:
        queue = Queue(database)
        done = await queue.claim("old", 10, lease_seconds=600, dataset_names=["a"])
        await queue.complete([(x, answer(f"done {x.key}")) for x in done])
        bad = await queue.claim("old", 4, lease_seconds=600, dataset_names=["a"])
        await queue.fail([(x, Failure("http_400", "refused")) for x in bad[:2]])
        await queue.retry([(x, Failure("timeout", "slow"), 0.0) for x in bad[2:]])
        await queue.claim("old", 5, lease_seconds=600, dataset_names=["a"])  # left running
        conversations = await queue.claim("old", 3, lease_seconds=600, dataset_names=["m"])
        advanced = await queue.write_round(
            Round(advance=[(x, answer(f"turn0 {x.key}")) for x in conversations])
        )
        assert len(advanced.accepted["advance"]) == 3
        last = dataclasses.replace(conversations[0], turn=1)
        assert await queue.complete([(last, answer(f"turn1 {last.key}"))])
    finally:
        await database.close()


@pytest.mark.postgresql
def test_copy_to_postgresql_finish_there_and_back(
    tmp_path: Path, sim_process: SimFactory, pg_database: Callable[[], str]
) -> None:
    lite = str(tmp_path / "run.db")
    asyncio.run(half_done(lite, tmp_path))
    before = export(lite, tmp_path / "before.jsonl")
    assert len(before) == 11  # 10 answers and one whole conversation
    lite_items = {row[0]: row for row in query(lite, ITEMS)}
    running = {key for key, row in lite_items.items() if row[1] == "running"}
    assert len(running) == 5 + 2

    pg = pg_database()
    result = cli("db", "copy", "--from", lite, "--to", pg)
    assert result.returncode == 0, result.stderr
    assert "7 items that were running are pending again" in result.stdout
    # Outputs and turns byte for byte; running items pending, lease cleared, attempt back.
    assert query(pg, OUTPUTS) == query(lite, OUTPUTS)
    assert query(pg, TURNS) == query(lite, TURNS)
    for key, state, attempts, turn, token, error_class in query(pg, ITEMS):
        old = lite_items[key]
        if key in running:
            assert (state, attempts, turn, token) == ("pending", old[2] - 1, old[3], None)
        else:
            assert (state, attempts, turn, token, error_class) == old[1:]
    assert query(pg, "SELECT count(*) FROM attempt_errors") == [(4,)]
    for table in ("datasets", "items", "attempt_errors"):  # sequences moved past the ids
        [(last_id,)] = query(pg, f"SELECT max(id) FROM {table}")
        [(next_id,)] = query(pg, f"SELECT nextval(pg_get_serial_sequence('{table}', 'id'))")
        assert next_id > last_id

    # A target with rows in it is refused, and left as it was.
    kept = db_snapshot(pg)
    refused = cli("db", "copy", "--from", lite, "--to", pg)
    assert refused.returncode == 2 and "is not empty" in refused.stderr
    assert db_snapshot(pg) == kept

    # The run goes on, and ends, on PostgreSQL.
    server = sim_process("--latency", "0.01")
    assert cli("requeue", "--db", pg).returncode == 0
    worker = start_worker(pg, server.url, "--exit-when-done")
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0, stderr[-3000:]
    assert {state for _, state, *_ in query(pg, ITEMS)} == {"done"}
    after = export(pg, tmp_path / "after.jsonl")
    assert sorted(after) == sorted([f"a{i:06d}" for i in range(40)] + [f"m{i}" for i in range(8)])
    for key, line in before.items():
        assert after[key] == line, key
    # Conversations resumed at their next turn, with the turn generated on SQLite.
    for key in running & {f"m{i}" for i in range(8)}:
        messages = orjson.loads(after[key])["messages"]
        assert messages[1]["content"] == f"turn0 {key}"

    # And back: PostgreSQL to a new SQLite file gives the same export, byte for byte.
    back = str(tmp_path / "back.db")
    result = cli("db", "copy", "--from", pg, "--to", back)
    assert result.returncode == 0, result.stderr
    export(back, tmp_path / "back.jsonl")
    assert (tmp_path / "back.jsonl").read_bytes() == (tmp_path / "after.jsonl").read_bytes()
    assert query(back, OUTPUTS) == query(pg, OUTPUTS)


def test_copy_refuses_a_source_behind_and_the_same_database(tmp_path: Path) -> None:
    lite = tmp_path / "old.db"
    sqlite3.connect(lite).close()  # a file without the schema
    result = cli("db", "copy", "--from", str(lite), "--to", str(tmp_path / "new.db"))
    # The source is checked as every read-only command checks it, before the target.
    assert result.returncode == 3 and "empty database" in result.stderr
    assert not (tmp_path / "new.db").exists()
    same = cli("db", "copy", "--from", str(lite), "--to", str(lite))
    assert same.returncode == 2 and "same database" in same.stderr
    missing = cli("db", "copy", "--from", str(tmp_path / "nope.db"), "--to", str(lite))
    assert missing.returncode == 3 and f"no database at {tmp_path / 'nope.db'}" in missing.stderr
