"""Quality flags and the think-tag split: pure functions, no server needed."""

from __future__ import annotations

import pytest

from orchestrator.errors import ConfigError
from orchestrator.items.quality import (
    ALL_FLAGS,
    EMPTY_CONTENT,
    REASONING_ONLY,
    TOOL_MISMATCH,
    TRUNCATED,
    UNCLOSED_THINK,
    flag_names,
    flags_of,
    parse_flag,
    parse_flags,
    split_think,
)

CALL = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


def test_bits_are_stable_and_distinct():
    # Stored in the database: these values are a file format.
    assert dict(ALL_FLAGS) == {
        "truncated": 1,
        "empty": 2,
        "unclosed_think": 4,
        "reasoning_only": 8,
        "nul": 16,
        "tool_mismatch": 32,
        "invalid_json": 64,
        "schema_mismatch": 128,
        "max_tokens_reduced": 256,
        "token_mismatch": 512,
    }
    assert (TRUNCATED, EMPTY_CONTENT, UNCLOSED_THINK, REASONING_ONLY) == (1, 2, 4, 8)
    assert TOOL_MISMATCH == 32
    with pytest.raises(TypeError):
        ALL_FLAGS["new"] = 512  # type: ignore[index]


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ({"content": "an answer", "finish_reason": "stop"}, 0),
        ({"content": "an answer", "reasoning": "hmm", "finish_reason": "stop"}, 0),
        ({"content": "an ans", "finish_reason": "length"}, TRUNCATED),
        ({"content": None, "tool_calls": CALL, "finish_reason": "tool_calls"}, 0),
        ({"content": "", "tool_calls": CALL, "finish_reason": "length"}, TRUNCATED),
        ({"content": "", "finish_reason": "stop"}, EMPTY_CONTENT),
        ({"content": " \n ", "finish_reason": "stop"}, EMPTY_CONTENT),
        ({"content": None, "tool_calls": [], "finish_reason": "stop"}, EMPTY_CONTENT),
        (
            {"content": None, "reasoning": "thinking", "finish_reason": "stop"},
            EMPTY_CONTENT | REASONING_ONLY,
        ),
        (
            {"content": "", "reasoning": "  ", "finish_reason": "stop"},
            EMPTY_CONTENT,
        ),
        (
            {
                "content": "",
                "reasoning": "thin",
                "finish_reason": "length",
                "unclosed_think": True,
            },
            TRUNCATED | EMPTY_CONTENT | UNCLOSED_THINK | REASONING_ONLY,
        ),
    ],
)
def test_flags_of(parts: dict, expected: int):
    full = {"content": None, "reasoning": None, "tool_calls": None, "finish_reason": None}
    assert flags_of(**{**full, **parts}) == expected


def test_flag_names_in_bit_order():
    assert flag_names(0) == []
    assert flag_names(TRUNCATED | REASONING_ONLY | EMPTY_CONTENT) == [
        "truncated",
        "empty",
        "reasoning_only",
    ]
    assert flag_names(sum(ALL_FLAGS.values()) | 1024) == list(ALL_FLAGS)


@pytest.mark.parametrize(
    ("name", "bit"),
    [
        ("truncated", TRUNCATED),
        ("TRUNCATED", TRUNCATED),
        (" empty ", EMPTY_CONTENT),
        ("empty_content", EMPTY_CONTENT),
        ("unclosed-think", UNCLOSED_THINK),
        ("reasoning_only", REASONING_ONLY),
        ("Reasoning-Only", REASONING_ONLY),
    ],
)
def test_parse_flag(name: str, bit: int):
    assert parse_flag(name) == bit


@pytest.mark.parametrize("name", ["", "truncate", "length", "all"])
def test_parse_flag_rejects_unknown_names_listing_the_valid_ones(name: str):
    with pytest.raises(ConfigError) as info:
        parse_flag(name)
    message = str(info.value)
    assert repr(name) in message
    assert all(valid in message for valid in ALL_FLAGS)
    assert info.value.exit_code == 2


def test_parse_flags():
    assert parse_flags("truncated") == TRUNCATED
    assert parse_flags("truncated, empty,") == TRUNCATED | EMPTY_CONTENT
    assert parse_flags(",".join(ALL_FLAGS)) == sum(ALL_FLAGS.values())
    for bad in ("", " , ", "truncated,nope"):
        with pytest.raises(ConfigError, match="valid flags"):
            parse_flags(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain answer", (None, "plain answer", False)),
        ("<think>\nhmm\n</think>\n\nthe answer", ("hmm", "the answer", False)),
        ("  \n<think>hmm</think>the answer ", ("hmm", "the answer ", False)),
        ("<think>\nstill thinking", ("still thinking", "", True)),
        ("<think>", (None, "", True)),
        ("<think>\n\n</think>\n\nanswer", (None, "answer", False)),
        ("hmm, let me see\n</think>\n\nthe answer", ("hmm, let me see", "the answer", False)),
        ("</think>answer", (None, "answer", False)),
        ("<think>a</think>b</think>c", ("a", "b</think>c", False)),
        # Tags that do not open the text are part of the answer.
        ("About <think> tags: see </think>.", (None, "About <think> tags: see </think>.", False)),
        ("Use <think>x</think>", (None, "Use <think>x</think>", False)),
    ],
)
def test_split_think(text: str, expected: tuple[str | None, str, bool]):
    assert split_think(text) == expected
