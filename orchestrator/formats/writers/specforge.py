"""SpecForge's training-data lines: the regenerated data its scripts write and check, and
the tool-calling conversations its trainer's loader takes.

Read from sgl-project/SpecForge at commit a6b6b0230009d15ec2a97a57384e6f53f0f96946.
A line is ``{"id", "conversations": [{"role", "content"}, ..., {"role": "assistant",
"content", "reasoning_content"}], "tools", "status": "success"}``. Two readers judge it:

- A conversation of system, user and assistant text is held to
  ``scripts/validate_regenerated_data.py`` ``validate_row`` with ``--strict-think-markers``,
  check for check and in its order, so that the first reason found is the one it gives.
- A conversation with tool calls or tool results is one that validator refuses whole
  (``scripts/conversation_validation.py`` ``validate_conversation`` wants non-empty content
  and user/assistant roles), as its regeneration script never writes one; but the trainer
  takes it: ``specforge/utils.py`` ``safe_conversations_generator`` and
  ``specforge/data/preprocessing.py`` ``build_eagle3_dataset`` hand its messages and the
  row's ``tools`` to ``specforge/data/parse.py`` ``GeneralParser.parse``, which renders them
  with the target's chat template (``apply_chat_template(messages, tools=...)``). Such a
  line is held to that parser's rules (:func:`_tool_conversation`): an assistant turn keeps
  its ``tool_calls`` as OpenAI structures with content ``""``, a tool result its role and
  ``tool_call_id``.

A row either reader would refuse, or that the parser would render other than written, is
not written there: SpecForge's trainer takes the file as it is, so one bad row costs a run,
and a row it cuts short trains on less than was asked. Such a row goes to
``OUT_skipped.jsonl`` with ``"status": "skipped"`` and the reason as ``"error"``; a failed
item goes to ``OUT_error.jsonl`` with ``"status": "error"``, as SpecForge's script writes
both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from orchestrator.items.params import REASONING_KEYS

SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"

_SYSTEM = ("system", "developer")

#: Why rows are skipped, by the short name the export report counts them under.
REASONS: dict[str, str] = {
    "id": "no id",
    "no_conversation": "no conversation (pre-tokenised rows)",
    "not_object": "a message that is not an object",
    "empty_content": "a message with empty content",
    "content_type": "a message whose content is not text",
    "unsupported_role": "a role other than system, user, assistant, tool",
    "role_order": "turns out of order",
    "no_user": "no user message",
    "tool_call": "a tool call without a function name",
    "tool_arguments": "tool-call arguments that are not JSON",
    "reasoning_type": "reasoning_content neither string nor null",
    "think_marker": "<think> markers left in the answer",
    "no_assistant": "no assistant message",
    "ends_with_user": "not ending with an assistant message",
}

#: The formats that carry a skipped row whole, named at the end of the export.
CARRIED_BY = (
    "`--format messages` (OpenAI messages with tool_calls) and `--format sharegpt` carry them "
    "whole, and `--format tokens` as the server's own ids (enqueue --token-ids)"
)


def message(item: dict[str, Any]) -> dict[str, Any]:
    """One message as SpecForge's loader reads it: ``role`` and ``content``, and on an
    assistant turn ``reasoning_content`` (a string, or null when there is none).

    An assistant turn keeps its ``tool_calls`` as they were made (arguments as JSON text,
    which ``parse.py`` ``Parser._sanitize_message`` parses), its null content as ``""``
    (what ``Parser._normalize_message`` makes of it, and a string for Arrow's column). A
    tool result keeps its keys (``tool_call_id``, which ``ThinkingParser`` passes on), its
    null content as ``""`` too.
    """
    role = item.get("role")
    if role == "assistant":
        reasoning = next((item[k] for k in REASONING_KEYS if item.get(k) is not None), None)
        content = item.get("content")
        if item.get("tool_calls") and content is None:
            content = ""
        out = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if item.get("tool_calls"):
            out["tool_calls"] = item["tool_calls"]
        return out
    if role in _SYSTEM:
        return {"role": "system", "content": item.get("content")}
    if role == "user":
        return {"role": "user", "content": item.get("content")}
    out = dict(item)
    if role == "tool" and out.get("content") is None:
        out["content"] = ""
    return out


def line(line_id: str, messages: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    """A done item's line. ``tools`` is on every line, the request's or ``[]``: SpecForge's
    offline loader (HF ``Dataset.from_generator``) takes its columns from the first rows,
    so a key on some lines only is dropped from all; ``build_eagle3_dataset`` reads ``[]``
    as no tools."""
    return {
        "id": line_id,
        "conversations": [message(m) if isinstance(m, dict) else m for m in messages],
        "tools": request.get("tools") or [],
        "status": "success",
    }


def _has_think(text: str) -> bool:
    lowered = text.lower()
    return "<think>" in lowered or "</think>" in lowered


def _conversation(messages: Any) -> tuple[str, str] | None:
    """``scripts/conversation_validation.py`` ``validate_conversation`` (validation wording)."""
    if not isinstance(messages, list) or not messages:
        return "no_conversation", "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for index, item in enumerate(messages):
        if not isinstance(item, dict):
            return "not_object", f"message {index} must be an object"
        role, content = item.get("role"), item.get("content")
        if not isinstance(content, str) or not content.strip():
            return "empty_content", f"message {index} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role not in ("user", "assistant"):
            return "unsupported_role", f"message {index} has unsupported role {role!r}"
        if role != expected:
            return "role_order", f"message {index} expected role {expected!r}, got {role!r}"
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    if not saw_user:
        return "no_user", "conversation has no user message"
    return None


def uses_tools(messages: Any) -> bool:
    """Whether a conversation has a tool call or a tool result: the rows
    :func:`_tool_conversation` judges rather than the validator."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or bool(m.get("tool_calls")))
        for m in messages
    )


#: The turn each role may follow in ``parse.py`` ``GeneralParser.parse``; at any other it
#: cuts the conversation (``break``), and the rest is never trained on.
_FOLLOWS = {"assistant": ("user", "tool"), "tool": ("assistant", "tool")}
_SPEAKERS = ("system", "user")


def _tool_conversation(messages: list[Any]) -> tuple[str, str] | None:
    """A conversation with tool turns, as SpecForge's trainer reads it; a rule broken is
    a row it would drop, cut short or render other than written."""
    previous, saw_user = None, False
    for index, item in enumerate(messages):
        if not isinstance(item, dict):  # utils.py safe_conversations_generator drops it
            return "not_object", f"message {index} must be an object"
        role, content = item.get("role"), item.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            return "unsupported_role", f"message {index} has unsupported role {role!r}"
        # parse.py GeneralParser.parse: the first message may be the system prompt, and
        # every other turn before the first user message is dropped; after it, a turn
        # that follows one it may not follow cuts the conversation.
        saw_user = saw_user or role == "user"
        if not saw_user and (index > 0 or role != "system"):
            return "role_order", (
                f"message {index}: a {role!r} turn before the first user message is dropped"
            )
        after = _FOLLOWS.get(role)
        if previous is not None and after is not None and previous not in after:
            return "role_order", (
                f"message {index}: a {role!r} turn after {previous!r} cuts the conversation"
            )
        previous = role
        # parse.py Parser._normalize_message reads a null content as ""; utils.py
        # safe_conversations_generator writes any other non-string as its JSON text.
        if content is not None and not isinstance(content, str):
            return "content_type", f"message {index} content must be a string"
        # scripts/conversation_validation.py validate_conversation: text in every turn
        # but a tool call's and a tool result's.
        said = isinstance(content, str) and bool(content.strip())
        if not said and (role in _SPEAKERS or (role == "assistant" and not item.get("tool_calls"))):
            return "empty_content", f"message {index} content must be a non-empty string"
        found = _tool_calls(index, item.get("tool_calls"))
        if found is not None:
            return found
    return None


def _tool_calls(index: int, calls: Any) -> tuple[str, str] | None:
    """``parse.py`` ``Parser._sanitize_message``: a call that is not an object is dropped,
    one without a ``function`` object loses it, and arguments that are not JSON become
    ``{}``; each would train a call other than the one made."""
    if not calls:
        return None
    if not isinstance(calls, list):
        return "tool_call", f"message {index} tool_calls must be a list"
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            return "tool_call", f"message {index} tool call {k} has no function name"
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                return "tool_arguments", (
                    f"message {index} tool call {k} arguments are not JSON "
                    "(SpecForge's parser would train {} in their place)"
                )
    return None


def problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """Why SpecForge would not take the row as written: the reason's short name
    (:data:`REASONS`) and the message, or None. A row without tool turns gets the
    validator's own (``validate_regenerated_data.py`` ``validate_row``,
    ``--strict-think-markers``); one with them the trainer's loader's rules."""
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        return "id", "id must be a non-empty string"
    messages = row.get("conversations")
    found = _tool_conversation(messages) if uses_tools(messages) else _conversation(messages)
    if found is not None:
        return found
    # validate_regenerated_data.py validate_row, for both.
    assistants = 0
    for index, item in enumerate(messages):
        if item.get("role") != "assistant":
            continue
        assistants += 1
        reasoning = item.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return "reasoning_type", (
                f"assistant message {index} reasoning_content must be a string or null"
            )
        if _has_think(item.get("content") or ""):
            return "think_marker", f"assistant message {index} contains a thinking marker"
        if isinstance(reasoning, str) and _has_think(reasoning):
            return "think_marker", (
                f"assistant message {index} reasoning_content contains a thinking marker"
            )
    if assistants == 0:
        return "no_assistant", "conversation has no assistant message"
    if messages[-1].get("role") != "assistant":
        return "ends_with_user", "conversation must end with an assistant message"
    return None


def skipped(row: dict[str, Any], error: str) -> dict[str, Any]:
    """The row as SpecForge's ``set_skipped`` leaves it."""
    return {**row, "status": "skipped", "error": error}


def error_line(failed: dict[str, Any]) -> dict[str, Any]:
    """A failed item (``export.failed_line``) as SpecForge writes one: ``status`` and
    ``error``, then our error class, attempts and turn."""
    rest = {k: v for k, v in failed.items() if k not in ("id", "dataset", "last_error")}
    return {
        "id": failed["id"],
        "dataset": failed["dataset"],
        "status": "error",
        "error": failed["last_error"],
        **rest,
    }


def beside(out: str | os.PathLike[str], suffix: str) -> Path:
    """``train.jsonl`` → ``train_skipped.jsonl``, SpecForge's names for its side files."""
    path = Path(out)
    if path.suffix == ".jsonl":
        return path.with_name(f"{path.stem}_{suffix}.jsonl")
    return path.with_name(f"{path.name}_{suffix}.jsonl")


def summary(counts: dict[str, int], files: list[Path]) -> str | None:
    """The line, said last, that counts the rows skipped, says why and where they are,
    and names the formats that carry them whole."""
    total = sum(counts.values())
    if not total:
        return None
    parts = ", ".join(
        f"{n:,} {REASONS.get(reason, reason)}"
        for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    if len(files) == 1:
        where = str(files[0])
    else:
        where = f"{files[0].parent}/<dataset>_skipped.jsonl" if files else "no file"
    return f"skipped {total:,} rows SpecForge cannot take ({parts}): in {where}; {CARRIED_BY}"
