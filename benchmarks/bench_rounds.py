"""The queue's write rounds alone: what storing an answer and claiming the next item cost.

No HTTP and no worker: one loop calls ``Queue.write_round`` with the leases of the last
round completed (a short answer each) and a claim for as many more, until the queue is
empty: a worker's rounds at the size a busy worker writes them. Per item it reports the
CPU this process spent (SQLAlchemy, the driver, building rows and leases) and, on a
PostgreSQL server on this machine, the CPU the server spent. ``bench_run.py`` measures the
whole worker; this isolates the storage seam, so a change to a statement or to the
per-row Python shows here without the noise of the HTTP side.

    python benchmarks/bench_rounds.py [--items 20000] [--round 46] [--repeat 3]
    python benchmarks/bench_rounds.py --postgres postgresql://postgres@127.0.0.1:5432
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from common import (
    enqueue_argv,
    fresh_database,
    postgres_cpu_seconds,
    print_machine,
    print_table,
    run_measured,
    workdir,
    write_prompts,
)

if TYPE_CHECKING:
    from orchestrator.store.leases import Output

_ANSWER = "north tau shadow worker"


async def _rounds(url: str, size: int) -> tuple[int, int, float, float]:
    """Complete and claim until nothing is left: items, rounds, CPU and wall seconds."""
    from orchestrator.store import open_database
    from orchestrator.store.leases import Claim
    from orchestrator.store.queue import Queue
    from orchestrator.store.rounds import Round

    database = await open_database(url)
    try:
        queue, leases, items, rounds = Queue(database), [], 0, 0
        cpu, wall = time.process_time(), time.perf_counter()
        while True:
            done = [(lease, _output()) for lease in leases]
            result = await queue.write_round(Round(complete=done, claim=Claim("bench", size, 60)))
            items, rounds, leases = items + len(done), rounds + 1, result.leases
            if not leases:
                break
        return items, rounds, time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await database.close()


def _output() -> Output:
    from orchestrator.store.leases import Output

    return Output(
        message={"role": "assistant", "content": _ANSWER},
        content=_ANSWER,
        reasoning=None,
        finish_reason="stop",
        usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
        latency=0.01,
        server="http://127.0.0.1:8000",
        model="sim-model",
        response_id="chatcmpl-bench",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--round", type=int, default=46, help="items claimed per round")
    parser.add_argument("--repeat", type=int, default=3, help="passes; medians are used")
    parser.add_argument("--postgres", metavar="SERVER_URL", help="a local PostgreSQL server")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    import uvloop

    print_machine()
    print(f"{args.items:,} prompts, rounds of {args.round}, {args.repeat} passes\n")
    rows, client, server = [], [], []
    with workdir(args.workdir) as work:
        prompts = write_prompts(work / "prompts.jsonl", args.items)
        for n in range(args.repeat):
            with fresh_database(work, args.postgres, f"orchestrator_rounds_{n}") as url:
                run_measured(enqueue_argv(prompts, url)).check()  # type: ignore[arg-type]
                before = postgres_cpu_seconds() if args.postgres else 0.0
                items, rounds, cpu, wall = uvloop.run(_rounds(url, args.round))
                db_cpu = postgres_cpu_seconds() - before if args.postgres else 0.0
            client.append(cpu / items * 1e6)
            server.append(db_cpu / items * 1e6)
            rows.append(
                [n + 1, f"{items:,}", f"{rounds:,}", f"{client[-1]:.1f}", f"{server[-1]:.1f}",
                 f"{wall / items * 1e6:.1f}"]
            )  # fmt: skip
    print_table(
        ["pass", "items", "rounds", "this process CPU µs/item", "PostgreSQL CPU µs/item",
         "wall µs/item"],
        rows,
    )  # fmt: skip
    print(
        f"\nmedian: this process {median(client):.1f} µs of CPU per item"
        + (f", the PostgreSQL server {median(server):.1f} µs" if args.postgres else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
