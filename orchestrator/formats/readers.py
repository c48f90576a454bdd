"""Streaming reader for JSONL prompt files.

Input files hold 10^5-10^6 lines and single lines can be tens of megabytes, so the file is
read one binary line at a time and nothing is kept between lines. Every line is turned into
one ``Record`` whose ``request`` is a ready-to-send chat completion body, so the rest of the
orchestrator never needs to know which of the accepted formats a line came in.

Accepted line formats (detected per line, so files may mix them):

``messages``
    ``{"messages": [...], "tools": ..., "max_tokens": ..., ...}`` (OpenAI chat)
``sharegpt``
    ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": ..., "tools": ...}``
``prompt``
    ``{"prompt": "...", "system": ...}``
``openai-batch``
    ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``

Conversations that end in assistant turns have those turns dropped: the model is asked to
regenerate the final answer, which is what re-running a chat dataset through a new model
means. Two other ways of reading a file serve the other kinds of dataset:

``regenerate="all"``
    The whole conversation is kept, trailing assistant turns included, and each line
    counts the assistant turns the model will write (``orchestrator.conversation``).
``passthrough=True``
    Rows that already hold the answer and are stored as done: conversations ending with
    the assistant's turn (``messages`` or ``conversations``; the stored row is the line's
    object with ShareGPT turns in OpenAI ``messages`` form), or pre-tokenised ``tokens``
    rows (``{"input_ids": [...], "loss_mask": [...]}``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import IO, Any, NamedTuple, TypeVar

import orjson

from orchestrator import params
from orchestrator.conversation import targets
from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.choices import INPUT_FORMATS, LINE_FORMATS
from orchestrator.lengths import answer_tokens

__all__ = [
    "FORMATS",
    "INPUT_FORMATS",
    "MODES",
    "PASSTHROUGH_FORMATS",
    "REQUEST_FIELDS",
    "Prepared",
    "PreparedItem",
    "Record",
    "iter_prepared",
    "iter_records",
]

FORMATS = LINE_FORMATS
PASSTHROUGH_FORMATS: tuple[str, ...] = ("auto", "messages", "sharegpt", "tokens")
"""The formats whose rows can hold an answer to pass through."""
MODES: tuple[str, ...] = ("last", "all", "passthrough")
"""How a line was read: its final answer to generate, every assistant turn, or stored as is."""

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
_ROLE_SET = frozenset(ROLES)

# Per-line fields that travel with the request for the messages, sharegpt and prompt
# formats; anything else on the line is metadata and stays out of the request (and so out
# of the digest). Batch lines send their ``body`` as given instead.
REQUEST_FIELDS: tuple[str, ...] = (
    "tools",
    "tool_choice",
    "response_format",
    "chat_template_kwargs",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
)

SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}

# Message keys carried over from a ShareGPT ``from``/``value`` entry; the rest of such an
# entry (``weight``, ``markdown``, ...) is dataset bookkeeping a server would reject.
_SHAREGPT_KEEP: tuple[str, ...] = ("name", "tool_calls", "tool_call_id", "reasoning_content")

_BOM = b"\xef\xbb\xbf"
_UNRECOGNISED = (
    "expected one of messages, conversations, prompt, or an OpenAI batch line (custom_id/body)"
)
_TOKENS_NOT_PROMPTS = (
    "a pre-tokenised row (input_ids) is no prompt: only a pass-through dataset takes these"
)


@dataclass(frozen=True, slots=True)
class Record:
    """One input line, reduced to what identifies it and what gets sent."""

    line: int
    """1-based line number in the file."""
    key: str
    """The line's ``id`` (or ``custom_id``), stringified; the line number when it has none."""
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
    """The length of the answer turns the line holds and the model writes again (the
    trailing ones dropped, or every target turn for ``all``), in tokens estimated from
    their text (``orchestrator.lengths.answer_tokens``); 0 when it holds none."""


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


class _LineError(Exception):
    """A bad line; turned into an ``InputError`` once the path and line number are known."""


_T = TypeVar("_T")
_L = TypeVar("_L", Record, Prepared, PreparedItem)


def iter_records(
    path: str | os.PathLike[str],
    *,
    on_invalid: Callable[[InputError], None] | None = None,
    fmt: str = "auto",
    regenerate: str = "last",
    passthrough: bool = False,
) -> Iterator[Record]:
    """Yield one ``Record`` per non-blank line of the JSONL file at ``path``.

    A bad line raises ``InputError`` unless ``on_invalid`` is given, in which case the error
    is handed to it and the line skipped, so one malformed line need not stop a million-line
    ingest. Problems with the file itself (missing, a directory, unreadable, no records)
    always raise. Missing files and directories are reported here, before iteration starts,
    so callers fail fast; read errors surface on the first ``next()``.

    ``fmt`` (one of ``INPUT_FORMATS``) makes a line of any other format a bad line.
    ``regenerate="all"`` keeps whole conversations and counts their turns;
    ``passthrough`` reads rows that hold their answer (see the module docstring). An
    impossible combination raises ``ConfigError`` here.
    """
    mode = _mode(fmt, regenerate, passthrough)
    parse: Callable[[bytes, int], Record]
    if mode == "last":
        parse = _parse_line
    else:
        parse = partial(_record_item, mode, _ITEM_PARSERS[mode, fmt == "tokens"])
    return _iter_file(_checked_path(path), on_invalid, _only(fmt, parse))


def iter_prepared(
    path: str | os.PathLike[str],
    *,
    on_invalid: Callable[[InputError], None] | None = None,
    fmt: str = "auto",
    regenerate: str = "last",
    passthrough: bool = False,
) -> Iterator[Prepared] | Iterator[PreparedItem]:
    """``iter_records`` for bulk loading: the same lines, checks and errors, as ``Prepared``
    (``PreparedItem`` when read for ``regenerate="all"`` or pass-through)."""
    mode = _mode(fmt, regenerate, passthrough)
    if mode == "last":
        return _iter_file(_checked_path(path), on_invalid, _only(fmt, _prepare_line))
    parse = partial(_prepare_item, mode, _ITEM_PARSERS[mode, fmt == "tokens"])
    return _iter_file(_checked_path(path), on_invalid, _only(fmt, parse))


def _mode(fmt: str, regenerate: str, passthrough: bool) -> str:
    """Which of ``MODES`` the options ask for, or ``ConfigError``."""
    if fmt not in INPUT_FORMATS:
        raise ConfigError(f"format must be one of {', '.join(INPUT_FORMATS)}, got {fmt!r}")
    if regenerate not in ("last", "all"):
        raise ConfigError(f"regenerate must be last or all, got {regenerate!r}")
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


def _only(fmt: str, parse: Callable[[bytes, int], _L]) -> Callable[[bytes, int], _L]:
    """``parse``, refusing lines of another format than ``fmt`` (unless ``auto``)."""
    if fmt == "auto":
        return parse

    def parse_only(raw: bytes, lineno: int) -> _L:
        item = parse(raw, lineno)
        if item.fmt != fmt:
            raise _LineError(f'a {item.fmt} line in a dataset declared format = "{fmt}"')
        return item

    return parse_only


def _checked_path(path: str | os.PathLike[str]) -> str:
    name = os.fsdecode(path)
    try:
        st = os.stat(name)
    except OSError as exc:
        raise _file_error(name, exc) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError("is a directory, not a file", path=name)
    return name


def _iter_file(
    name: str,
    on_invalid: Callable[[InputError], None] | None,
    parse: Callable[[bytes, int], _T],
) -> Iterator[_T]:
    try:
        fh = open(name, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise _file_error(name, exc) from None
    with fh:
        lines = _read_lines(name, fh)
        yield from _parse_lines(name, lines, on_invalid, parse, "no records in file")


def _read_lines(name: str, fh: IO[bytes]) -> Iterator[bytes]:
    """The file's lines. Only the read itself is guarded: an OSError from on_invalid or
    from the consumer is theirs, not a problem with this file."""
    readline = fh.readline
    while True:
        try:
            raw = readline()
        except OSError as exc:
            raise _file_error(name, exc) from None
        if not raw:
            return
        yield raw


def _parse_lines(
    name: str,
    lines: Iterable[bytes],
    on_invalid: Callable[[InputError], None] | None,
    parse: Callable[[bytes, int], _T],
    empty: str,
) -> Iterator[_T]:
    """Each JSONL line through ``parse``; a bad one raises or goes to ``on_invalid``."""
    yielded = 0
    invalid = 0
    for lineno, line in enumerate(lines, 1):
        raw = line[len(_BOM) :] if lineno == 1 and line.startswith(_BOM) else line
        if raw.isspace() or not raw:
            continue
        try:
            item = parse(raw, lineno)
        except _LineError as exc:
            reason = str(exc)
        except orjson.JSONEncodeError:
            # The line reads, but its request cannot be written back as JSON: orjson
            # writes at most MAX_DEPTH levels of nesting.
            reason = _too_deep(raw)
        else:
            yielded += 1
            yield item
            continue
        error = InputError(reason, path=name, line=lineno)
        if on_invalid is None:
            raise error from None
        invalid += 1
        on_invalid(error)
    if yielded == 0 and invalid == 0:
        raise InputError(empty, path=name)


def iter_prepared_rows(
    rows: Iterable[Any],
    *,
    source: str = "<records>",
    on_invalid: Callable[[InputError], None] | None = None,
    fmt: str = "auto",
    regenerate: str = "last",
    passthrough: bool = False,
) -> Iterator[Prepared] | Iterator[PreparedItem]:
    """``iter_prepared`` over rows already in memory (the Python API's records).

    Each row is read as the JSONL line it would be in a file, so it gets the same checks
    and the same errors, naming ``source`` and the row's 1-based position as its line.
    """
    mode = _mode(fmt, regenerate, passthrough)
    if mode == "last":
        parse: Callable[[bytes, int], Any] = _only(fmt, _prepare_line)
    else:
        parse = _only(fmt, partial(_prepare_item, mode, _ITEM_PARSERS[mode, fmt == "tokens"]))
    return _parse_lines(source, _encoded(source, rows), on_invalid, parse, "no records")


def _encoded(source: str, rows: Iterable[Any]) -> Iterator[bytes]:
    """Rows as JSON lines; a row JSON cannot hold is refused with its position."""
    for n, row in enumerate(rows, 1):
        try:
            yield orjson.dumps(row)
        except orjson.JSONEncodeError as exc:
            raise InputError(f"not a JSON object: {exc}", path=source, line=n) from None


def _file_error(name: str, exc: OSError) -> InputError:
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


def _parse_line(raw: bytes, lineno: int) -> Record:
    key, request, fmt, predicted = _parse(raw, lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    return Record(lineno, key, request, digest, fmt, predicted_tokens=predicted)


def _prepare_line(raw: bytes, lineno: int) -> Prepared:
    key, request, fmt, predicted = _parse(raw, lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    # tuple.__new__: the NamedTuple's own __new__ is Python code, called a million times.
    return _new_tuple(Prepared, (lineno, key, fmt, digest, _dumps(request).decode(), predicted))


def _prepare_item(mode: str, parse: _ItemParser, raw: bytes, lineno: int) -> PreparedItem:
    key, request, fmt, turns, (prompt, completion) = parse(_object(raw), lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    body = _dumps(request).decode()
    predicted = _target_tokens(request) if mode == "all" else 0
    return PreparedItem(lineno, key, fmt, digest, body, mode, turns, prompt, completion, predicted)


def _record_item(mode: str, parse: _ItemParser, raw: bytes, lineno: int) -> Record:
    key, request, fmt, turns, (prompt, completion) = parse(_object(raw), lineno)
    digest = _sha256(_dumps(request, option=_SORT_KEYS)).hexdigest()
    predicted = _target_tokens(request) if mode == "all" else 0
    return Record(lineno, key, request, digest, fmt, mode, turns, prompt, completion, predicted)


def _target_tokens(request: dict[str, Any]) -> int:
    """A whole conversation's answer turns, each of which the model writes again; 0 when
    it lacks one (it ends before its final answer): part of its length is unknown."""
    messages = request["messages"]
    turns = targets(messages)
    if not turns or turns[-1] >= len(messages):
        return 0
    return answer_tokens(messages[i] for i in turns)


def _dropped_tokens(full: list[dict[str, Any]], kept: list[dict[str, Any]]) -> int:
    """The trailing answer turns ``_finish_messages`` dropped (``kept`` is a prefix of
    ``full``): the model writes them again, so their length predicts the new answer's."""
    return answer_tokens(full[len(kept) :]) if len(kept) < len(full) else 0


_loads = orjson.loads
_dumps = orjson.dumps
_SORT_KEYS = orjson.OPT_SORT_KEYS
_sha256 = hashlib.sha256
_new_tuple = tuple.__new__


def _parse(raw: bytes, lineno: int) -> tuple[str, dict[str, Any], str, int]:
    """The line's key, request, format and predicted answer tokens, or ``_LineError``."""
    try:
        obj = _loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _LineError(_json_reason(raw, exc)) from None
    if type(obj) is not dict:  # orjson makes plain dicts only
        raise _LineError(f"expected a JSON object, got {_kind(obj)}")

    predicted = 0
    if "messages" in obj:
        fmt = "messages"
        # Inline: this is the line format of nearly every large file.
        value = obj["messages"]
        kept = _chat_messages(value)
        request = {"messages": kept}
        if kept is not value:
            predicted = _dropped_tokens(value, kept)
        if not _FIELD_NAMES.isdisjoint(obj):
            _add_request_fields(request, obj)
    elif "conversations" in obj:
        fmt = "sharegpt"
        request, predicted = _sharegpt_last(obj)
    elif "prompt" in obj:
        fmt = "prompt"
        request = _prompt_request(obj)
    elif "body" in obj or ("custom_id" in obj and ("url" in obj or "method" in obj)):
        fmt = "openai-batch"
        request = _batch_request(obj)
        value = obj["body"]["messages"]
        if request["messages"] is not value:
            predicted = _dropped_tokens(value, request["messages"])
    else:
        if "input_ids" in obj:
            raise _LineError(_TOKENS_NOT_PROMPTS)
        raise _LineError(_UNRECOGNISED)

    if fmt == "openai-batch":
        key = _key(obj["custom_id"], "custom_id")
    elif "id" in obj:
        key = obj["id"]
        if type(key) is not str or not key:
            key = _key(key, "id")
    elif "custom_id" in obj:
        key = _key(obj["custom_id"], "custom_id")
    else:
        key = str(lineno)
    return key, request, fmt, predicted


def _object(raw: bytes) -> dict[str, Any]:
    try:
        obj = _loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _LineError(_json_reason(raw, exc)) from None
    if type(obj) is not dict:
        raise _LineError(f"expected a JSON object, got {_kind(obj)}")
    return obj


def _line_key(obj: dict[str, Any], fmt: str, lineno: int) -> str:
    """The key rule of ``_parse``: ``custom_id`` for batch lines, else ``id``, else the line."""
    if fmt == "openai-batch":
        return _key(obj["custom_id"], "custom_id")
    if "id" in obj:
        return _key(obj["id"], "id")
    if "custom_id" in obj:
        return _key(obj["custom_id"], "custom_id")
    return str(lineno)


MAX_DEPTH = 254
"""Most levels of nesting a request may have: orjson writes no deeper."""


def _too_deep(raw: bytes) -> str:
    """Where a line nests deeper than ``MAX_DEPTH`` (the path to its deepest value)."""
    deepest, where = 0, ""
    stack: list[tuple[object, int, str]] = [(_loads(raw), 1, "")]
    while stack:
        value, depth, path = stack.pop()
        children = (
            value.items()
            if isinstance(value, dict)
            else enumerate(value)
            if isinstance(value, list)
            else ()
        )
        if depth > deepest:
            deepest, where = depth, path
        for key, child in children:
            if isinstance(child, dict | list):
                step = f"[{key}]" if isinstance(key, int) else f".{key}" if path else str(key)
                stack.append((child, depth + 1, path + step if depth < 4 else path))
    at = f" at {where}{'…' if deepest > 4 else ''}" if where else ""
    return (
        f"nested {deepest} levels deep{at}; a request may nest at most {MAX_DEPTH} levels: "
        "flatten that field or leave it out"
    )


def _json_reason(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    # orjson reports bad UTF-8 as "surrogates not allowed" at column 1; find the real spot.
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as uexc:
        column = len(raw[: uexc.start].decode("utf-8", errors="replace")) + 1
        return f"invalid UTF-8 at column {column} (byte 0x{raw[uexc.start]:02x})"
    if exc.msg.startswith("depth limit exceeded"):
        return (
            f"nested deeper than {MAX_DEPTH} levels (at column {exc.colno}): a request may "
            f"nest at most {MAX_DEPTH} levels"
        )
    return f"invalid JSON: {exc.msg} at column {exc.colno}"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _key(value: object, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _LineError(f"{field} must be a string or an integer, got {_kind(value)}")
    if isinstance(value, str) and not value:
        raise _LineError(f"{field} is empty")
    return str(value)


# --- formats -------------------------------------------------------------------------------


def _sharegpt_request(obj: dict[str, Any]) -> dict[str, Any]:
    """The request of a ShareGPT line with every turn kept (``regenerate="all"``)."""
    request: dict[str, Any] = {"messages": _sharegpt_messages(obj)}
    _add_request_fields(request, _sharegpt_tools(obj))
    return request


def _sharegpt_last(obj: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The request of a ShareGPT line with its trailing assistant turns dropped, and the
    tokens of what was dropped."""
    messages = _sharegpt_messages(obj)
    kept = _finish_messages(messages)
    request: dict[str, Any] = {"messages": kept}
    _add_request_fields(request, _sharegpt_tools(obj))
    return request, _dropped_tokens(messages, kept)


def _sharegpt_messages(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns in OpenAI form, the top-level ``system`` first."""
    conversations = obj["conversations"]
    if not isinstance(conversations, list):
        raise _LineError(f"conversations must be a list, got {_kind(conversations)}")
    if not conversations:
        raise _LineError("conversations is empty")
    messages = [_sharegpt_message(i, entry) for i, entry in enumerate(conversations, start=1)]
    system = _system(obj)
    if system is not None:
        messages.insert(0, system)
    return messages


def _sharegpt_tools(obj: dict[str, Any]) -> dict[str, Any]:
    tools = obj.get("tools")
    if isinstance(tools, str):
        # LLaMA-Factory style ShareGPT stores tools as a JSON string ("" for none).
        return {**obj, "tools": _decode_tools(tools)}
    return obj


def _prompt_request(obj: dict[str, Any]) -> dict[str, Any]:
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise _LineError(f"prompt must be a string, got {_kind(prompt)}")
    if not prompt.strip():
        raise _LineError("prompt is empty")
    user = {"role": "user", "content": prompt}
    system = _system(obj) if "system" in obj else None
    request: dict[str, Any] = {"messages": [user] if system is None else [system, user]}
    _add_request_fields(request, obj)
    return request


def _batch_request(
    obj: dict[str, Any],
    messages: Callable[[object], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The body of a batch line; ``messages`` None drops trailing assistant turns."""
    if "custom_id" not in obj:
        raise _LineError("missing custom_id")
    method = obj.get("method")
    if method is not None and (not isinstance(method, str) or method.upper() != "POST"):
        raise _LineError(f"method must be POST, got {method!r}")
    url = obj.get("url")
    if url is not None and (
        not isinstance(url, str) or not url.rstrip("/").endswith("/chat/completions")
    ):
        raise _LineError(
            f"url must be a chat completions endpoint (/v1/chat/completions), got {url!r}"
        )
    if "body" not in obj:
        raise _LineError("missing body")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _LineError(f"body must be an object, got {_kind(body)}")
    if "messages" not in body:
        raise _LineError("body: missing messages")
    for name, value in body.items():
        if name in _BODY_CHECKS and value is not None:
            _check_field(name, value, "body: ")
    request = dict(body)
    raw = body["messages"]
    request["messages"] = _chat_messages(raw) if messages is None else messages(raw)
    return request


# --- whole conversations and pass-through rows ------------------------------------------------

_Usage = tuple[int | None, int | None]
_ItemParser = Callable[[dict[str, Any], int], tuple[str, dict[str, Any], str, int, _Usage]]
"""A line's object to (key, what is stored, format, turns, (prompt, completion) tokens)."""


def _parse_all(obj: dict[str, Any], lineno: int) -> tuple[str, dict[str, Any], str, int, _Usage]:
    """A prompt line for ``regenerate="all"``: the whole conversation and its turn count."""
    if "messages" in obj:
        fmt = "messages"
        request = {"messages": _messages(obj["messages"])}
        _add_request_fields(request, obj)
    elif "conversations" in obj:
        fmt = "sharegpt"
        request = _sharegpt_request(obj)
    elif "prompt" in obj:
        fmt = "prompt"
        request = _prompt_request(obj)
    elif "body" in obj or ("custom_id" in obj and ("url" in obj or "method" in obj)):
        fmt = "openai-batch"
        request = _batch_request(obj, _messages)
    else:
        raise _LineError(_TOKENS_NOT_PROMPTS if "input_ids" in obj else _UNRECOGNISED)
    turns = len(targets(request["messages"]))
    if not turns:
        raise _LineError("no user message")
    return _line_key(obj, fmt, lineno), request, fmt, turns, (None, None)


def _parse_passthrough(
    obj: dict[str, Any], lineno: int
) -> tuple[str, dict[str, Any], str, int, _Usage]:
    """A row that already holds its answer, as it is stored: the object as read, with
    ShareGPT turns in OpenAI ``messages`` form."""
    if "input_ids" in obj:
        return _parse_tokens(obj, lineno)
    if "messages" in obj:
        fmt = "messages"
        messages = _messages(obj["messages"])
        stored = obj
    elif "conversations" in obj:
        fmt = "sharegpt"
        messages = _sharegpt_messages(obj)
        stored = {k: v for k, v in _sharegpt_tools(obj).items() if k not in _SHAREGPT_ONLY}
        if stored.get("tools", "") is None:
            del stored["tools"]
        stored["messages"] = messages
    elif "prompt" in obj:
        raise _LineError("a prompt line holds no answer to pass through")
    elif "body" in obj or "custom_id" in obj:
        raise _LineError("an openai-batch line holds no answer to pass through")
    else:
        raise _LineError(
            "expected messages, conversations or input_ids (a pre-tokenised row) in a "
            "pass-through dataset"
        )
    if messages[-1]["role"] != "assistant":
        raise _LineError("a passthrough row must end with the assistant's answer")
    if not any(m["role"] == "user" for m in messages):
        raise _LineError("no user message")
    return _line_key(obj, fmt, lineno), stored, fmt, 1, _usage(obj)


# Keys of a ShareGPT row that its OpenAI form holds as messages.
_SHAREGPT_ONLY = frozenset({"conversations", "system"})


def _parse_tokens(obj: dict[str, Any], lineno: int) -> tuple[str, dict[str, Any], str, int, _Usage]:
    """A pre-tokenised row: ``input_ids`` and an optional 0/1 ``loss_mask`` as long."""
    ids = obj.get("input_ids")
    if type(ids) is not list or not ids:
        raise _LineError("input_ids must be a non-empty list of token ids")
    if not all(type(t) is int and t >= 0 for t in ids):
        raise _LineError("input_ids must hold non-negative integers only")
    mask = obj.get("loss_mask")
    if mask is not None:
        if type(mask) is not list or len(mask) != len(ids):
            raise _LineError(f"loss_mask must be a list as long as input_ids ({len(ids)})")
        if not all(type(m) is int and (m == 0 or m == 1) for m in mask):
            raise _LineError("loss_mask must hold 0 and 1 only")
        if 1 not in mask:
            raise _LineError("loss_mask is all 0: the row teaches nothing")
    return _line_key(obj, "tokens", lineno), obj, "tokens", 1, _usage(obj)


def _parse_token_rows(
    obj: dict[str, Any], lineno: int
) -> tuple[str, dict[str, Any], str, int, _Usage]:
    """``_parse_tokens`` for a file declared ``tokens``: a line of another format says so."""
    if "input_ids" not in obj:
        for field, fmt in (("messages", "messages"), ("conversations", "sharegpt")):
            if field in obj:
                raise _LineError(f'a {fmt} line in a dataset declared format = "tokens"')
    return _parse_tokens(obj, lineno)


def _usage(obj: dict[str, Any]) -> _Usage:
    """A pass-through row's ``usage`` token counts (an earlier export carries them)."""
    usage = obj.get("usage")
    if usage is None:
        return None, None
    if type(usage) is not dict:
        raise _LineError(f"usage must be an object, got {_kind(usage)}")
    counts = []
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if value is not None and not (_is_int(value) and value >= 0):
            raise _LineError(f"usage.{name} must be a non-negative integer, got {value!r}")
        counts.append(value)
    return counts[0], counts[1]


_ITEM_PARSERS: dict[tuple[str, bool], _ItemParser] = {
    ("all", False): _parse_all,
    ("passthrough", False): _parse_passthrough,
    ("passthrough", True): _parse_token_rows,
}
"""By (mode, format is tokens)."""


# --- messages ------------------------------------------------------------------------------


def _chat_messages(value: object) -> list[dict[str, Any]]:
    """``_finish_messages(_messages(value))``, in one pass for plain text turns.

    Nearly every line is a few ``{"role": ..., "content": "text"}`` turns ending in a user
    turn; anything else (or any doubt) takes the full checks, which name the problem.
    """
    if type(value) is list:
        if len(value) == 1:
            message = value[0]
            if (
                type(message) is dict
                and len(message) == 2
                and message.get("role") == "user"
                and type(message.get("content")) is str
            ):
                return value
        elif value:
            has_user = False
            for message in value:
                if type(message) is not dict or len(message) != 2:
                    break
                role = message.get("role")
                if type(message.get("content")) is not str or type(role) is not str:
                    break
                if role not in _ROLE_SET:
                    break
                if role == "user":
                    has_user = True
            else:
                if has_user and value[-1]["role"] != "assistant":
                    return value
    return _finish_messages(_messages(value))


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _LineError(f"messages must be a list, got {_kind(value)}")
    if not value:
        raise _LineError("messages is empty")
    for i, message in enumerate(value, start=1):
        # Fast path for the overwhelmingly common {"role": ..., "content": "text"}.
        if type(message) is dict and len(message) == 2 and type(message.get("content")) is str:
            role = message.get("role")
            if type(role) is str and role in _ROLE_SET:
                continue
        if not isinstance(message, dict):
            raise _LineError(f"message {i} must be an object, got {_kind(message)}")
        if "role" not in message:
            raise _LineError(f"message {i}: missing role")
        role = message["role"]
        if not isinstance(role, str):
            raise _LineError(f"message {i}: role must be a string, got {_kind(role)}")
        if role not in _ROLE_SET:
            raise _LineError(
                f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        _check_message(i, message)
    return value


def _sharegpt_message(i: int, entry: object) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise _LineError(f"message {i} must be an object, got {_kind(entry)}")
    if "from" in entry:
        role_field, content_field = "from", "value"
    elif "role" in entry:
        role_field, content_field = "role", "content"
    else:
        raise _LineError(f"message {i}: missing from (or role)")
    speaker = entry[role_field]
    if not isinstance(speaker, str):
        raise _LineError(f"message {i}: {role_field} must be a string, got {_kind(speaker)}")
    role = SHAREGPT_ROLES.get(speaker)
    if role is None:
        raise _LineError(
            f"message {i}: unknown role {speaker!r} (expected one of {', '.join(SHAREGPT_ROLES)})"
        )
    if role_field == "role":
        message = dict(entry)
        message["role"] = role
    else:
        message = {"role": role}
        if content_field in entry:
            message["content"] = entry[content_field]
        for key in _SHAREGPT_KEEP:
            if key in entry:
                message[key] = entry[key]
    _check_message(i, message, content_field)
    return message


def _check_message(i: int, message: dict[str, Any], content_field: str = "content") -> None:
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise _LineError(f"message {i}: tool_calls must be a list, got {_kind(tool_calls)}")
    for field in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(field)
        if value is not None and not isinstance(value, str):
            raise _LineError(f"message {i}: {field} must be a string, got {_kind(value)}")

    content = message.get("content")
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content, start=1):
            if not isinstance(part, dict):
                raise _LineError(
                    f"message {i}: {content_field} part {j} must be an object, got {_kind(part)}"
                )
            if "type" not in part:
                raise _LineError(f"message {i}: {content_field} part {j}: missing type")
            if not isinstance(part["type"], str):
                raise _LineError(
                    f"message {i}: {content_field} part {j}: type must be a string, "
                    f"got {_kind(part['type'])}"
                )
        return
    if content is None and message["role"] == "assistant" and tool_calls:
        return
    if "content" not in message:
        raise _LineError(f"message {i}: missing {content_field}")
    raise _LineError(
        f"message {i}: {content_field} must be a string or a list of parts, got {_kind(content)}"
    )


def _finish_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop trailing assistant turns so the model writes the final answer itself."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    for k in range(end):
        if messages[k]["role"] == "user":
            return messages if end == len(messages) else messages[:end]
    raise _LineError("no user message")


def _system(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The top-level ``system`` field as a message; empty means none (a blank column)."""
    system = obj.get("system")
    if system is None:
        return None
    if not isinstance(system, str):
        raise _LineError(f"system must be a string, got {_kind(system)}")
    return {"role": "system", "content": system} if system else None


def _decode_tools(text: str) -> object:
    if not text.strip():
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _LineError(f"tools is a string but not valid JSON: {exc.msg}") from None


# --- per-line request fields -----------------------------------------------------------------


def _add_request_fields(request: dict[str, Any], obj: dict[str, Any]) -> None:
    """Copy and type-check the request fields; null counts as absent (table exports)."""
    if _FIELD_NAMES.isdisjoint(obj):
        return
    for name, value in obj.items():
        if name in _FIELD_NAMES and value is not None:
            _check_field(name, value)
            request[name] = value


def _check_field(name: str, value: object, where: str = "") -> None:
    expected = _BODY_CHECKS[name](value)
    if expected:
        got = repr(value) if _is_number(value) else _kind(value)
        raise _LineError(f"{where}{name} must be {expected}, got {got}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_tools(value: object) -> str:
    ok = isinstance(value, list) and all(isinstance(t, dict) for t in value)
    return "" if ok else "a list of objects"


def _check_tool_choice(value: object) -> str:
    return "" if isinstance(value, str | dict) else "a string or an object"


def _check_object(value: object) -> str:
    return "" if isinstance(value, dict) else "an object"


def _check_stop(value: object) -> str:
    ok = isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    )
    return "" if ok else "a string or a list of strings"


def _check_seed(value: object) -> str:
    return "" if _is_int(value) else "an integer"


_FIELD_CHECKS: dict[str, Callable[[object], str]] = {
    "tools": _check_tools,
    "tool_choice": _check_tool_choice,
    "response_format": _check_object,
    "chat_template_kwargs": _check_object,
    # The checks of enqueue's options and a run file's keys (orchestrator.params).
    "max_tokens": lambda value: params.expected("max_tokens", value),
    "temperature": lambda value: params.expected("temperature", value),
    "top_p": lambda value: params.expected("top_p", value),
    "stop": _check_stop,
    "seed": _check_seed,
}
_FIELD_NAMES = frozenset(_FIELD_CHECKS)
# A batch line's body is sent as it is: its fields get the same checks, and ``n`` too (a
# line's own ``n`` is metadata, never sent).
_BODY_CHECKS = {**_FIELD_CHECKS, "n": lambda value: params.expected("n", value)}
