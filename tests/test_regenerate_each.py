"""``regenerate = "each"``: every assistant turn of a conversation asked against the
original history before it, an item per turn, exported as a row per turn; compared with
``all`` on simulated agentic traces, whose regenerated calls rarely match the recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

import orchestrator as orc
from orchestrator.items.conversation import targets
from orchestrator.items.params import without_reasoning
from orchestrator.sim import answer_matches
from orchestrator.sim.traces import swe_traces
from orchestrator.store import Database, Queue
from orchestrator.store.schema import items
from tests.conftest import StartSim
from tests.helpers import cli, planned, query, write_jsonl
from tests.test_servers import config as server_config
from tests.test_training_data import config, run_worker


def exported(db_url: str, path: Path, *extra: str) -> list[dict[str, Any]]:
    result = cli("export", str(path), "--db", db_url, *extra)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def enqueued(path: Path, db_url: str, name: str, mode: str, *extra: str) -> str:
    result = cli("enqueue", str(path), "-d", name, "--regenerate", mode, "--db", db_url, *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_each_asks_every_turn_against_the_original_history(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """Every assistant turn of every trace is a row, none stopped or flagged, each the
    server's answer to exactly its original history; ``all`` on the same traces stops
    at the first call that differs, and keeps far fewer usable turns."""
    traces = swe_traces(40, seed=3)
    path = write_jsonl(tmp_path / "traces.jsonl", traces)
    turns = sum(len(targets(t["messages"])) for t in traces)
    assert "an item per assistant turn" in enqueued(path, db_url, "each", "each")
    url = await sim(tool_call_rate=0.5)
    assert (await run_worker(database, config(url))).completed == turns
    rows = exported(db_url, tmp_path / "each.jsonl", "--dataset", "each", "--provenance")
    assert len(rows) == turns
    by_key = {row["id"]: row for row in rows}
    for trace in traces:
        messages = trace["messages"]
        for k, position in enumerate(targets(messages)):
            # The system prompt and user task come first: turn k is assistant message k.
            row = by_key[f"{trace['id']}#turn{k}"]
            assert row["flags"] == []
            assert row["messages"][:-1] == messages[:position]
            assert answer_matches(messages[:position], row["messages"][-1])
            assert row["tools"] == trace["tools"]
    # --per-turn rows of such a dataset are its rows, each one turn already, with the
    # keys a whole conversation's per-turn rows have.
    per_turn = exported(db_url, tmp_path / "per_turn.jsonl", "--dataset", "each", "--per-turn")
    assert [row["id"] for row in per_turn] == [row["id"] for row in rows]
    named = [(r["source_id"], r["source_row_index"], r["assistant_turn_index"]) for r in per_turn]
    expected = [
        (trace["id"], index, k)
        for index, trace in enumerate(traces)
        for k in range(len(targets(trace["messages"])))
    ]
    assert named == expected
    assert all(r["messages"] == by_key[r["id"]]["messages"] for r in per_turn)

    # The same traces regenerated in order: a call that differs ends a trace, flagged.
    enqueued(path, db_url, "all", "all")
    assert (await run_worker(database, config(url))).completed == len(traces)
    kept = exported(
        db_url,
        tmp_path / "all.jsonl",
        "--dataset",
        "all",
        "--exclude-flag",
        "tool_mismatch",
        "--per-turn",
    )
    assert len(kept) < turns // 4, (len(kept), turns)


async def test_a_file_enqueued_again_adds_nothing_and_plan_counts_every_turn(
    database: Database, db_url: str, tmp_path: Path
) -> None:
    traces = swe_traces(5)
    path = write_jsonl(tmp_path / "traces.jsonl", traces)
    turns = sum(len(targets(t["messages"])) for t in traces)
    enqueued(path, db_url, "each", "each")
    again = enqueued(path, db_url, "each", "each")
    assert f"nothing new: all {turns} items" in again
    async with database.read() as conn:
        count = (await conn.execute(sa.select(sa.func.count()).select_from(items))).scalar()
        positions = (await conn.execute(sa.select(items.c.position))).scalars().all()
    assert count == turns
    assert sorted(positions) == list(range(1, turns + 1))  # a place of its own each

    folder = tmp_path / "plan"
    folder.mkdir()
    write_jsonl(folder / "traces.jsonl", traces)
    modes = "".join(
        f'[[dataset]]\nname = "{mode}"\nfile = "traces.jsonl"\nregenerate = "{mode}"\n\n'
        for mode in ("last", "all", "each")
    )
    plans = {d["name"]: d for d in planned(folder, modes)}
    assert plans["last"]["requests"] == len(traces)
    assert plans["all"]["requests"] == plans["each"]["requests"] == turns
    assert plans["each"]["rows"] == len(traces)
    # The run file enqueues what it plans: a row per item, an item per turn.
    db = str(folder / "run.db")
    result = cli("enqueue", "--config", str(folder / "run.toml"), "--db", db)
    assert result.returncode == 0, result.stderr
    counted = dict(
        query(
            db,
            "SELECT d.name, count(*) FROM items AS i JOIN datasets AS d ON d.id = i.dataset_id"
            " GROUP BY d.name",
        )
    )
    assert counted == {"last": len(traces), "all": len(traces), "each": turns}


async def test_rows_without_a_turn_to_ask_and_rows_ending_on_a_user_turn(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """A row with no user message has no turn to regenerate: refused, named by its line.
    A conversation ending on a user turn has that answer generated too."""
    open_ended = {
        "id": "open",
        "messages": [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"},
        ],
    }
    lone = {"id": "lone", "messages": [{"role": "user", "content": "only a question"}]}
    no_user = {
        "id": "nouser",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "hello"},
        ],
    }
    path = write_jsonl(tmp_path / "rows.jsonl", [open_ended, no_user, lone])
    refused = cli("enqueue", str(path), "-d", "e", "--regenerate", "each", "--db", db_url)
    assert refused.returncode != 0
    assert "rows.jsonl:2: no user message" in refused.stderr
    enqueued(path, db_url, "e", "each", "--skip-invalid")
    url = await sim()
    assert (await run_worker(database, config(url))).completed == 3
    rows = {row["id"]: row for row in exported(db_url, tmp_path / "out.jsonl")}
    assert set(rows) == {"open#turn0", "open#turn1", "lone#turn0"}
    asked = open_ended["messages"]
    assert rows["open#turn0"]["messages"][:-1] == asked[:1]
    assert rows["open#turn1"]["messages"][:-1] == asked
    assert answer_matches(asked, rows["open#turn1"]["messages"][-1])
    assert answer_matches(lone["messages"], rows["lone#turn0"]["messages"][-1])


async def test_the_python_api_enqueues_an_item_per_turn(database: Database, db_url: str) -> None:
    """``Queue.enqueue(regenerate="each")``: an item per turn, each one turn long; a
    duplicate id names the rows, not the items."""
    traces = swe_traces(3)
    turns = sum(len(targets(t["messages"])) for t in traces)
    async with orc.open(db_url) as q:
        report = await q.enqueue(traces, dataset="api", regenerate="each", max_tokens=64)
        assert (report.added, report.turns, report.mode) == (turns, turns, "each")
        twice = await q.enqueue(
            [traces[0], traces[1], traces[0]], dataset="dup", regenerate="each", skip_invalid=True
        )
    assert twice.added == len(targets(traces[0]["messages"])) + len(targets(traces[1]["messages"]))
    assert twice.invalid
    assert all(e.line == 3 and "(first on line 1)" in str(e) for e in twice.invalid), [
        str(e) for e in twice.invalid
    ]
    leases = await Queue(database).claim("w", 2 * turns, lease_seconds=60)
    assert len(leases) == turns + twice.added
    assert all(lease.turns == 1 for lease in leases)


@pytest.mark.sqlite_only
async def test_the_turns_of_a_conversation_share_a_server_and_its_cache(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """Independent items, one prefix: a conversation's turns are claimed together, its
    longest first, and prefix routing sends the rest where that one went, whose cache
    serves them again."""
    traces = swe_traces(16)
    for trace in traces:
        trace["messages"][1]["content"] += f" Logs of {trace['id']}." * 60  # a long task
    path = write_jsonl(tmp_path / "traces.jsonl", traces)
    enqueued(path, db_url, "each", "each")
    positions = query(db_url, "SELECT key, position FROM items ORDER BY id")
    first = [key for key, _ in sorted(positions, key=lambda row: row[1])][:2]
    assert first == ["swe0000#turn6", "swe0000#turn5"]  # the last turn claimed first
    a = await sim(latency=0.01, prefix_cache=100_000)
    b = await sim(latency=0.01, prefix_cache=100_000)
    turns = sum(len(targets(t["messages"])) for t in traces)
    cfg = server_config((a, b), concurrency=32)
    assert (await run_worker(database, cfg)).completed == turns
    rows = query(
        db_url,
        "SELECT i.key, o.server, o.prompt_tokens, o.cached_tokens"
        " FROM outputs AS o JOIN items AS i ON i.id = o.item_id",
    )
    servers: dict[str, set[str]] = {}
    for key, server, _, _ in rows:
        servers.setdefault(key.split("#")[0], set()).add(server)
    together = sum(len(s) == 1 for s in servers.values())
    assert together >= 12, servers
    assert len(set.union(*servers.values())) == 2  # not all piled on one server
    assert sum(r[3] for r in rows) >= 0.5 * sum(r[2] for r in rows)


async def test_the_original_turns_go_with_their_reasoning_unless_the_dataset_drops_it(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """The history is sent as recorded, reasoning included, for a model that thinks in
    a tool loop; ``--history-reasoning drop`` sends it without."""
    traces = swe_traces(6)
    for trace in traces:
        for k, message in enumerate(trace["messages"]):
            if message["role"] == "assistant":
                message["reasoning_content"] = f"recorded thought {k}"
    path = write_jsonl(tmp_path / "traces.jsonl", traces)
    enqueued(path, db_url, "keep", "each")
    enqueued(path, db_url, "drop", "each", "--history-reasoning", "drop")
    url = await sim(reasoning="field", history_reasoning="render")
    turns = sum(len(targets(t["messages"])) for t in traces)
    assert (await run_worker(database, config(url))).completed == 2 * turns
    for name in ("keep", "drop"):
        rows = exported(db_url, tmp_path / f"{name}.jsonl", "--dataset", name)
        assert len(rows) == turns
        deep = 0
        for row in rows:
            history, answer = row["messages"][:-1], row["messages"][-1]
            sent = without_reasoning(history) if name == "drop" else history
            assert answer_matches(sent, answer), (name, row["id"])
            if sent != history:
                deep += 1
                assert not answer_matches(history, answer)
        assert deep == (turns - len(traces) if name == "drop" else 0)
