"""Rows of any table read by their columns: which column holds the prompt, the messages,
the key, the tools, or a template that builds the messages from several columns.

Without any of these a row is read as the JSONL line it would be (``formats.lines``).
``Columns`` is what every caller gives (the command's options, the Python API's keywords,
a run file's keys: the same names); ``check`` is the one place their combinations are
judged, ``problems`` the same judgement as a list (a run file reports every problem at
once), and ``mapper`` the per-row function the reader calls.

A template file is TOML, either the two common parts::

    system = "You are a careful solver."      # optional
    user = "Solve the problem below.\\n\\n{problem}"

or a whole conversation, each ``content`` a template::

    [[messages]]
    role = "system"
    content = "Answer from the context only."
    [[messages]]
    role = "user"
    content = "Context:\\n{context}\\n\\nQuestion: {question}"
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.formats.readers import lines
from orchestrator.formats.readers.lines import Mapped, RowError
from orchestrator.formats.readers.template import Template, TemplateError, ValueProblem, parse
from orchestrator.settings.checks import COLUMNS, check_all

__all__ = ["Columns", "Mapper", "check", "keyed", "mapper", "problems"]

Mapper = Callable[[dict[str, Any]], Mapped]
"""A row to what the reader stores (``formats.lines.Mapped``), or ``RowError``."""

_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True, slots=True, kw_only=True)
class Columns:
    """How a table's rows become prompts; all None: read each row as a JSONL line.

    The field names are the run file's keys and the Python API's keywords; the command
    spells them as options (``prompt_column`` is ``--prompt-column``).
    """

    prompt_column: str | None = None
    """A plain-text column: the user message."""
    messages_column: str | None = None
    """A list of messages (OpenAI role/content or ShareGPT from/value), or its JSON text."""
    template: str | None = None
    """The user message, built from any columns (``formats.template``)."""
    template_file: str | os.PathLike[str] | None = None
    """A TOML file of templates (the module docstring)."""
    system: str | None = None
    """A system message put first, as written (not a template)."""
    id_column: str | None = None
    """The item key; without it the row's ``id``/``custom_id``, else its place."""
    tools_column: str | None = None
    """The request's ``tools``: a list of tool objects, or its JSON text."""

    def __post_init__(self) -> None:
        # Each value by its rule (``orchestrator.settings.checks.COLUMNS``): the command's options
        # and a run file's keys are checked by the same ones before they get here.

        check_all(self.given(), COLUMNS)

    @property
    def builder(self) -> str | None:
        """Which option builds the messages, if any."""
        for name in _BUILDERS:
            if getattr(self, name) is not None:
                return name
        return None

    def given(self) -> dict[str, Any]:
        """The options set, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}


_BUILDERS = ("prompt_column", "messages_column", "template", "template_file")
_NEED_BUILDER = ("system", "tools_column")


def _say_key(name: str) -> str:
    return name


def problems(
    columns: Columns,
    *,
    fmt: str = "auto",
    mode: str = "last",
    say: Callable[[str], str] = _say_key,
) -> list[tuple[str, str]]:
    """Every problem with the mix of ``columns`` for a dataset read with ``fmt`` and
    ``mode``, as (option, reason) pairs; empty when they work (each value passed its rule
    when ``Columns`` was made). ``say`` spells an option's name the caller's way
    (``--prompt-column``, ``prompt_column``)."""
    found: list[tuple[str, str]] = []
    chosen = [name for name in _BUILDERS if getattr(columns, name) is not None]
    if len(chosen) > 1:
        found.append(
            (
                chosen[1],
                f"{' and '.join(say(n) for n in chosen)} both build the messages: choose one",
            )
        )
    if not chosen:
        found += [
            (
                name,
                f"{say(name)} needs one of {', '.join(say(n) for n in _BUILDERS)}: a row read "
                "as a JSONL line takes its system prompt and tools from its own fields",
            )
            for name in _NEED_BUILDER
            if getattr(columns, name) is not None
        ]
        return found
    if fmt != "auto":
        found.append(
            (
                "format",
                f"{say('format')} {fmt!r} names a JSONL line format; with {say(chosen[0])} the "
                "options say what each row holds",
            )
        )
    if columns.template_file is not None and columns.system is not None:
        found.append(("system", f"{say('system')}: the template file holds the system part"))
    if mode == "passthrough" and chosen[0] in ("prompt_column", "template"):
        found.append(
            (
                chosen[0],
                f"{say(chosen[0])} makes a user message only, no answer to pass through: a "
                f"pass-through dataset takes {say('messages_column')} or a "
                f"{say('template_file')} that ends with the assistant's part",
            )
        )
    return found


def check(
    columns: Columns | None,
    *,
    fmt: str = "auto",
    mode: str = "last",
    say: Callable[[str], str] = _say_key,
) -> Mapper | None:
    """The row mapper ``columns`` ask for (None: rows are read as JSONL lines, keyed by
    ``id_column`` if given: :func:`keyed`), or ``ConfigError`` with every problem, before
    anything is read."""
    if columns is None or not columns.given():
        return None
    found = problems(columns, fmt=fmt, mode=mode, say=say)
    if found:
        raise ConfigError("; ".join(reason for _, reason in found))
    if columns.builder is None:
        return None
    return mapper(columns, mode, say)


def keyed(parse: Mapper, column: str) -> Mapper:
    """``parse`` (a row read whole, as its JSONL line) with the key taken from ``column``:
    ``--id-column`` without a column that builds the messages, as for ultrachat's
    ``prompt_id`` beside its ``messages``."""

    def parse_keyed(row: dict[str, Any]) -> Mapped:
        key = _key(row, column)
        _, request, fmt, turns, usage, predicted = parse(row)
        return key, request, fmt, turns, usage, predicted

    return parse_keyed


def mapper(columns: Columns, mode: str, say: Callable[[str], str] = _say_key) -> Mapper:
    """The per-row function for ``columns`` (already ``check``-ed) and ``mode``.

    Raises ``ConfigError`` for a template or template file that cannot be used."""
    builder = _messages_builder(columns, mode, say)
    id_column = columns.id_column
    tools_column = columns.tools_column

    def map_row(row: dict[str, Any]) -> Mapped:
        messages, fmt = builder(row)
        messages, turns, predicted = _for_mode(mode, messages)
        request: dict[str, Any] = {"messages": messages}
        if tools_column is not None:
            tools = _tools(row, tools_column)
            if tools is not None:
                request["tools"] = tools
        key = _key(row, id_column) if id_column is not None else _own_key(row)
        return key, request, fmt, turns, (None, None), predicted

    return map_row


def template_columns(columns: Columns) -> frozenset[str] | None:
    """The top-level columns a mapping reads (a table source loads only these), or None
    when rows are read whole."""
    if columns.builder is None:
        return None
    names = {
        name
        for name in (columns.prompt_column, columns.messages_column, columns.id_column)
        if name is not None
    }
    if columns.tools_column is not None:
        names.add(columns.tools_column)
    for _, template in _templates(columns):
        names |= template.columns
    return frozenset(names)


# --- building the messages -----------------------------------------------------------------

_Builder = Callable[[dict[str, Any]], tuple[list[dict[str, Any]], str]]


def _messages_builder(columns: Columns, mode: str, say: Callable[[str], str]) -> _Builder:
    system = [{"role": "system", "content": columns.system}] if columns.system else []
    if columns.prompt_column is not None:
        column = columns.prompt_column

        def from_prompt(row: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
            return [*system, {"role": "user", "content": _text(row, column)}], "prompt"

        return from_prompt
    if columns.messages_column is not None:
        column = columns.messages_column

        def from_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
            messages, fmt = _conversation(row, column)
            return [*system, *messages], fmt

        return from_messages
    parts = _templates(columns, say)
    if mode == "passthrough" and parts[-1][0] != "assistant":
        raise ConfigError(
            f"{columns.template_file}: a pass-through dataset's template must end with the "
            "assistant's part (its answer)"
        )

    def from_template(row: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        messages = list(system)
        for role, template in parts:
            try:
                content = template.render(row)
            except ValueProblem as exc:
                raise RowError(str(exc)) from None
            if not content.strip():
                raise RowError(f"the template's {role} part is empty for this row")
            messages.append({"role": role, "content": content})
        return messages, "template"

    return from_template


def _templates(
    columns: Columns, say: Callable[[str], str] = _say_key
) -> list[tuple[str, Template]]:
    """The (role, template) parts of the template or template file; ``ConfigError``."""
    if columns.template is not None:
        return [("user", _parsed(columns.template, say("template")))]
    if columns.template_file is None:
        return []
    return _template_file(os.fspath(columns.template_file))


def _parsed(text: str, where: str) -> Template:
    try:
        return parse(text)
    except TemplateError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _template_file(path: str) -> list[tuple[str, Template]]:
    """A template file's parts, checked: every problem says the file and the key."""
    try:
        with open(path, "rb") as fh:
            document = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such template file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a template file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a TOML template file: {exc}") from None
    unknown = sorted(set(document) - {"system", "user", "messages"})
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r}: a template file has system and user, "
            "or [[messages]] tables with role and content"
        )
    if "messages" in document:
        if "system" in document or "user" in document:
            raise ConfigError(f"{path}: give system and user, or [[messages]], not both")
        return _message_parts(path, document["messages"])
    if "user" not in document:
        raise ConfigError(f"{path}: missing 'user' (the user message's template)")
    entries = [("system", document["system"])] if "system" in document else []
    entries.append(("user", document["user"]))
    parts = []
    for role, text in entries:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{path}: {role} must be a non-empty string")
        parts.append((role, _parsed(text, f"{path}: {role}")))
    return parts


def _message_parts(path: str, entries: object) -> list[tuple[str, Template]]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: messages must be an array of [[messages]] tables")
    parts = []
    for i, entry in enumerate(entries, start=1):
        where = f"{path}: messages[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"role", "content"}:
            raise ConfigError(f"{where} must have a role and a content, and nothing else")
        role, text = entry["role"], entry["content"]
        if role not in _ROLES:
            raise ConfigError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}.content must be a non-empty string")
        parts.append((role, _parsed(text, f"{where}.content")))
    if not any(role == "user" for role, _ in parts):
        raise ConfigError(f"{path}: no user message among the [[messages]]")
    return parts


# --- reading one column --------------------------------------------------------------------


def _value(row: dict[str, Any], column: str) -> Any:
    if column not in row:
        names = ", ".join(list(map(str, row))[:12])
        has = f" (the row has: {names})" if names else ""
        raise RowError(f"column {column!r} is missing{has}")
    value = row[column]
    if value is None:
        raise RowError(f"column {column!r} is null")
    return value


def _text(row: dict[str, Any], column: str) -> str:
    value = _value(row, column)
    if not isinstance(value, str):
        raise RowError(f"column {column!r} must be text, got {lines.kind(value)}")
    if not value.strip():
        raise RowError(f"column {column!r} is empty")
    return value


def _conversation(row: dict[str, Any], column: str) -> tuple[list[dict[str, Any]], str]:
    value = _value(row, column)
    if isinstance(value, str):
        # A CSV cell, or a column that stores the list as JSON text.
        try:
            value = lines.parse_json_value(value)
        except RowError as exc:
            raise RowError(f"column {column!r} is text but not a JSON list: {exc}") from None
    try:
        return lines.any_messages(value)
    except RowError as exc:
        raise RowError(f"column {column!r}: {exc}") from None


def _for_mode(mode: str, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
    return lines.conversation_for(mode, messages)


def _tools(row: dict[str, Any], column: str) -> object:
    if column not in row:
        raise RowError(f"column {column!r} is missing")
    try:
        return lines.tools_value(row[column])
    except RowError as exc:
        raise RowError(f"column {column!r}: {exc}") from None


def _key(row: dict[str, Any], column: str) -> str:
    value = _value(row, column)
    return lines.key_value(value, f"column {column!r}")


def _own_key(row: dict[str, Any]) -> str | None:
    """The row's own ``id`` (or ``custom_id``) column, as a JSONL line's; None without."""
    for name in ("id", "custom_id"):
        if row.get(name) is not None:
            return lines.key_value(row[name], name)
    return None
