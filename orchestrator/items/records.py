"""An input line as every layer takes it: read by ``orchestrator.formats``, written by
``orchestrator.store``. Defined once here, below both, so that the store binds the
fields in the order the readers give them without a copy of their shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True, slots=True)
class Record:
    """One input line, reduced to what identifies it and what gets sent."""

    line: int
    """The row's place in the source, from 1: a JSONL file's line number; across the files
    of a folder or glob, the count of the rows (and lines) before it plus its own number."""
    key: str
    """The row's ``id`` (or ``custom_id``, or ``--id-column``), stringified; without one,
    its place: the line number in a JSONL file named directly and in rows held in memory,
    ``FILE:N`` for the N-th row (or line) of a file of a table, folder or glob."""
    request: dict[str, Any]
    """Chat completion request body: ``messages`` plus the line's request fields."""
    digest: str
    """sha256 of the canonical request JSON: tells a changed line from an unchanged one."""
    fmt: str
    """Which of ``FORMATS`` (or ``tokens``) the line was written in."""
    mode: str = "last"
    """Which of ``MODES`` the line was read for. For ``passthrough`` the request is the row
    itself, to be stored as done."""
    turns: int = 1
    """Assistant turns to generate: ``len(conversation.targets(messages))`` for ``all``."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    """A pass-through row's own ``usage`` counts, if it has them."""
    predicted_tokens: int = 0
    """The length of the answer turns the row holds and the model writes again (the
    trailing ones dropped, or every target turn for ``all``; for ``each`` every target
    turn's, shared evenly by its items), in tokens estimated from their text
    (``orchestrator.items.answer_length.answer_tokens``); 0 when it holds none."""


class Prepared(NamedTuple):
    """One input line as the store writes it: the request already encoded and digested.

    What ``iter_prepared`` yields for bulk loading, so that a million-line file is encoded
    once per line and carries no per-line object heavier than a tuple.
    """

    line: int
    key: str
    fmt: str
    digest: str
    """The same digest as ``Record.digest``."""
    body: str
    """The request as JSON text (``orjson.dumps(Record.request)``): what is stored and sent."""
    predicted_tokens: int
    """As ``Record.predicted_tokens``."""


class PreparedItem(NamedTuple):
    """A ``Prepared`` line read for ``regenerate="all"`` or pass-through, which store more.

    The first five fields are ``Prepared``'s; a separate type keeps the plain prompt lines,
    nearly all of any large run, at six fields bound straight into the INSERT.
    """

    line: int
    key: str
    fmt: str
    digest: str
    body: str
    mode: str
    turns: int
    prompt_tokens: int | None
    completion_tokens: int | None
    predicted_tokens: int
