"""Enqueue time and peak RSS for a million prompt lines, against plain sqlite3.

The floor is ``executemany`` of the same rows into a table of the same shape (the real
schema, created by ``orchestrator db upgrade``: same columns, constraints and indexes) in
one transaction. Targets: ≤ 20 s and ≤ 200 MB for 1,000,000 lines.

    python benchmarks/bench_enqueue.py [--lines 1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson
from common import (
    DATASET,
    ORCH,
    add_common_args,
    connect,
    enqueue_argv,
    fmt_mb,
    print_machine,
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


def sqlite_floor(db: Path, rows: list[tuple[Any, ...]]) -> float:
    """Seconds for one executemany of ``rows`` in one transaction, same pragmas as the store."""
    run_measured([*ORCH, "db", "upgrade", "--db", str(db)]).check()
    conn = connect(db)
    try:
        now = time.time()
        conn.execute(
            "INSERT INTO datasets (id, name, params, created_at, updated_at)"
            " VALUES (1, ?, '{}', ?, ?)",
            (DATASET, now, now),
        )
        with timed() as watch:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                f"INSERT INTO items ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )
            conn.execute("COMMIT")
        return watch.seconds
    finally:
        conn.close()


def count_items(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT count(*) FROM items").fetchone()[0]
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    print_machine()

    with workdir(args.workdir) as work:
        with timed() as gen:
            prompts = write_prompts(work / "prompts.jsonl", args.lines)
        size_mb = prompts.stat().st_size / 2**20
        print(f"{args.lines:,} lines, {size_mb:,.0f} MB, written in {gen.seconds:.1f} s")
        db = work / "enqueue.db"
        floor_db = work / "floor.db"
        for stale in [*work.glob("enqueue.db*"), *work.glob("floor.db*")]:
            stale.unlink()

        startup = python_startup_seconds()
        m = run_measured(enqueue_argv(prompts, db), profile=args.profile).check()
        added = count_items(db)

        with timed() as prep:
            rows = build_rows(prompts)
        insert_s = sqlite_floor(floor_db, rows)
        del rows

    print()
    print_table(
        ["path", "rows", "seconds", "rows/s", "peak RSS"],
        [
            [
                "orchestrator enqueue (subprocess)",
                f"{added:,}",
                f"{m.seconds:.1f}",
                f"{added / m.seconds:,.0f}",
                fmt_mb(m.peak_rss_mb),
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
                f"{prep.seconds + insert_s:.1f}",
                f"{args.lines / (prep.seconds + insert_s):,.0f}",
                "-",
            ],
        ],
    )
    print()
    print(f"interpreter start-up and imports: ~{startup:.2f} s of the enqueue figure")
    print(
        f"ratio enqueue / executemany: {m.seconds / insert_s:.1f}x; "
        f"/ (read+parse+digest+executemany): {m.seconds / (prep.seconds + insert_s):.1f}x"
    )
    print(
        f"time {m.seconds:.1f} s, target ≤ {TARGET_SECONDS:.0f} s: "
        f"{verdict(m.seconds, TARGET_SECONDS)}; peak RSS {fmt_mb(m.peak_rss_mb)}, "
        f"target ≤ {TARGET_MB:.0f} MB: {verdict(m.peak_rss_mb, TARGET_MB)}"
    )
    if added != args.lines:
        print(f"WARNING: {added:,} of {args.lines:,} lines are in the queue")
    if args.profile:
        print(f"profile (collapsed stacks): {args.profile}; timings above include py-spy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
