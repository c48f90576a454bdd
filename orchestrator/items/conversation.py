"""Multi-turn regeneration: which assistant turns a conversation asks for, in what context.

With ``regenerate = "all"`` a conversation's original assistant turns are replaced, one
after the other, by the target model's own: turn *k* is asked with everything before it,
where the turns already generated stand in for the originals. That is what a draft model
must learn from: the target's answers to the target's own earlier answers.

The *targets* of a conversation are the positions of its assistant messages that follow
a user message (an assistant message before any user message is context, like a system
prompt), plus one position past the end when the conversation ends on a user or tool
message (its answer is generated too). System prompts, user messages and ``tool``
messages stay where they are.

Tool results answer calls by id. A regenerated turn whose calls *line up* with the
original's (as many calls, the same function names in order) keeps the original results,
renamed to the new calls' ids (``tool_call_id``), so the conversation stays one that chat
templates and servers accept. A turn whose calls do not line up (other functions, a call
where there was none, none where there was one) cannot be followed faithfully without
running the tools: the conversation stops after it (:func:`stops_after`), and
:func:`assemble` gives it that short.

Pure functions of the stored request: the worker builds each turn's messages with
:func:`turn_messages`, and export rebuilds the conversation with :func:`assemble`.

With ``regenerate = "each"`` nothing is replaced: every target is asked against the
original history before it (:func:`turn_prompts`), as an item of its own. No turn waits
for another and none can stop a conversation; the tool results are the originals',
answering the original calls, which is what an agentic trace recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.items.params import REASONING_KEYS

Message = dict[str, Any]

# What of a generated turn goes back to the server as context: its reasoning too, in the
# field the server answered it in. Models that think in a tool loop (Kimi-K2, DeepSeek-V3.2,
# GLM-4.5, MiniMax-M2, gpt-oss) render it; others' templates drop it by themselves. A
# dataset that must not send it says so (``items.params.item_body``).
_CONTEXT_KEYS = ("role", "content", "tool_calls", *REASONING_KEYS)


def targets(messages: Sequence[Message]) -> list[int]:
    """Positions of the assistant turns to generate, in order."""
    found: list[int] = []
    seen_user = False
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "user":
            seen_user = True
        elif role == "assistant" and seen_user:
            found.append(index)
    if seen_user and messages and messages[-1].get("role") != "assistant":
        found.append(len(messages))
    return found


def turn_prompts(messages: Sequence[Message]) -> list[tuple[int, list[Message]]]:
    """Each target of ``messages`` as its own prompt: ``(k, history)``, where ``k``
    counts the assistant messages before it (the ``#turn<k>`` of per-turn rows) and
    ``history`` is every original message before it."""
    prompts: list[tuple[int, list[Message]]] = []
    k = seen = 0
    for position in targets(messages):
        k += sum(1 for m in messages[seen:position] if m.get("role") == "assistant")
        seen = position
        prompts.append((k, list(messages[:position])))
    return prompts


def call_names(message: Message) -> list[Any]:
    """The function names of a message's tool calls, in order (empty: no calls)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return [None]
    return [_function(call).get("name") for call in calls]


def lines_up(original: Message, generated: Message) -> bool:
    """Whether a generated turn can stand in for the original with its tool results kept:
    as many tool calls, the same functions in the same order."""
    return call_names(original) == call_names(generated)


def stops_after(messages: Sequence[Message], turn: int, generated: Message) -> bool:
    """Whether the conversation ends after ``turn``, answered with ``generated``: there are
    turns after it, and its tool calls do not line up with the original's."""
    positions = targets(messages)
    if not 0 <= turn < len(positions):
        raise ValueError(f"turn {turn} out of range: the conversation has {len(positions)}")
    if turn + 1 == len(positions):
        return False
    return not lines_up(messages[positions[turn]], generated)


def turn_messages(
    messages: Sequence[Message], turn: int, generated: Sequence[Message]
) -> list[Message]:
    """The messages to send for ``turn``: the originals before it, with the turns
    already generated (``generated[:turn]``) in place of the original answers and the
    tool results after them renamed to their calls.

    Raises ValueError when an earlier generated turn does not line up: the conversation
    stopped there, and no later turn can be asked faithfully.
    """
    positions = targets(messages)
    if not 0 <= turn < len(positions):
        raise ValueError(f"turn {turn} out of range: the conversation has {len(positions)}")
    if len(generated) < turn:
        raise ValueError(f"turn {turn} needs {turn} generated turns, got {len(generated)}")
    for k in range(turn):
        if not lines_up(messages[positions[k]], generated[k]):
            raise ValueError(
                f"turn {k}'s tool calls {call_names(generated[k])} do not line up with the "
                f"original's {call_names(messages[positions[k]])}: the conversation stops there"
            )
    context = [_as_context(m) for m in generated[:turn]]
    return _placed(messages, positions, context)[: positions[turn]]


def assemble(messages: Sequence[Message], generated: Sequence[Message]) -> list[Message]:
    """The whole conversation with every target replaced by its generated turn.

    Fewer generated turns than targets is a conversation that stopped (see
    :func:`stops_after`): it ends with its last generated turn. Anything else short is
    refused.
    """
    positions = targets(messages)
    n = len(generated)
    if n == len(positions):
        return _placed(messages, positions, generated)
    if 0 < n < len(positions) and stops_after(messages, n - 1, generated[-1]):
        return _placed(messages, positions, generated)[: positions[n - 1] + 1]
    raise ValueError(f"{len(positions)} turns to place, got {n}")


def _placed(
    messages: Sequence[Message], positions: Sequence[int], generated: Sequence[Message]
) -> list[Message]:
    """The originals with ``generated`` at the first target positions, the tool results
    after each generated turn that lines up renamed to its calls' ids."""
    out = [dict(m) for m in messages]
    for position, new in zip(positions, generated, strict=False):
        if position == len(messages):
            out.append(dict(new))
            continue
        original = messages[position]
        out[position] = dict(new)
        if lines_up(original, new):
            _rename_results(out, position, original, new)
    return out


def _rename_results(out: list[Message], position: int, original: Message, new: Message) -> None:
    """Point the tool results right after ``position`` at the new calls: a result names
    the original call it answers by id (or, with an id unknown there, by its place)."""
    old_ids = [_call_id(c) for c in original.get("tool_calls") or []]
    new_ids = [_call_id(c) for c in new.get("tool_calls") or []]
    index = position + 1
    while index < len(out) and out[index].get("role") == "tool":
        answered = out[index].get("tool_call_id")
        place = index - position - 1
        if answered is not None:
            slot = old_ids.index(answered) if answered in old_ids else place
            if slot < len(new_ids) and new_ids[slot] is not None:
                out[index]["tool_call_id"] = new_ids[slot]
        index += 1


def _function(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    return function if isinstance(function, dict) else {}


def _call_id(call: Any) -> Any:
    return call.get("id") if isinstance(call, dict) else None


def _as_context(message: Message) -> Message:
    return {k: message[k] for k in _CONTEXT_KEYS if message.get(k) is not None or k == "content"}
