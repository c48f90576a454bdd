"""Quality flags of one answer, as a bitmask.

A finished answer can still be unfit for training: cut off by ``max_tokens``, empty, or
all thinking and no answer. Those answers are kept (retrying rarely changes them, and
whether they are wanted depends on the run), and marked instead, so that export and
``status`` can count, select or drop them. The mask is stored in an INTEGER column and
tested in SQL with ``flags & :bit``; the bit values below are part of the stored format and
must never change.

Also here: ``split_think``, which separates a ``<think>…</think>`` block that a server
without a reasoning parser leaves in the content, so the flags of a stored row can be
recomputed without the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from orchestrator.errors import ConfigError

__all__ = [
    "ALL_FLAGS",
    "EMPTY_CONTENT",
    "INVALID_JSON",
    "MAX_TOKENS_REDUCED",
    "NUL_CHAR",
    "REASONING_ONLY",
    "SCHEMA_MISMATCH",
    "TOKEN_MISMATCH",
    "TOOL_MISMATCH",
    "TRUNCATED",
    "UNCLOSED_THINK",
    "flag_names",
    "flags_of",
    "parse_flag",
    "parse_flags",
    "split_think",
]

#: finish_reason "length": the answer was cut by max_tokens (or the context length).
TRUNCATED = 1
#: Neither content nor tool calls (whitespace-only content counts as none).
EMPTY_CONTENT = 2
#: A ``<think>`` block that never closed: the answer is all reasoning, cut off.
UNCLOSED_THINK = 4
#: Reasoning but no answer: no content and no tool calls.
REASONING_ONLY = 8
#: The content or reasoning holds a U+0000 (NUL). The exported message keeps it as the
#: model emitted it; the plain-text ``content``/``reasoning`` columns hold U+FFFD in its
#: place, because PostgreSQL text cannot hold a NUL (docs/RELIABILITY.md).
NUL_CHAR = 16
#: ``regenerate = "all"``: a regenerated turn's tool calls did not line up with the
#: original's (orchestrator.items.conversation), so the conversation stopped after it.
TOOL_MISMATCH = 32
#: Structured output (``response_format`` ``json_object`` or ``json_schema``): the answer,
#: its reasoning split off, does not parse as JSON (``orchestrator.items.structured``).
INVALID_JSON = 64
#: Structured output: the answer parses, but does not satisfy the dataset's JSON schema.
SCHEMA_MISMATCH = 128
#: ``on_overflow = "fit"``: the prompt and ``max_tokens`` overflowed the server's context,
#: and the answer was asked again with ``max_tokens`` lowered to what fits.
MAX_TOKENS_REDUCED = 256
#: ``--token-ids``: the generated ids, spelled by the server's own ``/detokenize``, do not
#: hold the stored text (orchestrator.inference.tokenize): ids and text disagree.
TOKEN_MISMATCH = 512

#: Every flag by the name users type, in bit order.
ALL_FLAGS: Mapping[str, int] = MappingProxyType(
    {
        "truncated": TRUNCATED,
        "empty": EMPTY_CONTENT,
        "unclosed_think": UNCLOSED_THINK,
        "reasoning_only": REASONING_ONLY,
        "nul": NUL_CHAR,
        "tool_mismatch": TOOL_MISMATCH,
        "invalid_json": INVALID_JSON,
        "schema_mismatch": SCHEMA_MISMATCH,
        "max_tokens_reduced": MAX_TOKENS_REDUCED,
        "token_mismatch": TOKEN_MISMATCH,
    }
)

# Other spellings accepted from users: the error class name and the constant's name.
_ALIASES = {"empty_content": EMPTY_CONTENT}

_OPEN = "<think>"
_CLOSE = "</think>"


def split_think(text: str) -> tuple[str | None, str, bool]:
    """Split reasoning out of content from a server that left the think tags in it.

    Returns ``(reasoning, content, unclosed)``. A ``<think>`` opening the text (after
    whitespace) ends at the first ``</think>``; without one, a ``</think>`` alone ends the
    reasoning too (chat templates that open the block in the prompt). A ``<think>`` that
    never closes makes everything after it reasoning, with empty content: the answer was
    cut before the thinking ended. Text without tags comes back unchanged, reasoning None.
    """
    stripped = text.lstrip()
    if stripped.startswith(_OPEN):
        body = stripped[len(_OPEN) :]
        end = body.find(_CLOSE)
        if end < 0:
            return body.strip() or None, "", True
        return body[:end].strip() or None, body[end + len(_CLOSE) :].lstrip(), False
    end = text.find(_CLOSE)
    if end >= 0 and _OPEN not in text:
        return text[:end].strip() or None, text[end + len(_CLOSE) :].lstrip(), False
    return None, text, False


def flags_of(
    *,
    content: str | None,
    reasoning: str | None,
    tool_calls: Any,
    finish_reason: str | None,
    unclosed_think: bool = False,
) -> int:
    """The flag mask of one answer, from its parts after any think split."""
    mask = 0
    if finish_reason == "length":
        mask |= TRUNCATED
    answered = bool(content and content.strip()) or bool(tool_calls)
    if not answered:
        mask |= EMPTY_CONTENT
        if reasoning and reasoning.strip():
            mask |= REASONING_ONLY
    if unclosed_think:
        mask |= UNCLOSED_THINK
    if "\x00" in (content or "") or "\x00" in (reasoning or ""):
        mask |= NUL_CHAR
    return mask


def flag_names(mask: int) -> list[str]:
    """Names of the flags set in ``mask``, in bit order (unknown bits are left out)."""
    return [name for name, bit in ALL_FLAGS.items() if mask & bit]


def parse_flag(name: str) -> int:
    """The bit of a flag name as a user typed it (any case, ``-`` or ``_``)."""
    key = name.strip().lower().replace("-", "_")
    bit = ALL_FLAGS.get(key) or _ALIASES.get(key)
    if bit is None:
        raise ConfigError(f"unknown quality flag {name!r}; valid flags: {', '.join(ALL_FLAGS)}")
    return bit


def parse_flags(spec: str) -> int:
    """The mask of a comma-separated list of flag names, e.g. ``truncated,empty``."""
    mask = 0
    for name in spec.split(","):
        if name.strip():
            mask |= parse_flag(name)
    if not mask:
        raise ConfigError(f"no quality flag given; valid flags: {', '.join(ALL_FLAGS)}")
    return mask
