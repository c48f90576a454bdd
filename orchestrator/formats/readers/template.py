"""Prompt templates: text with ``{column}`` holes, filled from a row and nothing else.

``{name}`` is the row's column ``name``; ``{a.b}`` is field ``b`` of the struct column
``a`` (any depth); ``{{`` and ``}}`` are literal braces. That is the whole language: no
format specs, conversions, attribute access or indexing, so a template cannot run code
or read anything but the row (``str.format`` would do all of those). A field name is any
text without ``{``, ``}`` and ``.``, spaces included: ``{x:>10}`` names a column called
``x:>10``, which a row lacks.

A hole takes text or a number (written as Python writes it: ``3``, ``0.5``); a missing,
null, boolean, list or struct value is the row's error, naming the column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.formats.readers.lines import kind

__all__ = ["Template", "TemplateError", "ValueProblem", "escape", "parse"]


class TemplateError(ValueError):
    """A template that cannot be parsed: says where (1-based column) and why."""


class ValueProblem(ValueError):
    """A row that cannot fill a hole: the column path and why (the row's error)."""

    def __init__(self, column: str, reason: str):
        self.column = column
        super().__init__(f"column {column!r} {reason}")


Field = tuple[str, ...]
"""A hole: the column name, then struct field names."""


@dataclass(frozen=True, slots=True)
class Template:
    """A parsed template: literal text and holes, in order."""

    text: str
    """The template as written."""
    parts: tuple[str | Field, ...]
    """Literal text (``str``) and holes (``Field``), in order."""

    @property
    def columns(self) -> frozenset[str]:
        """The top-level columns the holes read: what a table source must load."""
        return frozenset(part[0] for part in self.parts if isinstance(part, tuple))

    def render(self, row: Mapping[str, Any]) -> str:
        """The text with every hole filled from ``row``, or ``ValueProblem``."""
        return "".join(part if isinstance(part, str) else _text(part, row) for part in self.parts)


def parse(text: str) -> Template:
    """``text`` as a template, or ``TemplateError`` naming the column where it goes wrong."""
    parts: list[str | Field] = []
    literal: list[str] = []
    i, end = 0, len(text)
    while i < end:
        char = text[i]
        if char == "}":
            if text.startswith("}}", i):
                literal.append("}")
                i += 2
                continue
            raise TemplateError(f"unmatched '}}' at column {i + 1}: write '}}}}' for a brace")
        if char != "{":
            stop = _next_brace(text, i)
            literal.append(text[i:stop])
            i = stop
            continue
        if text.startswith("{{", i):
            literal.append("{")
            i += 2
            continue
        close = text.find("}", i + 1)
        opened = text.find("{", i + 1)
        if close < 0 or 0 <= opened < close:
            raise TemplateError(
                f"'{{' at column {i + 1} is not closed: write '{{{{' for a literal brace"
            )
        if literal:
            parts.append("".join(literal))
            literal = []
        parts.append(_field(text[i + 1 : close], i + 1))
        i = close + 1
    if literal:
        parts.append("".join(literal))
    return Template(text, tuple(parts))


def escape(text: str) -> str:
    """``text`` as a template that renders to itself: braces doubled."""
    return text.replace("{", "{{").replace("}", "}}")


def _next_brace(text: str, start: int) -> int:
    """Where the next brace is at or after ``start`` (the end when there is none)."""
    found = [p for p in (text.find("{", start), text.find("}", start)) if p >= 0]
    return min(found) if found else len(text)


def _field(inside: str, column: int) -> Field:
    if not inside:
        raise TemplateError(
            f"empty field {{}} at column {column}: name a column, or write '{{{{' for a brace"
        )
    names = tuple(inside.split("."))
    if any(not name for name in names):
        raise TemplateError(
            f"field {{{inside}}} at column {column}: '.' separates a struct column from "
            "its field names, none of which may be empty"
        )
    return names


def _text(field: Field, row: Mapping[str, Any]) -> str:
    value: Any = row
    for depth, name in enumerate(field):
        if not isinstance(value, Mapping):
            held = ".".join(field[:depth])
            raise ValueProblem(
                ".".join(field), f"is missing ({held!r} is {_kind(value)}, not a struct)"
            )
        if name not in value:
            raise ValueProblem(".".join(field), "is missing" + _has(value, depth))
        value = value[name]
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if value is None:
        raise ValueProblem(".".join(field), "is null")
    raise ValueProblem(".".join(field), f"must be text or a number, got {_kind(value)}")


def _has(value: Mapping[str, Any], depth: int) -> str:
    """The names there are, for a misspelt one: `` (the row has: a, b)``."""
    names = [str(name) for name in value]
    if not names:
        return ""
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f" (the {'row' if depth == 0 else 'struct'} has: {shown})"


#: How a message about a table's value names its type (``lines.kind``).
_TABLE_KINDS: tuple[tuple[Any, str], ...] = (
    (type(None), "null"),
    (bool, "a boolean"),
    (Mapping, "a struct"),
    (list | tuple, "a list"),
    (str, "text"),
)


def _kind(value: object) -> str:
    return kind(value, _TABLE_KINDS)
