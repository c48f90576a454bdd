"""A run sends the longest predicted answers first, through the real commands; ``plan``
counts the lines' own answers as the claim ranks them (store level: test_claim_order.py)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from tests.helpers import SimProcess, cli, planned, write_jsonl
from tests.test_claim_order import held, prompt


def started_order(db: Path) -> list[str]:
    """Item keys in the order their requests were sent (the answer's start)."""
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT i.key FROM outputs AS o JOIN items AS i ON i.id = o.item_id"
            " ORDER BY o.created_at - o.latency, o.created_at"
        ).fetchall()
    return [key for (key,) in rows]


def test_a_run_sends_the_longest_answers_of_all_datasets_first(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Two datasets of one priority, "short" enqueued first: once both have had their
    scouts (16 each, in input order), "long"'s items go before "short"'s, and each
    dataset's by length."""
    model = tmp_path / "lengths.json"
    model.write_text(
        json.dumps(
            {"datasets": {"short": {"mean": 5}, "long": {"mean": 60}}, "default": {"mean": 5}}
        )
    )
    server = sim_process("--length-model", str(model))
    db = tmp_path / "q.db"
    for name, sizes in (("short", [5, 3, 4, 6, 2] * 8), ("long", [60, 40, 80, 50, 70] * 8)):
        lines = [held(f"{name}{i:02d}-{n}", n) for i, n in enumerate(sizes)]
        path = write_jsonl(tmp_path / f"{name}.jsonl", lines)
        param = f'metadata={{"dataset": "{name}"}}'
        done = cli("enqueue", str(path), "--dataset", name, "--db", str(db), "--param", param)
        assert done.returncode == 0, done.stderr
    ran = cli(
        "run", "--server", server.url, "--db", str(db), "--concurrency", "1", "--exit-when-done"
    )
    assert ran.returncode == 0, ran.stderr
    order = started_order(db)
    assert len(order) == 80
    # The trial items, then the scouts: the first 16 of each dataset by input order (a
    # trial is one of its dataset's 16).
    scouts = {f"{name}{i:02d}" for name in ("short", "long") for i in range(16)}
    first = order[: len(scouts)]
    assert {key.split("-")[0] for key in first} == scouts
    rest = order[len(scouts) :]
    assert [key.startswith("long") for key in rest] == [True] * 24 + [False] * 24
    for name in ("long", "short"):
        sizes = [int(key.split("-")[1]) for key in rest if key.startswith(name)]
        assert sizes == sorted(sizes, reverse=True), (name, sizes)


def test_plan_counts_a_run_files_lines_at_their_answers_length(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "regen.jsonl", [held(f"r{i}", 100 * (i + 1)) for i in range(4)])
    write_jsonl(tmp_path / "prompts.jsonl", [prompt(f"p{i}") for i in range(4)])
    regen, prompts = planned(
        tmp_path,
        '[[dataset]]\nname = "regen"\nfile = "regen.jsonl"\n\n'
        '[[dataset]]\nname = "prompts"\nfile = "prompts.jsonl"\n',
    )
    # 100 + 200 + 300 + 400 tokens, the answers the lines hold; the prompts at 0.35 x 1000.
    assert (regen["predicted"], regen["generated_tokens"]) == (4, 1000)
    assert (prompts["predicted"], prompts["generated_tokens"]) == (0, 4 * 350)
    config = str(tmp_path / "run.toml")
    text = cli("plan", "--config", config, "--db", str(tmp_path / "none.db")).stdout
    assert " 250 p " in text and "p: requests whose line holds an answer" in text


def test_the_claim_reads_the_index_whatever_the_size(tmp_path: Path) -> None:
    """The longest-first claim and the heads it ranks by are index range reads."""
    db = tmp_path / "q.db"
    path = write_jsonl(tmp_path / "in.jsonl", [held(f"k{i}", i % 50 + 1) for i in range(200)])
    assert cli("enqueue", str(path), "--dataset", "ds", "--db", str(db)).returncode == 0
    from orchestrator.store.claims import HEADS, claim_sql

    with closing(sqlite3.connect(db)) as conn:
        for sql in (HEADS, claim_sql(False, False)):
            params = {"dataset": 1, "now": 0, "n": 5, "lost": "x", "token": "t"}
            params |= {"owner": "o", "expires": 0}
            plan = " ".join(str(r) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
            assert "ix_items_longest" in plan and "TEMP B-TREE" not in plan, plan
