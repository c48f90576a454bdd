"""A generated answer sent as the HTTP response: one JSON body, or an event stream of
deltas, each after the time its generation takes (the batching model's, or the plain
latency and per-token time), and what is counted when a client leaves mid-way.

Kept apart from the request handling (``orchestrator.sim.server``): this is the timing and
the writing of an answer already decided.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from orchestrator.sim.answer import Plan, answer_document
from orchestrator.sim.config import SimConfig
from orchestrator.sim.faults import client_gone, hang
from orchestrator.sim.generation import SimAnswer
from orchestrator.sim.messages import Shape, served_model, stream_deltas, usage_counts
from orchestrator.sim.refusals import JSON_TYPE
from orchestrator.sim.runtime import State


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


async def whole_answer(
    request: web.Request, state: State, plan: Plan, fault: str | None
) -> web.StreamResponse:
    """The answer in one body, once the time it takes to generate has passed (the
    longest choice's: a request's choices are generated side by side)."""
    config, n = state.config, max(a.tokens for a in plan.answers)
    prompt_tokens, cached = plan.prompt_tokens, plan.cached
    if state.batcher is not None:
        await state.batcher.generate(prompt_tokens, n, plan.limit, cached or 0)
    else:
        await _sleep(config.latency + config.per_token * n + _prefill(state, prompt_tokens, cached))
    if client_gone(request):
        state.stats.aborted += 1
        return web.Response(status=499)
    if fault == "malformed":
        completion_id = plan.completion_id
        truncated = f'{{"id": "{completion_id}", "object": "chat.completion", "choices": [{{'
        return web.Response(status=200, body=truncated.encode(), content_type=JSON_TYPE)
    doc = answer_document(state, plan)
    return web.Response(body=orjson.dumps(doc), content_type=JSON_TYPE)


def _prefill(state: State, prompt_tokens: int, cached: int | None) -> float:
    """Without batching, the seconds the uncached prompt tokens take, when the server
    models a prefix cache (without one the prompt is free, as it always was)."""
    if cached is None:
        return 0.0
    return state.config.prefill_per_token * (prompt_tokens - cached)


async def stream_answer(
    request: web.Request,
    state: State,
    *,
    completion_id: str,
    answers: list[SimAnswer],
    prompt_tokens: int,
    include_usage: bool,
    cut: bool,
    cached: int | None = None,
    continuous: bool = False,
    stall: bool = False,
    limit: int = 0,
    model: str = "",
    shapes: list[Shape] | None = None,
) -> web.StreamResponse:
    config = state.config
    batcher = state.batcher
    created = int(time.time())
    shapes = shapes or [Shape({}, a.digest, False, []) for a in answers]
    at = [0] * len(answers)  # each choice's position of the first token of its next delta

    def chunk(
        delta: dict[str, Any],
        finish: str | None,
        index: int = 0,
        tokens: int = 0,
        so_far: int | None = None,
    ) -> bytes:
        choice = shapes[index].choice(delta, at[index], tokens, streamed=True, index=index)
        at[index] += tokens
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "text_completion" if shapes[0].plain else "chat.completion.chunk",
            "created": created,
            "model": model or served_model({}, config),
            "choices": [{**choice, "finish_reason": finish}],
        }
        if so_far is not None:
            # vLLM's continuous_usage_stats: usage in every chunk, its completion tokens
            # those of the chunk's choice alone (the last chunk's are the request's).
            payload["usage"] = usage_counts(prompt_tokens, so_far, cached)
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    longest = max(a.tokens for a in answers)
    response = await _stream_started(request, state, prompt_tokens, longest, limit, cached)
    if not shapes[0].plain:
        for i in range(len(answers)):
            await response.write(chunk({"role": "assistant", "content": ""}, None, i))
    entries = _entries(answers, config)
    # A malformed stream stops after about half of its deltas, without finish_reason/[DONE];
    # a stalled one sends the same half, then nothing, keeping the connection open.
    sent = entries[: max(1, (len(entries) - 1) // 2)] if cut or stall else entries
    so_far, each = 0, [0] * len(answers)
    try:
        for index, delta, tokens, finish in sent:
            await _sleep(0 if batcher is not None or finish else config.per_token * tokens)
            so_far += tokens
            each[index] += tokens
            usage_now = each[index] if continuous and finish is None else None
            await response.write(chunk(delta, finish, index, tokens, usage_now))
    except (ConnectionError, asyncio.CancelledError):
        # The client left mid-stream: what it was sent is generated and thrown away.
        state.stats.aborted_tokens += so_far
        raise
    if stall:
        await hang(request, state)
        return response
    if not cut:
        if include_usage:
            usage = usage_counts(prompt_tokens, sum(a.tokens for a in answers), cached)
            name = model or served_model({}, config)
            await response.write(_usage_chunk(completion_id, created, name, usage))
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _usage_chunk(completion_id: str, created: int, model: str, usage: dict[str, Any]) -> bytes:
    """The last chunk of a stream that asked for usage: no choices, the request's usage."""
    chunk = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _entries(
    answers: list[SimAnswer], config: SimConfig
) -> list[tuple[int, dict[str, Any], int, str | None]]:
    """What a stream sends: each choice's deltas then its finish, one choice after the
    other (index, delta, tokens, finish reason)."""
    entries: list[tuple[int, dict[str, Any], int, str | None]] = []
    for i, each in enumerate(answers):
        entries += [(i, delta, tokens, None) for delta, tokens in stream_deltas(each, config)]
        entries.append((i, {}, 0, each.finish_reason))
    return entries


async def _stream_started(
    request: web.Request,
    state: State,
    prompt_tokens: int,
    tokens: int,
    limit: int,
    cached: int | None,
) -> web.StreamResponse:
    """The stream's response, once the answer (its longest choice, of ``tokens``) is
    ready to go: the batching model answers once the whole answer is generated, the plain
    one after its latency and prefill."""
    if state.batcher is not None:
        await state.batcher.generate(prompt_tokens, tokens, limit, cached or 0)
    else:
        await _sleep(state.config.latency + _prefill(state, prompt_tokens, cached))
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response
