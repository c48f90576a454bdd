"""Exports as their consumers read them: SpecForge's loader, batch readers, the combined file.

SpecForge builds its offline dataset with HF ``Dataset.from_generator`` over the JSONL
lines, keeping ``conversations`` and ``tools`` (both JSON-encoded for Arrow); the columns
come from the first rows written. Its other path is ``load_dataset("json")``. The tests
below make those calls themselves on exports of a real SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.formats.writers import specforge
from orchestrator.store import Queue, open_database
from tests import specforge_parser
from tests.conftest import StartSim
from tests.helpers import cli, events, write_jsonl
from tests.test_queue import answer
from tests.test_runfile import load_make_data
from tests.test_training_data import config, run_worker, tool_trace

datasets = pytest.importorskip("datasets")

T0 = 1_800_000_000.0
ROWS = 64


def _tool(i: int) -> dict[str, Any]:
    """A different schema per row, so that a lost or shuffled one shows."""
    props = {f"arg{j}": {"type": "string" if j % 2 else "integer"} for j in range(i % 4 + 1)}
    return {
        "type": "function",
        "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": props}},
    }


def _enqueue(tmp: Path, db: Path, name: str, rows: list[dict[str, Any]], *extra: str) -> None:
    path = write_jsonl(tmp / f"{name.replace('/', '_')}.jsonl", rows)
    result = cli("enqueue", str(path), "--dataset", name, *extra, "--db", str(db))
    assert result.returncode == 0, result.stderr


async def _answer_all(db: Path, names: list[str]) -> None:
    database = await open_database(str(db))
    try:
        queue = Queue(database)
        leases = await queue.claim("w", 10_000, lease_seconds=600, dataset_names=names, now=T0)
        done = [(lease, answer(f"answer {lease.key}")) for lease in leases]
        assert len(await queue.complete(done, now=T0 + 1)) == len(leases)
    finally:
        await database.close()


def _build(tmp: Path, tools: str, plain: str, tokens: str | None = None) -> Path:
    """Tool rows and tool-less rows in two datasets, no line with an id; token rows apart."""
    db = tmp / "q.db"
    tool_rows = [
        {"messages": [{"role": "user", "content": f"use tool {i}"}], "tools": [_tool(i)]}
        for i in range(ROWS)
    ]
    _enqueue(tmp, db, tools, tool_rows)
    _enqueue(tmp, db, plain, [{"prompt": f"plain {i}"} for i in range(ROWS)])
    if tokens is not None:
        rows = [{"input_ids": [1, 2, i], "loss_mask": [0, 1, 1]} for i in range(4)]
        _enqueue(tmp, db, tokens, rows, "--passthrough", "--format", "tokens")
    asyncio.run(_answer_all(db, [tools, plain]))
    return db


def _export(db: Path, out: Path, *args: str) -> Any:
    result = cli("export", str(out), *args, "--db", str(db))
    assert result.returncode == 0, result.stderr
    return result


def _specforge_rows(path: str) -> Iterator[dict[str, Any]]:
    """What SpecForge's offline loader yields per line: conversations and tools, as JSON text."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield specforge_parser.offline_row(json.loads(line))


@pytest.fixture(autouse=True)
def _hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


LAYOUTS = {
    # dataset names: the export writes datasets in name order
    "tool rows first": ("a-tools", "b-plain", None),
    "tool-less rows first": ("b-tools", "a-plain", None),
    "token rows first": ("b-tools", "c-plain", "a-tokens"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_tool_schema_survives_specforge_loading(tmp_path: Path, layout: str) -> None:
    tools, plain, tokens = LAYOUTS[layout]
    db = _build(tmp_path, tools, plain, tokens)
    out = tmp_path / "train.jsonl"
    _export(db, out, "--format", "sharegpt")

    loaded = datasets.Dataset.from_generator(
        _specforge_rows,
        gen_kwargs={"path": str(out)},
        cache_dir=str(tmp_path / "hf"),
        keep_in_memory=True,
    )
    assert "tools" in loaded.column_names
    schemas = [json.loads(t) for t in loaded["tools"]]
    rendered = [s for s in schemas if s]
    assert [s[0]["function"]["name"] for s in rendered] == [f"tool_{i}" for i in range(ROWS)]
    assert rendered == [[_tool(i)] for i in range(ROWS)]
    assert len(schemas) - len(rendered) == ROWS + (4 if tokens else 0)  # [] on every other

    # Its other path: the file read as JSON lines, one column per key.
    table = datasets.load_dataset(
        "json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf-json")
    )
    assert sum(1 for t in table["tools"] if t) == ROWS
    assert None not in table["tools"]


def _ids(data: bytes, field: str) -> list[str]:
    return [orjson.loads(line)[field] for line in data.splitlines()]


def _unqualified(value: str) -> tuple[str, str]:
    name, _, key = value.partition("/")
    return name.replace("%2F", "/").replace("%25", "%"), key


NAMES = ["web/q%a", "web"]  # "/" and "%" in a name


@pytest.fixture
def two_without_ids(tmp_path: Path) -> Path:
    """Two datasets whose lines have no id: both are keyed 1, 2, 3, 4."""
    db = tmp_path / "q.db"
    for name in NAMES:
        _enqueue(tmp_path, db, name, [{"prompt": f"{name} {i}"} for i in range(4)])
    asyncio.run(_answer_all(db, NAMES))
    return db


EXPECTED = sorted((name, str(i)) for name in NAMES for i in range(1, 5))


@pytest.mark.parametrize(("fmt", "field"), [("sharegpt", "id"), ("openai-batch", "custom_id")])
def test_combined_exports_tell_every_line_apart(
    two_without_ids: Path, tmp_path: Path, fmt: str, field: str
) -> None:
    out = tmp_path / f"{fmt}.jsonl"
    _export(two_without_ids, out, "--format", fmt)
    ids = _ids(out.read_bytes(), field)
    assert len(set(ids)) == len(ids) == 8, ids
    assert sorted(_unqualified(i) for i in ids) == EXPECTED
    assert "web%2Fq%25a/1" in ids and "web/1" in ids
    # One dataset in a file: today's ids, the keys.
    one = tmp_path / f"one-{fmt}.jsonl"
    _export(two_without_ids, one, "--format", fmt, "--dataset", "web")
    assert _ids(one.read_bytes(), field) == ["1", "2", "3", "4"]


def test_messages_lines_name_their_dataset(two_without_ids: Path, tmp_path: Path) -> None:
    """The messages format names the dataset on every line already; its ids stay the keys."""
    out = tmp_path / "messages.jsonl"
    _export(two_without_ids, out)
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert sorted((line["dataset"], line["id"]) for line in lines) == EXPECTED


def test_token_rows_among_conversations_are_announced(tmp_path: Path) -> None:
    db = _build(tmp_path, "b-tools", "c-plain", "a-tokens")
    out = tmp_path / "train.jsonl"
    result = _export(db, out, "--format", "sharegpt")
    (warning,) = [e for e in events(result.stderr) if e["event"] == "export_mixed_token_rows"]
    assert warning["level"] == "warning" and warning["file"] == str(out)
    assert warning["token_rows"] == 4 and warning["other_lines"] == 2 * ROWS
    assert "SpecForge skips pre-tokenised rows" in warning["hint"]
    # Text logs: the event and a line of the CLI's own.
    text = cli("--no-log-json", "export", str(out), "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert f"warning: {out}: 4 pre-tokenised rows among {2 * ROWS} other lines" in text.stderr
    # Each dataset in its own file: nothing mixed, nothing said.
    split = _export(db, tmp_path / "split", "--split")
    assert "pre-tokenised" not in split.stderr and "export_mixed" not in split.stderr


# ------------------------------------------- tool-call rows through SpecForge's parser


async def tool_call_run(db_url: str, tmp_path: Path, sim: StartSim) -> None:
    """Function-calling chats (examples/eagle3/make_data.py) answered once; agentic
    trajectories whose last answer is asked again after their calls and results; tool
    traces regenerated turn by turn, their results following the server's own calls. The
    server calls the first tool offered on half the requests offering tools, and reasons."""
    make_data = load_make_data()
    rng = random.Random(7)
    sets = {
        "toolcalls": (list(make_data.toolcalls(rng, 60)), []),
        "agentic": (list(make_data.agentic(rng, 30)), []),
        "traces": ([tool_trace(i, "open_box") for i in range(20)], ["--regenerate", "all"]),
    }
    for name, (rows, how) in sets.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        done = cli("enqueue", str(path), "-d", name, *how, "--max-tokens", "4096",
                   "--db", db_url)  # fmt: skip
        assert done.returncode == 0, done.stderr
    url = await sim(reasoning="field", tool_call_rate=0.5)
    database = await open_database(db_url)
    try:
        await run_worker(database, config(url, max_attempts=1))
    finally:
        await database.close()


def _has_calls(line: dict[str, Any]) -> bool:
    return any(m.get("tool_calls") for m in line["conversations"])


async def test_tool_call_rows_reach_specforges_parser(
    db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    """Every tool-calling conversation is written, none set aside, and SpecForge's loaders
    and parsers hand the chat template each of its messages as written, with its tools."""
    await tool_call_run(db_url, tmp_path, sim)
    out = tmp_path / "train.jsonl"
    result = cli("export", str(out), "--format", "specforge", "--db", db_url)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(raw) for raw in out.read_text().splitlines()]
    skipped = [json.loads(raw) for raw in (tmp_path / "train_skipped.jsonl").open()]
    by_set = Counter(row["id"].split("/")[0] for row in skipped)
    assert skipped == [], (by_set, [row["error"] for row in skipped][:5])
    assert "skipped" not in result.stderr
    calls = [line for line in lines if _has_calls(line)]
    traces = [line for line in calls if any(m["role"] == "tool" for m in line["conversations"])]
    assert len(calls) > 30 and len(traces) > 10, (len(calls), len(traces))
    assert all(specforge.problem(line) is None for line in lines)

    # The offline path: Dataset.from_generator over safe_conversations_generator's rows.
    offline = datasets.Dataset.from_generator(
        lambda: (specforge_parser.offline_row(line) for line in lines),
        cache_dir=str(tmp_path / "hf"),
        keep_in_memory=True,
    )
    # The online path: load_dataset("json") on the file.
    online = datasets.load_dataset(
        "json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf-json")
    )
    assert len(offline) == len(online) == len(lines)
    for line, by_generator, by_json in zip(lines, offline, online, strict=True):
        for loaded in (by_generator, by_json):
            lost = specforge_parser.losses(line, loaded)
            assert not lost, (line["id"], lost)
