"""Training-data fidelity in the worker: truncation policies, quality flags, parameter
provenance, requeue by flag, and multi-turn regeneration turn by turn."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import sqlalchemy as sa

from orchestrator.client import ClientConfig, InferenceClient
from orchestrator.conversation import turn_messages
from orchestrator.formats import iter_records
from orchestrator.quality import ALL_FLAGS
from orchestrator.sim import answer_matches
from orchestrator.store import Database, DatasetSpec, Queue, enqueue, open_database
from orchestrator.store.datasets import params_hash
from orchestrator.store.schema import item_turns, items, outputs, param_sets
from orchestrator.worker import Worker, WorkerConfig, WorkerStats
from tests.conftest import StartSim
from tests.helpers import cli, prompts, write_jsonl

TRUNCATED = ALL_FLAGS["truncated"]


def config(url: str, **overrides: Any) -> WorkerConfig:
    base: dict[str, Any] = {
        "servers": (url,),
        "concurrency": 8,
        "exit_when_done": True,
        "backoff_base": 0.01,
        "backoff_cap": 0.05,
        "poll_interval": 0.05,
        "probe_min": 0.05,
        "max_attempts": 3,
    }
    base.update(overrides)
    return WorkerConfig(**base)


async def run_worker(database: Database, cfg: WorkerConfig) -> WorkerStats:
    async with InferenceClient(ClientConfig(request_timeout=5)) as client:
        return await asyncio.wait_for(Worker(database, client, cfg).run(), 60)


async def load(database: Database, tmp_path: Path, n: int, spec: DatasetSpec) -> None:
    path = write_jsonl(tmp_path / f"{spec.name}.jsonl", prompts(n, prefix=spec.name))
    await enqueue(database, spec, iter_records(path), path=str(path))


async def rows(database: Database, *columns: sa.ColumnElement[Any]) -> list[Any]:
    async with database.read() as conn:
        return list((await conn.execute(sa.select(*columns))).all())


async def test_truncation_policies(database: Database, tmp_path: Path, sim: StartSim) -> None:
    # Answers of 30 to 90 words against a limit of 10: every answer is cut.
    url = await sim(mean_tokens=60)
    for policy in ("keep", "retry", "fail"):
        await load(
            database, tmp_path, 4, DatasetSpec(policy, {"max_tokens": 10}, on_truncated=policy)
        )
    stats = await run_worker(database, config(url))
    assert stats.completed == 4 and stats.failed == 8
    state = await rows(database, items.c.key, items.c.state, items.c.error_class, items.c.attempts)
    by_dataset: dict[str, set[tuple[str, str | None, int]]] = {}
    for key, st, error, attempts in state:
        by_dataset.setdefault(key.rstrip("0123456789"), set()).add((st, error, attempts))
    assert by_dataset["keep"] == {("done", None, 1)}
    assert by_dataset["retry"] == {("failed", "truncated", 3)}  # retried, then given up
    assert by_dataset["fail"] == {("failed", "truncated", 1)}  # at once
    flags = [f for (f,) in await rows(database, outputs.c.flags)]
    assert flags == [TRUNCATED] * 4
    async with database.read() as conn:
        errors = (
            await conn.execute(sa.select(items.c.last_error).where(items.c.key.like("fail%")))
        ).scalars()
        assert all("cut at max_tokens=10" in e for e in errors)


async def test_outputs_record_their_parameters_and_update_reaches_workers(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    url = await sim()
    old = {"max_tokens": 64, "temperature": 0.6}
    await load(database, tmp_path, 5, DatasetSpec("ds", old))
    assert (await run_worker(database, config(url))).completed == 5
    # New lines under new parameters: refused without --update, taken with it.
    path = write_jsonl(tmp_path / "more.jsonl", prompts(10, prefix="ds"))
    new = {"max_tokens": 64, "temperature": 1.0}
    try:
        await enqueue(database, DatasetSpec("ds", new), iter_records(path), path=str(path))
    except Exception as exc:
        assert "--update" in str(exc)
    else:
        raise AssertionError("changed parameters were accepted without --update")
    await enqueue(database, DatasetSpec("ds", new), iter_records(path), path=str(path), update=True)
    assert (await run_worker(database, config(url))).completed == 5
    hashes = sorted(h for (h,) in await rows(database, outputs.c.params_hash))
    assert hashes.count(params_hash(old)) == 5 and hashes.count(params_hash(new)) == 5
    stored = dict(await rows(database, param_sets.c.hash, param_sets.c.params))
    assert orjson.loads(stored[params_hash(new)]) == new


async def test_requeue_truncated_with_more_room(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    url = await sim(mean_tokens=40)
    await load(database, tmp_path, 6, DatasetSpec("ds", {"max_tokens": 25}))
    await run_worker(database, config(url))
    truncated = [f for (f,) in await rows(database, outputs.c.flags) if f & TRUNCATED]
    assert 0 < len(truncated) < 6  # answers of 20 to 60 words against 25
    queue = Queue(database)
    assert await queue.requeue(state="done", flags=TRUNCATED, max_tokens=200) == len(truncated)
    assert len(await rows(database, outputs.c.item_id)) == 6 - len(truncated)
    assert (await run_worker(database, config(url))).completed == len(truncated)
    assert [f for (f,) in await rows(database, outputs.c.flags) if f & TRUNCATED] == []
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/stats") as resp:
        assert (await resp.json())["completed"] == 6 + len(truncated)


def conversation(i: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "answer briefly"}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {i} question {t}"})
        messages.append({"role": "assistant", "content": f"original answer {t}"})
    return {"id": f"c{i:03d}", "messages": messages}


async def generated_turns(database: Database) -> dict[str, list[dict[str, Any]]]:
    async with database.read() as conn:
        result = await conn.execute(
            sa.select(items.c.key, item_turns.c.turn, item_turns.c.message)
            .select_from(item_turns.join(items, items.c.id == item_turns.c.item_id))
            .order_by(items.c.key, item_turns.c.turn)
        )
        found: dict[str, list[dict[str, Any]]] = {}
        for key, turn, message in result:
            assert turn == len(found.setdefault(key, []))
            found[key].append(orjson.loads(message))
        return found


async def test_regenerate_all_goes_turn_by_turn_and_resumes(
    db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    rows = [conversation(i, 3) for i in range(12)]
    path = write_jsonl(tmp_path / "multi.jsonl", rows)
    result = cli("enqueue", str(path), "-d", "multi", "--regenerate", "all", "--db", str(db_path))
    assert result.returncode == 0, result.stderr
    url = await sim(latency=0.05)
    database = await open_database(str(db_path))
    try:
        # Stop part-way: conversations are left between turns, their turns kept.
        async with InferenceClient(ClientConfig(request_timeout=5)) as client:
            worker = Worker(database, client, config(url, concurrency=4))
            task = asyncio.create_task(worker.run())
            while worker.stats.turns < 6:  # noqa: ASYNC110 (polling a counter)
                await asyncio.sleep(0.01)
            worker.request_stop(force=True)
            first = await asyncio.wait_for(task, 30)
        assert first.completed < 12
        partial = await generated_turns(database)
        assert any(0 < len(turns) < 3 for turns in partial.values())
        # A second worker picks every conversation up at its next turn.
        second = await run_worker(database, config(url))
        assert first.completed + second.completed == 12
        done = await generated_turns(database)
        assert sorted(done) == [row["id"] for row in rows]
        async with aiohttp.ClientSession() as s, s.get(url + "/sim/stats") as resp:
            served = (await resp.json())["completed"]
        # No turn was generated twice, beyond those cut short by the forced stop.
        assert 36 <= served <= 36 + 4
        for row in rows:
            turns = done[row["id"]]
            assert len(turns) == 3 and all(t["role"] == "assistant" for t in turns)
            for k, message in enumerate(turns):
                # Turn k answered the conversation with the turns generated before it.
                asked = turn_messages(row["messages"], k, turns[:k])
                assert answer_matches(asked, message), (row["id"], k)
        # The output is the last turn, and its token count covers every turn.
        async with database.read() as conn:
            outputs_rows = (
                await conn.execute(
                    sa.select(
                        items.c.key,
                        outputs.c.message,
                        outputs.c.completion_tokens,
                        outputs.c.latency,
                    ).join(items, items.c.id == outputs.c.item_id)
                )
            ).all()
            spent = (
                await conn.execute(
                    sa.select(items.c.key, item_turns.c.usage, item_turns.c.latency).join(
                        items, items.c.id == item_turns.c.item_id
                    )
                )
            ).all()
        assert len(outputs_rows) == 12
        per_key: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for key, usage, latency in spent:
            per_key[key] = per_key.get(key, 0) + orjson.loads(usage)["completion_tokens"]
            seconds[key] = seconds.get(key, 0.0) + latency
        for key, message, tokens, latency in outputs_rows:
            assert orjson.loads(message) == done[key][-1]
            assert tokens == per_key[key]
            # ... and so does its latency: what the ETA counts an item's cost by.
            assert latency == pytest.approx(seconds[key]) and latency > 0
    finally:
        await database.close()


async def test_a_failed_turn_fails_the_conversation_and_requeue_resumes_it(
    db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    path = write_jsonl(tmp_path / "multi.jsonl", [conversation(i, 3) for i in range(20)])
    enqueued = cli("enqueue", str(path), "-d", "m", "--regenerate", "all", "--db", str(db_path))
    assert enqueued.returncode == 0, enqueued.stderr
    database = await open_database(str(db_path))
    try:
        # Four requests in ten are refused (400, not worth retrying): conversations fail
        # at whichever turn drew the refusal, with that turn named.
        stats = await run_worker(database, config(await sim(faults={"400": 0.4})))
        async with database.read() as conn:
            failed = (
                await conn.execute(
                    sa.select(items.c.key, items.c.last_error, items.c.turn).where(
                        items.c.state == "failed"
                    )
                )
            ).all()
        assert len(failed) == stats.failed > 0
        kept = await generated_turns(database)
        for key, error, turn in failed:
            assert error.startswith(f"turn {turn + 1} of 3: HTTP 400"), error
            assert len(kept.get(key, [])) == turn
        assert any(turn > 0 for _, _, turn in failed)
        # Requeued, they resume at the failed turn: the turns before it are kept as they were.
        assert await Queue(database).requeue() == len(failed)
        assert (await run_worker(database, config(await sim()))).completed == len(failed)
        after = await generated_turns(database)
        assert all(len(turns) == 3 for turns in after.values()) and len(after) == 20
        for key, _, turn in failed:
            assert after[key][:turn] == kept.get(key, [])
    finally:
        await database.close()
