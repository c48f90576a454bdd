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
means.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from orchestrator.errors import InputError

__all__ = ["FORMATS", "REQUEST_FIELDS", "Record", "iter_records"]

FORMATS: tuple[str, ...] = ("messages", "sharegpt", "prompt", "openai-batch")

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
    """Which of ``FORMATS`` the line was written in."""


class _LineError(Exception):
    """A bad line; turned into an ``InputError`` once the path and line number are known."""


def iter_records(
    path: str | os.PathLike[str],
    *,
    on_invalid: Callable[[InputError], None] | None = None,
) -> Iterator[Record]:
    """Yield one ``Record`` per non-blank line of the JSONL file at ``path``.

    A bad line raises ``InputError`` unless ``on_invalid`` is given, in which case the error
    is handed to it and the line skipped, so one malformed line need not stop a million-line
    ingest. Problems with the file itself (missing, a directory, unreadable, no records)
    always raise. Missing files and directories are reported here, before iteration starts,
    so callers fail fast; read errors surface on the first ``next()``.
    """
    name = os.fsdecode(path)
    try:
        st = os.stat(name)
    except OSError as exc:
        raise _file_error(name, exc) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError("is a directory, not a file", path=name)
    return _iter_file(name, on_invalid)


def _iter_file(name: str, on_invalid: Callable[[InputError], None] | None) -> Iterator[Record]:
    try:
        fh = open(name, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise _file_error(name, exc) from None
    yielded = 0
    invalid = 0
    lineno = 0
    with fh:
        while True:
            # Only the read itself is guarded: an OSError from on_invalid or from the
            # consumer is theirs, not a problem with this file.
            try:
                raw = fh.readline()
            except OSError as exc:
                raise _file_error(name, exc) from None
            if not raw:
                break
            lineno += 1
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if raw.isspace() or not raw:
                continue
            try:
                record = _parse_line(raw, lineno)
            except _LineError as exc:
                error = InputError(str(exc), path=name, line=lineno)
                if on_invalid is None:
                    raise error from None
                invalid += 1
                on_invalid(error)
                continue
            yielded += 1
            yield record
    if yielded == 0 and invalid == 0:
        raise InputError("no records in file", path=name)


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
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _LineError(_json_reason(raw, exc)) from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {_kind(obj)}")

    if "messages" in obj:
        fmt = "messages"
        request = _chat_request(obj)
    elif "conversations" in obj:
        fmt = "sharegpt"
        request = _sharegpt_request(obj)
    elif "prompt" in obj:
        fmt = "prompt"
        request = _prompt_request(obj)
    elif "body" in obj or ("custom_id" in obj and ("url" in obj or "method" in obj)):
        fmt = "openai-batch"
        request = _batch_request(obj)
    else:
        raise _LineError(_UNRECOGNISED)

    if fmt == "openai-batch":
        key = _key(obj["custom_id"], "custom_id")
    elif "id" in obj:
        key = _key(obj["id"], "id")
    elif "custom_id" in obj:
        key = _key(obj["custom_id"], "custom_id")
    else:
        key = str(lineno)

    digest = hashlib.sha256(orjson.dumps(request, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return Record(lineno, key, request, digest, fmt)


def _json_reason(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    # orjson reports bad UTF-8 as "surrogates not allowed" at column 1; find the real spot.
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as uexc:
        column = len(raw[: uexc.start].decode("utf-8", errors="replace")) + 1
        return f"invalid UTF-8 at column {column} (byte 0x{raw[uexc.start]:02x})"
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


def _chat_request(obj: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = {"messages": _finish_messages(_messages(obj["messages"]))}
    _add_request_fields(request, obj)
    return request


def _sharegpt_request(obj: dict[str, Any]) -> dict[str, Any]:
    conversations = obj["conversations"]
    if not isinstance(conversations, list):
        raise _LineError(f"conversations must be a list, got {_kind(conversations)}")
    if not conversations:
        raise _LineError("conversations is empty")
    messages = [_sharegpt_message(i, entry) for i, entry in enumerate(conversations, start=1)]
    system = _system(obj)
    if system is not None:
        messages.insert(0, system)
    request: dict[str, Any] = {"messages": _finish_messages(messages)}
    tools = obj.get("tools")
    if isinstance(tools, str):
        # LLaMA-Factory style ShareGPT stores tools as a JSON string ("" for none).
        obj = {**obj, "tools": _decode_tools(tools)}
    _add_request_fields(request, obj)
    return request


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


def _batch_request(obj: dict[str, Any]) -> dict[str, Any]:
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
    request = dict(body)
    request["messages"] = _finish_messages(_messages(body["messages"]))
    return request


# --- messages ------------------------------------------------------------------------------


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
    for name, value in obj.items():
        check = _FIELD_CHECKS.get(name)
        if check is None or value is None:
            continue
        expected = check(value)
        if expected:
            got = repr(value) if _is_number(value) else _kind(value)
            raise _LineError(f"{name} must be {expected}, got {got}")
        request[name] = value


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


def _check_max_tokens(value: object) -> str:
    return "" if isinstance(value, int) and _is_int(value) and value > 0 else "a positive integer"


def _check_number(value: object) -> str:
    ok = isinstance(value, int | float) and _is_number(value) and value >= 0
    return "" if ok else "a non-negative number"


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
    "max_tokens": _check_max_tokens,
    "temperature": _check_number,
    "top_p": _check_number,
    "stop": _check_stop,
    "seed": _check_seed,
}
