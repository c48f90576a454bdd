"""SpecForge's regenerated-data shape: the lines its ``scripts/regenerate_train_data.py``
writes and its ``scripts/validate_regenerated_data.py`` accepts.

Read from sgl-project/SpecForge at commit a6b6b0230009d15ec2a97a57384e6f53f0f96946.
A line is ``{"id", "conversations": [{"role", "content"}, ..., {"role": "assistant",
"content", "reasoning_content"}], "tools"?, "status": "success"}``. A row the validator
would refuse is not written there: SpecForge's trainer takes the file as it is, so one
bad row costs a run. Such a row goes to ``OUT_skipped.jsonl`` with ``"status":
"skipped"`` and the validator's own words as ``"error"``; a failed item goes to
``OUT_error.jsonl`` with ``"status": "error"``, as SpecForge's script writes both.

:func:`problem` is the validator's ``validate_row`` with ``--strict-think-markers``,
check for check and in its order, so that the first reason found is the one it gives.
"""

from __future__ import annotations

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
    "empty_content": "a message with empty content (tool-call turns)",
    "tool_message": "tool messages",
    "unsupported_role": "a role other than system, user, assistant",
    "role_order": "user and assistant not alternating",
    "no_user": "no user message",
    "reasoning_type": "reasoning_content neither string nor null",
    "think_marker": "<think> markers left in the answer",
    "no_assistant": "no assistant message",
    "ends_with_user": "not ending with an assistant message",
}


def message(item: dict[str, Any]) -> dict[str, Any]:
    """One message as SpecForge writes it: ``role`` and ``content``, and on an assistant
    turn ``reasoning_content`` (a string, or null when there is none).

    An assistant turn keeps its ``tool_calls``: dropping them would teach a turn the model
    never produced. Tool results keep their keys; the validator refuses them anyway, and
    the skipped file shows them as they were.
    """
    role = item.get("role")
    if role == "assistant":
        reasoning = next((item[k] for k in REASONING_KEYS if item.get(k) is not None), None)
        out = {"role": "assistant", "content": item.get("content"), "reasoning_content": reasoning}
        if item.get("tool_calls"):
            out["tool_calls"] = item["tool_calls"]
        return out
    if role in _SYSTEM:
        return {"role": "system", "content": item.get("content")}
    if role == "user":
        return {"role": "user", "content": item.get("content")}
    return dict(item)


def line(line_id: str, messages: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    """A done item's line: ``tools`` only where the request has them, as SpecForge keeps
    its input row's keys."""
    out: dict[str, Any] = {
        "id": line_id,
        "conversations": [message(m) if isinstance(m, dict) else m for m in messages],
    }
    if request.get("tools"):
        out["tools"] = request["tools"]
    out["status"] = "success"
    return out


def _has_think(text: str) -> bool:
    lowered = text.lower()
    return "<think>" in lowered or "</think>" in lowered


def _conversation(messages: Any) -> tuple[str, str] | None:
    """SpecForge's ``validate_conversation`` (validation wording)."""
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
            kind = "tool_message" if role == "tool" else "unsupported_role"
            return kind, f"message {index} has unsupported role {role!r}"
        if role != expected:
            return "role_order", f"message {index} expected role {expected!r}, got {role!r}"
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    if not saw_user:
        return "no_user", "conversation has no user message"
    return None


def problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """Why SpecForge's validator (``--strict-think-markers``) refuses the row: the reason's
    short name (:data:`REASONS`) and the validator's message, or None."""
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id.strip():
        return "id", "id must be a non-empty string"
    messages = row.get("conversations")
    found = _conversation(messages)
    if found is not None:
        return found
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
        if _has_think(item["content"]):
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
    """The one line that says how many rows were skipped, why, and where they are."""
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
    return f"skipped {total:,} rows SpecForge's validator refuses ({parts}): in {where}"
