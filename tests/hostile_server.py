"""A small OpenAI-compatible server that misbehaves on purpose, run as its own process.

    python -m tests.hostile_server [--basic USER:PASSWORD] [--redirect STATUS=URL]
                                   [--answer-bytes N] [--stream-bytes N] [--piece-bytes N]
                                   [--stream-end HOW] [--rate-limit NAME=VALUE]
                                   [--answer-delay S] [--metrics-slots N]
                                   [--metrics-fail N] [--metrics-delay S]
                                   [--metrics-waiting N]

--basic         every route wants these HTTP Basic credentials (401 otherwise)
--redirect      chat requests are answered with a redirect to URL (its path kept)
--answer-bytes  each answer's content is N bytes long (sent without Content-Length)
--stream-bytes  each streamed answer sends N bytes of content (default 2) ...
--piece-bytes   ... in events of N bytes of content each (default 64 KiB)
--stream-end    after the finish_reason chunk: ``done`` (the usage chunk, then [DONE]),
                ``usage`` (the usage chunk, then the body ends), ``close`` (the body ends),
                ``break`` (the connection is dropped, the chunked body unterminated)
--rate-limit    the first request of each prompt is answered 429 with header NAME: VALUE
--answer-delay  each chat request is answered after S seconds
--metrics-slots /metrics in vLLM's names, as a server of N slots: the chat requests in
                flight beyond N are its queue
--metrics-fail  ... the worker's first N looks at it (not status's) are answered 503
--metrics-delay ... the worker's first look after those takes S seconds to answer
--metrics-waiting ... the server is full (N slots running) with a queue of N, whatever
                the worker has in flight: a server other clients keep busy, whose figures
                do not hang on how fast a loaded machine turns its answers around

Every route answers GET as well as POST, as a misconfigured proxy may; ``/stats`` counts
the requests seen by method and path, and the Authorization headers received.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections import Counter
from typing import Any

import orjson
from aiohttp import web

_STATS: Counter[str] = Counter()
_IN_FLIGHT: Counter[str] = Counter()


def _answer(content: str) -> bytes:
    return orjson.dumps(
        {
            "id": "hostile-1",
            "model": "hostile",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def make_app(args: argparse.Namespace) -> web.Application:
    wanted = "Basic " + base64.b64encode(args.basic.encode()).decode() if args.basic else None

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/stats":
            _STATS[f"{request.method} {request.path}"] += 1
            _STATS[f"auth {request.headers.get('Authorization', '-')}"] += 1
            if wanted and request.headers.get("Authorization") != wanted:
                return web.json_response({"error": {"message": "bad credentials"}}, status=401)
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(dict(_STATS))

    limited: set[bytes] = set()

    async def chat(request: web.Request) -> web.StreamResponse:
        _IN_FLIGHT["chat"] += 1
        try:
            await asyncio.sleep(args.answer_delay)
            return await answer(request)
        finally:
            _IN_FLIGHT["chat"] -= 1

    async def answer(request: web.Request) -> web.StreamResponse:
        if args.rate_limit:
            name, _, value = args.rate_limit.partition("=")
            body = await request.read()
            if body not in limited:
                limited.add(body)
                return web.json_response(
                    {"error": {"message": "slow down"}}, status=429, headers={name: value}
                )
        if args.redirect:
            status, _, target = args.redirect.partition("=")
            raise _redirect(int(status), target.rstrip("/") + request.path)
        if request.method == "GET":
            return web.Response(
                body=_answer("an answer to no request"), content_type="application/json"
            )
        body = orjson.loads(await request.read())
        if body.get("stream"):
            return await _stream(request, args)
        content = "x" * args.answer_bytes if args.answer_bytes else "ok"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        payload = _answer(content)
        for start in range(0, len(payload), 2**20):
            await resp.write(payload[start : start + 2**20])
        await resp.write_eof()
        return resp

    app = web.Application(middlewares=[count], client_max_size=2**30)
    app.router.add_route("*", "/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_route("*", "/v1/chat/completions", chat)
    if args.metrics_slots:
        app.router.add_get("/metrics", _metrics(args))
    return app


def _redirect(status: int, location: str) -> web.HTTPException:
    classes = {
        301: web.HTTPMovedPermanently,
        302: web.HTTPFound,
        303: web.HTTPSeeOther,
        307: web.HTTPTemporaryRedirect,
        308: web.HTTPPermanentRedirect,
    }
    return classes[status](location)


def _metrics(args: argparse.Namespace) -> Any:
    """``/metrics`` as vLLM names it, for a server of ``--metrics-slots`` slots."""
    looks = Counter[str]()

    async def metrics(request: web.Request) -> web.Response:
        if request.headers.get("User-Agent") == "orchestrator":  # the tuner's, not status's
            looks["tuner"] += 1
            if looks["tuner"] <= args.metrics_fail:
                return web.Response(status=503, text="busy")
            if looks["tuner"] == args.metrics_fail + 1:
                await asyncio.sleep(args.metrics_delay)
        running = min(_IN_FLIGHT["chat"], args.metrics_slots)
        waiting = _IN_FLIGHT["chat"] - running
        if args.metrics_waiting is not None:
            running, waiting = args.metrics_slots, args.metrics_waiting
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        )
        return web.Response(text=text)

    return metrics


async def _stream(request: web.Request, args: argparse.Namespace) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    size = args.stream_bytes or 2
    for start in range(0, size, args.piece_bytes):
        piece = "y" * min(args.piece_bytes, size - start)
        chunk = {
            "id": "s",
            "model": "hostile",
            "choices": [{"index": 0, "delta": {"content": piece}}],
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    finish = {"id": "s", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {"id": "s", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    await resp.write(b"data: " + orjson.dumps(finish) + b"\n\n")
    if args.stream_end in ("done", "usage"):
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
    if args.stream_end == "done":
        await resp.write(b"data: [DONE]\n\n")
    if args.stream_end == "break":
        assert request.transport is not None
        request.transport.close()  # no last chunk: the client sees a body cut short
        return resp
    await resp.write_eof()
    return resp


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--basic")
    parser.add_argument("--redirect")
    parser.add_argument("--answer-bytes", type=int, default=0)
    parser.add_argument("--stream-bytes", type=int, default=0)
    parser.add_argument("--piece-bytes", type=int, default=2**16)
    parser.add_argument("--stream-end", choices=("done", "usage", "close", "break"), default="done")
    parser.add_argument("--rate-limit")
    parser.add_argument("--answer-delay", type=float, default=0.0)
    parser.add_argument("--metrics-slots", type=int, default=0)
    parser.add_argument("--metrics-waiting", type=int, default=None)
    parser.add_argument("--metrics-fail", type=int, default=0)
    parser.add_argument("--metrics-delay", type=float, default=0.0)
    args = parser.parse_args()
    runner = web.AppRunner(make_app(args), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
