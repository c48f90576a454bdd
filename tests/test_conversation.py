"""Which turns a conversation regenerates, and the context each turn is asked with."""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.items.conversation import (
    assemble,
    call_names,
    stops_after,
    targets,
    turn_messages,
    turn_prompts,
)


def m(role: str, content: str | None, **extra: object) -> dict[str, object]:
    return {"role": role, "content": content, **extra}


def call(call_id: str, name: str) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


AGENTIC = [
    m("system", "be brief"),
    m("user", "weather in Oslo?"),
    m("assistant", None, tool_calls=[call("c1", "weather")]),
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
        m("assistant", None, tool_calls=[call("g1", "weather")]),
        m("assistant", "Twelve degrees.", reasoning_content="looked it up"),
        m("assistant", "Colder, 8C."),
    ]
    assert turn_messages(AGENTIC, 0, []) == AGENTIC[:2]
    second = turn_messages(AGENTIC, 1, new[:1])
    # The same call, made again under its own id: the original result now answers it.
    result = {**AGENTIC[3], "tool_call_id": "g1"}
    assert second == [
        *AGENTIC[:2],
        {"role": "assistant", "content": None, "tool_calls": new[0]["tool_calls"]},
        result,
    ]
    third = turn_messages(AGENTIC, 2, new[:2])
    # Earlier reasoning goes back with its turn (the server's template decides what of it
    # the model sees); tool messages and user turns stay in place.
    assert third[4] == {
        "role": "assistant",
        "content": "Twelve degrees.",
        "reasoning_content": "looked it up",
    }
    assert [x["role"] for x in third] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert assemble(AGENTIC, new) == [*AGENTIC[:2], new[0], result, new[1], AGENTIC[5], new[2]]
    assert AGENTIC[3]["tool_call_id"] == "c1"  # the stored request is left as it was


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


def test_tool_results_follow_the_new_calls_by_id() -> None:
    convo = [
        m("user", "weather and time in Oslo?"),
        m("assistant", "", tool_calls=[call("c1", "weather"), call("c2", "time")]),
        m("tool", "14:00", tool_call_id="c2"),
        m("tool", "12C", tool_call_id="c1"),
        m("assistant", "12C at 14:00."),
    ]
    new = [
        m("assistant", None, tool_calls=[call("g1", "weather"), call("g2", "time")]),
        m("assistant", "Twelve degrees, two o'clock."),
    ]
    assert stops_after(convo, 0, new[0]) is False
    asked = turn_messages(convo, 1, new[:1])
    # Each result keeps its place and answers the new call that stands for its own.
    assert [(x["content"], x.get("tool_call_id")) for x in asked[2:]] == [
        ("14:00", "g2"),
        ("12C", "g1"),
    ]
    assert assemble(convo, new)[2:4] == asked[2:4]


@pytest.mark.parametrize(
    ("original", "regenerated"),
    [
        ([call("c1", "weather")], [call("g1", "search")]),  # another function
        ([call("c1", "weather")], []),  # no call where there was one
        ([call("c1", "weather")], [call("g1", "weather"), call("g2", "weather")]),
        ([], [call("g1", "weather")]),  # a call where there was none
    ],
)
def test_a_turn_that_does_not_line_up_stops_the_conversation(
    original: list[dict[str, object]], regenerated: list[dict[str, object]]
) -> None:
    convo = [m("user", "weather in Oslo?"), m("assistant", "x", tool_calls=original)]
    convo += [m("tool", "12C", tool_call_id=c["id"]) for c in original]
    convo += [m("assistant", "It is 12C."), m("user", "thanks")]
    new = m("assistant", "let me see", tool_calls=regenerated)
    assert stops_after(convo, 0, new)
    # The conversation ends with the turn that went its own way.
    assert assemble(convo, [new]) == [convo[0], new]
    with pytest.raises(ValueError, match="do not line up"):
        turn_messages(convo, 1, [new])
    # The last turn never stops anything: nothing follows it.
    assert not stops_after(convo, len(targets(convo)) - 1, new)


def test_a_short_conversation_must_have_stopped() -> None:
    lined_up = m("assistant", None, tool_calls=[call("g1", "weather")])
    with pytest.raises(ValueError, match="3 turns to place, got 1"):
        assemble(AGENTIC, [lined_up])


# ---------------------------------------------------------------- properties

NAMES = ("weather", "search", "read")


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, object]]:
    """Conversations as datasets hold them: system or developer prompts, perhaps an
    opening assistant message, then exchanges of a user turn and zero or more assistant
    turns, with or without tool calls, each call answered by a tool result (in any
    order); they may end on a user turn, a tool result or an assistant turn."""
    messages: list[dict[str, object]] = []
    for i, role in enumerate(draw(st.lists(st.sampled_from(["system", "developer"]), max_size=2))):
        messages.append(m(role, f"prompt {i}"))
    if draw(st.booleans()):
        messages.append(m("assistant", "hello, ask me"))
    ids = itertools.count()
    for u in range(draw(st.integers(1, 3))):
        messages.append(m("user", f"question {u}"))
        for s in range(draw(st.integers(0, 3))):
            names = draw(st.lists(st.sampled_from(NAMES), max_size=3))
            if not names:
                messages.append(m("assistant", f"answer {u}.{s}"))
                continue
            calls = [call(f"c{next(ids)}", name) for name in names]
            content = draw(st.sampled_from([None, "", "let me check"]))
            messages.append(m("assistant", content, tool_calls=calls))
            for i in draw(st.permutations(range(len(calls)))):
                messages.append(m("tool", f"result {i}", tool_call_id=calls[i]["id"]))
    return messages


@st.composite
def answer_to(draw: st.DrawFn, original: dict[str, object] | None, k: int) -> dict[str, object]:
    """A generated turn: often the original's calls made again (under new ids), else
    whatever calls (or none) the model chose; sometimes with reasoning."""
    same = original is not None and draw(st.booleans())
    names = call_names(original) if same and original else draw(st.lists(st.sampled_from(NAMES)))
    message = m("assistant", None if names else f"new answer {k}")
    if names:
        message["tool_calls"] = [call(f"g{k}.{i}", str(n)) for i, n in enumerate(names)]
    field = draw(st.sampled_from([None, "reasoning_content", "reasoning"]))
    if field is not None:
        message[field] = f"thinking {k}"
    return message


def context(message: dict[str, object]) -> dict[str, object]:
    """What of a generated turn is sent back: all of it, its reasoning too, in the field
    the server answered it in."""
    return dict(message)


def regenerate_in_order(
    messages: list[dict[str, object]], answers: list[dict[str, object]]
) -> tuple[list[list[dict[str, object]]], list[dict[str, object]]]:
    """The reference: one walk from front to back, answering each assistant turn after a
    user turn (and a final user or tool turn) with the next answer, renaming the results
    of calls made again, and ending after a turn whose calls went another way. Returns
    what each turn was asked with, and the conversation."""
    out: list[tuple[dict[str, object], bool]] = []
    asked: list[list[dict[str, object]]] = []
    seen_user = False
    renames: dict[object, object] = {}

    def answer() -> dict[str, object]:
        asked.append([context(x) if generated else dict(x) for x, generated in out])
        new = answers[len(asked) - 1]
        out.append((new, True))
        return new

    for i, message in enumerate(messages):
        if message["role"] != "tool":
            renames = {}
        if message["role"] == "user":
            seen_user = True
        if message["role"] == "assistant" and seen_user:
            new = answer()
            old_calls = message.get("tool_calls") or []
            new_calls = new.get("tool_calls") or []
            old_names = [c["function"]["name"] for c in old_calls]  # type: ignore[index]
            if old_names == [c["function"]["name"] for c in new_calls]:  # type: ignore[index]
                renames = {o["id"]: n["id"] for o, n in zip(old_calls, new_calls, strict=True)}  # type: ignore[index]
                continue
            rest = messages[i + 1 :]
            if any(x["role"] == "assistant" for x in rest) or messages[-1]["role"] != "assistant":
                return asked, [x for x, _ in out]
            continue
        if message["role"] == "tool" and message["tool_call_id"] in renames:
            message = {**message, "tool_call_id": renames[message["tool_call_id"]]}
        out.append((dict(message), False))
    if seen_user and messages[-1]["role"] != "assistant":
        answer()
    return asked, [x for x, _ in out]


def unanswered(conversation: list[dict[str, object]]) -> list[object]:
    """Tool results that answer no call of the assistant turn before them."""
    offered: list[object] = []
    stray = []
    for message in conversation:
        if message["role"] == "assistant":
            offered = [c["id"] for c in message.get("tool_calls") or []]  # type: ignore[index]
        elif message["role"] == "tool" and message["tool_call_id"] not in offered:
            stray.append(message["tool_call_id"])
    return stray


@settings(max_examples=300, deadline=None)
@given(conversations(), st.data())
def test_turns_are_asked_and_assembled_as_regenerated_in_order(
    messages: list[dict[str, object]], data: st.DataObject
) -> None:
    frozen = copy.deepcopy(messages)
    positions = targets(messages)
    originals = [messages[p] if p < len(messages) else None for p in positions]
    answers = [data.draw(answer_to(o, k)) for k, o in enumerate(originals)]
    expected_asked, expected = regenerate_in_order(messages, answers)
    # The worker's loop: ask each turn, stop where the conversation cannot go on.
    generated: list[dict[str, object]] = []
    for k in range(len(positions)):
        asked = turn_messages(messages, k, generated)
        assert asked == expected_asked[k], k
        # No target of its own: the turn's original answer is never sent.
        assert len(asked) == positions[k]
        generated.append(answers[k])
        if stops_after(messages, k, answers[k]):
            break
    assert len(generated) == len(expected_asked)
    assert assemble(messages, generated) == expected
    assert unanswered(expected) == [] and unanswered(assemble(messages, generated)) == []
    assert messages == frozen  # the stored request is never changed in place


def test_each_turn_is_asked_against_the_original_history() -> None:
    """``regenerate = "each"``: every target with the original messages before it, the
    original tool results answering the original calls; k counts every assistant
    message before it (an opening one too), as per-turn rows are numbered."""
    opening = [m("system", "s"), m("assistant", "hello"), *AGENTIC[1:], m("user", "thanks")]
    prompts = turn_prompts(opening)
    assert [k for k, _ in prompts] == [1, 2, 3, 4]
    assert [len(history) for _, history in prompts] == targets(opening)
    assert all(history == opening[: len(history)] for _, history in prompts)
    assert prompts[1][1][-1] == m("tool", "12C", tool_call_id="c1")
    assert turn_prompts([m("system", "s"), m("assistant", "a")]) == []
