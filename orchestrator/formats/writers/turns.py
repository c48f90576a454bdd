"""``--per-turn``: one row per generated assistant turn, whatever the line format.

The rows are those SpecForge's ``scripts/expand_reasoning_conversations.py`` (commit
a6b6b0230009d15ec2a97a57384e6f53f0f96946) writes: ``id`` = ``<id>#turn<k>``,
``source_id``, ``source_row_index`` (the row's index in the file the whole
conversations would make), ``assistant_turn_index`` (k, counting every assistant
message), the conversation up to and including turn k, and the row's other keys. The
turns before k are shown as the model saw them when it wrote turn k: without their
reasoning, as thinking chat templates render history. Trained with
``train_only_last_turn``, each row teaches one turn, in its own context.

This is a transformation of finished rows, so every writer (each JSONL format, and any
other that takes the same rows) expands the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from orchestrator.items.params import REASONING_KEYS

# The conversation's key and how an assistant message is told, by line format.
_CONVERSATION = {
    "messages": ("messages", "role", "assistant"),
    "sharegpt": ("conversations", "from", "gpt"),
    "specforge": ("conversations", "role", "assistant"),
    "parquet": ("messages", "role", "assistant"),  # the messages rows, as a table
}
# The block ``--reasoning inline`` puts before the content (export.apply_reasoning).
_INLINE = re.compile(r"\A<think>\n.*?\n</think>\n\n", re.DOTALL)
# Fields of the whole conversation's final answer: an earlier turn has none of its own.
_FINAL_ONLY = ("finish_reason", "usage")


def expandable(fmt: str) -> bool:
    return fmt in _CONVERSATION


def _visible(message: dict[str, Any], content_key: str, reasoning: str) -> dict[str, Any]:
    """An earlier turn as history: its reasoning taken out, wherever the mode put it."""
    out = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    if reasoning == "inline":
        content = out.get(content_key)
        if isinstance(content, str):
            out[content_key] = _INLINE.sub("", content, count=1)
        elif (
            isinstance(content, list)
            and content
            and isinstance(content[0], dict)
            and _INLINE.fullmatch(str(content[0].get("text", "")))
        ):
            out[content_key] = content[1:]
    return out


def expand(
    row: dict[str, Any],
    fmt: str,
    source_row_index: int,
    *,
    every_turn: bool,
    reasoning: str = "separate",
) -> Iterator[dict[str, Any]]:
    """The rows of one line, one per generated assistant turn.

    ``every_turn``: every assistant turn after the first user message was generated
    (``regenerate = "all"``, pass-through conversations); otherwise only the final one.
    A row without a conversation (a pre-tokenised row) is yielded as it is.
    """
    key, role_key, assistant = _CONVERSATION[fmt]
    messages = row.get(key)
    if not isinstance(messages, list):
        yield row
        return
    content_key = "value" if fmt == "sharegpt" else "content"
    user = "human" if fmt == "sharegpt" else "user"
    last = max(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get(role_key) == assistant),
        default=-1,
    )
    history: list[Any] = []
    turn, seen_user = 0, False
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get(role_key) != assistant:
            seen_user = seen_user or (isinstance(message, dict) and message.get(role_key) == user)
            history.append(message)
            continue
        if index == last or (every_turn and seen_user):
            yield _event(row, key, [*history, message], turn, source_row_index, index == last)
        history.append(_visible(message, content_key, reasoning))
        turn += 1


def named(row: dict[str, Any], index_of: Callable[[str], int]) -> dict[str, Any]:
    """A row that is one turn already (``regenerate = "each"``: its ``id`` is
    ``<id>#turn<k>``) with the keys ``expand`` gives its rows, so both kinds of per-turn
    file read alike: ``source_id``, ``source_row_index`` (``index_of(source_id)``) and
    ``assistant_turn_index``."""
    source_id, _, turn = str(row.get("id")).rpartition("#turn")
    event: dict[str, Any] = {
        "id": row.get("id"),
        "source_id": source_id,
        "source_row_index": index_of(source_id),
        "assistant_turn_index": int(turn) if turn.isdigit() else None,
    }
    event.update((name, value) for name, value in row.items() if name not in event)
    return event


def _event(
    row: dict[str, Any],
    key: str,
    conversation: list[Any],
    turn: int,
    source_row_index: int,
    final: bool,
) -> dict[str, Any]:
    source_id = row.get("id")
    event: dict[str, Any] = {
        "id": f"{source_id}#turn{turn}",
        "source_id": source_id,
        "source_row_index": source_row_index,
        "assistant_turn_index": turn,
    }
    for name, value in row.items():
        if name == key:
            event[name] = conversation
        elif name not in event:
            event[name] = value if final or name not in _FINAL_ONLY else None
    return event
