"""Regeneration checked end to end: after SIGKILL runs, every exported answer is the
simulated server's answer to exactly the conversation the rules say it was asked with
(tests/oracle.py), in every dataset kind, reasoning mode and export format."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from orchestrator.formats.writers import specforge
from orchestrator.settings.choices import EXPORT_FORMATS as FORMATS
from orchestrator.settings.choices import REASONING_MODES
from orchestrator.sim.config import REASONING_MODES as SIM_REASONING
from tests import oracle
from tests.helpers import SimProcess, cli, query, start_worker, write_jsonl

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("lookup", "search")
]

Row = dict[str, Any]


def msg(role: str, content: str | None, **extra: Any) -> Row:
    return {"role": role, "content": content, **extra}


def plain(rng: random.Random, key: str) -> list[Row]:
    """A chat: system or developer prompts, perhaps an opening assistant message, one
    to four exchanges; it may end on a user turn (answered too)."""
    messages = [msg(rng.choice(["system", "developer"]), f"{key} prompt")]
    if rng.random() < 0.2:
        messages.append(msg("assistant", f"{key} hello, ask me"))
    for t in range(rng.randint(1, 4)):
        messages.append(msg("user", f"{key} question {t}"))
        if rng.random() < 0.85:
            messages.append(msg("assistant", f"{key} original answer {t}"))
    return messages


def agentic(rng: random.Random, key: str) -> list[Row]:
    """A tool trace: calls of the tool the simulated server calls (``lookup``, its first),
    of another, several at once, or none; each call answered by a result."""
    messages = [msg("system", "use the tools"), msg("user", f"{key} task")]
    ids = 0
    for step in range(rng.randint(1, 4)):
        pattern = rng.choice([["lookup"], ["lookup"], [], ["search"], ["lookup", "lookup"]])
        if not pattern:
            messages.append(msg("assistant", f"{key} thinking aloud {step}"))
            if rng.random() < 0.5:
                messages.append(msg("user", f"{key} go on {step}"))
            continue
        calls = []
        for name in pattern:
            ids += 1
            calls.append(
                {
                    "id": f"orig_{ids}",
                    "type": "function",
                    "function": {"name": name, "arguments": "{}"},
                }
            )
        messages.append(msg("assistant", rng.choice([None, "", "checking"]), tool_calls=calls))
        for c in reversed(calls) if rng.random() < 0.3 else calls:
            messages.append(msg("tool", f"{key} result of {c['id']}", tool_call_id=c["id"]))
    if rng.random() < 0.7:
        messages.append(msg("assistant", f"{key} done"))
    return messages


def datasets(
    tmp_path: Path, seed: int, scale: int = 1
) -> tuple[dict[str, Row], dict[str, str], list[Path]]:
    """Input files of every kind: their rows by key, each dataset's mode, the files."""
    rng = random.Random(seed)
    plan = {
        "last": ("last", 40 * scale, plain),
        "all": ("all", 70 * scale, plain),
        "tools": ("all", 90 * scale, agentic),
        "pass": ("passthrough", 20 * scale, plain),
    }
    inputs: dict[str, Row] = {}
    files = []
    for name, (_, n, make) in plan.items():
        rows = []
        for i in range(n):
            key = f"{name}-{i:04d}"
            messages = make(rng, key)
            if name == "pass" and messages[-1]["role"] != "assistant":
                messages.append(msg("assistant", f"{key} final"))
            row: Row = {"id": key, "messages": messages}
            if name == "tools":
                row["tools"] = TOOLS
            rows.append(row)
            inputs[key] = row
        files.append(write_jsonl(tmp_path / f"{name}.jsonl", rows))
    return inputs, {name: mode for name, (mode, _, _) in plan.items()}, files


def enqueue_all(db: str, files: list[Path], modes: dict[str, str]) -> None:
    for path in files:
        name = path.stem
        mode = modes[name]
        extra = ["--passthrough"] if mode == "passthrough" else ["--regenerate", mode]
        result = cli("enqueue", str(path), "-d", name, "--format", "messages", "--db", db, *extra)
        assert result.returncode == 0, result.stderr


def run_with_kills(db: str, url: str, kills: int, rng: random.Random) -> int:
    """SIGKILL a fresh worker ``kills`` times mid-run, then let one finish."""
    killed = 0
    for _ in range(kills):
        worker = start_worker(db, url, "--concurrency", "16", "--exit-when-done")
        time.sleep(rng.uniform(0.6, 1.6))
        worker.kill()
        worker.communicate(timeout=30)
        killed += worker.returncode == -signal.SIGKILL
    worker = start_worker(db, url, "--concurrency", "16", "--exit-when-done")
    _, stderr = worker.communicate(timeout=90)
    assert worker.returncode == 0, stderr[-3000:]
    return killed


def export(db: str, out: Path, *args: str) -> list[Row]:
    result = cli("export", str(out), "--db", db, *args)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(raw) for raw in out.read_bytes().splitlines()]


def _bare(messages: list[Row]) -> list[Row]:
    """Messages without their null keys: a Parquet row has every column of the struct,
    a JSONL line only the keys the message has."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def check_specforge(
    lines: list[Row], tmp_path: Path, out: Path, inputs: dict[str, Row]
) -> list[Row]:
    """SpecForge's lines and its skipped file hold every input once; each skipped row is
    one its validator refuses, for the reason given, and no written one is."""
    skipped_file = out.with_name(f"{out.stem}_skipped.jsonl")
    skipped = [orjson.loads(raw) for raw in skipped_file.read_bytes().splitlines()]
    keys = [oracle.key_of(line, inputs) for line in lines + skipped]
    assert sorted(keys) == sorted(inputs)
    assert lines and all(line["status"] == "success" for line in lines)
    for row in lines:
        assert specforge.problem(row) is None, row["id"]
    for row in skipped:
        found = specforge.problem({k: v for k, v in row.items() if k not in ("status", "error")})
        assert found is not None and row["status"] == "skipped", row["id"]
        assert row["error"] == found[1], row["id"]
    return lines


def check_parquet(db: str, tmp_path: Path, reasoning: str, lines: list[Row]) -> None:
    """The Parquet export holds the rows of the messages export, message for message."""
    out = tmp_path / f"parquet-{reasoning}.parquet"
    result = cli("export", str(out), "--db", db, "--format", "parquet", "--reasoning", reasoning)
    assert result.returncode == 0, result.stderr
    rows = {row["id"]: _bare(row["messages"]) for row in pq.read_table(out).to_pylist()}
    assert rows == {line["id"]: _bare(line["messages"]) for line in lines}


def _reasonings(fmt: str) -> tuple[str, ...]:
    """The ``--reasoning`` modes a format takes: the Batch API's message keeps it apart,
    SpecForge keeps it in ``reasoning_content`` or drops it (inline is refused)."""
    if fmt == "openai-batch":
        return ("separate",)
    if fmt == "specforge":
        return ("separate", "drop")
    return REASONING_MODES


def verify_run(
    db: str, tmp_path: Path, inputs: dict[str, Row], modes: dict[str, str], sim_reasoning: str
) -> oracle.Verdict:
    """Every format and reasoning mode of the export, each line checked by the oracle."""
    states = {state for (state,) in query(db, "SELECT DISTINCT state FROM items")}
    assert states == {"done"}
    # Chat datasets have no raw completions to write: refused, naming the way that fits.
    refused = cli("export", str(tmp_path / "c.jsonl"), "--db", db, "--format", "completions")
    assert refused.returncode != 0 and "--format completions is for" in refused.stderr
    checked: oracle.Verdict | None = None
    conversations: dict[str, list[Row]] = {}
    for fmt in (f for f in FORMATS if f not in ("completions", "parquet", "tokens")):
        for reasoning in _reasonings(fmt):
            out = tmp_path / f"{fmt}-{reasoning}.jsonl"
            lines = export(db, out, "--format", fmt, "--reasoning", reasoning)
            if fmt == "specforge":
                lines = check_specforge(lines, tmp_path, out, inputs)
            else:
                keys = [oracle.key_of(line, inputs) for line in lines]
                assert sorted(keys) == sorted(inputs), (fmt, reasoning)
            if fmt == "messages":
                check_parquet(db, tmp_path, reasoning, lines)
            if fmt == "openai-batch":
                verdict = oracle.check_batch(lines, conversations)
            else:
                verdict = oracle.check_export(
                    lines,
                    inputs,
                    modes=modes,
                    fmt=fmt,
                    reasoning=reasoning,
                    sim_reasoning=sim_reasoning,
                )
                if fmt == "messages" and reasoning == "separate":
                    checked = verdict
                    conversations = {
                        oracle.key_of(line, inputs): line["messages"] for line in lines
                    }
            assert verdict.faults == [], (fmt, reasoning, verdict.faults)
    assert checked is not None
    return checked


def oracle_run(
    db: str, tmp_path: Path, sim_reasoning: str, *, scale: int = 1, kills: int = 3
) -> dict[str, Any]:
    """Enqueue every kind, run with SIGKILLs against a simulated server answering in
    ``sim_reasoning`` mode, and check every export; the run's figures."""
    seed = SIM_REASONING.index(sim_reasoning)
    rng = random.Random(seed)
    inputs, modes, files = datasets(tmp_path, seed, scale)
    enqueue_all(db, files, modes)
    server = SimProcess(
        *("--latency", "0.02", "--per-token", "0.002", "--mean-tokens", "12"),
        *("--reasoning", sim_reasoning, "--seed", str(seed)),
    )
    server.start()
    try:
        killed = run_with_kills(db, server.url, kills, rng)
    finally:
        server.stop()
    verdict = verify_run(db, tmp_path, inputs, modes, sim_reasoning)
    # Both kinds of regenerated tool turns happened: some lined up, some ended the trace.
    assert verdict.renamed > 0 and verdict.stopped > 0
    status = json.loads(cli("status", "--json", "--db", db).stdout)
    flagged = {d["name"]: d["flags"]["tool_mismatch"] for d in status["datasets"]}
    assert flagged == {"last": 0, "all": 0, "tools": verdict.stopped, "pass": 0}
    kept = export(db, tmp_path / "kept.jsonl", "--exclude-flag", "tool_mismatch")
    assert len(kept) == len(inputs) - verdict.stopped
    return {
        "sim_reasoning": sim_reasoning,
        "items": len(inputs),
        "kills": killed,
        "answers_checked": verdict.answers,
        "tool_results_renamed": verdict.renamed,
        "stopped_tool_mismatch": verdict.stopped,
    }


@pytest.mark.parametrize("sim_reasoning", SIM_REASONING)
def test_every_exported_answer_was_asked_as_the_rules_say(
    tmp_path: Path, sim_reasoning: str, figures: dict[str, Any]
) -> None:
    figures.update(oracle_run(str(tmp_path / "q.db"), tmp_path, sim_reasoning))


@pytest.mark.postgresql
def test_every_exported_answer_was_asked_as_the_rules_say_on_postgresql(
    tmp_path: Path, pg_database: Callable[[], str], figures: dict[str, Any]
) -> None:
    figures.update(oracle_run(pg_database(), tmp_path, "field"))


@pytest.mark.slow
@pytest.mark.parametrize("sim_reasoning", ["none", "think"])
def test_every_exported_answer_was_asked_as_the_rules_say_at_scale(
    tmp_path: Path, sim_reasoning: str, figures: dict[str, Any]
) -> None:
    figures.update(oracle_run(str(tmp_path / "q.db"), tmp_path, sim_reasoning, scale=8, kills=10))
