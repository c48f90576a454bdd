"""Tests for the streaming JSONL reader: formats, bad lines, file-level errors, memory."""

from __future__ import annotations

import gc
import hashlib
import os
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.errors import ConfigError, InputError
from orchestrator.formats import FORMATS, Record, iter_prepared, iter_records
from orchestrator.formats.readers import jsonl, lines
from orchestrator.formats.readers import rows as readers
from tests.helpers import ANSWER, CALL, RESULT

USER = {"role": "user", "content": "hi"}


def write_lines(path: Path, *lines: Any) -> Path:
    """Write objects as JSON lines and bytes/str verbatim, one per line."""
    chunks = []
    for line in lines:
        if isinstance(line, bytes):
            chunks.append(line)
        elif isinstance(line, str):
            chunks.append(line.encode())
        else:
            chunks.append(orjson.dumps(line))
    path.write_bytes(b"\n".join(chunks) + b"\n")
    return path


def read_all(path: Path) -> list[Record]:
    return list(iter_records(path))


def one(tmp_path: Path, line: Any) -> Record:
    records = read_all(write_lines(tmp_path / "in.jsonl", line))
    assert len(records) == 1
    return records[0]


def bad(tmp_path: Path, line: Any, *, lineno: int = 2) -> InputError:
    """Put ``line`` at ``lineno`` after good lines and return the error it raises."""
    path = tmp_path / "in.jsonl"
    write_lines(path, *([{"prompt": "ok"}] * (lineno - 1)), line)
    with pytest.raises(InputError) as info:
        read_all(path)
    err = info.value
    assert str(err).startswith(f"{path}:{lineno}: ")
    assert err.path == str(path)
    assert err.line == lineno
    return err


def canonical_digest(request: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(request, option=orjson.OPT_SORT_KEYS)).hexdigest()


# --- formats -----------------------------------------------------------------------------------


def test_formats_constant() -> None:
    assert FORMATS == ("messages", "sharegpt", "prompt", "openai-batch")


def test_request_fields_all_checked() -> None:
    assert set(lines.REQUEST_FIELDS) == set(lines._FIELD_CHECKS)


def test_messages_format_keeps_request_fields_only(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = {
        "messages": [{"role": "system", "content": "be brief"}, USER],
        "tools": tools,
        "tool_choice": "auto",
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 7,
    }
    # The line is the request plus its id, extra columns and a model, which are dropped.
    line = {"id": "a1", **request, "source": "web", "category": "qa", "model": "ignored"}
    rec = one(tmp_path, line)
    assert rec.fmt == "messages"
    assert rec.key == "a1"
    assert rec.line == 1
    assert rec.request == request
    assert rec.digest == canonical_digest(rec.request)


def test_messages_keep_message_keys_and_parts(tmp_path: Path) -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
            "reasoning_content": "thinking",
        },
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"},
    ]
    rec = one(tmp_path, {"messages": messages})
    assert rec.request == {"messages": messages}
    assert rec.key == "1"


def test_assistant_with_tool_calls_may_omit_content(tmp_path: Path) -> None:
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    rec = one(tmp_path, {"messages": [USER, call, tool]})
    assert rec.request["messages"] == [USER, call, tool]


def test_integer_id_and_custom_id_keys(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        {"id": 17, "prompt": "a"},
        {"custom_id": "c-2", "prompt": "b"},
        {"id": "x", "custom_id": "y", "prompt": "c"},
        {"prompt": "d"},
    )
    assert [r.key for r in read_all(path)] == ["17", "c-2", "x", "4"]


def test_sharegpt_from_value(tmp_path: Path) -> None:
    rec = one(
        tmp_path,
        {
            "id": "s1",
            "system": "you are terse",
            "conversations": [
                {"from": "human", "value": "q1"},
                {"from": "gpt", "value": "a1", "weight": 0},
                {"from": "user", "value": "q2"},
                {"from": "chatgpt", "value": "a2"},
                {"from": "observation", "value": "obs"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 10,
        },
    )
    assert rec.fmt == "sharegpt"
    assert rec.key == "s1"
    assert rec.request == {
        "messages": [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
            {"role": "tool", "content": "obs"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "max_tokens": 10,
    }


@pytest.mark.parametrize(
    ("speaker", "role"),
    [
        ("system", "system"),
        ("human", "user"),
        ("user", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("chatgpt", "assistant"),
        ("bard", "assistant"),
        ("bing", "assistant"),
        ("model", "assistant"),
        ("tool", "tool"),
        ("observation", "tool"),
        ("function_response", "tool"),
    ],
)
def test_sharegpt_role_map(tmp_path: Path, speaker: str, role: str) -> None:
    conv = [
        {"from": "human", "value": "q"},
        {"from": speaker, "value": "x"},
        {"from": "human", "value": "z"},
    ]
    rec = one(tmp_path, {"conversations": conv})
    assert rec.request["messages"][1] == {"role": role, "content": "x"}


def test_sharegpt_role_content_entries_and_string_tools(tmp_path: Path) -> None:
    rec = one(
        tmp_path,
        {
            "conversations": [{"role": "human", "content": "q"}],
            "tools": '[{"type": "function", "function": {"name": "f"}}]',
            "system": "",
        },
    )
    assert rec.request == {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    rec = one(tmp_path, {"conversations": [{"from": "human", "value": "q"}], "tools": ""})
    assert rec.request == {"messages": [{"role": "user", "content": "q"}]}


def test_sharegpt_unknown_role(tmp_path: Path) -> None:
    err = bad(
        tmp_path,
        {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
    )
    assert "message 2: unknown role 'bot'" in err.reason
    assert "human" in err.reason and "function_response" in err.reason


def test_prompt_format(tmp_path: Path) -> None:
    rec = one(tmp_path, {"prompt": "Say hi", "system": "sys", "id": "p", "temperature": 0})
    assert rec.fmt == "prompt"
    assert rec.request == {
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Say hi"}],
        "temperature": 0,
    }
    rec = one(tmp_path, {"prompt": "Say hi"})
    assert rec.request == {"messages": [{"role": "user", "content": "Say hi"}]}


def test_openai_batch_format_keeps_body(tmp_path: Path) -> None:
    body = {
        "model": "m",
        "max_tokens": 100,
        "logprobs": True,
        "messages": [USER, {"role": "assistant", "content": "old answer"}],
    }
    rec = one(
        tmp_path,
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": body},
    )
    assert rec.fmt == "openai-batch"
    assert rec.key == "req-1"
    assert rec.request == {"model": "m", "max_tokens": 100, "logprobs": True, "messages": [USER]}
    assert rec.digest == canonical_digest(rec.request)


def test_batch_without_method_and_url(tmp_path: Path) -> None:
    rec = one(tmp_path, {"custom_id": "r", "body": {"messages": [USER]}})
    assert rec.fmt == "openai-batch"
    assert rec.request == {"messages": [USER]}


def test_digest_stable_and_content_sensitive(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        {"id": "a", "messages": [USER], "max_tokens": 5, "source": "x"},
        {"max_tokens": 5, "source": "y", "messages": [USER], "id": "b"},
        {"id": "c", "messages": [USER], "max_tokens": 6},
        {"id": "d", "messages": [{"role": "user", "content": "hi!"}], "max_tokens": 5},
        {"id": "e", "prompt": "hi", "max_tokens": 5},
    )
    a, b, c, d, e = read_all(path)
    assert a.digest == b.digest  # key order and metadata do not matter
    assert len({a.digest, c.digest, d.digest}) == 3
    assert e.digest == a.digest  # same request, whatever the input format
    assert [r.digest for r in read_all(path)] == [r.digest for r in (a, b, c, d, e)]
    assert all(len(r.digest) == 64 for r in (a, b, c, d, e))


def test_mixed_formats_in_one_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        {"messages": [USER]},
        {"conversations": [{"from": "human", "value": "hi"}]},
        {"prompt": "hi"},
        {"custom_id": "z", "body": {"messages": [USER]}},
    )
    records = read_all(path)
    assert [r.fmt for r in records] == list(FORMATS)
    assert len({r.digest for r in records}) == 1


def test_null_request_fields_count_as_absent(tmp_path: Path) -> None:
    rec = one(tmp_path, {"messages": [USER], "temperature": None, "tools": None})
    assert rec.request == {"messages": [USER]}


# --- regeneration --------------------------------------------------------------------------


def test_trailing_assistant_turns_dropped(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "s"},
        USER,
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "a2"},
        {"role": "assistant", "content": "a3"},
    ]
    rec = one(tmp_path, {"messages": messages})
    assert rec.request["messages"] == messages[:4]


def test_conversation_of_only_assistant_turns_is_an_error(tmp_path: Path) -> None:
    err = bad(
        tmp_path,
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
    )
    assert err.reason == "no user message"


def test_no_user_message(tmp_path: Path) -> None:
    err = bad(
        tmp_path,
        {"messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}]},
    )
    assert err.reason == "no user message"


# --- bad lines -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"messages": [', "invalid JSON: unexpected end of data"),
        (b'{"prompt": "x",}', "invalid JSON: trailing comma"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b"42", "expected a JSON object, got int"),
        (b'"text"', "expected a JSON object, got str"),
        (b"null", "expected a JSON object, got null"),
        ({"text": "x"}, "expected one of messages, conversations, prompt, or an OpenAI batch"),
        ({"messages": "hi"}, "messages must be a list, got str"),
        ({"messages": []}, "messages is empty"),
        ({"messages": None}, "messages must be a list, got null"),
        ({"messages": ["hi"]}, "message 1 must be an object, got str"),
        ({"messages": [{"content": "x"}]}, "message 1: missing role"),
        ({"messages": [{"role": 3, "content": "x"}]}, "message 1: role must be a string, got int"),
        (
            {"messages": [{"role": ["user"], "content": "x"}]},
            "message 1: role must be a string, got list",
        ),
        (
            {"messages": [USER, USER, {"role": "bot", "content": "x"}]},
            "message 3: unknown role 'bot' (expected one of system, developer, user, assistant, "
            "tool)",
        ),
        (
            {"messages": [USER, {"role": "user", "content": 5}]},
            "message 2: content must be a string or a list of parts, got int",
        ),
        ({"messages": [{"role": "user"}]}, "message 1: missing content"),
        (
            {"messages": [USER, {"role": "assistant", "content": None}, USER]},
            "message 2: content must be a string or a list of parts, got null",
        ),
        (
            {"messages": [{"role": "user", "content": ["text"]}]},
            "message 1: content part 1 must be an object, got str",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "message 1: content part 1: missing type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": 1}]}]},
            "message 1: content part 1: type must be a string, got int",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": "a", "tool_calls": {}}]},
            "message 2: tool_calls must be a list, got object",
        ),
        (
            {"messages": [USER, {"role": "tool", "content": "a", "tool_call_id": 3}]},
            "message 2: tool_call_id must be a string, got int",
        ),
        ({"id": ["a"], "messages": [USER]}, "id must be a string or an integer, got list"),
        ({"id": True, "messages": [USER]}, "id must be a string or an integer, got bool"),
        ({"id": "", "messages": [USER]}, "id is empty"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": 3}, "prompt must be a string, got int"),
        ({"prompt": "x", "system": 1}, "system must be a string, got int"),
        ({"messages": [USER], "max_tokens": "9"}, "max_tokens must be an integer, got str"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"messages": [USER], "temperature": "hot"}, "temperature must be a number"),
        ({"messages": [USER], "stop": [1]}, "stop must be a string or a list of strings"),
        ({"messages": [USER], "tools": {}}, "tools must be a list of objects, got object"),
        ({"conversations": "x"}, "conversations must be a list, got str"),
        ({"conversations": []}, "conversations is empty"),
        ({"conversations": [{"value": "x"}]}, "message 1: missing from (or role)"),
        ({"conversations": [{"from": "human"}]}, "message 1: missing value"),
        (
            {"conversations": [{"from": "human", "value": 1}]},
            "message 1: value must be a string or a list of parts, got int",
        ),
        ({"conversations": [{"from": "gpt", "value": "a"}]}, "no user message"),
        (
            {"custom_id": "r", "method": "GET", "url": "/v1/chat/completions", "body": {}},
            "method must be POST, got 'GET'",
        ),
        (
            {"custom_id": "r", "method": "POST", "url": "/v1/embeddings", "body": {}},
            "url must be a chat completions endpoint",
        ),
        ({"custom_id": "r", "body": []}, "body must be an object, got list"),
        ({"custom_id": "r", "body": {"model": "m"}}, "body: missing messages"),
        ({"custom_id": "r", "body": {"messages": []}}, "messages is empty"),
        ({"body": {"messages": [USER]}}, "missing custom_id"),
        ({"custom_id": 1.5, "body": {"messages": [USER]}}, "custom_id must be a string or an"),
        ({"custom_id": "r", "url": "/v1/chat/completions"}, "missing body"),
    ],
)
def test_bad_line(tmp_path: Path, line: Any, reason: str) -> None:
    err = bad(tmp_path, line)
    assert err.reason.startswith(reason), err.reason


def test_invalid_utf8_mid_line(tmp_path: Path) -> None:
    err = bad(tmp_path, b'{"prompt": "caf\xc3\xa9 \xff\xfe here"}', lineno=3)
    assert err.reason == "invalid UTF-8 at column 18 (byte 0xff)"


def test_encoded_surrogate_is_invalid_utf8(tmp_path: Path) -> None:
    err = bad(tmp_path, b'{"prompt": "\xed\xa0\x80"}')
    assert err.reason.startswith("invalid UTF-8 at column 13")


def test_first_bad_line_stops_reading(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"}, b"{", {"prompt": "c"})
    it = iter_records(path)
    assert next(it).key == "1"
    with pytest.raises(InputError, match=r":2: invalid JSON"):
        next(it)


def test_on_invalid_collects_and_continues(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        {"prompt": "a"},
        b"{broken",
        {"messages": []},
        b"",
        {"prompt": "d", "id": "k"},
        b"[]",
    )
    errors: list[InputError] = []
    records = list(iter_records(path, on_invalid=errors.append))
    assert [(r.line, r.key) for r in records] == [(1, "1"), (5, "k")]
    assert [e.line for e in errors] == [2, 3, 6]
    assert str(errors[1]) == f"{path}:3: messages is empty"


def test_exception_from_on_invalid_propagates_unchanged(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"}, b"{")

    def fail(error: InputError) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        list(iter_records(path, on_invalid=fail))


def test_all_lines_invalid_with_on_invalid_is_not_a_file_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", b"{", b"[]")
    errors: list[InputError] = []
    assert list(iter_records(path, on_invalid=errors.append)) == []
    assert len(errors) == 2


# --- encoding, line ends, blank lines --------------------------------------------------------


def test_bom_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    records = read_all(path)
    assert [r.request["messages"][0]["content"] for r in records] == ["a", "b"]
    assert [r.line for r in records] == [1, 2]


def test_bom_only_allowed_at_start(tmp_path: Path) -> None:
    err = bad(tmp_path, b'\xef\xbb\xbf{"prompt": "a"}')
    assert err.reason.startswith("invalid JSON")


def test_blank_lines_skipped_numbering_kept(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\n  \n{"prompt": "a"}\n\t\r\n\n{"prompt": "b"}\n{"oops": 1}')
    with pytest.raises(InputError) as info:
        for _ in iter_records(path):
            pass
    assert info.value.line == 7
    errors: list[InputError] = []
    assert [r.line for r in iter_records(path, on_invalid=errors.append)] == [3, 6]
    assert [r.key for r in iter_records(path, on_invalid=errors.append)] == ["3", "6"]


def test_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}')
    assert [r.line for r in read_all(path)] == [1, 2]


# --- file-level errors -----------------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(InputError) as info:
        read_all(path)
    assert str(info.value) == f"{path}: no records in file"
    assert info.value.line is None


def test_only_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n   \n\r\n")
    with pytest.raises(InputError, match="no records in file") as info:
        list(iter_records(path, on_invalid=lambda e: None))
    assert info.value.line is None


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as info:
        iter_records(path)  # raised on the call, before iteration
    assert str(info.value) == f"{path}: no such file"
    assert info.value.line is None


def test_directory_without_data_files(tmp_path: Path) -> None:
    """A folder is a source of shards: one with none is refused, naming what it lacks."""
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(InputError) as info:
        iter_records(tmp_path, on_invalid=lambda e: None)  # raised on the call
    assert str(info.value) == (
        f"{tmp_path}: is a directory with no data files in it (*.parquet, *.arrow, *.jsonl, "
        "*.csv, *.tsv; the text ones also as .gz, .zst)"
    )
    assert info.value.line is None


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read anything"
)
def test_unreadable_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "secret.jsonl", {"prompt": "a"})
    path.chmod(0)
    try:
        with pytest.raises(InputError, match="permission denied"):
            list(iter_records(path))
    finally:
        path.chmod(0o600)


def test_open_failure_is_a_file_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores file modes, so simulate the refusal where the reader opens the file.
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"})

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(jsonl, "open", refuse, raising=False)
    with pytest.raises(InputError) as info:
        list(iter_records(path, on_invalid=lambda e: None))
    assert str(info.value) == f"{path}: permission denied"
    assert info.value.line is None


def test_str_path_accepted(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"})
    assert [r.key for r in iter_records(str(path))] == ["1"]


# --- size and memory -------------------------------------------------------------------------


def test_fifty_megabyte_line(tmp_path: Path) -> None:
    big = "x" * (50 * 1024 * 1024)
    path = tmp_path / "big.jsonl"
    with path.open("wb") as fh:
        fh.write(b'{"prompt": "small"}\n')
        fh.write(b'{"id": "big", "messages": [{"role": "user", "content": "')
        fh.write(big.encode())
        fh.write(b'"}]}\n{"prompt": "after"}\n')
    keys = []
    for rec in iter_records(path):
        keys.append(rec.key)
        if rec.key == "big":
            assert len(rec.request["messages"][0]["content"]) == len(big)
    assert keys == ["1", "big", "3"]


def test_memory_stays_flat(tmp_path: Path) -> None:
    path = tmp_path / "many.jsonl"
    # Small lines in three formats: tracemalloc slows every allocation, and the point is that
    # nothing accumulates from line to line, not how big each line is.
    block = b"".join(
        orjson.dumps(obj) + b"\n"
        for obj in (
            {"prompt": "p", "tag": "t"},
            {"messages": [USER], "max_tokens": 8},
            {"conversations": [{"from": "human", "value": "q"}]},
            {"id": 5, "prompt": "p"},
        )
    )
    with path.open("wb") as fh:
        for _ in range(50):
            fh.write(block * 1000)

    gc.collect()
    tracemalloc.start()
    try:
        count = 0
        for rec in iter_records(path):
            count += 1
            del rec
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 200_000
    assert peak < 2 * 1024 * 1024, peak


# --- prepared lines ----------------------------------------------------------------------------


def test_prepared_lines_match_records(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        {"id": "a", "messages": [{"role": "system", "content": "s"}, USER], "seed": 3},
        {"messages": [USER, {"role": "assistant", "content": "dropped"}]},
        b"{broken",
        {"conversations": [{"from": "human", "value": "q"}], "tools": ""},
        b"",
        {"id": 9, "prompt": "p", "system": "be brief", "tag": "meta"},
        {"custom_id": "c", "body": {"model": "m", "messages": [USER]}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}]},
        {"messages": [{"role": "robot", "content": "x"}]},
    )
    errors: list[InputError] = []
    prepared = list(iter_prepared(path, on_invalid=errors.append))
    record_errors: list[InputError] = []
    records = list(iter_records(path, on_invalid=record_errors.append))
    assert [str(e) for e in errors] == [str(e) for e in record_errors]
    assert [e.line for e in errors] == [3, 9]
    assert prepared == [
        (r.line, r.key, r.fmt, r.digest, orjson.dumps(r.request).decode(), r.predicted_tokens)
        for r in records
    ]
    assert [p.line for p in prepared] == [1, 2, 4, 6, 7, 8]
    # The dropped answer of line 2 ("dropped", 7 bytes) predicts the new one's length.
    assert [p.predicted_tokens for p in prepared] == [0, 2, 0, 0, 0, 0]
    assert all(p.digest == canonical_digest(orjson.loads(p.body)) for p in prepared)


def test_prepared_lines_stop_at_the_first_bad_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"}, {"messages": "x"}, {"prompt": "c"})
    it = iter_prepared(path)
    assert next(it).key == "1"
    with pytest.raises(InputError, match=r":2: messages must be a list"):
        next(it)
    with pytest.raises(InputError, match="no such file"):
        iter_prepared(tmp_path / "missing.jsonl")


def test_prepared_memory_stays_flat(tmp_path: Path) -> None:
    path = tmp_path / "many.jsonl"
    block = b"".join(
        orjson.dumps(obj) + b"\n"
        for obj in (
            {"id": "a", "messages": [USER]},
            {"prompt": "p", "tag": "t"},
            {"conversations": [{"from": "human", "value": "q"}]},
            {"custom_id": "b", "body": {"messages": [USER]}},
        )
    )
    path.write_bytes(block * 25_000)
    gc.collect()
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_prepared(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 100_000
    assert peak < 2 * 1024 * 1024, peak


# --- regenerate="all", pass-through and token rows ---------------------------------------------


def read_as(path: Path, **options: Any) -> list[Record]:
    return list(iter_records(path, **options))


def bad_as(tmp_path: Path, line: Any, **options: Any) -> InputError:
    """``bad`` for a file read with ``options``: the error names line 2."""
    good = tokens_row() if options.get("fmt") == "tokens" else {"messages": [USER, ANSWER]}
    path = write_lines(tmp_path / "in.jsonl", good, line)
    with pytest.raises(InputError) as info:
        read_as(path, **options)
    assert info.value.path == str(path) and info.value.line == 2
    assert str(info.value).startswith(f"{path}:2: ")
    return info.value


def test_input_format_constants() -> None:
    assert ("auto", *FORMATS, "tokens") == readers.INPUT_FORMATS
    assert readers.MODES == ("last", "all", "each", "passthrough")
    assert set(readers.PASSTHROUGH_FORMATS) < set(readers.INPUT_FORMATS)


@pytest.mark.parametrize(
    ("line", "messages", "turns"),
    [
        pytest.param({"messages": [USER, ANSWER, USER, ANSWER]}, None, 2, id="two-turns"),
        pytest.param({"messages": [USER, CALL, RESULT, CALL, RESULT, ANSWER]}, None, 3, id="agent"),
        pytest.param({"messages": [USER, ANSWER, USER]}, None, 2, id="ends-on-user"),
        pytest.param({"messages": [USER, CALL, RESULT]}, None, 2, id="ends-on-tool"),
        pytest.param({"messages": [ANSWER, USER, ANSWER]}, None, 1, id="leading-assistant"),
        pytest.param({"prompt": "q"}, [{"role": "user", "content": "q"}], 1, id="prompt"),
        pytest.param(
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a"}]},
            [USER, ANSWER],
            1,
            id="sharegpt",
        ),
        pytest.param(
            {"custom_id": "b", "body": {"messages": [USER, ANSWER, USER, ANSWER]}},
            None,
            2,
            id="batch",
        ),
    ],
)
def test_regenerate_all_keeps_the_whole_conversation(
    tmp_path: Path, line: dict[str, Any], messages: list[Any] | None, turns: int
) -> None:
    path = write_lines(tmp_path / "in.jsonl", line)
    [record] = read_as(path, regenerate="all")
    expected = messages or (line.get("messages") or line["body"]["messages"])
    assert record.request["messages"] == expected
    assert (record.mode, record.turns) == ("all", turns)
    assert record.digest == canonical_digest(record.request)
    [prepared] = list(iter_prepared(path, regenerate="all"))
    assert isinstance(prepared, readers.PreparedItem)
    assert prepared[:5] == (
        record.line,
        record.key,
        record.fmt,
        record.digest,
        orjson.dumps(record.request).decode(),
    )
    assert (prepared.mode, prepared.turns) == ("all", turns)
    # The same line read for its last answer: trailing answers dropped, one turn.
    [last] = read_as(path)
    assert (last.mode, last.turns) == ("last", 1)


def test_regenerate_all_keeps_request_fields(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    [record] = read_as(
        write_lines(tmp_path / "in.jsonl", {"id": 7, "messages": [USER, CALL], "tools": tools}),
        regenerate="all",
    )
    assert record.key == "7"
    assert record.request == {"messages": [USER, CALL], "tools": tools}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"messages": [ANSWER]}, "no user message"),
        ({"messages": [{"role": "system", "content": "s"}, ANSWER]}, "no user message"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown role 'bot'"),
        ({"input_ids": [1, 2]}, "only a pass-through dataset takes these"),
    ],
)
def test_regenerate_all_bad_lines(tmp_path: Path, line: Any, reason: str) -> None:
    assert reason in str(bad_as(tmp_path, line, regenerate="all"))


def test_token_row_read_as_a_prompt_says_what_it_is(tmp_path: Path) -> None:
    err = bad(tmp_path, {"input_ids": [1, 2], "loss_mask": [0, 1]})
    assert "pre-tokenised row (input_ids)" in str(err)


def test_passthrough_conversation_is_the_row_as_read(tmp_path: Path) -> None:
    row = {
        "id": "f1",
        "messages": [USER, ANSWER],
        "dataset": "old",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    path = write_lines(tmp_path / "in.jsonl", row, {"messages": [USER, CALL, RESULT, ANSWER]})
    first, second = read_as(path, passthrough=True)
    assert first.request == row
    assert (first.key, first.fmt, first.mode, first.turns) == ("f1", "messages", "passthrough", 1)
    assert (first.prompt_tokens, first.completion_tokens) == (3, 5)
    assert first.digest == canonical_digest(row)
    assert (second.key, second.prompt_tokens, second.completion_tokens) == ("2", None, None)
    prepared = list(iter_prepared(path, passthrough=True))
    assert [p.body for p in prepared] == [orjson.dumps(r.request).decode() for r in (first, second)]
    assert [(p.mode, p.prompt_tokens, p.completion_tokens) for p in prepared] == [
        ("passthrough", 3, 5),
        ("passthrough", None, None),
    ]


def test_passthrough_sharegpt_is_stored_as_messages(tmp_path: Path) -> None:
    row = {
        "id": "s1",
        "system": "be brief",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a"}],
        "tools": "",
        "source": "x",
    }
    [record] = read_as(write_lines(tmp_path / "in.jsonl", row), passthrough=True)
    assert record.fmt == "sharegpt"
    assert record.request == {
        "id": "s1",
        "source": "x",
        "messages": [{"role": "system", "content": "be brief"}, USER, ANSWER],
    }


def tokens_row(**fields: Any) -> dict[str, Any]:
    return {"input_ids": [5, 0, 7], "loss_mask": [0, 1, 1], **fields}


def test_token_rows(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        tokens_row(id="t1", source="x"),
        {"input_ids": [1]},  # no loss_mask: allowed
        tokens_row(usage={"completion_tokens": 2}),
    )
    for options in ({"passthrough": True}, {"passthrough": True, "fmt": "tokens"}):
        records = read_as(path, **options)
        assert [(r.key, r.fmt, r.mode) for r in records] == [
            ("t1", "tokens", "passthrough"),
            ("2", "tokens", "passthrough"),
            ("3", "tokens", "passthrough"),
        ]
        assert records[0].request == tokens_row(id="t1", source="x")
        assert (records[2].prompt_tokens, records[2].completion_tokens) == (None, 2)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"input_ids": []}, "input_ids must be a non-empty list of token ids"),
        ({"input_ids": "1 2"}, "input_ids must be a non-empty list of token ids"),
        ({"input_ids": [1, -2]}, "input_ids must hold non-negative integers only"),
        ({"input_ids": [1, 2.0]}, "input_ids must hold non-negative integers only"),
        ({"input_ids": [1, True]}, "input_ids must hold non-negative integers only"),
        (tokens_row(loss_mask=[0, 1]), "loss_mask must be a list as long as input_ids (3)"),
        (tokens_row(loss_mask="011"), "loss_mask must be a list as long as input_ids (3)"),
        (tokens_row(loss_mask=[0, 1, 2]), "loss_mask must hold 0 and 1 only"),
        (tokens_row(loss_mask=[0, True, 1]), "loss_mask must hold 0 and 1 only"),
        (tokens_row(loss_mask=[0, 0, 0]), "loss_mask is all 0: the row teaches nothing"),
        (tokens_row(id=""), "id is empty"),
        (tokens_row(usage=[1]), "usage must be an object"),
        (tokens_row(usage={"prompt_tokens": -1}), "usage.prompt_tokens must be a non-negative"),
        (b'{"input_ids": [1,', "invalid JSON"),
    ],
)
def test_bad_token_rows(tmp_path: Path, line: Any, reason: str) -> None:
    path = write_lines(tmp_path / "in.jsonl", tokens_row(), line)
    for options in ({"passthrough": True}, {"passthrough": True, "fmt": "tokens"}):
        with pytest.raises(InputError) as info:
            read_as(path, **options)
        assert info.value.line == 2
        assert str(info.value).startswith(f"{path}:2: ") and reason in str(info.value)


@pytest.mark.parametrize(
    ("line", "options", "reason"),
    [
        ({"messages": [USER]}, {}, "a passthrough row must end with the assistant's answer"),
        ({"messages": [ANSWER]}, {}, "no user message"),
        ({"prompt": "q"}, {}, "a prompt line holds no answer to pass through"),
        ({"custom_id": "b", "body": {"messages": [USER]}}, {}, "an openai-batch line holds no"),
        ({"text": "x"}, {}, "expected messages, conversations or input_ids"),
        ({"messages": [USER, ANSWER]}, {"fmt": "tokens"}, "a messages line in a dataset declared"),
        (tokens_row(), {"fmt": "messages"}, 'a tokens line in a dataset declared format = "mes'),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"fmt": "messages"},
            'a sharegpt line in a dataset declared format = "messages"',
        ),
    ],
)
def test_bad_passthrough_rows(
    tmp_path: Path, line: Any, options: dict[str, Any], reason: str
) -> None:
    assert reason in str(bad_as(tmp_path, line, passthrough=True, **options))


def test_declared_format_refuses_other_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"}, {"messages": [USER]})
    assert len(read_as(path)) == 2
    for options in ({"fmt": "prompt"}, {"fmt": "prompt", "regenerate": "all"}):
        with pytest.raises(
            InputError, match=r':2: a messages line in a dataset declared format = "prompt"'
        ):
            read_as(path, **options)
        with pytest.raises(InputError, match=":2: a messages line"):
            list(iter_prepared(path, **options))
    errors: list[InputError] = []
    assert [r.key for r in iter_records(path, fmt="prompt", on_invalid=errors.append)] == ["1"]
    assert [e.line for e in errors] == [2]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"fmt": "tokens"}, "can only be passed through"),
        ({"fmt": "prompt", "passthrough": True}, "prompt lines hold no answer to pass through"),
        ({"fmt": "openai-batch", "passthrough": True}, "openai-batch lines hold no answer"),
        ({"fmt": "csv"}, "format must be one of"),
        ({"regenerate": "every"}, "regenerate must be one of last, all, each"),
    ],
)
def test_impossible_options(tmp_path: Path, options: dict[str, Any], reason: str) -> None:
    path = write_lines(tmp_path / "in.jsonl", {"prompt": "a"})
    for read in (iter_records, iter_prepared):
        with pytest.raises(ConfigError, match=reason):
            read(path, **options)
