"""Where a worker's run goes, by queue operation: calls, items per call, time inside.

The profile says the worker is CPU-bound in its own process; this says how that CPU is
spent per item: how many claim and complete transactions a run takes and how many items
each carries. It runs the real ``Worker`` in this process against the simulated server
(a subprocess), with counting wrappers around the ``Queue`` methods; the core code is
used as is.

    python benchmarks/run_breakdown.py [--items 20000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from common import (
    SimServer,
    enqueue_argv,
    print_machine,
    print_table,
    run_measured,
    workdir,
    write_prompts,
)

# operation -> [calls, items, seconds]
TALLY: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])


def _size(result: Any) -> int:
    try:
        return len(result)
    except TypeError:
        return 1


def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            entry = TALLY[name]
            entry[0] += 1
            entry[2] += time.perf_counter() - start
            if name in ("complete", "retry", "release", "fail", "renew"):
                entry[1] += _size(args[1])

    return wrapper


def instrument() -> None:
    from orchestrator.store import queue as queue_mod
    from orchestrator.store.engine import Database

    queue_cls = queue_mod.Queue
    original_claim = queue_cls.claim

    async def claim(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        leases = await original_claim(self, *args, **kwargs)
        entry = TALLY["claim"]
        entry[0] += 1
        entry[1] += len(leases)
        entry[2] += time.perf_counter() - start
        return leases

    queue_cls.claim = claim  # type: ignore[method-assign]
    for name in ("complete", "retry", "release", "fail", "renew", "reap", "remaining"):
        setattr(queue_cls, name, counted(name, getattr(queue_cls, name)))

    original_write = Database.write

    @contextlib.asynccontextmanager
    async def write(self: Any) -> AsyncIterator[Any]:
        start = time.perf_counter()
        async with original_write(self) as conn:
            yield conn
        entry = TALLY["(every write transaction)"]
        entry[0] += 1
        entry[2] += time.perf_counter() - start

    Database.write = write  # type: ignore[method-assign]


async def run_worker(db: Path, url: str, concurrency: int) -> tuple[float, int]:
    from orchestrator.client import InferenceClient
    from orchestrator.store import open_database
    from orchestrator.worker import Worker, WorkerConfig

    database = await open_database(str(db))
    try:
        config = WorkerConfig(servers=(url,), concurrency=concurrency, exit_when_done=True)
        async with InferenceClient() as client:
            start = time.perf_counter()
            stats = await Worker(database, client, config).run()
            return time.perf_counter() - start, stats.completed
    finally:
        await database.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    print_machine()

    from orchestrator import logs

    logs.configure("warning", json=True)
    instrument()
    with workdir(args.workdir) as work:
        prompts = write_prompts(work / "prompts.jsonl", args.items)
        db = work / "breakdown.db"
        for stale in work.glob("breakdown.db*"):
            stale.unlink()
        run_measured(enqueue_argv(prompts, db)).check()
        with SimServer(mean_tokens=8) as server:
            seconds, done = asyncio.run(run_worker(db, server.url, args.concurrency))

    print(f"\n{done:,} done in {seconds:.1f} s ({done / seconds:,.0f} req/s, in-process)\n")
    rows = []
    for name, (calls, items, spent) in sorted(TALLY.items(), key=lambda kv: -kv[1][2]):
        rows.append(
            [
                name,
                f"{calls:,.0f}",
                f"{items / calls:.1f}" if items and calls else "-",
                f"{spent:.2f}",
                f"{1000 * spent / calls:.2f}" if calls else "-",
                f"{spent / seconds:.0%}",
            ]
        )
    print_table(
        ["operation", "calls", "items/call", "seconds inside", "ms/call", "share of run"], rows
    )
    print(
        "\n'seconds inside' is wall time from call to return: it includes waiting for the "
        "process's write lock and for the event loop, so shares overlap and do not add up."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
