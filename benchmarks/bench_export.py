"""Export time and peak RSS for a million done items.

The database is built quickly and outside the measurement: the real ``enqueue``, then
every item marked done with a 64-word answer, in plain SQL. Targets: ≤ 20 s and ≤ 200 MB
for 1,000,000 items.

    python benchmarks/bench_export.py [--items 1000000] [--workdir DIR]
"""

from __future__ import annotations

import argparse

from common import (
    add_common_args,
    export_argv,
    fmt_mb,
    prepared_db,
    print_machine,
    print_table,
    python_startup_seconds,
    run_measured,
    verdict,
    workdir,
)

TARGET_SECONDS = 20.0
TARGET_MB = 200.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    print_machine()

    with workdir(args.workdir) as work:
        db = prepared_db(work, args.items, "done")
        out = work / "export.jsonl"
        startup = python_startup_seconds()
        m = run_measured(export_argv(out, db), profile=args.profile).check()
        with open(out, "rb") as fh:
            lines = sum(1 for _ in fh)
        size_mb = out.stat().st_size / 2**20
        out.unlink()

    print()
    print_table(
        ["command", "lines", "file", "seconds", "lines/s", "peak RSS"],
        [
            [
                "orchestrator export",
                f"{lines:,}",
                f"{size_mb:,.0f} MB",
                f"{m.seconds:.1f}",
                f"{lines / m.seconds:,.0f}",
                fmt_mb(m.peak_rss_mb),
            ]
        ],
    )
    print()
    print(f"interpreter start-up and imports: ~{startup:.2f} s of the figure")
    print(
        f"time {m.seconds:.1f} s, target ≤ {TARGET_SECONDS:.0f} s: "
        f"{verdict(m.seconds, TARGET_SECONDS)}; peak RSS {fmt_mb(m.peak_rss_mb)}, "
        f"target ≤ {TARGET_MB:.0f} MB: {verdict(m.peak_rss_mb, TARGET_MB)}"
    )
    if lines != args.items:
        print(f"WARNING: {lines:,} lines exported for {args.items:,} done items")
    if args.profile:
        print(f"profile (collapsed stacks): {args.profile}; timings above include py-spy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
