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

from orchestrator.formats import iter_records
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.items.conversation import turn_messages
from orchestrator.items.quality import ALL_FLAGS
from orchestrator.sim import answer_matches
from orchestrator.store import (
    Database,
    DatasetSpec,
    Failure,
    Output,
    Queue,
    enqueue,
    open_database,
)
from orchestrator.store.datasets import params_hash
from orchestrator.store.requeue import Selection, requeue
from orchestrator.store.rounds import Round
from orchestrator.store.schema import item_turns, items, outputs, param_sets
from orchestrator.worker import Worker, WorkerConfig, WorkerStats
from tests.conftest import StartSim
from tests.helpers import cli, prompts, write_jsonl
from tests.test_worker import config as worker_config

TRUNCATED = ALL_FLAGS["truncated"]


def config(url: str, **overrides: Any) -> WorkerConfig:
    """The worker tests' settings, with quicker retries, a third attempt and the default
    probe ceiling."""
    quick = {"backoff_base": 0.01, "backoff_cap": 0.05, "probe_max": 5.0, "max_attempts": 3}
    return worker_config(url, **{"concurrency": 8, **quick, **overrides})


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
    done = Selection(state="done", flags=TRUNCATED)
    assert await requeue(database, done, max_tokens=200) == len(truncated)
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
        assert await requeue(database, Selection()) == len(failed)
        assert (await run_worker(database, config(await sim()))).completed == len(failed)
        after = await generated_turns(database)
        assert all(len(turns) == 3 for turns in after.values()) and len(after) == 20
        for key, _, turn in failed:
            assert after[key][:turn] == kept.get(key, [])
    finally:
        await database.close()


async def test_regenerate_all_asks_a_single_turn_without_its_answer(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """A conversation with one assistant turn, in a dataset that regenerates every turn,
    is asked with what comes before that turn: never with the original answer."""
    single = {
        "id": "c3",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "u0"},
            {"role": "assistant", "content": "a0"},
        ],
    }
    rows = [single, *(conversation(i, 2) for i in range(4))]
    path = write_jsonl(tmp_path / "mt.jsonl", rows)
    result = cli("enqueue", str(path), "--dataset", "mt", "--regenerate", "all", "--db", db_url)
    assert result.returncode == 0, result.stderr
    stats = await run_worker(database, config(await sim()))
    assert stats.completed == 5
    async with database.read() as conn:
        answer = (
            await conn.execute(
                sa.select(outputs.c.message)
                .join(items, items.c.id == outputs.c.item_id)
                .where(items.c.key == "c3")
            )
        ).scalar_one()
    assert answer_matches(single["messages"][:2], orjson.loads(answer))
    assert not answer_matches(single["messages"], orjson.loads(answer))
    exported = tmp_path / "out.jsonl"
    assert cli("export", str(exported), "--db", db_url).returncode == 0
    line = orjson.loads(exported.read_bytes().splitlines()[0])
    assert line["messages"] == [*single["messages"][:2], orjson.loads(answer)]


def tool_trace(i: int, first: str) -> dict[str, Any]:
    """A trace whose first turn calls ``first``, then reads its result and answers."""
    call_id = f"orig_{i}"
    return {
        "id": f"t{i:03d}",
        "messages": [
            {"role": "user", "content": f"trace {i}: what is in the box?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": first, "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "a cat"},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
            for name in ("open_box", "weigh_box")
        ],
    }


async def test_tool_results_follow_regenerated_calls_or_the_trace_stops_flagged(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """The simulated server calls the first tool offered (``open_box``) or answers in
    words. A trace whose original first turn called it too lines up when the server calls
    it again; any other first turn ends the trace there, flagged ``tool_mismatch``."""
    rows = [tool_trace(i, "open_box" if i % 2 else "weigh_box") for i in range(30)]
    path = write_jsonl(tmp_path / "tools.jsonl", rows)
    result = cli("enqueue", str(path), "--dataset", "tools", "--regenerate", "all", "--db", db_url)
    assert result.returncode == 0, result.stderr
    url = await sim(tool_call_rate=0.5)
    assert (await run_worker(database, config(url))).completed == 30
    out = tmp_path / "out.jsonl"
    assert cli("export", str(out), "--db", db_url, "--provenance").returncode == 0
    lines = {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}
    stopped = {key for key, line in lines.items() if "tool_mismatch" in line["flags"]}
    renamed = 0
    for row in rows:
        line = lines[row["id"]]
        first = line["messages"][1]
        made = [c["function"]["name"] for c in first.get("tool_calls") or []]
        asked = row["messages"][:1]
        assert answer_matches(asked, first)
        if made == [row["messages"][1]["tool_calls"][0]["function"]["name"]]:
            # The same call, made again: the original result answers it, under its id.
            result_message = line["messages"][2]
            assert result_message == {
                **row["messages"][2],
                "tool_call_id": first["tool_calls"][0]["id"],
            }
            assert result_message["tool_call_id"] != "orig_" + row["id"][1:].lstrip("0")
            assert answer_matches(
                [asked[0], first_context(first), result_message], line["messages"][3]
            )
            renamed += 1
            # Its second turn, an answer in words, stops the trace if it made a call.
            called_again = bool(line["messages"][3].get("tool_calls"))
            assert (row["id"] in stopped) == called_again
            assert len(line["messages"]) == (4 if called_again else 6)
        else:
            # Another way: the trace ends with that turn, and is flagged.
            assert row["id"] in stopped
            assert line["messages"] == [row["messages"][0], first]
    assert renamed > 0 and len(stopped) > 0
    # status counts them; export leaves them out on request; requeue picks them by flag.
    status = orjson.loads(cli("status", "--json", "--db", db_url).stdout)
    assert status["datasets"][0]["flags"]["tool_mismatch"] == len(stopped)
    kept = tmp_path / "kept.jsonl"
    excluded = cli("export", str(kept), "--db", db_url, "--exclude-flag", "tool_mismatch")
    assert excluded.returncode == 0, excluded.stderr
    assert len(kept.read_bytes().splitlines()) == 30 - len(stopped)
    requeued = cli("requeue", "--flag", "tool_mismatch", "--db", db_url)
    assert requeued.returncode == 0, requeued.stderr
    async with database.read() as conn:
        pending = (
            await conn.execute(sa.select(items.c.key).where(items.c.state == "pending"))
        ).scalars()
        assert set(pending) == stopped
        turns_left = (
            await conn.execute(sa.select(sa.func.count()).select_from(item_turns))
        ).scalar()
    assert turns_left == 3 * (30 - len(stopped))  # a whole trace has three turns


def first_context(message: dict[str, Any]) -> dict[str, Any]:
    """A generated turn as it is sent back: role, content, calls and reasoning."""
    keys = ("role", "content", "tool_calls", "reasoning_content", "reasoning")
    return {k: message[k] for k in keys if k in message}


async def test_a_conversation_resumed_past_a_turn_that_went_another_way_fails(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """A conversation stored part-way with a first turn whose calls do not line up (as
    an older version advanced it) is not asked its next turn: the original tool result
    would answer a call never made. It fails with the reason, for requeue to redo."""
    path = write_jsonl(tmp_path / "tools.jsonl", [tool_trace(0, "open_box")])
    result = cli("enqueue", str(path), "--dataset", "tools", "--regenerate", "all", "--db", db_url)
    assert result.returncode == 0, result.stderr
    queue = Queue(database)
    [lease] = await queue.claim("old-worker", 1, lease_seconds=60)
    words = {"role": "assistant", "content": "no tools for me"}
    turn = Output(words, words["content"], None, "stop", None, 0.1, None, None, None)
    await queue.write_round(Round(advance=[(lease, turn)]))
    await queue.release([(lease, Failure("shutdown", "stopped"), 0.0)])
    stats = await run_worker(database, config(await sim()))
    assert stats.failed == 1
    async with database.read() as conn:
        state, error_class, error = (
            await conn.execute(sa.select(items.c.state, items.c.error_class, items.c.last_error))
        ).one()
    assert (state, error_class) == ("failed", "conversation")
    assert error.startswith("turn 2 of 3: turn 0's tool calls [] do not line up"), error
