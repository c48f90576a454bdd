"""A simulated OpenAI-compatible inference server.

It stands in for an SGLang/vLLM server wherever a GPU is not wanted: tests, rehearsals of a
run, benchmarks of the orchestrator itself and the demo. Answers are deterministic and carry
the digest of the request they answer, so a caller can prove that every stored answer
belongs to its prompt. Failures real servers show under load (5xx, 429, resets, hangs,
garbage bodies, restarts) can be injected at chosen rates to rehearse recovery.

It can also answer as a reasoning model does, with the thinking in a separate field (a
server with a reasoning parser) or left in the content between ``<think>`` tags (one
without), and with tool calls when the request offers tools, so that everything a client
must take apart can be exercised without a GPU.

This module is the server itself: its request handlers, the application's assembly and
its command line. The model it simulates is ``orchestrator.sim.generation``, the answer as
written ``orchestrator.sim.messages`` and ``orchestrator.sim.responses``, the checks before
an answer ``orchestrator.sim.refusals``, the injected failures ``orchestrator.sim.faults``,
and what lives as long as the server ``orchestrator.sim.runtime``.

Run it with ``python -m orchestrator.sim.server --port 30000 --fault 500=0.05``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import click
import orjson
from aiohttp import web

from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim.answer import plan_answer
from orchestrator.sim.batchapi import add_batch_api, batch_api_stats
from orchestrator.sim.config import SimConfig
from orchestrator.sim.exposition import Figures, metrics_text
from orchestrator.sim.faults import fault_response, outage_middleware
from orchestrator.sim.messages import served_model, usage_counts
from orchestrator.sim.options import sim_config, sim_options
from orchestrator.sim.prefix import prompt_words
from orchestrator.sim.refusals import JSON_TYPE, error_response, validate
from orchestrator.sim.responses import stream_answer, whole_answer
from orchestrator.sim.runtime import STATE, State

__all__ = ["build_app", "main", "run_forever", "serve"]


#: KV-cache size the ``sglang:token_usage`` gauge is measured against.
_KV_CAPACITY_TOKENS = 262_144

#: The faults whose answers are still whole answers, billed as any (None: no fault).
BILLED_FAULTS = (None, "empty", "bad_ids")


#: The endpoints, each declared beside its handler.
ROUTES = web.RouteTableDef()


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    authorized = request.headers.get("Authorization") == f"Bearer {key}"
    if key and request.path.startswith("/v1/") and not authorized:
        return error_response(401, "invalid or missing API key", "AuthenticationError")
    return await handler(request)


@ROUTES.post("/v1/completions")
async def _completions(request: web.Request) -> web.StreamResponse:
    """``/v1/completions``: a plain prompt, answered as a base model would (text only)."""
    return await _chat_completions(request, plain=True)


@ROUTES.post("/v1/chat/completions")
async def _chat_completions(request: web.Request, *, plain: bool = False) -> web.StreamResponse:
    state = request.app[STATE]
    stats = state.stats
    stats.chat_requests += 1
    stats.running += 1
    stats.peak_running = max(stats.peak_running, stats.running)
    sequences = 0
    try:
        sequences = await _sequences(request, state.config)
        stats.sequences += sequences
        stats.peak_sequences = max(stats.peak_sequences, stats.sequences)
        return await _answer_chat(request, state, plain=plain)
    except asyncio.CancelledError:
        # The client went away (handler cancellation) or the server is stopping.
        stats.aborted += 1
        raise
    except ConnectionError:
        stats.aborted += 1
        return web.Response(status=499)
    finally:
        stats.running -= 1
        stats.sequences -= sequences


async def _sequences(request: web.Request, config: SimConfig) -> int:
    """The sequences a request asks the server to generate at once (its ``n``), as a
    batching server gives each a slot; the body is read here and again, from aiohttp's
    copy, when it is answered."""
    if config.ignore_n:
        return 1
    try:
        n = orjson.loads(await request.read()).get("n", 1)
    except (orjson.JSONDecodeError, AttributeError):
        return 1
    return n if isinstance(n, int) and n > 1 else 1


async def _answer_chat(
    request: web.Request, state: State, *, plain: bool = False
) -> web.StreamResponse:
    config, stats = state.config, state.stats
    begun = time.monotonic()
    raw = await request.read()
    checked = validate(state, raw, plain=plain)
    if isinstance(checked, web.Response):
        stats.invalid += 1
        return checked
    body = checked
    stream = body.get("stream") is True

    fault = state.draw_fault()
    if fault is not None:
        stats.faults[fault] += 1
        faulty = await fault_response(request, state, fault, body, stream)
        if faulty is not None:
            return faulty

    plan = plan_answer(state, body, plain=plain, fault=fault)
    if isinstance(plan, web.Response):
        return plan
    prompt_tokens, n = plan.prompt_tokens, plan.tokens
    response: web.StreamResponse
    stats.running_tokens += prompt_tokens + n
    try:
        if stream:
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            continuous = include_usage and options.get("continuous_usage_stats") is True
            response = await stream_answer(
                request, state, completion_id=plan.completion_id, answers=plan.answers,
                prompt_tokens=prompt_tokens, cached=plan.cached, include_usage=include_usage,
                continuous=continuous, cut=fault == "malformed", stall=fault == "stall",
                limit=plan.limit, model=served_model(body, config), shapes=plan.shapes,
            )  # fmt: skip
        else:
            response = await whole_answer(request, state, plan, fault)
    finally:
        stats.running_tokens -= prompt_tokens + n
    if fault is None and response.status != 499:  # 499: the client left before the answer
        stats.record_completion(prompt_tokens, n, time.monotonic() - begun)
    if response.status == 200 and fault in BILLED_FAULTS:
        asked = {k: v for k, v in body.items() if k != "messages"} if plain else body
        state.bill.charge(asked, usage_counts(prompt_tokens, n, plan.cached), batch=False)
    return response


@ROUTES.post("/tokenize")
async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: a prompt's or a chat's messages' ids, as the answers count them."""
    state = request.app[STATE]
    if state.config.prompt_ids == "none":
        return error_response(404, "Not Found", "NotFoundError")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        messages = [{"role": "user", "content": body["prompt"]}]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return error_response(400, "'messages' or 'prompt' is required", "BadRequestError")
    ids = sim_tokens.prompt_ids(prompt_words(messages))
    doc = {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids}
    return web.Response(body=orjson.dumps(doc), content_type=JSON_TYPE)


@ROUTES.post("/detokenize")
async def _detokenize(request: web.Request) -> web.Response:
    """``/detokenize``: the text of an answer the server gave with these ids (llama.cpp's
    ``content`` and vLLM's ``prompt``); ids of no recent answer spell ``" t<id>"`` each."""
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        return error_response(400, "'tokens' must be a list of token ids", "BadRequestError")
    text = state.spelled.get(tuple(ids))
    if text is None:
        text = "".join(f" t{i}" for i in ids)
    return web.Response(
        body=orjson.dumps({"content": text, "prompt": text}), content_type=JSON_TYPE
    )


@ROUTES.get("/health")
@ROUTES.get("/health_generate")
async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@ROUTES.get("/v1/models")
async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    created = int(time.time() - state.uptime())
    context = {"max_model_len": state.config.max_model_len} if state.config.max_model_len else {}
    body = {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "sim", **context}
            for name in state.config.served
        ],
    }
    return web.Response(body=orjson.dumps(body), content_type=JSON_TYPE)


def _metrics_text(state: State) -> str:
    stats = state.stats
    batcher = state.batcher
    if batcher is not None:
        running, queued = len(batcher.model.running), len(batcher.model.queue)
        usage, throughput = batcher.model.usage, batcher.throughput()
    else:
        running, queued = stats.running, 0
        usage = min(1.0, stats.running_tokens / _KV_CAPACITY_TOKENS)
        throughput = stats.throughput(state.uptime())
    retracted = batcher.model.retracted if batcher is not None else 0
    figures = Figures(running, queued, usage, throughput, retracted, stats)
    config = state.config
    return metrics_text(config.metric_names, config.served[0], figures)


@ROUTES.get("/metrics")
async def _metrics(request: web.Request) -> web.Response:
    text = _metrics_text(request.app[STATE])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


@ROUTES.get("/sim/stats")
async def _sim_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = {**state.stats.as_json(), "uptime": state.uptime(), "in_outage": state.in_outage()}
    if state.batcher is not None:
        body["batch"] = state.batcher.as_json()
    body["batch_api"] = batch_api_stats(request.app)
    return web.Response(body=orjson.dumps(body), content_type=JSON_TYPE)


@ROUTES.get("/sim/bill")
async def _sim_bill(request: web.Request) -> web.Response:
    """What the answers so far would cost (``orchestrator.sim.bill``)."""
    bill = request.app[STATE].bill.as_json()
    return web.Response(body=orjson.dumps(bill), content_type=JSON_TYPE)


def build_app(config: SimConfig) -> web.Application:
    """The simulated server as an aiohttp application (outage clock starts at startup)."""
    # Room for a Batch API input file of --batch-max-bytes (and its multipart framing).
    largest = max(64 * 1024**2, config.batch_max_bytes + 1024**2)
    app = web.Application(
        middlewares=[outage_middleware, _auth_middleware], client_max_size=largest
    )
    state = State(config)
    app[STATE] = state
    add_batch_api(app)

    async def on_startup(app: web.Application) -> None:
        state.started = time.monotonic()

    async def on_shutdown(app: web.Application) -> None:
        # Release hanging requests so that shutdown does not wait for their clients.
        state.closing.set()

    async def on_cleanup(app: web.Application) -> None:
        if state.batcher is not None:
            await state.batcher.close()

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        # Every chat answer, a 429 or a stream too, says the buckets as they are now.
        if (
            state.limiter is not None
            and state.config.rate_limit_headers
            and request.path == "/v1/chat/completions"
        ):
            response.headers.update(state.limiter.headers())

    app.on_response_prepare.append(on_prepare)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.add_routes(ROUTES)
    return app


async def serve(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start the server in the running loop; returns the runner (``await runner.cleanup()``
    to stop) and the bound port, which matters when ``port`` is 0."""
    runner = web.AppRunner(
        build_app(config), access_log=None, handler_cancellation=True, shutdown_timeout=5.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


def run_forever(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve until SIGINT/SIGTERM; announces the bound port on one stdout line."""

    async def run() -> None:
        runner, bound = await serve(config, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            shown = f"[{host}]" if ":" in host else host
            print(f"sim-server listening on http://{shown}:{bound}", flush=True)
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await runner.cleanup()

    asyncio.run(run())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@sim_options(module=True)
def _command(host: str, port: int, **options: Any) -> None:
    """Simulated OpenAI-compatible inference server."""
    run_forever(sim_config(options), host, port)


def main(argv: list[str] | None = None) -> None:
    """Command line of ``python -m orchestrator.sim.server``: the options of
    ``orchestrator sim-server`` (``orchestrator.sim.options``); exits when it stops."""
    _command.main(argv, prog_name="python -m orchestrator.sim.server")


if __name__ == "__main__":
    main()
