"""Export time and peak RSS for the same million done items as JSONL and as Parquet.

The database is figure 3's (``bench_export.py``): the real ``enqueue``, then every item
marked done with a 64-word answer in plain SQL, brought to the current schema before the
measured runs. Each pass exports it three ways, alternating: the default JSONL lines,
one Parquet file (``--format parquet``), and ``--format parquet --split`` (shards of
100,000 rows and the dataset card). Medians of the wall time and of the export process's
CPU time are reported (on a shared machine the CPU time is the steadier measure).
Target: Parquet within 2x the JSONL time, in the same memory bound (≤ 200 MB, flat in
the number of rows).

    python benchmarks/bench_export_formats.py [--items 1000000] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

import pyarrow.parquet as pq
from common import (
    Measured,
    against,
    export_argv,
    fmt_mb,
    items_args,
    print_passes,
    print_table,
    run_measured,
    upgraded_db,
    verdict,
    workdir,
)

TARGET_RATIO = 2.0
TARGET_MB = 200.0
JSONL = "JSONL (messages lines)"


def _rows(out: Path) -> int:
    """Rows the export wrote: lines of a JSONL file, rows of every Parquet file."""
    if out.suffix == ".jsonl":
        with open(out, "rb") as fh:
            return sum(1 for _ in fh)
    files = [out] if out.is_file() else sorted(out.rglob("*.parquet"))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _size_mb(out: Path) -> float:
    files = [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file()]
    return sum(f.stat().st_size for f in files) / 2**20


def main(argv: list[str] | None = None) -> int:
    args = items_args(argv, __doc__, repeat=3, repeat_help="alternating passes; medians")
    with workdir(args.workdir) as work:
        db = upgraded_db(work, args.items, "done")
        ways = {
            JSONL: (work / "export.jsonl", []),
            "Parquet, one file": (work / "export.parquet", ["--format", "parquet"]),
            "Parquet, --split + card": (work / "export-split", ["--format", "parquet", "--split"]),
        }
        runs: dict[str, list[Measured]] = {name: [] for name in ways}
        sizes: dict[str, str] = {}
        for i in range(args.repeat):
            load = os.getloadavg()[0]
            for name, (out, options) in ways.items():
                runs[name].append(run_measured([*export_argv(out, db), *options]).check())
                rows = _rows(out)
                if rows != args.items:
                    print(f"WARNING: {name}: {rows:,} rows exported of {args.items:,}")
                sizes[name] = f"{_size_mb(out):,.0f} MB"
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            shown = "; ".join(f"{n} {r[-1].seconds:.1f} s" for n, r in runs.items())
            print(f"pass {i + 1} (load {load:.2f}): {shown}", flush=True)
    _report(runs, sizes, args.items, args.repeat)
    return 0


def _report(runs: dict[str, list[Measured]], sizes: dict[str, str], n: int, repeat: int) -> None:
    base = statistics.median(m.seconds for m in runs[JSONL])
    base_cpu = statistics.median(m.cpu_s for m in runs[JSONL])
    rows = [
        [
            name,
            f"{n:,}",
            sizes[name],
            *against(measured, runs[JSONL]),
            fmt_mb(max(m.peak_rss_mb for m in measured)),
        ]
        for name, measured in runs.items()
    ]
    print()
    heads = [f"wall s, median of {repeat} (÷ JSONL)", "CPU s (÷ JSONL)", "peak RSS"]
    print_table(["export", "rows", "size", *heads], rows)
    print()
    print_passes(runs)
    worst = max(
        max(
            statistics.median(m.seconds for m in measured) / base,
            statistics.median(m.cpu_s for m in measured) / base_cpu,
        )
        for name, measured in runs.items()
        if name != JSONL
    )
    rss = max(m.peak_rss_mb for name, ms in runs.items() if name != JSONL for m in ms)
    print(
        f"Parquet ÷ JSONL at most {worst:.2f}x (wall or CPU); target ≤ {TARGET_RATIO}x: "
        f"{verdict(worst, TARGET_RATIO)}; peak RSS {fmt_mb(rss)} (JSONL "
        f"{fmt_mb(max(m.peak_rss_mb for m in runs[JSONL]))}), target ≤ {TARGET_MB:.0f} MB: "
        f"{verdict(rss, TARGET_MB)}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
