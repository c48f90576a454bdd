"""The bundled EAGLE-3 run, rehearsed end to end on the simulated server.

The same commands an operator runs, as subprocesses: enqueue the run file, run a worker
against a server that thinks (``<think>`` in the content, no reasoning parser) and calls
tools, then export every format. Every generated turn must answer its own prompt, and
the pass-through rows must come out as they went in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from orchestrator.items.conversation import targets, turn_messages
from orchestrator.sim import answer_matches
from tests.helpers import REPO, SimProcess, cli

RUN = REPO / "examples" / "eagle3" / "run.toml"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for raw in path.read_bytes().splitlines()]


def test_bundled_eagle3_run(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> None:
    db = tmp_path / "run.db"
    enqueued = cli("enqueue", "--config", str(RUN), "--db", str(db))
    assert enqueued.returncode == 0, enqueued.stderr
    server = sim_process(
        "--latency", "0", "--mean-tokens", "24", "--reasoning", "think", "--model", "Qwen/Qwen3-8B"
    )
    ran = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done", timeout=240)
    assert ran.returncode == 0, ran.stderr

    status = json.loads(cli("status", "--json", "--db", str(db)).stdout)
    datasets = {d["name"]: d for d in status["datasets"]}
    assert len(datasets) == 10
    total = status["totals"]["counts"]
    assert total["done"] == total["total"] > 0 and total["failed"] == 0

    out = tmp_path / "train.jsonl"
    exported = cli("export", str(out), "--db", str(db), "--reasoning", "separate")
    assert exported.returncode == 0, exported.stderr
    lines = read_jsonl(out)
    assert len(lines) == total["total"]
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_dataset.setdefault(line.get("dataset", "pretokenised"), []).append(line)

    for name, rows in by_dataset.items():
        if name in ("final_chats", "pretokenised"):
            continue  # pass-through: checked below
        for line in rows:
            messages = line["messages"]
            if name == "agentic":  # every assistant turn regenerated, each in context
                generated = [messages[i] for i in targets(messages)]
                for k, answer in enumerate(generated):
                    asked = turn_messages(messages, k, generated[:k])
                    assert answer_matches(asked, answer), (name, line["id"], k)
            else:
                *prompt, answer = messages
                assert answer_matches(prompt, answer), (name, line["id"])
                # No reasoning parser on the server: the think block was split out.
                assert "<think>" not in (answer.get("content") or "")
    assert any(
        m.get("tool_calls") for line in by_dataset["toolcalls"] for m in line["messages"][-1:]
    )

    # Pass-through rows come out exactly as they went in.
    source = RUN.parent / "data"
    assert [line["messages"] for line in by_dataset["final_chats"]] == [
        row["messages"] for row in read_jsonl(source / "final_chats.jsonl")
    ]
    # In a file of several datasets each token row also names its dataset.
    tokens = [row for row in lines if "input_ids" in row]
    assert {row.pop("dataset") for row in tokens} == {"pretokenised"}
    assert tokens == read_jsonl(source / "pretokenised.jsonl")

    # The other formats hold the same items.
    sharegpt = tmp_path / "train.sharegpt.jsonl"
    assert cli("export", str(sharegpt), "--db", str(db), "--format", "sharegpt").returncode == 0
    assert len(read_jsonl(sharegpt)) == len(lines)
    batch = tmp_path / "train.batch.jsonl"
    assert cli("export", str(batch), "--db", str(db), "--format", "openai-batch").returncode == 0
    answers = read_jsonl(batch)
    assert len(answers) == len(lines)
    assert all(a["error"] is None for a in answers if "input_ids" not in a)
    inline = tmp_path / "train.inline.jsonl"
    assert cli("export", str(inline), "--db", str(db), "--reasoning", "inline").returncode == 0
    thought = [
        line["messages"][-1]["content"]
        for line in read_jsonl(inline)
        if line.get("dataset") == "math"
    ]
    assert thought and all(text.startswith("<think>\n") for text in thought)
