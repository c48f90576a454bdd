"""Run throughput: the worker (claim → call → durable commit) against a bare aiohttp loop.

Both send the same N short prompts with the same concurrency to the same simulated server
(zero latency, 8-token answers), so the server costs the same in both and the ratio is
what the queue costs: claims, commits, leases. Target: worker ≥ 0.8 × bare loop.

    python benchmarks/bench_run.py [--items 20000] [--concurrency 64]
    python benchmarks/bench_run.py --postgres postgresql://postgres@127.0.0.1:5432
"""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import orjson
from common import (
    BENCH_DIR,
    PYTHON,
    Measured,
    SimServer,
    add_common_args,
    enqueue_argv,
    fmt_mb,
    fresh_database,
    pg_row,
    placement,
    postgres_cpu_seconds,
    print_machine,
    print_profile,
    print_table,
    python_startup_seconds,
    run_argv,
    run_measured,
    verdict,
    workdir,
    write_prompts,
)

TARGET_RATIO = 0.8


@dataclass(slots=True)
class RunFigures:
    """One client's pass over the prompts."""

    label: str
    requests: int
    measured: Measured
    active_s: float
    server_cpu_s: float
    #: The PostgreSQL server's CPU over the pass (0 on SQLite, where the worker runs it).
    database_cpu_s: float = 0.0

    @property
    def wall_rps(self) -> float:
        return self.requests / self.measured.seconds

    @property
    def active_rps(self) -> float:
        return self.requests / self.active_s if self.active_s else 0.0

    def row(self) -> list[str]:
        m = self.measured
        return [
            self.label,
            f"{self.requests:,}",
            f"{m.seconds:.2f}",
            f"{self.wall_rps:,.0f}",
            f"{self.active_rps:,.0f}",
            f"{m.cpu_s / m.seconds:.0%}",
            f"{self.cpu_us:,.0f}",
            f"{self.server_cpu_s / m.seconds:.0%}",
            fmt_mb(m.peak_rss_mb),
        ]

    @property
    def cpu_us(self) -> float:
        """Client CPU microseconds per answered request, start-up included."""
        return 1e6 * self.measured.cpu_s / self.requests if self.requests else 0.0


_SPAN = "SELECT count(*), min(created_at - latency), max(created_at) FROM outputs"


def worker_active_seconds(db: Path | str) -> tuple[int, float]:
    """Done outputs and the span from the first request sent to the last answer committed."""
    if str(db).startswith("postgresql"):
        n, first, last = pg_row(str(db), _SPAN)
    else:
        conn = sqlite3.connect(db)
        try:
            n, first, last = conn.execute(_SPAN).fetchone()
        finally:
            conn.close()
    return n, (last - first) if n else 0.0


def run_bare(
    server: SimServer, prompts: Path, concurrency: int, cpu: int | None, loop: str
) -> RunFigures:
    before = server.cpu_seconds()
    m = run_measured(
        [
            PYTHON,
            str(BENCH_DIR / "bare_loop.py"),
            "--server",
            server.url,
            "--prompts",
            str(prompts),
            "--concurrency",
            str(concurrency),
            "--loop",
            loop,
        ],
        cpu=cpu,
    ).check()
    result = orjson.loads(m.stdout.strip().splitlines()[-1])
    return RunFigures(
        f"bare loop, {loop}",
        result["requests"],
        m,
        result["seconds"],
        server.cpu_seconds() - before,
    )


def run_worker(
    server: SimServer, db: Path | str, concurrency: int, cpu: int | None, profile: Path | None
) -> RunFigures:
    before, database_before = server.cpu_seconds(), postgres_cpu_seconds()
    m = run_measured(run_argv(server.url, db, concurrency), cpu=cpu, profile=profile)  # type: ignore[arg-type]
    database_cpu = postgres_cpu_seconds() - database_before
    m.warn_if_failed("orchestrator run")
    done, active = worker_active_seconds(db)
    return RunFigures(
        "orchestrator run",
        done,
        m,
        active,
        server.cpu_seconds() - before,
        database_cpu if str(db).startswith("postgresql") else 0.0,
    )


def report(
    args: argparse.Namespace,
    plain: list[RunFigures],
    bares: list[RunFigures],
    workers: list[RunFigures],
    startup: float,
) -> None:
    """The table of every pass and the ratios of the median ones."""
    print()
    print_table(
        [
            "client",
            "answers",
            "wall s",
            "req/s (wall)",
            "req/s (active)",
            "client CPU",
            "CPU µs/req",
            "server CPU",
            "peak RSS",
        ],
        [f.row() for trio in zip(plain, bares, workers, strict=True) for f in trio],
    )
    bare = min(bares, key=lambda f: abs(f.wall_rps - median(b.wall_rps for b in bares)))
    worker = min(workers, key=lambda f: abs(f.wall_rps - median(w.wall_rps for w in workers)))
    ratio_wall = worker.wall_rps / bare.wall_rps
    ratio_active = worker.active_rps / bare.active_rps
    print()
    print(
        f"wall: whole subprocess, including ~{startup:.2f} s to start Python and import the "
        "CLI and store; active: first request sent to last answer (bare) / committed "
        "(worker). CPU figures are shares of one core over wall."
    )
    print(
        f"ratio worker/bare (median passes): {ratio_wall:.2f} (wall), {ratio_active:.2f} (active); "
        f"target ≥ {TARGET_RATIO}: {verdict(ratio_wall, TARGET_RATIO, higher_is_better=True)}"
    )
    slow = min(plain, key=lambda f: abs(f.wall_rps - median(b.wall_rps for b in plain)))
    print(
        "the worker runs on uvloop, as the bare loop it is compared with; against the bare "
        f"loop on asyncio's own loop: {worker.wall_rps / slow.wall_rps:.2f} (wall), "
        f"{worker.active_rps / slow.active_rps:.2f} (active)"
    )
    print(
        f"client CPU per answered request, start-up included (median passes): worker "
        f"{worker.cpu_us:,.0f} µs, "
        f"bare loop {bare.cpu_us:,.0f} µs ({worker.cpu_us / bare.cpu_us:.2f}x)"
    )
    if worker.database_cpu_s:
        print(
            "PostgreSQL server CPU per answered request (median pass, its processes on the "
            f"same cores): {1e6 * worker.database_cpu_s / worker.requests:,.0f} µs, "
            f"{worker.database_cpu_s / worker.measured.seconds:.0%} of a core over wall"
        )
    print(f"worker peak RSS: {fmt_mb(worker.measured.peak_rss_mb)}")
    if worker.requests != args.items:
        print(f"WARNING: {worker.requests:,} of {args.items:,} items have an output")
    print_profile(args.profile, "; timings above include py-spy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--mean-tokens", type=int, default=8)
    parser.add_argument(
        "--repeat", type=int, default=1, help="alternate bare/worker passes; medians are used"
    )
    parser.add_argument(
        "--postgres",
        metavar="SERVER_URL",
        help="run the worker on PostgreSQL: a fresh database per pass on this server "
        "(e.g. postgresql://postgres@127.0.0.1:5432), dropped afterwards",
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    place = placement(args.pin)
    print_machine()
    print(f"cores: {place.describe()}")

    with workdir(args.workdir) as work, contextlib.ExitStack() as databases:
        prompts = write_prompts(work / "prompts.jsonl", args.items)
        dbs = [
            databases.enter_context(fresh_database(work, args.postgres, f"orch_bench_run_{i}"))
            for i in range(args.repeat)
        ]
        for db in dbs:
            run_measured(enqueue_argv(prompts, db)).check()  # type: ignore[arg-type]
        startup = python_startup_seconds(place.client)
        bares: list[RunFigures] = []
        plain: list[RunFigures] = []
        workers: list[RunFigures] = []
        with SimServer(mean_tokens=args.mean_tokens, cpu=place.server) as server:
            print(
                f"sim server {server.url}; {args.items:,} prompts; concurrency {args.concurrency}"
            )
            for db in dbs:
                plain.append(run_bare(server, prompts, args.concurrency, place.client, "asyncio"))
                bares.append(run_bare(server, prompts, args.concurrency, place.client, "uvloop"))
                workers.append(run_worker(server, db, args.concurrency, place.client, args.profile))

    report(args, plain, bares, workers, startup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
