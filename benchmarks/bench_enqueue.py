"""Enqueue time and peak RSS for a million prompt lines, against plain sqlite3.

The floor is ``executemany`` of the same rows into a table of the same shape (the real
schema, created by ``orchestrator db upgrade``: same columns, constraints and indexes) in
one transaction. Targets: ≤ 20 s and ≤ 200 MB for 1,000,000 lines. Also shown: the same
rows as multi-row INSERTs of 2,000 rows, which is how enqueue writes them, i.e. the
SQLite side of enqueue on its own.

    python benchmarks/bench_enqueue.py [--lines 1000000] [--repeat 5] [--regenerate all]

``--regenerate all`` enqueues the same lines for a dataset that regenerates every
assistant turn (whole conversations and their turn counts stored); the floors stay those
of plain prompt rows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from itertools import chain
from pathlib import Path
from typing import Any

import orjson
from common import (
    DATASET,
    ORCH,
    Measured,
    add_common_args,
    connect,
    count_items,
    enqueue_argv,
    fmt_mb,
    print_machine,
    print_profile,
    print_table,
    python_startup_seconds,
    run_measured,
    timed,
    verdict,
    workdir,
    write_prompts,
)

TARGET_SECONDS = 20.0
TARGET_MB = 200.0
_COLUMNS = (
    "dataset_id, key, position, request, digest, state, attempts, not_before, created_at,"
    " updated_at"
)


def build_rows(prompts: Path) -> list[tuple[Any, ...]]:
    """The rows enqueue writes, with the least Python that can produce them."""
    now = time.time()
    rows = []
    with open(prompts, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            obj = orjson.loads(raw)
            request = {"messages": obj["messages"]}
            digest = hashlib.sha256(orjson.dumps(request, option=orjson.OPT_SORT_KEYS))
            rows.append(
                (
                    1,
                    str(obj["id"]),
                    line_no,
                    orjson.dumps(request).decode(),
                    digest.hexdigest(),
                    "pending",
                    0,
                    0.0,
                    now,
                    now,
                )
            )
    return rows


def sqlite_floor(db: Path, rows: list[tuple[Any, ...]], per_statement: int = 1) -> float:
    """Seconds to insert ``rows`` in one transaction, same pragmas as the store.

    ``per_statement`` 1: one ``executemany``; more: multi-row INSERTs of that many rows.
    """
    for stale in db.parent.glob(f"{db.name}*"):
        stale.unlink()
    run_measured([*ORCH, "db", "upgrade", "--db", str(db)]).check()
    conn = connect(db)
    try:
        now = time.time()
        conn.execute(
            "INSERT INTO datasets (id, name, params, created_at, updated_at)"
            " VALUES (1, ?, '{}', ?, ?)",
            (DATASET, now, now),
        )
        one = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        with timed() as watch:
            conn.execute("BEGIN IMMEDIATE")
            if per_statement == 1:
                conn.executemany(f"INSERT INTO items ({_COLUMNS}) VALUES {one}", rows)
            else:
                for i in range(0, len(rows), per_statement):
                    chunk = rows[i : i + per_statement]
                    conn.execute(
                        f"INSERT INTO items ({_COLUMNS}) VALUES {', '.join([one] * len(chunk))}",
                        list(chain.from_iterable(chunk)),
                    )
            conn.execute("COMMIT")
        return watch.seconds
    finally:
        conn.close()


def report(
    args: argparse.Namespace,
    runs: list[Measured],
    floors: list[float],
    multi: list[float],
    loads: list[float],
    prep_seconds: float,
    startup: float,
) -> None:
    """The table and the ratios, from the medians of the passes."""
    seconds = statistics.median(m.seconds for m in runs)
    rss = max(m.peak_rss_mb for m in runs)
    insert_s = statistics.median(floors)
    multi_s = statistics.median(multi)
    spread = "" if args.repeat == 1 else f" (median of {args.repeat})"
    print()
    print_table(
        ["path", "rows", "seconds" + spread, "rows/s", "peak RSS"],
        [
            [
                "orchestrator enqueue (subprocess)",
                f"{args.lines:,}",
                f"{seconds:.1f}",
                f"{args.lines / seconds:,.0f}",
                fmt_mb(rss),
            ],
            [
                "sqlite3 executemany, rows prebuilt",
                f"{args.lines:,}",
                f"{insert_s:.1f}",
                f"{args.lines / insert_s:,.0f}",
                "-",
            ],
            [
                "read+parse+digest+executemany",
                f"{args.lines:,}",
                f"{prep_seconds + insert_s:.1f}",
                f"{args.lines / (prep_seconds + insert_s):,.0f}",
                "-",
            ],
            [
                "sqlite3 multi-row INSERT, rows prebuilt",
                f"{args.lines:,}",
                f"{multi_s:.1f}",
                f"{args.lines / multi_s:,.0f}",
                "-",
            ],
        ],
    )
    print()
    if args.repeat > 1:
        print(
            "enqueue runs: " + ", ".join(f"{m.seconds:.1f}" for m in runs) + " s; "
            "executemany: " + ", ".join(f"{f:.1f}" for f in floors) + " s; "
            "load at each pass: " + ", ".join(f"{x:.2f}" for x in loads)
        )
    print(f"interpreter start-up and imports: ~{startup:.2f} s of the enqueue figure")
    print(
        f"ratio enqueue / executemany: {seconds / insert_s:.2f}x; "
        f"/ (read+parse+digest+executemany): {seconds / (prep_seconds + insert_s):.2f}x; "
        f"/ multi-row INSERT: {seconds / multi_s:.2f}x"
    )
    print(
        f"time {seconds:.1f} s, target ≤ {TARGET_SECONDS:.0f} s: "
        f"{verdict(seconds, TARGET_SECONDS)}; peak RSS {fmt_mb(rss)}, "
        f"target ≤ {TARGET_MB:.0f} MB: {verdict(rss, TARGET_MB)}"
    )
    print_profile(
        args.profile, "; timings above include py-spy", what="collapsed stacks, first pass"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="alternate enqueue and floor runs this many times; medians are used",
    )
    parser.add_argument(
        "--regenerate",
        choices=("last", "all"),
        default="last",
        help="the dataset's regenerate mode (enqueue --regenerate)",
    )
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    print_machine()

    runs: list[Measured] = []
    floors: list[float] = []
    multi: list[float] = []
    loads: list[float] = []
    with workdir(args.workdir) as work:
        with timed() as gen:
            prompts = write_prompts(work / "prompts.jsonl", args.lines)
        size_mb = prompts.stat().st_size / 2**20
        print(f"{args.lines:,} lines, {size_mb:,.0f} MB, written in {gen.seconds:.1f} s")
        db = work / "enqueue.db"
        startup = python_startup_seconds()
        with timed() as prep:
            rows = build_rows(prompts)
        for i in range(args.repeat):
            for stale in work.glob("enqueue.db*"):
                stale.unlink()
            loads.append(os.getloadavg()[0])
            profile = args.profile if i == 0 else None
            argv = [*enqueue_argv(prompts, db), "--regenerate", args.regenerate]
            m = run_measured(argv, profile=profile).check()
            added = count_items(db)
            if added != args.lines:
                print(f"WARNING: {added:,} of {args.lines:,} lines are in the queue")
            runs.append(m)
            floors.append(sqlite_floor(work / "floor.db", rows))
            multi.append(sqlite_floor(work / "floor-multi.db", rows, per_statement=2000))
            if args.repeat > 1:
                print(
                    f"pass {i + 1}: enqueue {m.seconds:.1f} s, {fmt_mb(m.peak_rss_mb)}; "
                    f"executemany {floors[-1]:.1f} s; multi-row {multi[-1]:.1f} s; "
                    f"load {loads[-1]:.2f}",
                    flush=True,
                )
        del rows

    report(args, runs, floors, multi, loads, prep.seconds, startup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
