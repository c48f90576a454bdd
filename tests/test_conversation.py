"""Which turns a conversation regenerates, and the context each turn is asked with."""

from __future__ import annotations

import pytest

from orchestrator.conversation import assemble, targets, turn_messages


def m(role: str, content: str | None, **extra: object) -> dict[str, object]:
    return {"role": role, "content": content, **extra}


AGENTIC = [
    m("system", "be brief"),
    m("user", "weather in Oslo?"),
    m("assistant", None, tool_calls=[{"id": "c1", "type": "function"}]),
    m("tool", "12C", tool_call_id="c1"),
    m("assistant", "It is 12C."),
    m("user", "and tomorrow?"),
    m("assistant", "Colder."),
]


def test_targets_are_assistant_turns_after_a_user_turn() -> None:
    assert targets(AGENTIC) == [2, 4, 6]
    # An opening assistant message is context; a final user turn asks for one more.
    greeting = [
        m("assistant", "hi, ask me"),
        m("user", "2+2?"),
        m("assistant", "4"),
        m("user", "3+3?"),
    ]
    assert targets(greeting) == [2, 4]
    assert targets([m("system", "s")]) == []


def test_each_turn_sees_the_generated_turns_before_it() -> None:
    new = [
        m("assistant", None, tool_calls=[{"id": "g1", "type": "function"}]),
        m("assistant", "Twelve degrees.", reasoning_content="looked it up"),
        m("assistant", "Colder, 8C."),
    ]
    assert turn_messages(AGENTIC, 0, []) == AGENTIC[:2]
    second = turn_messages(AGENTIC, 1, new[:1])
    assert second == [
        *AGENTIC[:2],
        {"role": "assistant", "content": None, "tool_calls": new[0]["tool_calls"]},
        AGENTIC[3],
    ]
    third = turn_messages(AGENTIC, 2, new[:2])
    # Earlier reasoning is not sent back; tool messages and user turns stay in place.
    assert third[4] == {"role": "assistant", "content": "Twelve degrees."}
    assert [x["role"] for x in third] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert assemble(AGENTIC, new) == [*AGENTIC[:2], new[0], AGENTIC[3], new[1], AGENTIC[5], new[2]]


def test_a_final_user_turn_is_answered_at_the_end() -> None:
    convo = [m("user", "a"), m("assistant", "old"), m("user", "b")]
    new = [m("assistant", "A"), m("assistant", "B")]
    assert turn_messages(convo, 1, new[:1]) == [
        convo[0],
        {"role": "assistant", "content": "A"},
        convo[2],
    ]
    assert assemble(convo, new) == [convo[0], new[0], convo[2], new[1]]


def test_out_of_range_turns_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        turn_messages(AGENTIC, 3, [])
    with pytest.raises(ValueError, match="needs 2 generated"):
        turn_messages(AGENTIC, 2, [])
    with pytest.raises(ValueError, match="3 turns to place"):
        assemble(AGENTIC, [])
