"""How enqueue, run and export scale from 10k to 1M items, as a table and a chart.

Each size gets a fresh database and goes through the whole life of a run: ``enqueue``,
``run --exit-when-done`` against the simulated server (zero latency, 8-token answers),
``export``. A figure that grows faster than the item count (throughput falling, RSS
rising) points at a query or a structure that is not O(1) per item.

    python benchmarks/bench_scale.py [--sizes 10000,100000,1000000] [--run-limit 420]

On two cores the 1M step takes the longest, mostly in ``run`` (an hour or more to the
end). ``--run-limit S`` stops each run step after S seconds and measures its req/s over
what was committed; export then covers only those items. Each step's duration is printed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import (
    BENCH_DIR,
    Measured,
    SimServer,
    add_common_args,
    count,
    enqueue_argv,
    export_argv,
    placement,
    print_machine,
    print_table,
    run_argv,
    run_measured,
    timed,
    workdir,
    write_prompts,
)


@dataclass(slots=True)
class SizeFigures:
    items: int
    enqueue: Measured
    run: Measured
    export: Measured
    done: int
    run_active_s: float
    total_s: float

    @property
    def run_rps(self) -> float:
        """Answers committed per second while the worker was working (first send to last
        commit): comparable between a run to the end and one stopped early."""
        return self.done / self.run_active_s if self.run_active_s else 0.0

    def row(self) -> list[str]:
        return [
            f"{self.items:,}",
            f"{self.enqueue.seconds:.1f}",
            f"{self.items / self.enqueue.seconds:,.0f}",
            f"{self.enqueue.peak_rss_mb:,.0f}",
            f"{self.run.seconds:.1f}" + ("" if self.done == self.items else " (stopped)"),
            f"{self.done:,}",
            f"{self.run_rps:,.0f}",
            f"{self.run.peak_rss_mb:,.0f}",
            f"{self.export.seconds:.1f}",
            f"{self.export.peak_rss_mb:,.0f}",
            f"{self.total_s:.0f}",
        ]


HEADERS = [
    "items",
    "enqueue s",
    "enqueue rows/s",
    "enqueue RSS MB",
    "run s",
    "answers",
    "run req/s",
    "worker RSS MB",
    "export s",
    "export RSS MB",
    "step total s",
]


def one_size(
    work: Path,
    n: int,
    concurrency: int,
    server: SimServer,
    cpu: int | None,
    run_limit: float | None,
) -> SizeFigures:
    with timed() as total:
        prompts = write_prompts(work / f"prompts-{n}.jsonl", n)
        db = work / f"scale-{n}.db"
        for stale in work.glob(f"scale-{n}.db*"):
            stale.unlink()
        enq = run_measured(enqueue_argv(prompts, db), cpu=cpu).check()
        prompts.unlink()
        run = run_measured(
            run_argv(server.url, db, concurrency), cpu=cpu, stop_after=run_limit
        ).warn_if_failed(f"run ({n:,} items)")
        server.check_alive()
        out = work / f"export-{n}.jsonl"
        exp = run_measured(export_argv(out, db), cpu=cpu).check()
        out.unlink()
        done = count(db, "SELECT count(*) FROM outputs")
        span = count(db, "SELECT 1000 * (max(created_at) - min(created_at - latency)) FROM outputs")
        for path in work.glob(f"scale-{n}.db*"):
            path.unlink()
    return SizeFigures(n, enq, run, exp, done, span / 1000, total.seconds)


def chart(figures: list[SizeFigures], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [f.items for f in figures]
    # A stopped run leaves few items to export: its export time would mislead.
    whole = [f for f in figures if f.done == f.items]
    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_t.plot(sizes, [f.enqueue.seconds for f in figures], marker="o", label="enqueue")
    ax_t.plot(
        sizes, [f.items / f.run_rps for f in figures], marker="o", label="run (items ÷ req/s)"
    )
    ax_t.plot(
        [f.items for f in whole], [f.export.seconds for f in whole], marker="o", label="export"
    )
    ax_t.set(xscale="log", yscale="log", xlabel="items", ylabel="seconds", title="Wall time")
    ax_t.legend()
    ax_r.plot(sizes, [f.run_rps for f in figures], marker="o", label="run req/s")
    ax_r.plot(
        sizes,
        [f.items / f.enqueue.seconds / 10 for f in figures],
        marker="s",
        label="enqueue rows/s ÷ 10",
    )
    ax_r.set(xscale="log", xlabel="items", ylabel="per second", title="Throughput")
    ax_r.set_ylim(bottom=0)
    ax_r.legend()
    ax_m.plot(sizes, [f.enqueue.peak_rss_mb for f in figures], marker="o", label="enqueue")
    ax_m.plot(sizes, [f.run.peak_rss_mb for f in figures], marker="o", label="worker")
    ax_m.plot(
        [f.items for f in whole], [f.export.peak_rss_mb for f in whole], marker="o", label="export"
    )
    ax_m.axhline(200, color="grey", linestyle="--", linewidth=1, label="200 MB target")
    ax_m.set(xscale="log", xlabel="items", ylabel="MB", title="Peak RSS")
    ax_m.set_ylim(bottom=0)
    ax_m.legend()
    title = "orchestrator: enqueue → run (sim server, 0 latency, 8 tokens) → export"
    stopped = [f"{f.items:,}" for f in figures if f.done != f.items]
    if stopped:
        title += f"; run stopped early at {', '.join(stopped)} items (req/s over what committed)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help="comma-separated item counts (the 1M step is the slow one)",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--run-limit",
        type=float,
        help="stop each run step after this many seconds (SIGTERM, graceful); its req/s is "
        "then measured over what was committed",
    )
    parser.add_argument("--chart", type=Path, default=BENCH_DIR / "scale.png")
    add_common_args(parser)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    place = placement(args.pin)
    print_machine()
    print(f"cores: {place.describe()}")

    figures: list[SizeFigures] = []
    with workdir(args.workdir) as work, SimServer(mean_tokens=8, cpu=place.server) as server:
        for n in sizes:
            server.check_alive()
            figures.append(
                one_size(work, n, args.concurrency, server, place.client, args.run_limit)
            )
            f = figures[-1]
            print(
                f"{n:,} items: step took {f.total_s:.0f} s (enqueue {f.enqueue.seconds:.0f} s, "
                f"run {f.run.seconds:.0f} s with {f.done:,} done, export {f.export.seconds:.0f} s)",
                flush=True,
            )
    print()
    print_table(HEADERS, [f.row() for f in figures])
    chart(figures, args.chart)
    print(f"\nchart: {args.chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
