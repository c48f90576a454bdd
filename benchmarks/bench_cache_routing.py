"""Prefix-aware routing against least-loaded routing, on two servers, and one server as
the reference for how much of the prompt a cache can serve.

Workloads: items sharing a prompt prefix (``shared``: groups of items with one long
system prompt, the stand-in for several samples of one prompt), conversations whose
every turn is regenerated (``conversations``, many in flight), retries after failures
(``retries``: a share of requests answered 500, simulator only), the samples of one
prompt (``samples``: ``--group`` samples a prompt asked in one request with ``n``
choices; ``samples-seeds``: a request per sample) and servers of unequal
speed (``unequal``, simulator only). Backends: two real ``llama-server`` processes
(``--backend llama``) or two simulated servers with a prefix cache (``--backend sim``).

The worker runs in this process, so least-loaded routing is had by setting the cache
threshold out of reach; cached and prompt tokens are the worker's own counters (every
turn's), throughput is answers per second of the run.

    python benchmarks/bench_cache_routing.py --backend llama
    python benchmarks/bench_cache_routing.py --backend sim --scale 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import structlog

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.formats import iter_records  # noqa: E402
from orchestrator.inference import pool, routing  # noqa: E402
from orchestrator.inference.client import ClientConfig, InferenceClient  # noqa: E402
from orchestrator.sim.config import SimConfig  # noqa: E402
from orchestrator.sim.server import serve  # noqa: E402
from orchestrator.store import DatasetSpec, enqueue, open_database  # noqa: E402
from orchestrator.worker import Worker, WorkerConfig  # noqa: E402
from orchestrator.worker.call import Caller  # noqa: E402
from orchestrator.worker.metrics import WorkerMetrics  # noqa: E402
from scripts import llama_server  # noqa: E402

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "field",
    "light",
    "shadow",
    "signal",
]


def _text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i // 5) % len(WORDS)] + str(seed) for i in range(n))


#: Items per system prompt in ``shared`` (``--group``).
GROUP = 8


def shared_rows(n: int) -> list[dict[str, Any]]:
    """Groups of GROUP items with one system prompt each, asked different short questions."""
    return [
        {
            "id": f"s{i}",
            "messages": [
                {"role": "system", "content": _text(i // GROUP, 400)},
                {"role": "user", "content": f"question {i}"},
            ],
            "max_tokens": 16,
        }
        for i in range(n)
    ]


def conversation_rows(n: int) -> list[dict[str, Any]]:
    """Conversations of four user turns, the first one long."""
    rows = []
    for i in range(n):
        turns = [_text(1000 + i, 300), "go on", "and then", "sum it up"]
        messages: list[dict[str, str]] = []
        for t in turns:
            messages += [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]
        rows.append({"id": f"c{i}", "messages": messages, "max_tokens": 16})
    return rows


def sample_rows(n: int) -> list[dict[str, Any]]:
    """``n // GROUP`` prompts, each asked for GROUP samples (``--samples``): the long
    system prompt and the question are the same for every sample of a prompt."""
    return [
        {
            "id": f"p{i}",
            "messages": [
                {"role": "system", "content": _text(i, 400)},
                {"role": "user", "content": f"question {i}"},
            ],
            "max_tokens": 16,
        }
        for i in range(max(1, n // GROUP))
    ]


WORKLOADS: dict[str, tuple[Callable[[int], list[dict[str, Any]]], str]] = {
    "shared": (shared_rows, "last"),
    "samples": (sample_rows, "last"),
    "samples-seeds": (sample_rows, "last"),
    "conversations": (conversation_rows, "all"),
    "retries": (shared_rows, "last"),
    "unequal": (conversation_rows, "all"),
}
#: Workloads of samples, and how they are asked: one request with n choices, or one
#: request per sample (``--sample-requests seeds``).
SAMPLED = {"samples": "n", "samples-seeds": "seeds"}


@contextlib.asynccontextmanager
async def sim_servers(workload: str, count: int) -> AsyncIterator[list[str]]:
    runners, urls = [], []
    for i in range(count):
        # Batching with a prompt cost, so a cached prefix answers faster.
        options: dict[str, Any] = {
            "max_running": 16,
            "kv_tokens": 200_000,
            "step_time": 0.004,
            "prefill_per_token": 0.00005,
            "prefix_cache": 50_000,
            "mean_tokens": 16,
        }
        if workload == "retries":
            options["faults"] = {"500": 0.2}
        if workload == "unequal" and i == 1:
            options["step_time"] = 0.012  # three times slower decoding
        runner, port = await serve(SimConfig(**options), "127.0.0.1", 0)
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def llama_servers(workload: str, count: int) -> AsyncIterator[list[str]]:
    started = [llama_server.LlamaServer(slots=4, context=16384) for _ in range(count)]
    try:
        yield [s.start() for s in started]
    finally:
        for s in started:
            s.stop()


async def _not_holding(self: Caller, server: str | None, landed: asyncio.Future[bool]) -> bool:
    return await landed


KEEP_SLOT = Caller._holding
_HOLDER = pool.ServerPool._holder


def _holder_alone(
    self: pool.ServerPool,
    hashes: list[int],
    lowest: float,
    previous: str | None = None,
    width: int = 1,
) -> pool.ServerState | None:
    return _HOLDER(self, hashes, lowest, None, width)


async def measure(
    backend: str, workload: str, n: int, servers_used: int, cache: bool, keep: bool = True
) -> dict:
    make, mode = WORKLOADS[workload]
    routing.CACHE_THRESHOLD = 0.5 if cache else math.inf
    # Least-loaded routing knows no previous server either.
    pool.ServerPool._holder = _HOLDER if cache else _holder_alone  # type: ignore[method-assign]
    Caller._holding = KEEP_SLOT if keep else _not_holding  # type: ignore[method-assign]
    start = sim_servers if backend == "sim" else llama_servers
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(b"\n".join(orjson.dumps(r) for r in make(n)) + b"\n")
        database = await open_database(str(Path(tmp) / "q.db"))
        draws = {"samples": GROUP, "draw_mode": SAMPLED[workload]} if workload in SAMPLED else {}
        spec = DatasetSpec("bench", regenerate=mode, **draws)
        await enqueue(database, spec, iter_records(path, regenerate=mode), path=str(path))
        async with start(workload, servers_used) as urls:
            cfg = WorkerConfig(
                servers=tuple(urls),
                concurrency=4 if backend == "llama" else 16,
                exit_when_done=True,
                backoff_base=0.02,
                backoff_cap=0.2,
                max_attempts=20,
            )
            metrics = WorkerMetrics()
            began = time.monotonic()
            async with InferenceClient(ClientConfig(request_timeout=120)) as client:
                stats = await Worker(database, client, cfg, metrics=metrics).run()
            seconds = time.monotonic() - began
        await database.close()
    text = metrics.exposition().decode()
    return {
        "done": stats.completed,
        "seconds": seconds,
        "prompt": _counter(text, "prompt"),
        "cached": _counter(text, "cached"),
    }


def _counter(text: str, kind: str) -> float:
    name = f'orchestrator_tokens_total{{dataset="bench",kind="{kind}"}}'
    lines = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


async def main_async(args: argparse.Namespace) -> None:
    workloads = args.workload or (
        ["shared", "conversations"] if args.backend == "llama" else list(WORKLOADS)
    )
    for workload in workloads:
        n = args.items * (args.scale if args.backend == "sim" else 1)
        rows = []
        for label, count, cache, keep in (
            ("one server", 1, True, True),
            ("two, least-loaded", 2, False, False),
            ("two, l-l + slot kept", 2, False, True),
            ("two, prefix-aware", 2, True, True),
        ):
            r = await measure(args.backend, workload, n, count, cache, keep)
            share = r["cached"] / r["prompt"] if r["prompt"] else 0.0
            rows.append((label, r["done"], r["cached"], share, r["done"] / r["seconds"]))
        print(f"\n{args.backend} / {workload}: {n} items")
        print(f"{'routing':<22} {'done':>6} {'cached tok':>11} {'cached %':>9} {'items/s':>8}")
        for label, done, cached, share, rate in rows:
            print(f"{label:<22} {done:>6} {cached:>11.0f} {100 * share:>8.1f}% {rate:>8.2f}")
        ref = rows[0][2]
        aware = rows[3]
        print(
            f"prefix-aware cached tokens = {100 * aware[2] / ref:.0f}% of one server's;"
            f" throughput {aware[4] / rows[1][4]:.2f}x least-loaded"
            if ref
            else ""
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("llama", "sim"), default="sim")
    parser.add_argument("--workload", action="append", choices=tuple(WORKLOADS))
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--scale", type=int, default=1, help="Simulator: items times this.")
    parser.add_argument("--group", type=int, default=8, help="shared: items per system prompt.")
    global GROUP
    args = parser.parse_args()
    GROUP = args.group
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
