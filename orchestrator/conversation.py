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

Pure functions of the stored request: the worker builds each turn's messages with
:func:`turn_messages`, and export rebuilds the conversation with :func:`assemble`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

# What of a generated turn goes back to the server as context: the reasoning of earlier
# turns is not sent (chat templates of reasoning models drop it anyway).
_CONTEXT_KEYS = ("role", "content", "tool_calls")


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


def turn_messages(
    messages: Sequence[Message], turn: int, generated: Sequence[Message]
) -> list[Message]:
    """The messages to send for ``turn``: the originals before it, with the turns
    already generated (``generated[:turn]``) in place of the original answers."""
    positions = targets(messages)
    if not 0 <= turn < len(positions):
        raise ValueError(f"turn {turn} out of range: the conversation has {len(positions)}")
    if len(generated) < turn:
        raise ValueError(f"turn {turn} needs {turn} generated turns, got {len(generated)}")
    replaced = {position: generated[i] for i, position in enumerate(positions[:turn])}
    return [
        _as_context(replaced[i]) if i in replaced else dict(messages[i])
        for i in range(positions[turn])
    ]


def assemble(messages: Sequence[Message], generated: Sequence[Message]) -> list[Message]:
    """The whole conversation with every target replaced by its generated turn."""
    positions = targets(messages)
    if len(generated) != len(positions):
        raise ValueError(f"{len(positions)} turns to place, got {len(generated)}")
    replaced = dict(zip(positions, generated, strict=True))
    out = [dict(replaced.get(i, m)) for i, m in enumerate(messages)]
    if positions and positions[-1] == len(messages):
        out.append(dict(generated[-1]))
    return out


def _as_context(message: Message) -> Message:
    return {k: message[k] for k in _CONTEXT_KEYS if message.get(k) is not None or k == "content"}
