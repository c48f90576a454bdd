"""Export time and peak RSS for a million done items.

The database is built quickly and outside the measurement: the real ``enqueue``, then
every item marked done with a 64-word answer, in plain SQL. It is brought to the current
schema before the measured runs (a database built by an older version would otherwise
pay its migration in the first one). Targets: ≤ 20 s and ≤ 200 MB for 1,000,000 items.

    python benchmarks/bench_export.py [--items 1000000] [--workdir DIR] [--repeat 3]
"""

from __future__ import annotations

import statistics

from common import (
    export_argv,
    fmt_mb,
    items_args,
    print_profile,
    print_table,
    python_startup_seconds,
    run_measured,
    upgraded_db,
    verdict,
    workdir,
)

TARGET_SECONDS = 20.0
TARGET_MB = 200.0


def main(argv: list[str] | None = None) -> int:
    args = items_args(argv, __doc__, repeat=3, repeat_help="measured runs (median shown)")

    with workdir(args.workdir) as work:
        db = upgraded_db(work, args.items, "done")
        out = work / "export.jsonl"
        startup = python_startup_seconds()
        runs = []
        for _ in range(args.repeat):
            runs.append(run_measured(export_argv(out, db)).check())
            with open(out, "rb") as fh:
                lines = sum(1 for _ in fh)
            size_mb = out.stat().st_size / 2**20
            out.unlink()
        if args.profile:
            run_measured(export_argv(out, db), profile=args.profile).check()
            out.unlink()

    seconds = statistics.median(m.seconds for m in runs)
    peak_mb = max(m.peak_rss_mb for m in runs)
    print()
    print_table(
        ["command", "run", "lines", "file", "seconds", "lines/s", "CPU s", "peak RSS"],
        [
            [
                "orchestrator export",
                str(i + 1),
                f"{lines:,}",
                f"{size_mb:,.0f} MB",
                f"{m.seconds:.1f}",
                f"{lines / m.seconds:,.0f}",
                f"{m.cpu_s:.1f}",
                fmt_mb(m.peak_rss_mb),
            ]
            for i, m in enumerate(runs)
        ],
    )
    print()
    print(f"interpreter start-up and imports: ~{startup:.2f} s of each figure")
    print(
        f"time {seconds:.1f} s (median of {len(runs)}), target ≤ {TARGET_SECONDS:.0f} s: "
        f"{verdict(seconds, TARGET_SECONDS)}; peak RSS {fmt_mb(peak_mb)} (highest), "
        f"target ≤ {TARGET_MB:.0f} MB: {verdict(peak_mb, TARGET_MB)}"
    )
    if lines != args.items:
        print(f"WARNING: {lines:,} lines exported for {args.items:,} done items")
    print_profile(args.profile, "; from one extra run under py-spy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
