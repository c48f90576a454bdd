"""What every reader shares: a source's parts and rows, the columns a mapping wants,
and the words a file that cannot be read is refused in. The readers (one module per
format) import this; the registry that picks them (``source``) imports them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.errors import InputError

Raw = bytes | dict[str, Any]
"""A row as a source gives it: a JSONL line's bytes, or a table row."""
Rows = Iterator[tuple[int, Raw]]
"""A part's rows with their 1-based numbers (a JSONL file's blank lines are skipped, and
counted)."""
Wanted = frozenset[str] | None
"""The columns a mapping by columns needs: a table source may load only these and the key
columns; None: rows are read whole, as JSONL lines. A file that lacks one is read whole,
so that the row's error can list the columns there are."""
KEY_COLUMNS = frozenset({"id", "custom_id"})
"""Read with the wanted columns wherever they are: a row's own key."""


def projection(names: list[str], wanted: Wanted) -> list[str] | None:
    """Which of a table's columns ``names`` to load for ``wanted`` (None: all)."""
    if wanted is None or not wanted.issubset(names):
        return None
    return [name for name in names if name in wanted or name in KEY_COLUMNS]


@dataclass(frozen=True, slots=True)
class Part:
    """One file of a source, or its one stream: how its rows are named."""

    path: str
    """How errors name it: the path as given (a shard: the folder or glob's directory
    joined with its name), ``<stdin>``, ``<records>``, ``hf://org/name[train]``."""
    key: str | None
    """The key of a row without an id is ``f"{key}:{number}"``; None: the number alone
    (a JSONL file named directly, rows in memory: the keys they always had)."""
    unit: str = "line"
    """``line`` or ``row``: what errors count (``FILE:3``, ``FILE:row 3``)."""


class Source(Protocol):
    """Rows from one place, part by part, in a stable order."""

    @property
    def name(self) -> str:
        """The source as a whole, as the report and the dataset's ``source_path`` name it."""
        ...

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        """Each part with its rows, opened as it is reached."""
        ...

    def sha256(self) -> str | None:
        """The digest of the files read, or None (a stream, rows in memory, the Hub)."""
        ...


def file_error(name: str, exc: OSError) -> InputError:
    """A file that cannot be opened or read, in the words every reader uses."""
    if isinstance(exc, FileNotFoundError):
        reason = "no such file"
    elif isinstance(exc, IsADirectoryError):
        reason = "is a directory, not a file"
    elif isinstance(exc, NotADirectoryError):
        reason = "no such file (a parent is not a directory)"
    elif isinstance(exc, PermissionError):
        reason = "permission denied"
    else:
        reason = f"cannot read: {exc.strerror or exc}"
    return InputError(reason, path=name)


def stdin_binary() -> Any:
    """Standard input's bytes (the command's ``-``)."""
    return sys.stdin.buffer
