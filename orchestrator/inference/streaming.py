"""A streamed answer read: the event stream's lines, its ``data:`` events, the chunks
assembled into each choice's whole answer.

Apart from the client's sending because a stream has rules of its own: an idle gap is
bounded between ``data:`` events (``: ping`` comments are not progress), the answer is
complete once every choice has its finish reason (the usage chunk and ``[DONE]`` are read
when they come, not required), and tool calls arrive in pieces to be merged. The whole
answer is then checked as a non-streamed one is (``orchestrator.inference.completions``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import structlog

from orchestrator.errors import TransientError
from orchestrator.inference.completions import (
    MAX_TOKENS,
    TOKEN_IDS,
    Completion,
    answer_ids,
    choice_index,
    counted,
    read_ids,
    reasoning_key,
    reasoning_of,
    text_size,
    tokens_of,
    with_cached,
)
from orchestrator.inference.failures import too_large
from orchestrator.items import error_classes as ec
from orchestrator.items.samples import choice_usages
from orchestrator.items.token_ids import generated_ids_of, prompt_ids_of

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Streamed:
    """The completion tokens a request's stream has said so far (None: none said)."""

    tokens: int | None = None

    def said(self, tokens: Any) -> None:
        if type(tokens) is int and 0 <= tokens <= MAX_TOKENS:
            self.tokens = tokens


async def data_events(
    resp: aiohttp.ClientResponse, server: str, idle: float, limit: int
) -> AsyncIterator[bytes]:
    """The payloads of a stream's ``data:`` events, each within ``idle`` seconds of the
    one before: comments (``: ping``) and blank lines are not progress. The body may pass
    ``limit`` bytes no more than a whole one may."""
    lines = _sse_lines(resp.content, limit)
    while True:
        quiet = asyncio.timeout(idle)
        try:
            async with quiet:
                while True:
                    raw_line = await anext(lines, None)
                    if raw_line is None:
                        return
                    line = raw_line.strip()
                    if line.startswith(b"data:"):
                        break
        except TimeoutError:
            if not quiet.expired():
                raise  # the whole request's bound, not silence
            raise TransientError(
                f"no data from {server} for {idle:g}s", error_class=ec.STREAM_IDLE
            ) from None
        yield line[5:].strip()


async def read_stream(
    resp: aiohttp.ClientResponse,
    server: str,
    started: float,
    progress: Streamed | None = None,
    *,
    idle: float,
    limit: int,
    raw: bool = False,
) -> list[Completion]:
    """A streamed answer, complete once its ``finish_reason`` has come: what follows
    (the usage chunk, ``[DONE]``) is read when the server sends it, but a stream that
    ends after the finish reason without them, closed, broken or silent, still
    answered in full. Without a finish reason it was cut: ``stream_cut``."""
    ctype = resp.headers.get("Content-Type", "")
    if "event-stream" not in ctype:
        raise TransientError(
            f"expected an event stream, got content type {ctype!r}",
            error_class=ec.BAD_RESPONSE,
        )
    got = _Streamed(raw=raw)
    try:
        async for data in data_events(resp, server, idle, limit):
            if data == b"[DONE]":
                break
            got.add(data)
            if progress is not None and isinstance(got.usage, dict):
                progress.said(got.usage.get("completion_tokens"))
    except (*_STREAM_BROKEN, TransientError) as exc:
        ended = not isinstance(exc, TransientError) or exc.error_class == ec.STREAM_IDLE
        if not got.finished or not ended:
            raise
        log.debug(
            "stream_ended_after_finish",
            server=server,
            usage=got.usage is not None,
            error=str(exc) or type(exc).__name__,
        )
    if not got.finished:
        raise TransientError(
            "the stream ended before the answer was complete", error_class=ec.STREAM_CUT
        )
    ordered = [c for _, c in sorted(got.choices.items())]
    tokens = [tokens_of(c.token_parts) for c in ordered]
    usages = choice_usages(
        with_cached(got.usage, got.timings),
        [len(t) if t else c.said for c, t in zip(ordered, tokens, strict=True)],
        [text_size(c.content, c.reasoning, list(c.tool_calls.values())) for c in ordered],
    )
    return [
        counted(
            usage,
            "".join(c.content),
            "".join(c.reasoning) or None,
            [c.tool_calls[i] for i in sorted(c.tool_calls)] or None,
            c.finish_reason,
            usage=usage,
            latency=time.monotonic() - started,
            server=server,
            model=got.model,
            response_id=got.response_id,
            tokens=tokens_,
            raw=raw,
            reasoning_key=c.reasoning_key,
            ids=answer_ids(got.prompt_ids, c.generated_ids),
        )
        for c, tokens_, usage in zip(ordered, tokens, usages, strict=True)
    ]


#: How a stream can end other than by ``[DONE]`` or a clean close: the connection broken
#: (a chunked body left unterminated, a reset) or silent past the idle timeout.
_STREAM_BROKEN = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.SocketTimeoutError,
)


async def _sse_lines(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The lines of an event stream, each whole however long, until the body has passed
    ``limit`` bytes (``response_too_large``). Split here rather than by aiohttp's
    ``readline``, which refuses a line over 512 KiB with an exception of its own. A last
    line the body ends inside is not given: an event ends with its line."""
    pending = bytearray()
    received = 0
    while chunk := await content.readany():
        received += len(chunk)
        if received > limit:
            raise too_large(limit, "the stream kept coming")
        scan, start = len(pending), 0
        pending += chunk
        end = pending.find(b"\n", scan)
        while end != -1:
            yield bytes(pending[start:end])
            start = end + 1
            end = pending.find(b"\n", start)
        del pending[:start]


@dataclass(slots=True)
class _StreamedChoice:
    """What a stream's chunks have said so far of one choice."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    #: The generated ids its chunks said in the server's own field (None: none).
    generated_ids: list[int] | None = None
    #: The field its reasoning came in (``completions.reasoning_key``).
    reasoning_key: str = "reasoning_content"
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: Any = None
    #: Its chunks that carry logprobs or token ids, in order.
    token_parts: list[dict[str, Any]] = field(default_factory=list)
    #: Its completion tokens so far, as a chunk of this choice alone said in its usage
    #: (vLLM's ``continuous_usage_stats`` counts each choice apart).
    said: Any = None


@dataclass(slots=True)
class _Streamed:
    """What a stream's chunks have said so far: each choice's part, by its index."""

    choices: dict[int, _StreamedChoice] = field(default_factory=dict)
    usage: Any = None
    timings: Any = None
    model: Any = None
    response_id: Any = None
    #: A raw completion's stream (``text`` in each choice, not a ``delta``).
    raw: bool = False
    #: The prompt's ids, as vLLM's first chunk says them.
    prompt_ids: tuple[int, ...] | None = None

    def add(self, data: bytes) -> None:
        """One ``data:`` payload: a chunk object, or ``bad_response``."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise TransientError(
                f"unparsable stream chunk: {exc}", error_class=ec.BAD_RESPONSE
            ) from exc
        if not isinstance(chunk, dict):
            raise TransientError("stream chunk is not an object", error_class=ec.BAD_RESPONSE)
        self.model = chunk.get("model") or self.model
        self.response_id = chunk.get("id") or self.response_id
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        alone = isinstance(chunk.get("usage"), dict) and len(chunk.get("choices") or ()) == 1
        self.prompt_ids = read_ids(prompt_ids_of, chunk, {}) or self.prompt_ids
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                raise TransientError(
                    "a stream choice is not an object", error_class=ec.BAD_RESPONSE
                )
            got = self.choices.setdefault(choice_index(choice), _StreamedChoice())
            if alone:
                got.said = chunk["usage"].get("completion_tokens")
            self.prompt_ids = read_ids(prompt_ids_of, {}, choice) or self.prompt_ids
            generated = read_ids(generated_ids_of, chunk, choice)
            if generated is not None:
                got.generated_ids = [*(got.generated_ids or ()), *generated]
            if choice.get("logprobs") or TOKEN_IDS.intersection(choice):
                got.token_parts.append(choice)
            delta = {"content": choice.get("text")} if self.raw else choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                got.content.append(delta["content"])
            piece = reasoning_of(delta)
            if piece:
                got.reasoning.append(piece)
                got.reasoning_key = reasoning_key(delta)
            for call in delta.get("tool_calls") or []:
                _merge_tool_call(got.tool_calls, call)
            if choice.get("finish_reason"):
                got.finish_reason = choice["finish_reason"]

    @property
    def finished(self) -> bool:
        """Every choice begun has its finish reason."""
        return bool(self.choices) and all(
            c.finish_reason is not None for c in self.choices.values()
        )


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Add one streamed tool-call delta: the first of an index names the call (id, name),
    the rest carry pieces of its arguments. Keys keep the order of a non-streamed call."""
    index = int(delta.get("index", len(calls)))
    fn = delta.get("function") or {}
    call = calls.get(index)
    if call is None:
        call = calls[index] = {}
        if delta.get("id"):
            call["id"] = delta["id"]
        call["type"] = delta.get("type") or "function"
        call["function"] = {"name": fn["name"]} if fn.get("name") else {}
        call["function"]["arguments"] = ""
    elif delta.get("id"):
        call["id"] = delta["id"]
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]
