"""Enqueue time and peak RSS for the same million prompts from JSONL and from Parquet.

The rows are ``bench_enqueue.py``'s (an ``id`` and a one-message ``messages`` list), as
JSONL lines and as a Parquet file written the way ``datasets`` and pandas write one
(row groups of 100,000, snappy): read as rows (the line formats' rules on each row), and,
from a flat ``prompt`` column, by ``--prompt-column``. Passes alternate between the
sources; medians are reported, of the wall time and of the enqueue process's CPU time (on
a shared machine the CPU time is the steadier measure). Target: Parquet at most 1.5x the
JSONL time, in the same memory bound (≤ 200 MB, flat in the number of rows).

    python benchmarks/bench_enqueue_formats.py [--lines 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import (
    ORCH,
    Measured,
    add_common_args,
    against,
    count_items,
    fmt_mb,
    print_machine,
    print_passes,
    print_table,
    prompt_line,
    run_measured,
    timed,
    verdict,
    workdir,
    write_prompts,
)

TARGET_RATIO = 1.5
TARGET_MB = 200.0
ROW_GROUP = 100_000


def write_parquet(path: Path, n: int, *, flat: bool) -> Path:
    """``n`` of ``prompt_line``'s rows as Parquet: as they are, or ``flat`` (id, prompt)."""
    with pq.ParquetWriter(path, _schema(flat)) as writer:
        for start in range(0, n, ROW_GROUP):
            rows = [prompt_line(i) for i in range(start, min(n, start + ROW_GROUP))]
            if flat:
                rows = [{"id": r["id"], "prompt": r["messages"][0]["content"]} for r in rows]
            writer.write_table(pa.Table.from_pylist(rows, schema=_schema(flat)))
    return path


def _schema(flat: bool) -> pa.Schema:
    if flat:
        return pa.schema([("id", pa.string()), ("prompt", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("id", pa.string()), ("messages", pa.list_(message))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="alternating passes; medians")
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    print_machine()
    with workdir(args.workdir) as work:
        with timed() as gen:
            sources = {
                "JSONL (messages lines)": (write_prompts(work / "p.jsonl", args.lines), ()),
                "Parquet, rows as lines": (
                    write_parquet(work / "p.parquet", args.lines, flat=False),
                    (),
                ),
                "Parquet, --prompt-column": (
                    write_parquet(work / "flat.parquet", args.lines, flat=True),
                    ("--prompt-column", "prompt"),
                ),
            }
        sizes = ", ".join(
            f"{path.name} {path.stat().st_size / 2**20:,.0f} MB" for path, _ in sources.values()
        )
        print(f"{args.lines:,} rows ({sizes}), written in {gen.seconds:.1f} s")
        runs: dict[str, list[Measured]] = {name: [] for name in sources}
        for i in range(args.repeat):
            load = os.getloadavg()[0]
            for name, (path, options) in sources.items():
                db = work / "formats.db"
                for stale in work.glob("formats.db*"):
                    stale.unlink()
                argv_ = [*ORCH, "enqueue", str(path), "-d", "bench", "--db", str(db), *options]
                m = run_measured(argv_).check()
                if count_items(db) != args.lines:
                    print(f"WARNING: {name}: {count_items(db):,} of {args.lines:,} rows queued")
                runs[name].append(m)
            shown = "; ".join(f"{n} {r[-1].seconds:.1f} s" for n, r in runs.items())
            print(f"pass {i + 1} (load {load:.2f}): {shown}", flush=True)
    _report(runs, args.lines, args.repeat)
    return 0


def _report(runs: dict[str, list[Measured]], lines: int, repeat: int) -> None:
    jsonl = runs["JSONL (messages lines)"]
    base = statistics.median(m.seconds for m in jsonl)
    base_cpu = statistics.median(m.cpu_s for m in jsonl)
    rows = [
        [
            name,
            f"{lines:,}",
            *against(measured, jsonl),
            f"{lines / statistics.median(m.seconds for m in measured):,.0f}",
            fmt_mb(max(m.peak_rss_mb for m in measured)),
        ]
        for name, measured in runs.items()
    ]
    print()
    heads = [f"wall s, median of {repeat} (÷ JSONL)", "CPU s (÷ JSONL)", "rows/s", "peak RSS"]
    print_table(["source", "rows", *heads], rows)
    print()
    print_passes(runs)
    parquet = runs["Parquet, rows as lines"]
    wall = statistics.median(m.seconds for m in parquet) / base
    cpu = statistics.median(m.cpu_s for m in parquet) / base_cpu
    rss = max(m.peak_rss_mb for name in runs if runs[name] is not jsonl for m in runs[name])
    base_rss = max(m.peak_rss_mb for m in jsonl)
    print(
        f"Parquet ÷ JSONL {wall:.2f}x wall, {cpu:.2f}x CPU; target ≤ {TARGET_RATIO}x: "
        f"{verdict(max(wall, cpu), TARGET_RATIO)}; peak RSS {fmt_mb(rss)} (JSONL "
        f"{fmt_mb(base_rss)}), target ≤ {TARGET_MB:.0f} MB: {verdict(rss, TARGET_MB)}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
