"""Pacing under a hosted provider's limits: how many requests bounce off as 429s, and
how close the run comes to the provider's rate.

The simulated provider (``orchestrator sim-server --rate-limit rpm=300,burst=25``) refills a
bucket of 25 requests at 5 a second and answers 429 with ``Retry-After`` when it is
empty. ``orchestrator run --exit-when-done --concurrency 32`` (a worker subprocess, as a
user runs it) works through 400 prompts against it:

- ``headers``: the provider sends ``x-ratelimit-*`` headers, no cap is given;
- ``--rpm``: no headers, ``--rpm 300`` given;
- ``no pacing``: no headers, no cap (a 429 sends its item back until its Retry-After);
- ``before``: with ``--before DIR``, the same command from another checkout's sources
  (``/work/main`` before pacing), against the provider with headers.

The 429 share is the provider's own count (``/sim/stats``) over every request it got;
throughput is answers a second from the first request's start to the last answer's end
(the stored outputs), as a share of the bucket's rate. The buckets run in real time, so
each run takes about (400 - 25) / 5 = 75 s.

    python benchmarks/bench_pacing.py
    python benchmarks/bench_pacing.py --before /work/main
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    PYTHON,
    SimServer,
    print_machine,
    print_table,
    verdict,
    workdir,
    write_prompts,
)

RPM, BURST = 300, 25


def run_once(
    work: Path,
    name: str,
    *,
    items: int,
    concurrency: int,
    headers: bool,
    run_args: list[str],
    source: Path = REPO,
) -> list[object]:
    """One run against a fresh provider: its row of the table."""
    db = work / f"{name.replace(' ', '_').replace('-', '')}.db"
    prompts = write_prompts(work / "prompts.jsonl", items)
    env = {**os.environ, "PYTHONPATH": str(source)}
    cli = [PYTHON, "-m", "orchestrator"]
    limit = ["--rate-limit", f"rpm={RPM},burst={BURST}"]
    flag = ["--rate-limit-headers", "true" if headers else "false"]
    with SimServer(mean_tokens=16, latency=0.2, extra=(*limit, *flag)) as sim:
        subprocess.run(
            [*cli, "enqueue", str(prompts), "--dataset", "d", "--db", str(db)],
            check=True,
            cwd=source,
            env=env,
            capture_output=True,
        )
        started = time.monotonic()
        subprocess.run(
            [
                *cli,
                "run",
                "--server",
                sim.url,
                "--db",
                str(db),
                "--exit-when-done",
                "--concurrency",
                str(concurrency),
                *run_args,
            ],
            check=True,
            cwd=source,
            env=env,
            capture_output=True,
        )
        wall = time.monotonic() - started
        stats = sim.stats()
    with sqlite3.connect(db) as conn:
        done, first, last = conn.execute(
            "SELECT count(*), min(created_at - latency), max(created_at) FROM outputs"
        ).fetchone()
    requests, limited = stats["chat_requests"], stats["rate_limited"]
    rate = done / (last - first) if last > first else 0.0
    share = rate / (RPM / 60)
    return [
        name,
        done,
        requests,
        limited,
        f"{100 * limited / requests:.1f} %",
        f"{rate:.2f}",
        f"{share:.2f}",
        f"{wall:.0f}",
        verdict(limited / requests, 0.01) + " / " + verdict(share, 0.95, higher_is_better=True),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--before", type=Path, help="a checkout whose sources run 'before'")
    parser.add_argument("--only", choices=("headers", "rpm", "none"), help="one mode only")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    print_machine()
    modes = [
        ("headers", True, []),
        ("--rpm only", False, ["--rpm", str(RPM)]),
        ("no pacing", False, []),
    ]
    if args.only:
        modes = [modes[("headers", "rpm", "none").index(args.only)]]
    rows = []
    with workdir(args.workdir) as work:
        if args.before:
            rows.append(
                run_once(
                    work,
                    "before",
                    items=args.items,
                    concurrency=args.concurrency,
                    headers=True,
                    run_args=[],
                    source=args.before,
                )
            )
        for name, headers, extra in modes:
            rows.append(
                run_once(
                    work,
                    name,
                    items=args.items,
                    concurrency=args.concurrency,
                    headers=headers,
                    run_args=extra,
                )
            )
    print(
        f"\nprovider: {RPM} requests/min, burst {BURST}; {args.items} prompts, "
        f"concurrency {args.concurrency}; targets: 429s <= 1 %, throughput >= 0.95 of the rate"
    )
    print_table(
        [
            "mode",
            "answers",
            "requests",
            "429s",
            "429 share",
            "answers/s",
            "of rate",
            "wall s",
            "429 / rate",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
