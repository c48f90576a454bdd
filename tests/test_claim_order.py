"""The claim order: the longest predicted answers first, across the datasets of one
priority; priorities and per-dataset caps still hold (through the commands:
tests/test_longest_first_run.py).

On SQLite and PostgreSQL (``[sqlite]``, ``[postgresql]``), and on SQLite both with the
worker's plain SQL and with SQLAlchemy's statements, as tests/test_queue.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.formats import iter_records
from orchestrator.items.answer_length import Expected
from orchestrator.store import Database, DatasetSpec, Queue, enqueue, list_datasets
from orchestrator.store.leases import Claim
from orchestrator.store.rounds import Round
from tests.helpers import write_jsonl
from tests.test_queue import statements  # noqa: F401 - both ways of running statements

USER = {"role": "user", "content": "question"}


def held(key: str, tokens: int) -> dict[str, Any]:
    """A line that holds an answer of ``tokens`` predicted tokens (4 bytes each)."""
    answer = {"role": "assistant", "content": "abc " * tokens}
    return {"id": key, "messages": [{**USER, "content": f"question {key}"}, answer]}


def prompt(key: str) -> dict[str, Any]:
    return {"id": key, "messages": [{**USER, "content": f"question {key}"}]}


async def load(
    database: Database, tmp_path: Path, name: str, lines: list[dict[str, Any]], **spec: Any
) -> int:
    path = write_jsonl(tmp_path / f"{name}.jsonl", lines)
    await enqueue(database, DatasetSpec(name, **spec), iter_records(path), path=str(path))
    return {d.name: d.id for d in await list_datasets(database)}[name]


async def claim(database: Database, want: int, **options: Any) -> list[str]:
    result = await Queue(database).write_round(Round(claim=Claim("w", want, 60.0, **options)))
    return [lease.key for lease in result.leases]


async def test_a_dataset_is_claimed_longest_predicted_answer_first(
    database: Database, tmp_path: Path
) -> None:
    lengths = {"a": 5, "b": 50, "c": 20, "d": 80, "e": 1}
    await load(database, tmp_path, "ds", [*(held(k, n) for k, n in lengths.items()), prompt("f")])
    assert await claim(database, 3) == ["d", "b", "c"]
    # Lines without an answer of their own rank last, in input order.
    assert await claim(database, 5) == ["a", "e", "f"]


async def test_lines_without_answers_keep_their_input_order(
    database: Database, tmp_path: Path
) -> None:
    await load(database, tmp_path, "ds", [prompt(f"p{i}") for i in range(6)])
    assert await claim(database, 4) == ["p0", "p1", "p2", "p3"]


async def test_the_datasets_of_one_priority_are_claimed_longest_first_across_them(
    database: Database, tmp_path: Path
) -> None:
    a = await load(database, tmp_path, "a", [held(f"a{n}", n) for n in (10, 40, 70)])
    b = await load(database, tmp_path, "b", [held(f"b{n}", n) for n in (20, 50, 60)])
    assert await claim(database, 4) == ["a70", "b60", "b50", "a40"]
    # Measured, "b"'s answers run twice as long as its lines' answers: it ranks first.
    lengths = {a: Expected(scale=1.0), b: Expected(scale=2.0)}
    assert await claim(database, 2, lengths=lengths) == ["b20", "a10"]


async def test_items_without_a_prediction_rank_at_their_datasets_expected_length(
    database: Database, tmp_path: Path
) -> None:
    a = await load(database, tmp_path, "a", [held(f"a{n}", n) for n in (10, 40, 70)])
    b = await load(database, tmp_path, "b", [prompt(f"b{i}") for i in range(3)])
    lengths = {a: Expected(), b: Expected(unknown=50.0)}
    assert await claim(database, 3, lengths=lengths) == ["a70", "b0", "b1"]
    # max_tokens caps a prediction's rank.
    lengths = {a: Expected(max_tokens=30), b: Expected(unknown=50.0)}
    assert await claim(database, 2, lengths=lengths) == ["b2", "a40"]


async def test_priority_and_caps_still_hold(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, "low", [held(f"low{n}", n) for n in (900, 800, 700)])
    await load(database, tmp_path, "high", [held(f"high{n}", n) for n in (1, 2, 3)], priority=1)
    await load(
        database,
        tmp_path,
        "capped",
        [held(f"cap{n}", n) for n in (5000, 4000, 3000)],
        concurrency=1,
    )
    # "high" first, whatever its lengths; then the longest of the rest, "capped" at one.
    assert await claim(database, 6) == ["high3", "high2", "high1", "cap5000", "low900", "low800"]
    assert await claim(database, 6) == ["low700"]


async def test_scouts_are_taken_in_input_order(database: Database, tmp_path: Path) -> None:
    await load(database, tmp_path, "ds", [held(f"k{i}", n) for i, n in enumerate((1, 9, 5, 7))])
    started: set[int] = set()
    assert await claim(database, 3, scouts=2, started=started) == ["k0", "k1", "k3"]


async def test_a_prompts_samples_asked_together_are_never_cut_by_a_claim(
    database: Database, tmp_path: Path
) -> None:
    """Whatever a claim wants, scouts or longest first, mixed with another dataset, each
    prompt of a dataset asking its samples in one request comes whole and in order."""
    grouped = await load(
        database, tmp_path, "g", [held(f"g{i}", n) for i, n in enumerate((5, 90, 40, 7, 60))],
        samples=3,
    )  # fmt: skip
    await load(database, tmp_path, "plain", [held(f"p{i}", n) for i, n in enumerate((80, 50))])
    together = {grouped: 3}
    started: set[int] = set()
    seen: list[tuple[str, int]] = []
    for want in (1, 2, 1, 4, 2, 5, 9):
        result = await Queue(database).write_round(
            Round(claim=Claim("w", want, 60.0, scouts=2, started=started, together=together))
        )
        got = [(lease.key, lease.sample) for lease in result.leases if lease.dataset_id == grouped]
        for key in {key for key, _ in got}:
            assert [s for k, s in got if k == key] == [0, 1, 2], (want, got)
        # One prompt's samples one after another, nothing between them.
        keys = [lease.key for lease in result.leases]
        assert all(keys.index(k) + 2 == len(keys) - 1 - keys[::-1].index(k) for k, _ in got)
        seen += got
    assert sorted(seen) == [(f"g{i}", s) for i in range(5) for s in range(3)]


async def test_a_prompts_samples_claimed_together_stay_within_the_datasets_cap(
    database: Database, tmp_path: Path
) -> None:
    """A cap of two with three samples a prompt: no claim holds more than two of its
    items at once, scouts or not; a prompt's samples then come in parts."""
    capped = await load(
        database, tmp_path, "c", [held(f"c{i}", 10) for i in range(3)], samples=3, concurrency=2
    )
    queue = Queue(database)

    async def claim_keys(**options: Any) -> list[tuple[str, int]]:
        claim = Claim("w", 8, 60.0, together={capped: 3}, **options)
        return [
            (lease.key, lease.sample)
            for lease in (await queue.write_round(Round(claim=claim))).leases
        ]

    assert await claim_keys(scouts=2, started=set()) == [("c0", 0), ("c0", 1)]
    assert await claim_keys() == []  # the cap is full
