"""Options declared once: those several commands take alike, and the rows a command with
many options lists them in, so that a long list reads as a table, not as a wall of
decorators each spelling out the same keywords.

Only click here: ``common`` builds on it, and ``orchestrator --help`` loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

#: One option: its names (the parameter's name after them where it differs), its help
#: (None: none), and click's other keywords.
Row = tuple[str | tuple[str, ...], str | None, Mapping[str, Any]]

#: The keywords of an on/off option.
FLAG: Mapping[str, Any] = {"is_flag": True}

#: The keywords of an option that repeats.
MANY: Mapping[str, Any] = {"multiple": True}


def stacked(command: F, options: list[Callable[..., Any]]) -> F:
    """``command`` with ``options`` in the order listed (as stacked decorators would be)."""
    for option in reversed(options):
        command = option(command)
    return command


def row_options(rows: tuple[Row, ...]) -> list[Callable[..., Any]]:
    """The rows as click options, in their order."""
    options = []
    for names, text, keywords in rows:
        declared = (names,) if isinstance(names, str) else names
        options.append(click.option(*declared, help=text, **keywords))
    return options


def table(*rows: Row) -> Callable[[F], F]:
    """A decorator adding the rows' options, the first one first in ``--help``."""
    options = row_options(rows)
    return lambda command: stacked(command, options)


def datasets_option(text: str) -> Callable[[F], F]:
    """``--dataset`` repeated: the datasets a command keeps to."""
    return click.option("--dataset", "datasets", multiple=True, help=text)


def json_option(text: str) -> Callable[[F], F]:
    """``--json``: the command's answer for programs rather than people."""
    return click.option("--json", "as_json", is_flag=True, help=text)


def shown(default: Any, kind: Any = None, **more: Any) -> dict[str, Any]:
    """The keywords of an option whose default ``--help`` shows (``[default: 5]``), of
    type ``kind`` when given."""
    keywords = {"default": default, "show_default": True, **more}
    return keywords if kind is None else {"type": kind, **keywords}
