"""A server's answer read into a :class:`Completion`: what is checked before it is kept.

Both transports and both forms (a whole JSON body, a stream's assembled chunks) end here,
so an answer is judged the same however it came: finish reasons, reasoning fields, tool
calls, usage counts, token ids and logprobs. Fields of the wrong type are refused as
``bad_response``: what is stored becomes training data. An answer that is usable but poor
(cut by ``max_tokens``, reasoning without an answer) is not an error: it carries its
quality flags (``orchestrator.items.quality``), and what to do with it is the caller's
choice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import orjson

from orchestrator.errors import InferenceError, TransientError
from orchestrator.inference.failures import RateLimits, rate_limits
from orchestrator.items import error_classes as ec
from orchestrator.items.answer import Answer
from orchestrator.items.quality import UNCLOSED_THINK, flags_of, split_think
from orchestrator.items.samples import choice_usages
from orchestrator.items.token_ids import BadIds, TokenIds, generated_ids_of, prompt_ids_of
from orchestrator.items.tokens import CHOICE_ID_FIELDS, BadTokens, Collector, Tokens


@dataclass(frozen=True, slots=True)
class Completion(Answer):
    """One answer from a server (``orchestrator.items.answer.Answer``'s fields), the token ids
    and logprobs it came with (``orchestrator.items.tokens``; None: the server gave none), and
    the rate limits its headers said (not stored: the pacer's)."""

    tokens: Tokens | None = None
    rate_limits: RateLimits | None = None

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return self.message.get("tool_calls")

    @property
    def unclosed_think(self) -> bool:
        """The answer opened a ``<think>`` block and was cut before closing it."""
        return bool(self.flags & UNCLOSED_THINK)


def parse_answer(
    body: bytes, headers: Any, server: str, started: float, *, raw: bool = False
) -> list[Completion]:
    """A whole (not streamed) answer's body: each of its choices in index order, or a
    classified error."""
    latency = time.monotonic() - started
    ctype = headers.get("Content-Type", "")
    if "json" not in ctype:
        raise TransientError(
            f"expected a JSON answer, got content type {ctype!r}", error_class=ec.BAD_RESPONSE
        )
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise TransientError(f"unparsable answer: {exc}", error_class=ec.BAD_RESPONSE) from exc
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not choices or not all(isinstance(c, dict) for c in choices):
        raise TransientError("the answer has no choices", error_class=ec.BAD_RESPONSE)
    ordered = sorted(choices, key=choice_index)
    messages = []
    for choice in ordered:
        message = {"content": choice.get("text")} if raw else choice.get("message")
        if not isinstance(message, dict):
            raise TransientError("the answer's choice has no message", error_class=ec.BAD_RESPONSE)
        messages.append(message)
    tokens = [tokens_of([choice]) for choice in ordered]
    alone = len(ordered) == 1  # llama.cpp's ids are the answer's, not a choice's
    ids = [
        answer_ids(
            read_ids(prompt_ids_of, doc, c), read_ids(generated_ids_of, doc if alone else {}, c)
        )
        for c in ordered
    ]
    usages = choice_usages(
        with_cached(doc.get("usage"), doc.get("timings")),
        [len(t) if t else None for t in tokens],
        [text_size(m.get("content"), reasoning_of(m), m.get("tool_calls")) for m in messages],
    )
    return [
        counted(
            usage,
            message.get("content"),
            reasoning_of(message),
            message.get("tool_calls") or None,
            choice.get("finish_reason"),
            usage=usage,
            latency=latency,
            server=server,
            model=doc.get("model"),
            response_id=doc.get("id"),
            tokens=tokens_,
            raw=raw,
            reasoning_key=reasoning_key(message),
            ids=ids_,
        )
        for choice, message, tokens_, usage, ids_ in zip(
            ordered, messages, tokens, usages, ids, strict=True
        )
    ]


def read_ids(read: Any, doc: dict[str, Any], choice: dict[str, Any]) -> tuple[int, ...] | None:
    """``read`` (``prompt_ids_of`` or ``generated_ids_of``), its refusal a ``bad_response``."""
    try:
        return read(doc, choice)
    except BadIds as exc:
        raise _bad(str(exc)) from exc


def answer_ids(prompt: Any, generated: Any) -> TokenIds | None:
    """The ids an answer came with (None: it said none)."""
    if prompt is None and generated is None:
        return None
    source = "response" if prompt is not None else "none"
    return TokenIds(prompt, tuple(generated) if generated is not None else None, source)


def reasoning_of(obj: dict[str, Any]) -> str | None:
    # SGLang and older vLLM say reasoning_content; newer vLLM says reasoning.
    value = obj.get("reasoning_content")
    if value is None:
        value = obj.get("reasoning")
    return value if isinstance(value, str) else None


def reasoning_key(obj: dict[str, Any]) -> str:
    """The field a message or delta says its reasoning in: the stored answer keeps it
    there, so that a later turn sends it back as this server reads it."""
    if obj.get("reasoning_content") is None and isinstance(obj.get("reasoning"), str):
        return "reasoning"
    return "reasoning_content"


def _check_finished(
    content: str | None, reasoning: str | None, tool_calls: Any, finish_reason: str | None
) -> None:
    if finish_reason == "abort":
        raise TransientError("the server aborted the request", error_class=ec.ABORTED)
    if not content and not reasoning and not tool_calls:
        raise TransientError(
            f"the answer has no content (finish_reason={finish_reason!r})",
            error_class=ec.EMPTY_CONTENT,
        )


def tokens_of(choices: list[dict[str, Any]]) -> Tokens | None:
    """The tokens the choices say (a streamed answer's in order), or ``bad_response``."""
    collector = Collector()
    try:
        for choice in choices:
            collector.add(choice)
        return collector.result()
    except BadTokens as exc:
        raise _bad(f"unreadable logprobs or token ids: {exc}") from exc


def with_limits(choices: list[Completion], headers: Any) -> list[Completion]:
    """The choices, with the rate limits the answer's headers said (if any)."""
    limits = rate_limits(headers)
    if limits is None:
        return choices
    return [dataclasses.replace(c, rate_limits=limits) for c in choices]


def choice_index(choice: dict[str, Any]) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def text_size(content: Any, reasoning: Any, tool_calls: Any) -> int:
    """How much text a choice holds (its parts as received): what a request's completion
    tokens are shared by (``draws.choice_usages``)."""
    size = 0
    for part in (content, reasoning):
        if isinstance(part, str):
            size += len(part)
        elif isinstance(part, list):  # a stream's pieces
            size += sum(len(p) for p in part if isinstance(p, str))
    if tool_calls:
        size += len(orjson.dumps(tool_calls, default=str, option=orjson.OPT_NON_STR_KEYS))
    return size


def counted(said: Any, *args: Any, **kwargs: Any) -> Completion:
    """:func:`_completion`; an answer it refuses keeps the completion tokens its usage
    said (``generated_tokens``), the work thrown away with it."""
    try:
        return _completion(*args, **kwargs)
    except InferenceError as exc:
        tokens = said.get("completion_tokens") if isinstance(said, dict) else None
        if type(tokens) is int and 0 <= tokens <= MAX_TOKENS:
            exc.generated_tokens = tokens
        raise


TOKEN_IDS = frozenset(CHOICE_ID_FIELDS)


def _completion(
    content: Any,
    reasoning: str | None,
    tool_calls: Any,
    finish_reason: Any,
    *,
    usage: Any,
    latency: float,
    server: str,
    model: Any,
    response_id: Any,
    tokens: Tokens | None = None,
    raw: bool = False,
    reasoning_key: str = "reasoning_content",
    ids: TokenIds | None = None,
) -> Completion:
    """Check a received answer and build its Completion, the same for both transports.

    Fields of the wrong type are refused as ``bad_response`` (see :func:`_checked_answer`):
    what is stored becomes training data, and a malformed field in it either poisons the
    data or cannot be stored at all. Reasoning is split out of the content only when the
    server sent none apart: a server
    without a reasoning parser leaves the model's think tags in the content. A tool-call
    answer with empty content says ``None``, as a non-streaming server does. A raw
    completion (``raw``) is the text as generated: nothing is split out of it.
    """
    content, tool_calls, finish_reason = _checked_answer(content, tool_calls, finish_reason)
    usage = _checked_usage(usage)
    model, response_id = _identifier(model, "model"), _identifier(response_id, "id")
    unclosed = False
    if reasoning is None and isinstance(content, str) and not raw:
        reasoning, content, unclosed = split_think(content)
    if tool_calls and content == "":
        content = None
    _check_finished(content, reasoning, tool_calls, finish_reason)
    return Completion(
        message=_assistant_message(content, reasoning, tool_calls, reasoning_key),
        content=content,
        reasoning=reasoning,
        finish_reason=finish_reason,
        usage=usage,
        latency=latency,
        server=server,
        model=model,
        response_id=response_id,
        flags=flags_of(
            content=content,
            reasoning=reasoning,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            unclosed_think=unclosed,
        ),
        tokens=tokens,
        ids=ids,
    )


# Most tokens a usage count may say: the columns are 32-bit, and no answer comes near.
MAX_TOKENS = 2**31 - 1
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def with_cached(usage: Any, timings: Any) -> Any:
    """``usage`` with ``cached_tokens``: the prompt tokens the server took from its
    prefix cache rather than computing them, when it says.

    SGLang and vLLM say it in ``usage.prompt_tokens_details.cached_tokens``; llama.cpp's
    ``llama-server`` in ``timings.cache_n`` (its ``prompt_n`` being those it computed).
    A server that says neither leaves ``usage`` as it was: no count is not zero.
    """
    if not isinstance(usage, dict) or "cached_tokens" in usage:
        return usage
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None and isinstance(timings, dict):
        cached = timings.get("cache_n")
    if cached is None:
        return usage
    return {**usage, "cached_tokens": cached}


def _bad(message: str) -> TransientError:
    return TransientError(message, error_class=ec.BAD_RESPONSE)


def _checked_answer(
    content: Any, tool_calls: Any, finish_reason: Any
) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """The answer's content, tool calls and finish_reason, or ``bad_response``.

    A ``finish_reason`` given as an object (``{"type": "length", ...}``, as SGLang's
    native API does) is read as its type; an answer without one may have been cut short.
    """
    if content is not None and not isinstance(content, str):
        raise _bad(f"the answer's content is a {type(content).__name__}, not a string")
    if isinstance(finish_reason, dict) and isinstance(finish_reason.get("type"), str):
        finish_reason = finish_reason["type"]
    if finish_reason is None:
        raise _bad("the answer has no finish_reason: it may have been cut short")
    if not isinstance(finish_reason, str):
        raise _bad(f"finish_reason is a {type(finish_reason).__name__}, not a string")
    if tool_calls is not None:
        if not isinstance(tool_calls, list) or not all(_is_tool_call(c) for c in tool_calls):
            raise _bad(f"malformed tool_calls: {str(tool_calls)[:200]}")
        tool_calls = tool_calls or None
    return content, tool_calls, finish_reason


def _is_tool_call(call: Any) -> bool:
    """An OpenAI tool call: a function with a name and arguments (JSON text or object)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return False
    fn = call["function"]
    return (
        isinstance(fn.get("name"), str)
        and isinstance(fn.get("arguments", ""), str | dict)
        and isinstance(call.get("id", ""), str)
        and isinstance(call.get("type", ""), str)
    )


def _checked_usage(usage: Any) -> dict[str, Any] | None:
    """``usage`` with whole, plausible token counts, or ``bad_response``."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise _bad(f"usage is a {type(usage).__name__}, not an object")
    for name in _USAGE_COUNTS:
        if name not in usage:
            continue
        value = usage[name]
        if type(value) is not int or not 0 <= value <= MAX_TOKENS:
            raise _bad(f"usage.{name} is {str(value)[:40]!r}, not a token count")
    return usage


def _identifier(value: Any, name: str) -> str | None:
    """A response's ``model`` or ``id``: text (a number is written as text), or None."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is int or type(value) is float:
        return str(value)
    raise _bad(f"the answer's {name} is a {type(value).__name__}, not a string")


def _assistant_message(
    content: str | None, reasoning: str | None, tool_calls: Any, key: str
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message[key] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message
