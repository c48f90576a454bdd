"""The line formats' rules: one JSON object (a JSONL line, or a table's row) to the
request it asks for, with every check and its message.

Accepted shapes (detected per object, so files may mix them):

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
means. ``ITEM_PARSERS`` read whole conversations (``regenerate="all"`` or ``"each"``)
and rows that already hold their answer (pass-through) instead. Every function here
raises ``RowError`` with the reason only; the reader adds where the row is.

A row read for an answer also says how long that answer will likely be: the tokens of the
answer turns it holds that the model writes again (the trailing ones dropped, or every
target turn for ``regenerate="all"``), ``orchestrator.items.answer_length.answer_tokens``; 0 when it
holds none. The store keeps it per item (``predicted_tokens``), the claim ranks by it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from orchestrator.items import params
from orchestrator.items.answer_length import answer_tokens
from orchestrator.items.conversation import targets

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

_UNRECOGNISED = (
    "expected one of messages, conversations, prompt, or an OpenAI batch line (custom_id/body)"
)
_TOKENS_NOT_PROMPTS = (
    "a pre-tokenised row (input_ids) is no prompt: only a pass-through dataset takes these"
)


class RowError(Exception):
    """A bad row; the reader turns it into an ``InputError`` naming the source and row."""


_loads = orjson.loads

Usage = tuple[int | None, int | None]
Mapped = tuple[str | None, dict[str, Any], str, int, Usage, int]
"""A row read: (its own key, None when it has none; what is stored; format; turns to
generate; a pass-through row's (prompt, completion) token counts; predicted answer
tokens, 0 for none)."""
ItemParser = Callable[[dict[str, Any]], Mapped]


def parse_line(raw: bytes, lineno: int) -> tuple[str, dict[str, Any], str, int]:
    """A JSONL prompt line's key (its line number when it has no id), request, format
    and predicted answer tokens, or ``RowError``: the path nearly every line of a large
    file takes."""
    try:
        obj = _loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RowError(json_reason(raw, exc)) from None
    if type(obj) is not dict:  # orjson makes plain dicts only
        raise RowError(f"expected a JSON object, got {kind(obj)}")
    key, request, fmt, predicted = parse_object(obj)
    return str(lineno) if key is None else key, request, fmt, predicted


def parse_object(obj: dict[str, Any]) -> tuple[str | None, dict[str, Any], str, int]:
    """A prompt row's own key (None without one), request, format and predicted answer
    tokens (those of the trailing assistant turns dropped), or ``RowError``."""
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
            raise RowError(_TOKENS_NOT_PROMPTS)
        raise RowError(_UNRECOGNISED)

    if fmt == "openai-batch":
        key = _key(obj["custom_id"], "custom_id")
    elif "id" in obj:
        key = obj["id"]
        if type(key) is not str or not key:
            key = _key(key, "id")
    elif "custom_id" in obj:
        key = _key(obj["custom_id"], "custom_id")
    else:
        key = None
    return key, request, fmt, predicted


def _target_tokens(messages: list[dict[str, Any]], turns: list[int]) -> int:
    """A whole conversation's answer turns (``turns``, its ``targets``), each of which the
    model writes again; 0 when it lacks one (it ends before its final answer): part of
    its length is unknown."""
    if not turns or turns[-1] >= len(messages):
        return 0
    return answer_tokens(messages[i] for i in turns)


def _dropped_tokens(full: list[dict[str, Any]], kept: list[dict[str, Any]]) -> int:
    """The trailing answer turns ``_finish_messages`` dropped (``kept`` is a prefix of
    ``full``): the model writes them again, so their length predicts the new answer's."""
    return answer_tokens(full[len(kept) :]) if len(kept) < len(full) else 0


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSONL line's object, or ``RowError``."""
    try:
        obj = _loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RowError(json_reason(raw, exc)) from None
    if type(obj) is not dict:
        raise RowError(f"expected a JSON object, got {kind(obj)}")
    return obj


def _line_key(obj: dict[str, Any], fmt: str) -> str | None:
    """The key rule of ``parse_object``: ``custom_id`` for batch lines, else ``id``, else
    ``custom_id``; None for a row with neither (the reader keys it by its place)."""
    if fmt == "openai-batch":
        return _key(obj["custom_id"], "custom_id")
    if "id" in obj:
        return _key(obj["id"], "id")
    if "custom_id" in obj:
        return _key(obj["custom_id"], "custom_id")
    return None


MAX_DEPTH = 254
"""Most levels of nesting a request may have: orjson writes no deeper."""


def too_deep(row: object) -> str:
    """Where a row nests deeper than ``MAX_DEPTH`` (the path to its deepest value)."""
    deepest, where = 0, ""
    stack: list[tuple[object, int, str]] = [(row, 1, "")]
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


def json_reason(raw: bytes, exc: orjson.JSONDecodeError) -> str:
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


#: How a message about a JSON line names a value's type (``kind``).
JSON_KINDS: tuple[tuple[Any, str], ...] = ((type(None), "null"), (dict, "object"))


def kind(value: object, names: tuple[tuple[Any, str], ...] = JSON_KINDS) -> str:
    """How a message names the type of ``value``: by the first of ``names`` whose types it
    is an instance of, else by its Python type's name."""
    for types, name in names:
        if isinstance(value, types):
            return name
    return type(value).__name__


def _key(value: object, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RowError(f"{field} must be a string or an integer, got {kind(value)}")
    if isinstance(value, str) and not value:
        raise RowError(f"{field} is empty")
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
        raise RowError(f"conversations must be a list, got {kind(conversations)}")
    if not conversations:
        raise RowError("conversations is empty")
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
        raise RowError(f"prompt must be a string, got {kind(prompt)}")
    if not prompt.strip():
        raise RowError("prompt is empty")
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
        raise RowError("missing custom_id")
    method = obj.get("method")
    if method is not None and (not isinstance(method, str) or method.upper() != "POST"):
        raise RowError(f"method must be POST, got {method!r}")
    url = obj.get("url")
    if url is not None and (
        not isinstance(url, str) or not url.rstrip("/").endswith("/chat/completions")
    ):
        raise RowError(
            f"url must be a chat completions endpoint (/v1/chat/completions), got {url!r}"
        )
    if "body" not in obj:
        raise RowError("missing body")
    body = obj["body"]
    if not isinstance(body, dict):
        raise RowError(f"body must be an object, got {kind(body)}")
    if "messages" not in body:
        raise RowError("body: missing messages")
    for name, value in body.items():
        if name in _BODY_CHECKS and value is not None:
            _check_field(name, value, "body: ")
    request = dict(body)
    raw = body["messages"]
    request["messages"] = _chat_messages(raw) if messages is None else messages(raw)
    return request


# --- whole conversations and pass-through rows ------------------------------------------------


def _parse_last(obj: dict[str, Any]) -> Mapped:
    """``parse_object`` as an item parser: one turn, no token counts."""
    key, request, fmt, predicted = parse_object(obj)
    return key, request, fmt, 1, (None, None), predicted


def _parse_all(obj: dict[str, Any]) -> Mapped:
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
        raise RowError(_TOKENS_NOT_PROMPTS if "input_ids" in obj else _UNRECOGNISED)
    messages = request["messages"]
    turns = targets(messages)
    if not turns:
        raise RowError("no user message")
    predicted = _target_tokens(messages, turns)
    return _line_key(obj, fmt), request, fmt, len(turns), (None, None), predicted


def _parse_passthrough(obj: dict[str, Any]) -> Mapped:
    """A row that already holds its answer, as it is stored: the object as read, with
    ShareGPT turns in OpenAI ``messages`` form."""
    if "input_ids" in obj:
        return _parse_tokens(obj)
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
        raise RowError("a prompt line holds no answer to pass through")
    elif "body" in obj or "custom_id" in obj:
        raise RowError("an openai-batch line holds no answer to pass through")
    else:
        raise RowError(
            "expected messages, conversations or input_ids (a pre-tokenised row) in a "
            "pass-through dataset"
        )
    if messages[-1]["role"] != "assistant":
        raise RowError("a passthrough row must end with the assistant's answer")
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no user message")
    return _line_key(obj, fmt), stored, fmt, 1, _usage(obj), 0


# Keys of a ShareGPT row that its OpenAI form holds as messages.
_SHAREGPT_ONLY = frozenset({"conversations", "system"})


def _parse_tokens(obj: dict[str, Any]) -> Mapped:
    """A pre-tokenised row: ``input_ids`` and an optional 0/1 ``loss_mask`` as long."""
    ids = obj.get("input_ids")
    if type(ids) is not list or not ids:
        raise RowError("input_ids must be a non-empty list of token ids")
    if not all(type(t) is int and t >= 0 for t in ids):
        raise RowError("input_ids must hold non-negative integers only")
    mask = obj.get("loss_mask")
    if mask is not None:
        if type(mask) is not list or len(mask) != len(ids):
            raise RowError(f"loss_mask must be a list as long as input_ids ({len(ids)})")
        if not all(type(m) is int and (m == 0 or m == 1) for m in mask):
            raise RowError("loss_mask must hold 0 and 1 only")
        if 1 not in mask:
            raise RowError("loss_mask is all 0: the row teaches nothing")
    return _line_key(obj, "tokens"), obj, "tokens", 1, _usage(obj), 0


def _parse_token_rows(obj: dict[str, Any]) -> Mapped:
    """``_parse_tokens`` for a file declared ``tokens``: a line of another format says so."""
    if "input_ids" not in obj:
        for field, fmt in (("messages", "messages"), ("conversations", "sharegpt")):
            if field in obj:
                raise RowError(f'a {fmt} line in a dataset declared format = "tokens"')
    return _parse_tokens(obj)


def _usage(obj: dict[str, Any]) -> Usage:
    """A pass-through row's ``usage`` token counts (an earlier export carries them)."""
    usage = obj.get("usage")
    if usage is None:
        return None, None
    if type(usage) is not dict:
        raise RowError(f"usage must be an object, got {kind(usage)}")
    counts = []
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if value is not None and not (_is_int(value) and value >= 0):
            raise RowError(f"usage.{name} must be a non-negative integer, got {value!r}")
        counts.append(value)
    return counts[0], counts[1]


ITEM_PARSERS: dict[tuple[str, bool], ItemParser] = {
    ("last", False): _parse_last,
    ("all", False): _parse_all,
    # Whole conversations too: the reader makes one item of each turn (``readers.rows``).
    ("each", False): _parse_all,
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
        raise RowError(f"messages must be a list, got {kind(value)}")
    if not value:
        raise RowError("messages is empty")
    for i, message in enumerate(value, start=1):
        # Fast path for the overwhelmingly common {"role": ..., "content": "text"}.
        if type(message) is dict and len(message) == 2 and type(message.get("content")) is str:
            role = message.get("role")
            if type(role) is str and role in _ROLE_SET:
                continue
        if not isinstance(message, dict):
            raise RowError(f"message {i} must be an object, got {kind(message)}")
        if "role" not in message:
            raise RowError(f"message {i}: missing role")
        role = message["role"]
        if not isinstance(role, str):
            raise RowError(f"message {i}: role must be a string, got {kind(role)}")
        if role not in _ROLE_SET:
            raise RowError(
                f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        _check_message(i, message)
    return value


def _sharegpt_message(i: int, entry: object) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise RowError(f"message {i} must be an object, got {kind(entry)}")
    if "from" in entry:
        role_field, content_field = "from", "value"
    elif "role" in entry:
        role_field, content_field = "role", "content"
    else:
        raise RowError(f"message {i}: missing from (or role)")
    speaker = entry[role_field]
    if not isinstance(speaker, str):
        raise RowError(f"message {i}: {role_field} must be a string, got {kind(speaker)}")
    role = SHAREGPT_ROLES.get(speaker)
    if role is None:
        raise RowError(
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
        raise RowError(f"message {i}: tool_calls must be a list, got {kind(tool_calls)}")
    for field in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(field)
        if value is not None and not isinstance(value, str):
            raise RowError(f"message {i}: {field} must be a string, got {kind(value)}")

    content = message.get("content")
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content, start=1):
            if not isinstance(part, dict):
                raise RowError(
                    f"message {i}: {content_field} part {j} must be an object, got {kind(part)}"
                )
            if "type" not in part:
                raise RowError(f"message {i}: {content_field} part {j}: missing type")
            if not isinstance(part["type"], str):
                raise RowError(
                    f"message {i}: {content_field} part {j}: type must be a string, "
                    f"got {kind(part['type'])}"
                )
        return
    if content is None and message["role"] == "assistant" and tool_calls:
        return
    if "content" not in message:
        raise RowError(f"message {i}: missing {content_field}")
    raise RowError(
        f"message {i}: {content_field} must be a string or a list of parts, got {kind(content)}"
    )


def _finish_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop trailing assistant turns so the model writes the final answer itself."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    for k in range(end):
        if messages[k]["role"] == "user":
            return messages if end == len(messages) else messages[:end]
    raise RowError("no user message")


def _system(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The top-level ``system`` field as a message; empty means none (a blank column)."""
    system = obj.get("system")
    if system is None:
        return None
    if not isinstance(system, str):
        raise RowError(f"system must be a string, got {kind(system)}")
    return {"role": "system", "content": system} if system else None


def _decode_tools(text: str) -> object:
    if not text.strip():
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RowError(f"tools is a string but not valid JSON: {exc.msg}") from None


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
        got = repr(value) if _is_number(value) else kind(value)
        raise RowError(f"{where}{name} must be {expected}, got {got}")
    if why := params.unusable(name, value):
        raise RowError(f"{where}{name}: {why}")


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
    "response_format": lambda value: params.expected("response_format", value),
    "chat_template_kwargs": _check_object,
    # The checks of enqueue's options and a run file's keys (orchestrator.items.params).
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


# --- the pieces a column mapping builds with (orchestrator.formats.readers.columns) ---


def key_value(value: object, name: str) -> str:
    """A key read from ``name``: a non-empty string or an integer, as text."""
    return _key(value, name)


def any_messages(value: object) -> tuple[list[dict[str, Any]], str]:
    """A list of messages with OpenAI (``role``/``content``) or ShareGPT (``from``/``value``)
    keys, as OpenAI messages, and which of ``messages`` / ``sharegpt`` it was."""
    if not isinstance(value, list):
        raise RowError(f"must be a list of messages, got {kind(value)}")
    if not value:
        raise RowError("is empty")
    if not any(isinstance(entry, dict) and "from" in entry for entry in value):
        return _messages(value), "messages"
    return [_sharegpt_message(i, entry) for i, entry in enumerate(value, start=1)], "sharegpt"


def conversation_for(
    mode: str, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int, int]:
    """``messages`` as a row read for ``mode`` keeps them, the turns to generate and the
    predicted answer tokens: the line formats' rules (trailing answers dropped for
    ``last``, their length the prediction; every assistant turn for ``all`` and
    ``each``; the answer required for ``passthrough``, which predicts nothing: it is
    stored as done)."""
    if mode == "last":
        kept = _finish_messages(messages)
        return kept, 1, _dropped_tokens(messages, kept)
    if mode in ("all", "each"):
        turns = targets(messages)
        if not turns:
            raise RowError("no user message")
        return messages, len(turns), _target_tokens(messages, turns)
    if messages[-1]["role"] != "assistant":
        raise RowError("a passthrough row must end with the assistant's answer")
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no user message")
    return messages, 1, 0


def parse_json_value(text: str) -> object:
    """JSON text held in a column (a CSV cell, a string column), or ``RowError``."""
    raw = text.encode()
    try:
        return _loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RowError(json_reason(raw, exc)) from None


def tools_value(value: object) -> object:
    """A tools column: a list of tool objects, or its JSON text; None or blank for none."""
    if isinstance(value, str):
        value = _decode_tools(value)
    if value is not None:
        _check_field("tools", value)
    return value
