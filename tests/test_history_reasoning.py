"""Thinking kept where the model keeps it: earlier turns go back to the server with their
reasoning, in the field the server answered it in, and a dataset may drop it for a server
that refuses it. The simulated server's template renders, requires or refuses the
reasoning of the history; its answers are a function of what it saw, so the oracle
recomputes every exported turn from its exported context, reasoning included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from orchestrator.errors import RunHalted
from orchestrator.items.conversation import targets
from orchestrator.items.params import REASONING_KEYS, request_settings
from orchestrator.sim import answer_matches
from orchestrator.store import Database
from orchestrator.store.datasets import params_hash
from orchestrator.store.schema import item_turns, items, outputs, param_sets
from tests.conftest import StartSim
from tests.helpers import cli, write_jsonl
from tests.test_training_data import config, run_worker, tool_trace


def with_reasoning(row: dict[str, Any]) -> dict[str, Any]:
    """A trace whose original turns carry the reasoning they were made with."""
    messages = [
        {**m, "reasoning_content": f"thought {k}"} if m["role"] == "assistant" else m
        for k, m in enumerate(row["messages"])
    ]
    return {**row, "messages": messages}


def exported(db_url: str, tmp_path: Path, *extra: str) -> dict[str, dict[str, Any]]:
    out = tmp_path / "out.jsonl"
    result = cli("export", str(out), "--db", db_url, *extra)
    assert result.returncode == 0, result.stderr
    return {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}


def enqueue(db_url: str, tmp_path: Path, rows: list[dict[str, Any]], *extra: str) -> None:
    path = write_jsonl(tmp_path / "traces.jsonl", rows)
    result = cli("enqueue", str(path), "--dataset", "traces", "--db", db_url, *extra)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_each_turn_answers_its_context_with_the_reasoning_before_it(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim, field: str
) -> None:
    """A server that thinks in a tool loop and refuses a tool-call turn in the history
    without its reasoning (as Moonshot's API does): no item fails, and every exported
    turn is the server's answer to the conversation before it, reasoning included."""
    rows = [tool_trace(i, "open_box") for i in range(40)]
    enqueue(db_url, tmp_path, rows, "--regenerate", "all")
    url = await sim(
        reasoning="field", reasoning_field=field, history_reasoning="require", tool_call_rate=0.5
    )
    stats = await run_worker(database, config(url))
    assert (stats.completed, stats.failed) == (40, 0)
    lines = exported(db_url, tmp_path)
    deep = 0
    for row in rows:
        messages = lines[row["id"]]["messages"]
        answered = [p for p in targets(messages) if p < len(messages)]
        for position in answered:
            assert answer_matches(messages[:position], messages[position]), (row["id"], position)
        # A later turn asked after a generated tool call, whose reasoning it had to carry.
        calls = [p for p in answered if messages[p].get("tool_calls")]
        deep += any(p > calls[0] for p in answered) if calls else 0
    assert deep > 0
    # Stored as the server said it, so that it went back in the field the server reads.
    async with database.read() as conn:
        stored = (await conn.execute(sa.select(item_turns.c.message))).scalars().all()
        stored += (await conn.execute(sa.select(outputs.c.message))).scalars().all()
    keys = {k for m in map(orjson.loads, stored) for k in REASONING_KEYS if k in m}
    assert keys == {field}


async def halted(database: Database, url: str) -> str:
    """The run's halt: the reason it gives, after checking that no item failed for it."""
    with pytest.raises(RunHalted) as stopped:
        await run_worker(database, config(url))
    async with database.read() as conn:
        states = set((await conn.execute(sa.select(items.c.state))).scalars())
    assert states == {"pending"}
    return str(stopped.value)


async def test_a_dataset_drops_history_reasoning_for_a_server_that_refuses_it(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """Reasoning in the input's history goes out as it is. A server that refuses the
    field halts the run with what to do and no item failed; ``dataset set
    --history-reasoning drop`` asks them again without it, and the outputs name the
    setting they were made with."""
    rows = [with_reasoning(tool_trace(i, "open_box")) for i in range(8)]
    enqueue(db_url, tmp_path, rows, "--max-tokens", "16")
    url = await sim(reasoning="field", history_reasoning="refuse")
    reason = await halted(database, url)
    assert "'reasoning_content' was unexpected" in reason
    assert "--history-reasoning drop" in reason
    changed = cli("dataset", "set", "traces", "--history-reasoning", "drop", "--db", db_url)
    assert changed.returncode == 0, changed.stderr
    assert "history_reasoning" in changed.stdout + changed.stderr
    stats = await run_worker(database, config(url))
    assert (stats.completed, stats.failed) == (8, 0)
    lines = exported(db_url, tmp_path)
    for row in rows:
        history = [{k: v for k, v in m.items() if k not in REASONING_KEYS} for m in row["messages"]]
        assert answer_matches(history, lines[row["id"]]["messages"][-1])
        # The input's own turns are exported as they were, reasoning and all.
        assert lines[row["id"]]["messages"][:-1] == row["messages"]
    dropped = params_hash(request_settings({"max_tokens": 16}, "drop"))
    assert dropped != params_hash({"max_tokens": 16})
    async with database.read() as conn:
        hashes = set((await conn.execute(sa.select(outputs.c.params_hash))).scalars())
        known = dict((await conn.execute(sa.select(param_sets.c.hash, param_sets.c.params))).all())
    assert hashes == {dropped}
    assert orjson.loads(known[dropped]) == {"max_tokens": 16, "history_reasoning": "drop"}


async def test_dropping_reasoning_a_server_requires_halts_with_its_words(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """The other way wrong: ``drop`` against a server that requires the reasoning of a
    tool-call turn. Nothing is answered without the context the model needs; kept,
    the same rows go through."""
    rows = [with_reasoning(tool_trace(i, "open_box")) for i in range(8)]
    enqueue(db_url, tmp_path, rows, "--history-reasoning", "drop")
    url = await sim(reasoning="field", history_reasoning="require")
    reason = await halted(database, url)
    assert "reasoning_content is missing" in reason and "--history-reasoning" in reason
    enqueue(db_url, tmp_path, rows, "--history-reasoning", "keep")
    stats = await run_worker(database, config(url))
    assert (stats.completed, stats.failed) == (8, 0)
    lines = exported(db_url, tmp_path)
    for row in rows:
        assert answer_matches(row["messages"], lines[row["id"]]["messages"][-1])
