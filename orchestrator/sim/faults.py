"""The faults the simulated server injects (``--fault KIND=RATE``, ``--outage``): error
answers drawn before generation, a connection reset mid-answer, a request left hanging,
garbage in place of an answer, and a whole outage.

Kept apart so that the failures a client must survive are read in one place; the faults
that show in the answer itself (``malformed``, ``stall``, ``empty``) are applied where the
answer is written (``orchestrator.sim.responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from orchestrator.sim.messages import served_model
from orchestrator.sim.refusals import JSON_TYPE, bad_request, error_response
from orchestrator.sim.runtime import STATE, State

#: The Batch API's paths: a provider's batches live apart from its online servers, so an
#: outage of those leaves them be.
BATCH_API_PATHS = ("/v1/files", "/v1/batches")


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def outage_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[STATE]
    if state.in_outage() and not request.path.startswith(BATCH_API_PATHS):
        state.stats.outage_rejected += 1
        return error_response(
            503, "server unavailable (simulated outage)", "ServiceUnavailableError"
        )
    return await handler(request)


async def fault_response(
    request: web.Request, state: State, fault: str, body: dict[str, Any], stream: bool
) -> web.StreamResponse | None:
    """The answer a drawn fault gives before any generation; None for the faults that
    show in the answer itself (malformed, stall when streaming, empty)."""
    config = state.config
    if fault == "500":
        return error_response(500, "simulated internal server error", "InternalServerError")
    if fault == "503":
        return error_response(
            503, "simulated overload: server unavailable", "ServiceUnavailableError"
        )
    if fault == "429":
        return error_response(
            429,
            "simulated rate limit: too many requests",
            "RateLimitError",
            headers={"Retry-After": f"{config.retry_after:g}"},
        )
    if fault == "400":
        # A refusal of this request alone: each message differs, as a real one
        # names what in the request it refuses.
        return bad_request(f"simulated bad request (#{state.stats.faults[fault]})")
    if fault == "reset":
        return await _reset(request, stream)
    if fault == "hang" or (fault == "stall" and not stream):
        return await hang(request, state)
    if fault == "nochoices":
        doc = {"id": "chatcmpl-x", "object": "chat.completion", "model": served_model(body, config)}
        return web.Response(body=orjson.dumps({**doc, "choices": []}), content_type=JSON_TYPE)
    if fault == "html":
        page = "<html><body><h1>502 Bad Gateway</h1></body></html>"
        return web.Response(status=200, text=page, content_type="text/html")
    return None


async def _reset(request: web.Request, stream: bool) -> web.StreamResponse:
    """The connection reset once the answer has begun: a request cut mid-way. (One closed
    before any byte, on a pooled connection, is a keep-alive connection the server had
    dropped, which a client sends again on a new one at no cost.)"""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream" if stream else JSON_TYPE}
    )
    await resp.prepare(request)
    await resp.write(b"data: {" if stream else b'{"id": ')
    if request.transport is not None:
        request.transport.abort()
    return resp


async def hang(request: web.Request, state: State) -> web.StreamResponse:
    """Never answer; return only once the client is gone or the server stops."""
    while not client_gone(request) and not state.closing.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closing.wait(), timeout=0.1)
    if client_gone(request):
        state.stats.aborted += 1
    elif request.transport is not None:
        # Stopping: drop the connection as a dying server would, never send an answer.
        request.transport.abort()
    return web.Response(status=499)
