"""Prefix-aware routing: a prompt goes to the server holding its prefix unless that one
is much busier; every turn of a conversation lands where the one before it did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.formats import iter_records
from orchestrator.inference import completions
from orchestrator.inference.pool import ServerPool
from orchestrator.inference.routing import PREFIX_BLOCK, prefix_blocks
from orchestrator.store import Database, DatasetSpec, enqueue
from orchestrator.worker.metrics import WorkerMetrics
from tests.conftest import StartSim
from tests.helpers import cli, dialogue, query, write_jsonl
from tests.test_dashboard import report_rows
from tests.test_servers import config, run_worker
from tests.test_worker import sim_stats

pytestmark = pytest.mark.sqlite_only


class _Settings:
    probe_min = 0.1
    probe_max = 1.0
    failure_limit = 3


def _pool(caps: dict[str, int]) -> ServerPool:
    pool = ServerPool(caps, client=None, config=_Settings())  # type: ignore[arg-type]
    for state in pool.states.values():
        state.healthy = True
    return pool


LONG = "x" * (4 * PREFIX_BLOCK)


@given(st.text(max_size=2000), st.text(max_size=2000))
def test_prompts_share_blocks_exactly_as_far_as_they_share_a_prefix(a: str, b: str) -> None:
    ha, hb = prefix_blocks(a), prefix_blocks(b)
    assert len(ha) == len(a) // PREFIX_BLOCK
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared = sum(1 for x, y in zip(ha, hb, strict=False) if x == y)
    assert shared == min(common // PREFIX_BLOCK, len(ha), len(hb))


def test_a_prompt_follows_its_prefix_until_that_server_is_much_busier() -> None:
    pool = _pool({"a": 8, "b": 8})
    first = pool.pick(LONG)
    other = "b" if first == "a" else "a"
    pool.request_started(first)
    # Busier by 1/8 of its cap: the prefix wins over the load.
    assert pool.pick(LONG + " next turn") == first
    for _ in range(4):
        pool.request_started(first)
    # Busier by 5/8: balanced instead, and the prefix is now cached on both.
    assert pool.pick(LONG + " a retry") == other
    assert pool.prefixes.matched(other, prefix_blocks(LONG)) == 4


def test_a_short_or_unknown_prompt_goes_to_the_least_loaded_server() -> None:
    pool = _pool({"a": 4, "b": 4})
    pool.request_started("a")
    assert pool.pick("short") == "b"
    assert pool.pick(None) == "b"
    pool.prefixes.add("a", prefix_blocks(LONG[:PREFIX_BLOCK]))
    # "a" holds one block of four: under the threshold, so the load decides.
    assert pool.pick(LONG) == "b"


def test_a_conversations_next_turn_stays_where_its_last_answer_was_written() -> None:
    """The index knows the prompts sent, not the answers: a turn whose answer was long
    shares under half its blocks with what the index knows of its server. The server
    that answered it holds it all, and kept its slot for it: it takes the turn while it
    has a slot free, however busy the others are not."""
    pool = _pool({"a": 4, "b": 4})
    pool.prefixes.add("b", prefix_blocks(LONG[:PREFIX_BLOCK]))
    for _ in range(3):
        pool.request_started("b")  # "b" busier by 3/4 of its cap
    assert pool.pick(LONG) == "a"  # one block of four known: the load decides
    assert pool.pick(LONG + " after a long answer", previous="b") == "b"
    pool.request_started("b")  # now full
    assert pool.pick(LONG + " after a long answer", previous="b") == "a"


def test_a_prompts_samples_go_where_there_is_room_for_all_of_them() -> None:
    """A request of ``n`` samples takes ``n`` slots: its prompt's holder takes it only
    with room for every one (the second request of a prompt's samples, asked beside the
    first, would otherwise double-book the holder while the other server idles)."""
    pool = _pool({"a": 4, "b": 4})
    first = pool.pick(LONG, width=4)
    pool.request_started(first, 4)
    assert pool.states[first].load == 1.0
    assert pool.pick(LONG, width=4) != first
    pool.request_ended(first, 4)
    assert pool.states[first].in_flight == 0
    roomy = _pool({"a": 4, "b": 4})
    roomy.pick(LONG, width=2)
    roomy.request_started("a", 2)
    assert roomy.pick(LONG, width=2) == "a"  # room for both, and 1/2 busier at most
    roomy.request_started("a", 2)
    assert roomy.pick(LONG, width=1) == "b"


async def test_a_servers_slots_hold_every_sample_it_is_asked_for(
    database: Database, tmp_path: Path, sim: StartSim
) -> None:
    """Eight samples of each prompt on two servers of four slots: two requests of four
    a prompt, the second asked while the first runs. Neither server is ever asked for
    more sequences than its slots, and both work."""
    system = "a long shared instruction " * 60
    rows = [
        {"id": f"p{i}", "messages": dialogue(f"question {i}", system=system + str(i))}
        for i in range(12)
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = DatasetSpec("ds", samples=8)
    await enqueue(database, spec, iter_records(path), path=str(path))
    a = await sim(latency=0.05)
    b = await sim(latency=0.05)
    assert (await run_worker(database, config((a, b), concurrency=4))).completed == 96
    seen = [await sim_stats(url) for url in (a, b)]
    assert [s["peak_sequences"] for s in seen] == [4, 4], seen
    assert all(s["completed"] for s in seen)


def test_a_server_that_went_down_holds_no_prefix() -> None:
    pool = _pool({"a": 4, "b": 4})
    pool.prefixes.add("a", prefix_blocks(LONG))
    pool.prefixes.forget("a")
    assert pool.prefixes.matched("a", prefix_blocks(LONG)) == 0


def test_cached_tokens_are_read_from_each_server_kind() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 2}
    sglang = {**usage, "prompt_tokens_details": {"cached_tokens": 7}}
    assert completions.with_cached(sglang, None)["cached_tokens"] == 7
    assert completions.with_cached(usage, {"cache_n": 5, "prompt_n": 5})["cached_tokens"] == 5
    assert "cached_tokens" not in completions.with_cached(usage, None)
    assert completions.with_cached(None, {"cache_n": 5}) is None


def _sample(exposition: str, name: str) -> float:
    line = next(x for x in exposition.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def _conversations(n: int) -> list[dict[str, Any]]:
    turns = [f"conversation {i} " + "words " * 120 for i in range(n)]
    return [
        {"id": f"c{i}", "messages": dialogue(t, "a", "go on", "b", "and then", "c", "end", "d")}
        for i, t in enumerate(turns)
    ]


async def test_every_turn_of_a_conversation_goes_to_the_same_server(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", _conversations(24))
    await enqueue(
        database,
        DatasetSpec("ds", regenerate="all"),
        iter_records(path, regenerate="all"),
        path=str(path),
    )
    a = await sim(latency=0.01)
    b = await sim(latency=0.01)
    # Two slots each: when a turn is picked its own slot is free (kept while the turn
    # before it was written), so its server is at most 1/2 busier than the other, within
    # BALANCE_THRESHOLD: every turn must stay.
    stats = await run_worker(database, config((a, b), concurrency=2))
    assert stats.completed == 24
    rows = query(
        db_url, "SELECT i.key, t.server FROM item_turns AS t JOIN items AS i ON i.id = t.item_id"
    )
    servers: dict[str, set[str]] = {}
    for key, server in rows:
        servers.setdefault(key, set()).add(server)
    assert len(servers) == 24
    assert all(len(s) == 1 for s in servers.values()), servers
    # Both servers were used: affinity did not pile everything on one.
    assert (await sim_stats(a))["completed"] and (await sim_stats(b))["completed"]


async def test_status_shows_the_share_the_prefix_caches_served(
    database: Database, db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", _conversations(12))
    spec = DatasetSpec("ds", regenerate="all")
    await enqueue(database, spec, iter_records(path, regenerate="all"), path=str(path))
    a = await sim(latency=0.01, prefix_cache=100_000)
    b = await sim(latency=0.01, prefix_cache=100_000)
    metrics = WorkerMetrics()
    assert (await run_worker(database, config((a, b)), metrics)).completed == 12
    # Each stored answer is a conversation's last turn: every word of its prompt but the
    # final question was the previous turn's, cached where that turn went (16-word blocks).
    rows = query(db_url, "SELECT prompt_tokens, cached_tokens FROM outputs")
    assert len(rows) == 12
    assert all(cached >= prompt - 20 for prompt, cached in rows), rows
    exposed = metrics.exposition().decode()
    cached_turns = _sample(exposed, 'orchestrator_tokens_total{dataset="ds",kind="cached"}')
    assert cached_turns >= sum(c for _, c in rows)  # every turn's, the last ones' included
    shown = json.loads(cli("status", "--json", "--db", db_url).stdout)
    cache = shown["totals"]["prompt_tokens"]
    assert cache["total"] == sum(p for p, _ in rows)
    assert cache["cached"] == sum(c for _, c in rows)
    assert cache["cached_share"] == round(cache["cached"] / cache["total"], 4)
    text = cli("status", "--db", db_url).stdout
    assert f"{100 * cache['cached_share']:.1f}% of those counted" in text
    # The report (the dashboard's page with its data in it) shows the same share.
    rows = await report_rows(tmp_path / "report.html", db_url)
    share = shown["datasets"][0]["prompt_tokens"]["cached_share"]
    assert rows["ds"]["cached"] == f"{100 * share:.1f}%"
