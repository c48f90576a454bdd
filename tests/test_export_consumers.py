"""Exports as their consumers read them: SpecForge's loader, batch readers, the combined file.

SpecForge builds its offline dataset with HF ``Dataset.from_generator`` over the JSONL
lines, keeping ``conversations`` and ``tools`` (both JSON-encoded for Arrow); the columns
come from the first rows written. Its other path is ``load_dataset("json")``. The tests
below make those calls themselves on exports of a real SQLite file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.store import Queue, open_database
from tests.helpers import cli, events, write_jsonl
from tests.test_queue import answer

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
            row = json.loads(line)
            turns = [
                {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in turn.items()}
                for turn in row.get("conversations", [])
                if isinstance(turn, dict)
            ]
            out: dict[str, Any] = {"conversations": turns}
            if "tools" in row:
                tools = row["tools"]
                out["tools"] = json.dumps(tools) if tools is not None else []
            yield out


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
