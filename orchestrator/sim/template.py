"""What the simulated server's chat template makes of the reasoning of earlier turns.

Real templates differ, and the data depends on it. Kimi-K2, DeepSeek-V3.2, GLM-4.5 and
later, MiniMax-M2 and gpt-oss render the reasoning of earlier assistant turns inside a
tool loop (``render``), Qwen3's drops it (``ignore``), Moonshot's API refuses a tool-call
turn in the history without it (``require``), and a strict server refuses the field
altogether (``refuse``). Either field name a server answers in (``reasoning_content``,
or newer vLLM's ``reasoning``) is read as the same thing, as vLLM does with both.

Pure functions of the messages, so that an oracle recomputes what the model saw.
"""

from __future__ import annotations

from typing import Any

from orchestrator.sim.config import REASONING_FIELDS as _KEYS

HISTORY_MODES: tuple[str, ...] = ("render", "ignore", "require", "refuse")


def seen(messages: Any, mode: str = "render") -> Any:
    """The messages as the template sees them: each reasoning under one name (none where
    it is empty), or, with ``ignore``, no reasoning at all."""
    if not isinstance(messages, list):
        return messages
    return [_seen(m, keep=mode != "ignore") for m in messages]


def _seen(message: Any, *, keep: bool) -> Any:
    if not isinstance(message, dict) or not any(k in message for k in _KEYS):
        return message
    out = {k: v for k, v in message.items() if k not in _KEYS}
    value = next((message[k] for k in _KEYS if message.get(k)), None)
    if keep and value is not None:
        out["reasoning_content"] = value
    return out


def refusal(messages: list[Any], mode: str, thinking: bool) -> str | None:
    """The 400 a template of ``mode`` gives these messages, or None."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        has = any(message.get(k) for k in _KEYS)
        if mode == "refuse" and any(k in message for k in _KEYS):
            key = next(k for k in _KEYS if k in message)
            return (
                f"messages.{index}: Additional properties are not allowed ('{key}' was unexpected)"
            )
        if mode == "require" and thinking and message.get("tool_calls") and not has:
            return (
                "thinking is enabled but reasoning_content is missing in assistant tool call "
                f"message at index {index}"
            )
    return None
