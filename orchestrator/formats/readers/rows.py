"""Reading a source's rows into what the store writes: the rules written once, for every
source format.

A source (``formats.source``: JSONL, Parquet, CSV, Arrow, the Hub, rows in memory) gives
raw rows with where they are; each becomes one ``Record`` whose ``request`` is a
ready-to-send chat completion body, so the rest of the orchestrator never needs to know
which format or file a row came from. A row is read by its columns when ``Columns`` say so
(``formats.columns``: a prompt column, a messages column, a template), else as the JSONL
line it would be (``formats.lines``: messages, sharegpt, prompt, openai-batch), so a table
of ``conversations`` rows reads as their JSONL file would. Three ways of reading serve the
kinds of dataset:

``regenerate="last"`` (default)
    The final answer is generated: trailing assistant turns are dropped.
``regenerate="all"``
    The whole conversation is kept, trailing assistant turns included, and each row
    counts the assistant turns the model will write (``orchestrator.items.conversation``).
``regenerate="each"``
    Each assistant turn to write becomes an item of its own, keyed ``<key>#turn<k>``,
    asking it against the original messages before it (``conversation.turn_prompts``):
    one ordinary prompt per turn, so nothing downstream needs to know.
``passthrough=True``
    Rows that already hold the answer and are stored as done: conversations ending with
    the assistant's turn (``messages`` or ``conversations``; the stored row is the line's
    object with ShareGPT turns in OpenAI ``messages`` form), or pre-tokenised ``tokens``
    rows (``{"input_ids": [...], "loss_mask": [...]}``).

A bad row names its place: ``FILE:LINE: reason`` for a line, ``FILE:row N: reason`` for a
table's row (numbered from 1, as lines are).
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, NamedTuple, TypedDict, TypeVar, Unpack

import orjson

from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.readers.base import Part, Raw, Source
from orchestrator.formats.readers.columns import Columns, keyed, template_columns
from orchestrator.formats.readers.columns import check as check_columns
from orchestrator.formats.readers.jsonl import RecordsSource
from orchestrator.formats.readers.lines import (
    ITEM_PARSERS,
    Mapped,
    RowError,
    parse_json,
    parse_line,
    parse_object,
    too_deep,
)
from orchestrator.formats.readers.source import open_source
from orchestrator.items.conversation import turn_prompts
from orchestrator.items.records import Prepared, PreparedItem, Record
from orchestrator.settings.choices import INPUT_FORMATS, LINE_FORMATS
from orchestrator.settings.dataset_options import REGENERATE

FORMATS = LINE_FORMATS
PASSTHROUGH_FORMATS: tuple[str, ...] = ("auto", "messages", "sharegpt", "tokens")
"""The formats whose rows can hold an answer to pass through."""
MODES: tuple[str, ...] = ("last", "all", "each", "passthrough")
"""How a line was read: its final answer to generate, every assistant turn (one item, or
an item per turn), or stored as is."""


_T = TypeVar("_T")
_L = TypeVar("_L", Record, Prepared, PreparedItem)
Say = Callable[[str], str]
"""How messages spell an option's name (``--prompt-column`` or ``prompt_column``)."""


class ReadOptions(TypedDict, total=False):
    """How a source is read: the keyword options of every reader, their defaults in
    :func:`_reading`, so that the readers take the same options under the same names."""

    on_invalid: Callable[[InputError], None] | None
    fmt: str
    regenerate: str
    passthrough: bool
    columns: Columns | None
    split: str | None
    config: str | None
    say: Say | None
    endpoint: str


def iter_records(source: object, **options: Unpack[ReadOptions]) -> Reading[Record]:
    """Yield one ``Record`` per row of ``source`` (``formats.source.open_source``: a
    path, a folder, a glob, ``-``, ``hf://``, a table or rows in memory).

    A bad row raises ``InputError`` unless ``on_invalid`` is given, in which case the error
    is handed to it and the row skipped, so one malformed row need not stop a million-row
    ingest. Problems with the source itself (missing, unreadable, no records) always raise.
    Missing files, empty folders and unknown splits are reported here, before iteration
    starts, so callers fail fast; read errors surface on the first ``next()``.

    ``fmt`` (one of ``INPUT_FORMATS``) makes a row of any other format a bad row.
    ``regenerate="all"`` keeps whole conversations and counts their turns;
    ``passthrough`` reads rows that hold their answer (see the module docstring);
    ``columns`` read rows by their columns. An impossible combination raises
    ``ConfigError`` here. ``endpoint="completions"`` takes plain prompts only, each as
    ``{"prompt": ...}`` (:func:`prompt_request`).
    """
    return _reading("record", source, **options)


def iter_prepared(
    source: object, **options: Unpack[ReadOptions]
) -> Reading[Prepared] | Reading[PreparedItem]:
    """``iter_records`` for bulk loading: the same rows, checks and errors, as ``Prepared``
    (``PreparedItem`` when read for ``regenerate="all"`` or pass-through). For the
    ``completions`` endpoint each row must be a plain prompt, stored as ``{"prompt"}``."""
    return _reading("prepared", source, **options)


def iter_prepared_rows(
    rows: Iterable[Any],
    *,
    source: str = "<records>",
    on_invalid: Callable[[InputError], None] | None = None,
    fmt: str = "auto",
    regenerate: str = "last",
    passthrough: bool = False,
) -> Reading[Prepared] | Reading[PreparedItem]:
    """``iter_prepared`` over rows already in memory (the Python API's records).

    Each row is read as the JSONL line it would be in a file, so it gets the same checks
    and the same errors, naming ``source`` and the row's 1-based position as its line.
    """
    records = RecordsSource(rows, name=source)
    return _reading(
        "prepared",
        records,
        on_invalid=on_invalid,
        fmt=fmt,
        regenerate=regenerate,
        passthrough=passthrough,
    )


def _reading(
    kind: str,
    spec: object,
    *,
    on_invalid: Callable[[InputError], None] | None = None,
    fmt: str = "auto",
    regenerate: str = "last",
    passthrough: bool = False,
    columns: Columns | None = None,
    split: str | None = None,
    config: str | None = None,
    say: Say | None = None,
    endpoint: str = "chat",
) -> Reading[Any]:
    """The one way every entry point reads: options checked, the source resolved, then
    the rows, lazily."""
    mode = _mode(fmt, regenerate, passthrough)
    if mode == "each" and endpoint == "completions":
        raise ConfigError("the completions endpoint sends plain prompts: it takes no turns")
    mapper = check_columns(columns, fmt=fmt, mode=mode, say=say or _same)
    wanted = template_columns(columns) if mapper is not None and columns is not None else None
    source = spec if _is_source(spec) else open_source(spec, split=split, config=config)
    # An id column without a column that builds the messages: rows read whole, keyed by it.
    id_column = columns.id_column if columns is not None and mapper is None else None
    parsers = _Parsers(kind, mode, fmt, mapper, raw=endpoint == "completions", id_column=id_column)
    return Reading(source, parsers, on_invalid, wanted)  # type: ignore[arg-type]


def _same(name: str) -> str:
    return name


def _is_source(spec: object) -> bool:
    return hasattr(spec, "parts") and hasattr(spec, "sha256") and hasattr(spec, "name")


def _mode(fmt: str, regenerate: str, passthrough: bool) -> str:
    """Which of ``MODES`` the options ask for, or ``ConfigError``."""
    if fmt not in INPUT_FORMATS:
        raise ConfigError(f"format must be one of {', '.join(INPUT_FORMATS)}, got {fmt!r}")
    if regenerate not in REGENERATE:
        raise ConfigError(f"regenerate must be one of {', '.join(REGENERATE)}, got {regenerate!r}")
    if passthrough:
        if fmt not in PASSTHROUGH_FORMATS:
            raise ConfigError(
                f"{fmt} lines hold no answer to pass through; a pass-through dataset takes "
                + ", ".join(PASSTHROUGH_FORMATS)
            )
        return "passthrough"
    if fmt == "tokens":
        raise ConfigError(
            "tokens rows are pre-tokenised training rows, not prompts: they can only be "
            "passed through (passthrough)"
        )
    return regenerate


class Reading(Generic[_T]):
    """A source's rows, read as they are iterated, and where each one came from.

    ``place`` names a row by its ``line`` (the store reports a duplicate or a changed row
    with it); ``name`` and ``sha256`` are the source's.
    """

    def __init__(
        self,
        source: Source,
        parsers: _Parsers,
        on_invalid: Callable[[InputError], None] | None,
        wanted: frozenset[str] | None,
    ):
        self.source = source
        self.name = source.name
        self._starts: list[tuple[int, Part]] = []
        self._turns = parsers.turns
        self._rows: Iterator[_T] = _read(source, parsers, on_invalid, wanted, self._starts)

    def __iter__(self) -> Iterator[_T]:
        # The generator itself: a loop over a million rows pays no Python call per row.
        return self._rows

    def __next__(self) -> _T:
        return next(self._rows)

    def sha256(self) -> str | None:
        return self.source.sha256()

    def row(self, line: int) -> int:
        """The ``line`` of the row an item at ``line`` was read from: itself, unless
        the row made an item per turn (``regenerate="each"``)."""
        return line if self._turns is None else self._turns.row(line)

    def place(self, line: int) -> tuple[str, int | None, int | None]:
        """(path, line, row) of the row at ``line``: what ``InputError`` takes."""
        if self._turns is not None:
            line = self._turns.row(line)
        part = None
        number = line
        for offset, start in self._starts:
            if offset >= line:
                break
            part, number = start, line - offset
        if part is None:
            return self.name, line, None
        return (part.path, number, None) if part.unit == "line" else (part.path, None, number)


def _read(
    source: Source,
    parsers: _Parsers,
    on_invalid: Callable[[InputError], None] | None,
    wanted: frozenset[str] | None,
    starts: list[tuple[int, Part]],
) -> Iterator[Any]:
    """Each part's rows through its parser; a bad one raises or goes to ``on_invalid``."""
    yielded = invalid = 0
    offset = 0
    many = parsers.turns is not None
    for part, rows in source.parts(wanted):
        starts.append((offset, part))
        parse = parsers.for_part(part, offset)
        last = 0
        for number, raw in rows:
            last = number
            try:
                item = parse(raw, number)
            except RowError as exc:
                reason = str(exc)
            except orjson.JSONEncodeError as exc:
                # The row reads, but its request cannot be written back as JSON: orjson
                # writes at most MAX_DEPTH levels of nesting, and JSON types only.
                reason = _unwritable(raw, exc)
            else:
                if many:
                    yielded += len(item)
                    yield from item
                    continue
                yielded += 1
                yield item
                continue
            error = _error(reason, part, number)
            if on_invalid is None:
                raise error from None
            invalid += 1
            on_invalid(error)
        offset += last
    if yielded == 0 and invalid == 0:
        raise InputError(_empty(source), path=source.name)


def _error(reason: str, part: Part, number: int) -> InputError:
    if part.unit == "line":
        return InputError(reason, path=part.path, line=number)
    return InputError(reason, path=part.path, row=number)


def _empty(source: Source) -> str:
    files = getattr(source, "files", None)
    if files is None:
        return "no records"
    return "no records in file" if len(files) == 1 else f"no records in its {len(files)} files"


def _unwritable(raw: Raw, exc: orjson.JSONEncodeError) -> str:
    if isinstance(raw, bytes):
        return too_deep(orjson.loads(raw))
    if "ecursion" in str(exc):
        return too_deep(raw)
    return f"a value has no JSON form: {exc}"


_dumps = orjson.dumps
_SORT_KEYS = orjson.OPT_SORT_KEYS
_sha256 = hashlib.sha256
_new_tuple = tuple.__new__


class _Parsers:
    """The per-row function of one read, made for each part: how its raw rows become
    what is yielded (``Record``, ``Prepared`` or ``PreparedItem``)."""

    def __init__(
        self,
        kind: str,
        mode: str,
        fmt: str,
        mapper: Callable[[dict], Mapped] | None,
        *,
        raw: bool = False,
        id_column: str | None = None,
    ):
        self.raw = raw
        self.kind = kind
        self.mode = mode
        self.fmt = fmt
        self.mapper = mapper
        self.item_parser = mapper or ITEM_PARSERS[mode, fmt == "tokens"]
        self.id_column = id_column
        # regenerate="each": a row becomes a list of items, numbered apart.
        self.turns = _TurnItems() if mode == "each" else None
        if id_column is not None:
            self.item_parser = keyed(self.item_parser, id_column)

    def for_part(self, part: Part, offset: int) -> Callable[[Raw, int], Any]:
        parse = self._for_part(part, offset)
        return _as_prompt(parse) if self.raw else parse

    def _for_part(self, part: Part, offset: int) -> Callable[[Raw, int], Any]:
        plain = self.mode == "last" and self.mapper is None and self.id_column is None
        if plain and part.key is None and offset == 0 and part.unit == "line":
            # A JSONL file named directly: nearly every large run's path.
            fast = _prepare_line if self.kind == "prepared" else _parse_line
            return _only(self.fmt, fast)
        prefix = "" if part.key is None else f"{part.key}:"
        if plain and self.kind == "prepared":
            return _only(self.fmt, _prepare_row(prefix, offset, part.unit == "line"))
        build = _BUILDERS[self.kind, self.mode == "last"]
        item_parser = self.item_parser
        mode = self.mode
        if self.turns is not None:
            only = self.fmt if self.mapper is None and self.fmt != "auto" else None
            return self.turns.parser(item_parser, build, prefix, offset, only)

        def parse(raw: Raw, number: int) -> Any:
            obj = raw if type(raw) is dict else parse_json(raw)  # type: ignore[arg-type]
            key, request, fmt, turns, usage, predicted = item_parser(obj)
            if key is None:
                key = prefix + str(number)
            item = (offset + number, key, request, fmt, mode, turns, usage, predicted)
            return build(_new_tuple(_Item, item))

        return parse if self.mapper is not None else _only(self.fmt, parse)


class _TurnItems:
    """``regenerate="each"``: a conversation's rows made one item per turn to write, each
    asking it against the original messages before it, keyed ``<key>#turn<k>``.

    The items of a read are numbered 1, 2, ... in their own sequence (the store places
    item N at the dataset's next position N, so every turn has a place of its own), and
    :meth:`row` maps an item's number back to its row's, for errors that name it.

    A conversation's turns are claimed together, its last (longest) one first: they
    share one prediction, the conversation's answer tokens spread evenly (the claim
    ranks by it, then by position; the plan's sum stays the conversation's), and are
    numbered last turn first. The server the longest prompt went to then holds every
    shorter one's prefix, and prefix routing sends them there. They are yielded in
    turn order, which is the order they are stored and exported in.
    """

    def __init__(self) -> None:
        self.count = 0
        self._firsts = array("q")
        self._rows = array("q")

    def row(self, number: int) -> int:
        """The row (its ``line``) that item ``number`` came from."""
        at = bisect_right(self._firsts, number) - 1
        return self._rows[at] if at >= 0 else number

    def parser(
        self,
        item_parser: Callable[[dict], Mapped],
        build: Callable[[_Item], Any],
        prefix: str,
        offset: int,
        only: str | None,
    ) -> Callable[[Raw, int], list[Any]]:
        """The per-row function of a part: its rows' items (``only``: the one format
        its rows may be in)."""

        def parse(raw: Raw, number: int) -> list[Any]:
            obj = raw if type(raw) is dict else parse_json(raw)  # type: ignore[arg-type]
            key, request, fmt, _turns, usage, predicted = item_parser(obj)
            if only is not None and fmt != only:
                raise RowError(f'a {fmt} line in a dataset declared format = "{only}"')
            if key is None:
                key = prefix + str(number)
            prompts = turn_prompts(request["messages"])
            last = self.count + len(prompts)
            share = -(-predicted // len(prompts))  # rounded up: a known answer stays known
            out = [
                build(
                    _Item(
                        last - i,
                        f"{key}#turn{k}",
                        {**request, "messages": history},
                        fmt,
                        "each",
                        1,
                        usage,
                        share,
                    )
                )
                for i, (k, history) in enumerate(prompts)
            ]
            self._firsts.append(self.count + 1)
            self._rows.append(offset + number)
            self.count = last
            return out

        return parse


def _only(fmt: str, parse: Callable[[Any, int], _L]) -> Callable[[Any, int], _L]:
    """``parse``, refusing rows of another format than ``fmt`` (unless ``auto``)."""
    if fmt == "auto":
        return parse

    def parse_only(raw: Any, number: int) -> _L:
        item = parse(raw, number)
        if item.fmt != fmt:
            raise RowError(f'a {item.fmt} line in a dataset declared format = "{fmt}"')
        return item

    return parse_only


def prompt_request(request: dict[str, Any]) -> dict[str, Any]:
    """A chat request of one user message as a raw completion's: ``{"prompt": ...}`` and
    its other fields. Anything more (a system message, turns, tools) has no plain-prompt
    form: ``RowError``, never a prompt silently cut down."""
    messages = request.get("messages")
    only = messages[0] if isinstance(messages, list) and len(messages) == 1 else None
    if not (
        isinstance(only, dict)
        and only.get("role") == "user"
        and isinstance(only.get("content"), str)
        and set(only) <= {"role", "content"}
    ):
        raise RowError(
            "the completions endpoint sends a plain prompt: the row must be one "
            '({"prompt": "..."} or --prompt-column, without a system message), not a '
            "conversation"
        )
    if "tools" in request:
        raise RowError("the completions endpoint takes no tools")
    rest = {k: v for k, v in request.items() if k != "messages"}
    return {"prompt": only["content"], **rest}


def _as_prompt(parse: Callable[[Raw, int], Any]) -> Callable[[Raw, int], Any]:
    """``parse``, each row's request made a raw completion's (:func:`prompt_request`)."""

    def parse_prompt(raw: Raw, number: int) -> Any:
        item = parse(raw, number)
        if isinstance(item, Record):
            request = prompt_request(item.request)
            return dataclasses.replace(item, request=request, digest=_digest(request))
        digest, body = _encoded(prompt_request(orjson.loads(item.body)))
        return item._replace(digest=digest, body=body)

    return parse_prompt


def _parse_line(raw: bytes, lineno: int) -> Record:
    key, request, fmt, predicted = parse_line(raw, lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    return Record(lineno, key, request, digest, fmt, predicted_tokens=predicted)


def _prepare_line(raw: bytes, lineno: int) -> Prepared:
    key, request, fmt, predicted = parse_line(raw, lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    # tuple.__new__: the NamedTuple's own __new__ is Python code, called a million times.
    return _new_tuple(Prepared, (lineno, key, fmt, digest, _dumps(request).decode(), predicted))


def _prepare_row(prefix: str, offset: int, lines: bool) -> Callable[[Raw, int], Prepared]:
    """``_prepare_line`` for a table's rows (dicts) and a shard's lines (bytes, when
    ``lines``): keyed by their place when they have no id, and numbered after the parts
    before them."""

    def prepare(obj: dict[str, Any], number: int) -> Prepared:
        key, request, fmt, predicted = parse_object(obj)
        if key is None:
            key = prefix + str(number)
        digest, body = _encoded(request)
        return _new_tuple(Prepared, (offset + number, key, fmt, digest, body, predicted))

    if not lines:
        return prepare  # type: ignore[return-value]
    return lambda raw, number: prepare(parse_json(raw), number)  # type: ignore[arg-type]


class _Item(NamedTuple):
    """An item as read from its row, before it is built into what the read yields."""

    line: int
    key: str
    request: dict
    fmt: str
    mode: str
    turns: int
    usage: tuple[int | None, int | None]
    predicted: int


def _build_prepared(item: _Item) -> Prepared:
    line, key, request, fmt, _, _, _, predicted = item
    return _new_tuple(Prepared, (line, key, fmt, *_encoded(request), predicted))


def _build_item(item: _Item) -> PreparedItem:
    line, key, request, fmt, mode, turns, (prompt, completion), predicted = item
    digest, body = _encoded(request)
    return PreparedItem(line, key, fmt, digest, body, mode, turns, prompt, completion, predicted)


def _build_record(item: _Item) -> Record:
    line, key, request, fmt, mode, turns, (prompt, completion), predicted = item
    digest = _digest(request)
    return Record(line, key, request, digest, fmt, mode, turns, prompt, completion, predicted)


def _digest(request: dict) -> str:
    """A request's digest: its JSON with the keys sorted, so the same request has one."""
    return _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()


def _encoded(request: dict) -> tuple[str, str]:
    """A request's digest and its JSON."""
    return _digest(request), _dumps(request).decode()


_BUILDERS: dict[tuple[str, bool], Callable[[_Item], Any]] = {
    ("prepared", True): _build_prepared,
    ("prepared", False): _build_item,
    ("record", True): _build_record,
    ("record", False): _build_record,
}
"""By (what is yielded, read for the final answer)."""
