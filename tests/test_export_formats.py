"""Export formats and options, on a real SQLite file, through both read paths.

One database holds every kind of row export meets: answers made through the real store
(reasoning, tool calls, truncated, empty, a failed item, a pending one), a multi-turn
dataset (``regenerate = 'all'``) and a pass-through dataset (a conversation row and a
pre-tokenised row), the last two inserted with plain SQL as the producing side stores
them. Each format and option is exported through the CLI (plain sqlite3), in process
(sqlite3 in a thread) and through the SQLAlchemy stream, and twice: the bytes must agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.cli import export as cli_export
from orchestrator.formats.export import export_database
from orchestrator.formats.options import ExportOptions
from orchestrator.formats.writers.job import file_stems
from orchestrator.formats.writers.lines import apply_reasoning, messages_line, sharegpt_turn
from orchestrator.items.quality import (
    ALL_FLAGS,
    EMPTY_CONTENT,
    REASONING_ONLY,
    TRUNCATED,
    UNCLOSED_THINK,
)
from orchestrator.monitor import status as status_view
from orchestrator.settings import choices
from orchestrator.store import Database, Failure, Output, Queue, iter_done, open_database
from orchestrator.store.reader import EngineRows, open_reader
from tests.helpers import cli as run_cli
from tests.helpers import cli_loading, write_jsonl

T0 = 1_800_000_000.0

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
PARAMS = {"model": "Qwen/Qwen3-8B", "max_tokens": 512, "temperature": 0.6}

CHAT_LINES: list[dict[str, Any]] = [
    {"id": "c0", "messages": [{"role": "user", "content": "Capital of France?"}]},
    {"id": "c1", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL]},
    {"id": "c2", "prompt": "Write a long essay.", "system": "You are verbose."},
    {"id": "c3", "prompt": "Say nothing."},
    {"id": "c4", "prompt": "Too long."},
    {"id": "c5", "prompt": "Still pending."},
]

# Generated answers for c0..c3: message, finish_reason, flags, params_hash, response_id.
CHAT_ANSWERS: list[tuple[dict[str, Any], str, int, str | None, str | None]] = [
    (
        {"role": "assistant", "content": "Paris.", "reasoning_content": "France: Paris."},
        "stop",
        0,
        "h1",
        "chatcmpl-abc",
    ),
    ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls", 0, "h1", None),
    (
        {"role": "assistant", "content": "Once upon", "reasoning_content": "plan"},
        "length",
        TRUNCATED,
        "h1",
        None,
    ),
    (
        {"role": "assistant", "content": "", "reasoning_content": "hmm"},
        "stop",
        EMPTY_CONTENT | REASONING_ONLY,
        None,
        None,
    ),
]

# Multi-turn: m0 replaces two answers; m1 is agentic (a tool call, its result, the answer).
M0 = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "old1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "old2"},
]
M0_TURNS = [
    {"role": "assistant", "content": "new1", "reasoning_content": "think1"},
    {"role": "assistant", "content": "new2", "reasoning_content": "think2"},
]
M1 = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "assistant", "content": "old answer"},
]
M1_TURNS = [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "content": "It is 18C.", "reasoning_content": "read the tool"},
]
P0 = {
    "id": "p0",
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
    ],
}
P1 = {"id": "p1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}


def _enqueue(tmp: Path, db: Path, name: str, rows: list[dict[str, Any]]) -> None:
    data = write_jsonl(tmp / f"{name.replace('/', '_')}.jsonl", rows)
    result = run_cli("enqueue", str(data), "--dataset", name, "--db", str(db))
    assert result.returncode == 0, result.stderr


def _output(
    i: int, message: dict[str, Any], finish: str, flags: int, params: str | None, rid: str | None
) -> Output:
    return Output(
        message=message,
        content=message.get("content"),
        reasoning=message.get("reasoning_content"),
        finish_reason=finish,
        usage={"prompt_tokens": 10 + i, "completion_tokens": 5 + i, "total_tokens": 15 + 2 * i},
        latency=0.5 + i,
        server="http://gpu:30000",
        model="Qwen/Qwen3-8B",
        response_id=rid,
        flags=flags,
        params_hash=params,
    )


async def _answer(db: Path) -> None:
    database = await open_database(str(db))
    try:
        queue = Queue(database)
        leases = await queue.claim("w", 5, lease_seconds=600, dataset_names=["chat"], now=T0)
        assert [lease.key for lease in leases] == ["c0", "c1", "c2", "c3", "c4"]
        done = [(lease, _output(i, *CHAT_ANSWERS[i])) for i, lease in enumerate(leases[:4])]
        assert len(await queue.complete(done, now=T0 + 10)) == 4
        failure = Failure("http_400", "context length exceeded")
        assert len(await queue.fail([(leases[4], failure)], now=T0 + 11)) == 1
        (web,) = await queue.claim("w", 1, lease_seconds=600, dataset_names=["web/qa"], now=T0)
        answer = {"role": "assistant", "content": "A locator."}
        assert await queue.complete([(web, _output(0, answer, "stop", 0, None, "r-web"))], now=T0)
    finally:
        await database.close()


def _row_id(conn: sqlite3.Connection, insert: str, params: tuple[Any, ...]) -> int:
    """One INSERT; the id of the row it made."""
    cur = conn.execute(insert, params)
    assert cur.lastrowid is not None
    return cur.lastrowid


def _dataset(conn: sqlite3.Connection, name: str, *, regenerate: str, passthrough: bool) -> int:
    return _row_id(
        conn,
        "INSERT INTO datasets (name, params, regenerate, passthrough, created_at, updated_at)"
        " VALUES (?, '{}', ?, ?, ?, ?)",
        (name, regenerate, passthrough, T0, T0),
    )


def _item(
    conn: sqlite3.Connection,
    dataset_id: int,
    key: str,
    position: int,
    request: dict[str, Any],
    *,
    state: str = "done",
    turn: int = 0,
    turns: int = 1,
    error: tuple[str, str] | None = None,
) -> int:
    return _row_id(
        conn,
        "INSERT INTO items (dataset_id, key, position, request, digest, state, attempts,"
        " error_class, last_error, created_at, updated_at, finished_at, turn, turns)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            dataset_id,
            key,
            position,
            orjson.dumps(request).decode(),
            f"{position:064d}",
            state,
            8 if error else 1,
            error[0] if error else None,
            error[1] if error else None,
            T0,
            T0,
            T0,
            turn,
            turns,
        ),
    )


def _stored_output(
    conn: sqlite3.Connection,
    item_id: int,
    dataset_id: int,
    message: dict[str, Any],
    *,
    flags: int = 0,
    latency: float = 2.0,
    usage: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        "INSERT INTO outputs (item_id, dataset_id, content, reasoning, finish_reason,"
        " completion_tokens, message, usage, latency, server, model, response_id, attempt,"
        " created_at, flags, params_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?)",
        (
            item_id,
            dataset_id,
            message.get("content"),
            message.get("reasoning_content"),
            "stop" if message else None,
            (usage or {}).get("completion_tokens"),
            orjson.dumps(message).decode(),
            orjson.dumps(usage).decode() if usage else None,
            latency,
            "http://gpu:30000" if message else None,
            "Qwen/Qwen3-8B" if message else None,
            None,
            T0 + 20,
            flags,
            "h1" if message else None,
        ),
    )


def _turns(conn: sqlite3.Connection, item_id: int, messages: list[dict[str, Any]]) -> None:
    for turn, message in enumerate(messages):
        conn.execute(
            "INSERT INTO item_turns (item_id, turn, message, finish_reason, usage, flags,"
            " latency, server, model, params_hash, created_at)"
            " VALUES (?, ?, ?, 'stop', NULL, 0, 1.0, 'http://gpu:30000', 'Qwen/Qwen3-8B',"
            " 'h1', ?)",
            (item_id, turn, orjson.dumps(message).decode(), T0 + 10 + turn),
        )


def _insert_new_kinds(db: Path) -> None:
    """Multi-turn and pass-through rows, and the parameter set, as the producers store them."""
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(
            "INSERT INTO param_sets (hash, params, created_at) VALUES ('h1', ?, ?)",
            (orjson.dumps(PARAMS).decode(), T0),
        )
        multi = _dataset(conn, "multi", regenerate="all", passthrough=False)
        usage = {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49}
        m0 = _item(conn, multi, "m0", 0, {"messages": M0}, turn=1, turns=2)
        _turns(conn, m0, M0_TURNS)
        _stored_output(conn, m0, multi, M0_TURNS[-1], usage=usage)
        m1 = _item(conn, multi, "m1", 1, {"messages": M1, "tools": [WEATHER_TOOL]}, turns=2)
        _turns(conn, m1, M1_TURNS)
        _stored_output(conn, m1, multi, M1_TURNS[-1], flags=UNCLOSED_THINK, usage=usage)
        _item(
            conn,
            multi,
            "m2",
            2,
            {"messages": M0},
            state="failed",
            turn=1,
            turns=2,
            error=("http_400", "context length exceeded at turn 1"),
        )
        passing = _dataset(conn, "pass", regenerate="last", passthrough=True)
        for position, row in enumerate((P0, P1)):
            item_id = _item(conn, passing, str(row["id"]), position, row)
            _stored_output(conn, item_id, passing, {}, latency=0.0)
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the copies below take the main file


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("formats")
    db = tmp / "formats.db"
    _enqueue(tmp, db, "chat", CHAT_LINES)
    _enqueue(tmp, db, "web/qa", [{"id": "w0", "prompt": "What is a URL?"}])
    asyncio.run(_answer(db))
    _insert_new_kinds(db)
    return db


@pytest.fixture
def db(built: Path, tmp_path: Path) -> Path:
    """A private copy: exports only read, but one test adds a broken item."""
    copy = tmp_path / "formats.db"
    shutil.copyfile(built, copy)
    return copy


@pytest.fixture
async def database(db: Path) -> AsyncIterator[Database]:
    database = await open_database(str(db))
    yield database
    await database.close()


def _tree(root: Path) -> dict[str, bytes]:
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert not [name for name in files if name.endswith(".tmp")], files
    return files


def _cli_export(db: Path, root: Path, args: list[str]) -> tuple[dict[str, bytes], str]:
    root.mkdir()
    out = root / ("split" if "--split" in args else "train.jsonl")
    extra = [a.replace("FAILED", str(root / "failed.jsonl")) for a in args]
    result = run_cli("export", str(out), *extra, "--db", str(db))
    assert result.returncode == 0, result.stderr
    return _tree(root), result.stdout


async def _library_export(
    database: Database, root: Path, options: ExportOptions, *, stream: bool
) -> dict[str, bytes]:
    root.mkdir()
    if options.include_failed is not None:
        options = dataclasses.replace(options, include_failed=root / "failed.jsonl")
    out = root / ("split" if options.split else "train.jsonl")
    database.is_sqlite = not stream
    try:
        await export_database(database, out, options=options)
    finally:
        database.is_sqlite = True
    return _tree(root)


def _lines(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines()]


CASES: list[tuple[list[str], ExportOptions]] = [
    ([], ExportOptions()),
    (
        ["--reasoning", "inline", "--provenance", "--exclude-flag", "truncated,empty"],
        ExportOptions(reasoning="inline", provenance=True, exclude_flags=TRUNCATED | EMPTY_CONTENT),
    ),
    (
        ["--format", "sharegpt", "--reasoning", "drop", "--include-failed", "FAILED"],
        ExportOptions(format="sharegpt", reasoning="drop", include_failed="FAILED"),
    ),
    (
        ["--format", "openai-batch", "--provenance"],
        ExportOptions(format="openai-batch", provenance=True),
    ),
    (
        ["--format", "openai-batch", "--split", "--exclude-flag", "unclosed_think"],
        ExportOptions(format="openai-batch", split=True, exclude_flags=UNCLOSED_THINK),
    ),
    (
        ["--format", "sharegpt", "--split", "--include-failed", "FAILED"],
        ExportOptions(format="sharegpt", split=True, include_failed="FAILED"),
    ),
]


@pytest.mark.parametrize(
    ("args", "options"), CASES, ids=[" ".join(a) or "default" for a, _ in CASES]
)
async def test_read_paths_and_repeats_give_the_same_bytes(
    db: Path, database: Database, tmp_path: Path, args: list[str], options: ExportOptions
) -> None:
    first, _ = _cli_export(db, tmp_path / "cli", args)
    again, _ = _cli_export(db, tmp_path / "again", args)
    threaded = await _library_export(database, tmp_path / "thread", options, stream=False)
    streamed = await _library_export(database, tmp_path / "stream", options, stream=True)
    assert first and any(first.values())
    assert again == first
    assert threaded == first
    assert streamed == first


async def test_default_messages_lines(db: Path, database: Database, tmp_path: Path) -> None:
    files, stdout = _cli_export(db, tmp_path / "out", [])
    lines = _lines(files["train.jsonl"])
    assert [(line.get("dataset", "pass"), line["id"]) for line in lines] == [
        ("chat", "c0"),
        ("chat", "c1"),
        ("chat", "c2"),
        ("chat", "c3"),
        ("multi", "m0"),
        ("multi", "m1"),
        ("pass", "p0"),
        ("pass", "p1"),
        ("web/qa", "w0"),
    ]
    assert "exported 9 items to" in stdout
    # Normal datasets: byte for byte the historic line.
    chat = b"".join(
        [orjson.dumps(messages_line(i)) + b"\n" async for i in iter_done(database, ["chat"])]
    )
    assert files["train.jsonl"].startswith(chat)
    assert lines[1]["tools"] == [WEATHER_TOOL]
    assert lines[0]["messages"][-1] == CHAT_ANSWERS[0][0]
    # Multi-turn: every original answer replaced by its generated turn, in place.
    m0, m1 = lines[4], lines[5]
    assert m0["messages"] == [M0[0], M0[1], M0_TURNS[0], M0[3], M0_TURNS[1]]
    assert m0["finish_reason"] == "stop" and m0["usage"]["completion_tokens"] == 9
    assert m1["messages"] == [M1[0], M1_TURNS[0], M1[2], M1_TURNS[1]]
    assert m1["tools"] == [WEATHER_TOOL]
    # Pass-through: the conversation as it was read; the token row as read, with the
    # dataset it came from (the file holds four).
    assert lines[6]["messages"] == P0["messages"]
    assert lines[6]["finish_reason"] is None and lines[6]["usage"] is None
    p1 = {"id": "p1", "dataset": "pass", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}
    assert files["train.jsonl"].splitlines()[7] == orjson.dumps(p1)


@pytest.mark.parametrize("fmt", ["messages", "sharegpt"])
async def test_reasoning_modes(db: Path, tmp_path: Path, fmt: str) -> None:
    by_mode = {}
    for mode in ("separate", "inline", "drop"):
        files, _ = _cli_export(db, tmp_path / mode, ["--format", fmt, "--reasoning", mode])
        # ShareGPT ids in a file of several datasets are dataset/key.
        by_mode[mode] = {
            line["id"].rpartition("/")[2]: line for line in _lines(files["train.jsonl"])
        }

    def answers(mode: str, key: str) -> list[dict[str, Any]]:
        line = by_mode[mode][key]
        turns = line["messages"] if fmt == "messages" else line["conversations"]
        role, assistant = ("role", "assistant") if fmt == "messages" else ("from", "gpt")
        return [m for m in turns if m[role] == assistant]

    content = "content" if fmt == "messages" else "value"
    assert answers("separate", "c0")[-1]["reasoning_content"] == "France: Paris."
    assert answers("inline", "c0")[-1][content] == "<think>\nFrance: Paris.\n</think>\n\nParis."
    assert answers("drop", "c0")[-1][content] == "Paris."
    for mode in ("inline", "drop"):
        for key in ("c0", "c2", "c3", "m0", "m1"):
            assert all("reasoning_content" not in m for m in answers(mode, key)), (mode, key)
    # Every generated turn of a multi-turn item; originals and pass-through rows untouched.
    assert [m[content] for m in answers("inline", "m0")] == [
        "<think>\nthink1\n</think>\n\nnew1",
        "<think>\nthink2\n</think>\n\nnew2",
    ]
    assert answers("inline", "c3")[-1][content] == "<think>\nhmm\n</think>\n\n"
    assert answers("inline", "c1")[-1].get("tool_calls") == [CALL]  # no reasoning: as is
    assert answers("inline", "p0")[-1]["reasoning_content"] == "add"


async def test_sharegpt_lines(db: Path, tmp_path: Path) -> None:
    files, _ = _cli_export(db, tmp_path / "out", ["--format", "sharegpt"])
    # The file holds several datasets: ids are dataset/key, the key after the first "/".
    lines = {line["id"].split("/", 1)[1]: line for line in _lines(files["train.jsonl"])}
    assert lines["c0"] == {
        "id": "chat/c0",
        "conversations": [
            {"from": "human", "value": "Capital of France?"},
            {"from": "gpt", "value": "Paris.", "reasoning_content": "France: Paris."},
        ],
        "tools": [],
    }
    assert lines["w0"]["id"] == "web%2Fqa/w0"
    assert lines["c1"]["conversations"][-1] == {"from": "gpt", "value": "", "tool_calls": [CALL]}
    assert lines["c1"]["tools"] == [WEATHER_TOOL]
    assert lines["c2"]["conversations"][0] == {"from": "system", "value": "You are verbose."}
    assert [t["from"] for t in lines["m1"]["conversations"]] == ["human", "gpt", "tool", "gpt"]
    assert lines["m1"]["conversations"][2] == {
        "from": "tool",
        "value": "18C",
        "tool_call_id": "call_1",
    }
    assert lines["p0"]["conversations"][-1] == {
        "from": "gpt",
        "value": "4",
        "reasoning_content": "add",
    }
    assert lines["p1"] == {"id": "pass/p1", **{k: P1[k] for k in P1 if k != "id"}, "tools": []}
    assert list(lines["m0"]) == ["id", "conversations", "tools"]


async def test_openai_batch_lines_and_error_file(db: Path, tmp_path: Path) -> None:
    files, stdout = _cli_export(db, tmp_path / "out", ["--format", "openai-batch"])
    assert set(files) == {"train.jsonl", "train.errors.jsonl"}
    # The file holds several datasets: custom_ids are dataset/key.
    lines = {line["custom_id"].split("/", 1)[1]: line for line in _lines(files["train.jsonl"])}
    c0 = lines["c0"]
    assert c0["custom_id"] == "chat/c0"
    assert c0["id"].startswith("batch_req_") and c0["error"] is None
    assert c0["response"] == {
        "status_code": 200,
        "request_id": "chatcmpl-abc",
        "body": {
            "id": "chatcmpl-abc",
            "object": "chat.completion",
            "created": int(T0 + 10),
            "model": "Qwen/Qwen3-8B",
            "choices": [
                {
                    "index": 0,
                    "message": CHAT_ANSWERS[0][0],
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        },
    }
    # No stored response id: deterministic ones, the same on every export.
    c1 = lines["c1"]["response"]
    suffix = lines["c1"]["id"].removeprefix("batch_req_")
    assert c1["request_id"] == f"req_{suffix}" and c1["body"]["id"] == f"chatcmpl-{suffix}"
    assert len({line["id"] for line in lines.values()}) == len(lines)
    # Multi-turn: the final completion; pass-through: the row's answer; tokens: as read.
    assert lines["m0"]["response"]["body"]["choices"][0]["message"] == M0_TURNS[-1]
    assert lines["p0"]["response"]["body"]["choices"][0]["message"] == P0["messages"][-1]
    assert lines["p1"] == {"custom_id": "pass/p1", **P1}
    errors = _lines(files["train.errors.jsonl"])
    assert [e["custom_id"] for e in errors] == ["chat/c4", "multi/m2"]
    assert errors[0] == {
        "id": errors[0]["id"],
        "custom_id": "chat/c4",
        "response": None,
        "error": {"code": "http_400", "message": "context length exceeded"},
    }
    assert errors[0]["id"].startswith("batch_req_")
    assert "wrote 2 failed items to" in stdout and "train.errors.jsonl" in stdout


async def test_split_one_file_per_dataset(db: Path, tmp_path: Path) -> None:
    whole, _ = _cli_export(db, tmp_path / "whole", [])
    files, stdout = _cli_export(db, tmp_path / "parts", ["--split"])
    web = f"split/{file_stems(['web/qa'])['web/qa']}.jsonl"
    assert web.startswith("split/web_qa-") and web.endswith(".jsonl")
    assert set(files) == {"split/chat.jsonl", "split/multi.jsonl", "split/pass.jsonl", web}
    joined = b"".join(files[name] for name in ("split/chat.jsonl", "split/multi.jsonl"))
    joined += files["split/pass.jsonl"] + files[web]
    # The same lines, but for the token row: in the combined file it names its dataset.
    named = orjson.dumps({"id": "p1", "dataset": "pass", **P1})
    assert joined == whole["train.jsonl"].replace(named, orjson.dumps(P1))
    assert "exported 9 items to 4 files in" in stdout
    # Exporting again into the same directory replaces the files, and leaves no temp files.
    result = run_cli("export", str(tmp_path / "parts" / "split"), "--split", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert _tree(tmp_path / "parts") == files
    # A file where the directory should be is refused.
    result = run_cli("export", str(tmp_path / "whole" / "train.jsonl"), "--split", "--db", str(db))
    assert result.returncode == 2 and "not a directory" in result.stderr


def test_file_stems() -> None:
    stems = file_stems(["chat", "a/b", "a_b", "..", "", "Code", "code", "é"])
    assert stems["chat"] == "chat" and stems["a_b"] == "a_b"
    assert stems["a/b"].startswith("a_b-") and stems[".."].startswith("dataset-")
    assert stems[""].startswith("dataset-") and stems["é"].startswith("_-")
    assert stems["Code"] != stems["code"] and stems["Code"].casefold() != stems["code"].casefold()
    assert len(set(stems.values())) == len(stems)


async def test_exclude_flags(db: Path, tmp_path: Path) -> None:
    args = ["--exclude-flag", "truncated", "--exclude-flag", "empty,unclosed-think"]
    files, stdout = _cli_export(db, tmp_path / "out", args)
    ids = [line["id"] for line in _lines(files["train.jsonl"])]
    assert ids == ["c0", "c1", "m0", "p0", "p1", "w0"]
    assert "left out 3 answers flagged truncated, empty, unclosed_think" in stdout
    files, stdout = _cli_export(db, tmp_path / "ro", ["--exclude-flag", "reasoning_only"])
    assert "c3" not in [line["id"] for line in _lines(files["train.jsonl"])]
    assert "left out 1 answers flagged reasoning_only" in stdout
    bad = run_cli("export", str(tmp_path / "x.jsonl"), "--exclude-flag", "short", "--db", str(db))
    assert bad.returncode == 2 and "unknown quality flag 'short'" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()


async def test_include_failed(db: Path, tmp_path: Path) -> None:
    files, stdout = _cli_export(db, tmp_path / "out", ["--include-failed", "FAILED"])
    assert _lines(files["failed.jsonl"]) == [
        {
            "id": "c4",
            "dataset": "chat",
            "error_class": "http_400",
            "last_error": "context length exceeded",
            "attempts": 1,
        },
        {
            "id": "m2",
            "dataset": "multi",
            "error_class": "http_400",
            "last_error": "context length exceeded at turn 1",
            "attempts": 8,
            "turn": 1,
            "turns": 2,
        },
    ]
    assert "wrote 2 failed items to" in stdout
    # With the batch format, the failed items take its error shape at that path instead.
    files, _ = _cli_export(
        db, tmp_path / "b", ["--format", "openai-batch", "--include-failed", "FAILED"]
    )
    assert set(files) == {"train.jsonl", "failed.jsonl"}
    assert [e["error"]["code"] for e in _lines(files["failed.jsonl"])] == ["http_400"] * 2


async def test_provenance(db: Path, tmp_path: Path) -> None:
    files, _ = _cli_export(db, tmp_path / "out", ["--provenance"])
    lines = {line["id"]: line for line in _lines(files["train.jsonl"])}
    c0 = lines["c0"]
    assert list(c0)[-7:] == [
        "model",
        "params",
        "params_hash",
        "server",
        "created_at",
        "started_at",
        "flags",
    ]
    assert c0["model"] == "Qwen/Qwen3-8B" and c0["params"] == PARAMS and c0["params_hash"] == "h1"
    assert c0["server"] == "http://gpu:30000"
    assert c0["created_at"] == T0 + 10 and c0["started_at"] == T0 + 10 - 0.5
    assert c0["flags"] == []
    assert lines["c3"]["params"] is None and lines["c3"]["flags"] == ["empty", "reasoning_only"]
    assert lines["c2"]["flags"] == ["truncated"] and lines["m1"]["flags"] == ["unclosed_think"]
    assert lines["p1"] == {**P1, "dataset": "pass"}  # a token row as read, with its dataset

    files, _ = _cli_export(db, tmp_path / "batch", ["--format", "openai-batch", "--provenance"])
    batch = {line["custom_id"]: line for line in _lines(files["train.jsonl"])}
    assert batch["chat/c0"]["provenance"] == {
        "params": PARAMS,
        "params_hash": "h1",
        "server": "http://gpu:30000",
        "created_at": T0 + 10,
        "started_at": T0 + 9.5,
        "flags": [],
    }
    assert list(batch["chat/c0"]) == ["id", "custom_id", "response", "error", "provenance"]


async def test_broken_multi_turn_item_stops_the_export(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "train.jsonl"
    out.write_bytes(b"previous\n")
    with closing(sqlite3.connect(db)) as conn, conn:
        (multi,) = conn.execute("SELECT id FROM datasets WHERE name = 'multi'").fetchone()
        item_id = _item(conn, multi, "m9", 9, {"messages": M0}, turns=2)
        _stored_output(conn, item_id, multi, M0_TURNS[-1])  # no item_turns at all
    result = run_cli("export", str(out), "--db", str(db))
    assert result.returncode == 3
    assert "item 'm9': 2 generated turns expected, 0 stored" in result.stderr
    assert out.read_bytes() == b"previous\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_reasoning_edge_cases() -> None:
    calls = {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "r"}
    assert apply_reasoning(calls, "inline") == {
        "role": "assistant",
        "content": "<think>\nr\n</think>\n\n",
        "tool_calls": [CALL],
    }
    assert apply_reasoning(calls, "drop") == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
    }
    assert apply_reasoning(calls, "separate") is calls
    plain = {"role": "assistant", "content": "x", "reasoning_content": None}
    assert apply_reasoning(plain, "inline") == {"role": "assistant", "content": "x"}
    vllm = {"role": "assistant", "content": "x", "reasoning": "y"}
    assert apply_reasoning(vllm, "inline")["content"] == "<think>\ny\n</think>\n\nx"
    parts = {
        "role": "assistant",
        "content": [{"type": "text", "text": "x"}],
        "reasoning_content": "y",
    }
    assert apply_reasoning(parts, "inline")["content"][0] == {
        "type": "text",
        "text": "<think>\ny\n</think>\n\n",
    }
    assert sharegpt_turn({"role": "developer", "content": "rules"}) == {
        "from": "system",
        "value": "rules",
    }


async def test_status_flag_counts(db: Path, database: Database, tmp_path: Path) -> None:
    now = T0 + 600
    via_engine = await _via_engine(database, now)
    with open_reader(str(db)) as read:  # type: ignore[union-attr]
        via_sqlite = status_view.read(read, now=now)
    assert via_sqlite == via_engine
    by_name = {e["name"]: e for e in via_engine["datasets"]}
    zero = dict.fromkeys(ALL_FLAGS, 0)  # every flag is counted, unset ones as 0
    assert by_name["chat"]["flags"] == {**zero, "truncated": 1, "empty": 1, "reasoning_only": 1}
    assert by_name["multi"]["flags"] == {**zero, "unclosed_think": 1}
    assert by_name["pass"]["flags"] == zero and by_name["web/qa"]["flags"] == zero
    assert via_engine["totals"]["flags"] == {
        **zero,
        "truncated": 1,
        "empty": 1,
        "unclosed_think": 1,
        "reasoning_only": 1,
    }
    status = run_cli("status", "--json", "--db", str(db))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["totals"]["flags"] == via_engine["totals"]["flags"]
    text = run_cli("status", "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert (
        "flagged answers (kept, marked unfit): truncated 1, empty 1, unclosed_think 1,"
        " reasoning_only 1" in text.stdout
    )
    assert "  chat   truncated 1, empty 1, reasoning_only 1" in text.stdout
    assert "  multi  unclosed_think 1" in text.stdout


def test_choices_kept_in_step() -> None:
    """The CLI spells the choices out to keep its start-up light."""
    assert cli_export.EXPORT_FORMATS is choices.EXPORT_FORMATS
    assert cli_export.REASONING_MODES is choices.REASONING_MODES


def test_options_keep_the_plain_sqlite_path(db: Path, tmp_path: Path) -> None:
    """Every option is served by plain sqlite3: no SQLAlchemy, alembic or structlog.

    structlog only for the one warning: pass.jsonl mixes a conversation and a token row.
    """
    args = ["export", str(tmp_path / "split"), "--split", "--format", "openai-batch"]
    args += ["--provenance", "--exclude-flag", "truncated", "--reasoning", "inline"]
    args += ["--include-failed", str(tmp_path / "failed.jsonl"), "--db", str(db)]
    result, heavy = cli_loading(args, ("sqlalchemy", "alembic", "aiosqlite", "structlog"))
    assert {name.split(".")[0] for name in heavy} == {"structlog"}
    (warning,) = [orjson.loads(line) for line in result.stderr.splitlines()[:-1]]
    assert warning["event"] == "export_mixed_token_rows"
    assert warning["file"].endswith("pass.jsonl")
    assert "exported 8 items to 4 files in" in result.stdout
    assert len(_lines((tmp_path / "failed.jsonl").read_bytes())) == 2


async def _via_engine(database: Database, now: float) -> dict[str, Any]:
    """The status document through the SQLAlchemy adapter, on SQLite too."""
    async with database.read() as conn:
        return await conn.run_sync(
            lambda c: status_view.read(EngineRows(c, database.where), now=now)
        )
