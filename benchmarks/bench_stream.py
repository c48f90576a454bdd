"""Streaming against llama.cpp's llama-server: the worker against a fresh-connection loop.

llama-server closes the connection after every streamed answer while its headers say
keep-alive, so a pooled client that picks such a connection fails on it. The worker's
client sends such a request again at once on a new connection, uncharged; this measures
what that costs against the floor for this server, a loop that opens a new connection
for every request (aiohttp ``force_close``). A plain pooled loop is shown beside them
to show the server's behaviour. All send the same N short prompts (``max_tokens`` 8, so
the figure is request-bound) at the same concurrency to one real llama-server (tiny
random model, 8 slots, built by ``scripts/llama_server.py``).

Targets: disconnect retries <= 1 % of requests; worker req/s >= 0.8 x the fresh loop.

    python benchmarks/bench_stream.py [--items 2000] [--concurrency 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import orjson
from common import (
    ORCH,
    PYTHON,
    add_common_args,
    print_against,
    print_machine,
    print_table,
    run_measured,
    workdir,
    write_prompts,
)

from scripts import llama_server

TARGET_RATIO = 0.8
TARGET_RETRIES = 0.01
MAX_TOKENS = 8


@dataclass(slots=True)
class Pass:
    label: str
    requests: int
    errors: int
    seconds: float  # first request sent to last answer read (or committed)
    disconnects: int = 0
    unavailable: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def _loop(url: str, bodies: list[bytes], concurrency: int, fresh: bool) -> dict:
    """Stream every body, reading each answer to ``[DONE]``; failures are counted, not
    retried."""
    import aiohttp

    done = errors = 0
    it = iter(bodies)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def slot() -> None:
            nonlocal done, errors
            for body in it:
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        raw = await resp.read()
                    ok = resp.status == 200 and raw.rstrip().endswith(b"data: [DONE]")
                except aiohttp.ClientError:
                    ok = False
                done += ok
                errors += not ok

        start = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {"requests": done, "errors": errors, "seconds": seconds}


def loop_main(args: argparse.Namespace) -> int:
    """A loop pass in its own process: ``--loop fresh|pooled``."""
    bodies = []
    with open(args.prompts, "rb") as fh:
        for line in fh:
            body = {
                "messages": orjson.loads(line)["messages"],
                "model": llama_server.MODEL_ALIAS,
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            bodies.append(orjson.dumps(body))
    url = args.server + "/v1/chat/completions"
    result = asyncio.run(_loop(url, bodies, args.concurrency, args.loop == "fresh"))
    print(orjson.dumps(result).decode())
    return 0


def run_loop(url: str, prompts: Path, concurrency: int, kind: str) -> Pass:
    argv = [PYTHON, __file__, "--loop", kind, "--server", url, "--prompts", str(prompts),
            "--concurrency", str(concurrency)]  # fmt: skip
    result = orjson.loads(run_measured(argv).check().stdout.strip().splitlines()[-1])
    label = "fresh connection per request" if kind == "fresh" else "pooled keep-alive loop"
    return Pass(label, result["requests"], result["errors"], result["seconds"])


def run_worker(url: str, prompts: Path, db: Path, concurrency: int, stream: bool) -> Pass:
    enqueue = [*ORCH, "enqueue", str(prompts), "-d", "bench", "--db", str(db),
               "--model", llama_server.MODEL_ALIAS, "--max-tokens", str(MAX_TOKENS)]  # fmt: skip
    run_measured(enqueue).check()
    run = [*ORCH, "run", "--server", url, "--db", str(db), "--exit-when-done",
           "--concurrency", str(concurrency), *(["--stream"] if stream else [])]  # fmt: skip
    run_measured(run).warn_if_failed("orchestrator run")
    conn = sqlite3.connect(db)
    try:
        n, first, last = conn.execute(
            "SELECT count(*), min(created_at - latency), max(created_at) FROM outputs"
        ).fetchone()
        classes = dict(
            conn.execute("SELECT error_class, count(*) FROM attempt_errors GROUP BY 1").fetchall()
        )
        failed = conn.execute("SELECT count(*) FROM items WHERE state = 'failed'").fetchone()[0]
    finally:
        conn.close()
    label = "orchestrator run --stream" if stream else "orchestrator run (no stream)"
    return Pass(
        label,
        n,
        failed,
        (last - first) if n else 0.0,
        disconnects=classes.get("disconnect", 0),
        unavailable=classes.get("unavailable", 0),
    )


def _median(passes: list[Pass]) -> Pass:
    mid = sorted(passes, key=lambda p: p.rps)[len(passes) // 2]
    return Pass(
        mid.label,
        mid.requests,
        int(median(p.errors for p in passes)),
        mid.seconds,
        int(median(p.disconnects for p in passes)),
        int(median(p.unavailable for p in passes)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="passes of each; medians shown")
    parser.add_argument("--loop", choices=("fresh", "pooled"), help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    if args.loop:
        return loop_main(args)
    if llama_server.main(["--check"]) != 0:
        raise SystemExit("llama-server is not built: python3 scripts/llama_server.py")
    print_machine()
    results: dict[str, list[Pass]] = {}
    with workdir(args.workdir) as work, llama_server.LlamaServer() as server:
        prompts = write_prompts(work / "prompts.jsonl", args.items)
        print(f"llama-server {server.url}; {args.items:,} prompts; concurrency {args.concurrency}")
        for i in range(args.repeat):
            for p in (
                run_loop(server.url, prompts, args.concurrency, "fresh"),
                run_loop(server.url, prompts, args.concurrency, "pooled"),
                run_worker(server.url, prompts, work / f"s{i}.db", args.concurrency, True),
                run_worker(server.url, prompts, work / f"p{i}.db", args.concurrency, False),
            ):
                results.setdefault(p.label, []).append(p)
    rows = [_median(passes) for passes in results.values()]
    print()
    print_table(
        ["client", "answers", "failed", "seconds", "req/s", "disconnect retries", "unavailable"],
        [
            [p.label, f"{p.requests:,}", p.errors, f"{p.seconds:.2f}", f"{p.rps:,.0f}",
             p.disconnects, p.unavailable]
            for p in rows
        ],
    )  # fmt: skip
    fresh, worker = rows[0], rows[2]
    ratio = worker.rps / fresh.rps if fresh.rps else 0.0
    share = worker.disconnects / args.items
    print()
    line = f"worker --stream / fresh loop: {ratio:.2f}"
    print_against(line, ratio, TARGET_RATIO, f"{TARGET_RATIO}", higher_is_better=True)
    line = f"disconnect retries: {share:.2%} of requests"
    print_against(line, share, TARGET_RETRIES, f"{TARGET_RETRIES:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
