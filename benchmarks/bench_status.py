"""``orchestrator status`` on a million items in mixed states, with the plans of its queries.

Status is what an operator runs every few minutes during a 30-hour run, often in a loop
(``watch``), so it must stay cheap however many rows are done. Target: ≤ 0.5 s for
1,000,000 items. The SQL is captured from the code path the command takes on an SQLite
file at the current schema (``monitor.status.read`` over ``store.reader``, with sqlite3's
trace callback), so the plans shown are those of the code as it is. The database is
brought to the current schema first, outside the measurement (a database built by an
older version would otherwise pay its migration in the first measured run).

    python benchmarks/bench_status.py [--items 1000000] [--workdir DIR] [--repeat 5]
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from common import (
    ORCH,
    PYTHON,
    connect,
    items_args,
    print_profile,
    print_states,
    print_table,
    run_measured,
    timed,
    upgraded_db,
    verdict,
    workdir,
)

TARGET_SECONDS = 0.5
# What the status command imports on its fast path (no SQLAlchemy, no alembic).
STATUS_IMPORTS = (
    "import orchestrator.cli, orchestrator.store.reader, orchestrator.store.stats, "
    "orchestrator.monitor.status, orchestrator.monitor.text"
)


def capture_snapshot(db: Path) -> tuple[float, list[tuple[str, Any]]]:
    """Seconds of one in-process status read (``monitor.status.read``) and its SELECTs."""
    from orchestrator.monitor.status import read
    from orchestrator.store.reader import open_reader

    reader = open_reader(str(db))
    if reader is None:
        raise SystemExit(f"{db}: not an SQLite database at the current schema")
    statements: list[tuple[str, Any]] = []

    def grab(statement: str) -> None:
        # sqlite3 passes the statement with its parameters already bound in.
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, ()))

    reader.conn.set_trace_callback(grab)
    with reader, timed() as watch:
        read(reader)
    return watch.seconds, statements


def explain(db: Path, statements: list[tuple[str, Any]]) -> list[tuple[str, float, list[str]]]:
    """Each statement's plan and its own run time through plain sqlite3."""
    conn = connect(db)
    out = []
    try:
        for sql, params in statements:
            plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
            with timed() as watch:
                conn.execute(sql, params).fetchall()
            out.append((sql, watch.seconds, plan))
    finally:
        conn.close()
    return out


def one_line(sql: str, width: int = 150) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    args = items_args(argv, __doc__, repeat=5, repeat_help="runs of each command")

    with workdir(args.workdir) as work:
        db = upgraded_db(work, args.items, "mixed")
        print_states(db)
        startup = min(
            run_measured([PYTHON, "-c", STATUS_IMPORTS]).seconds for _ in range(args.repeat)
        )
        rows = []
        figures: dict[str, float] = {}
        for label, extra in (("status", []), ("status --json", ["--json"])):
            argv_ = [*ORCH, "status", *extra, "--db", str(db)]
            runs = [run_measured(argv_).check() for _ in range(args.repeat)]
            times = [m.seconds for m in runs]
            figures[label] = statistics.median(times)
            rows.append(
                [
                    f"orchestrator {label}",
                    f"{min(times):.2f}",
                    f"{statistics.median(times):.2f}",
                    f"{max(r.peak_rss_mb for r in runs):,.0f} MB",
                ]
            )
        if args.profile:
            run_measured([*ORCH, "status", "--db", str(db)], profile=args.profile).check()
        snap_s, statements = capture_snapshot(db)
        plans = explain(db, statements)

    print("\nquery plans of the status read (orchestrator/store/stats.py), each timed alone:")
    for sql, seconds, plan in plans:
        print(f"\n  [{seconds * 1000:7.1f} ms] {one_line(sql)}")
        for step in plan:
            print(f"      {step}")
    print()
    print_table(["command", "min s", "median s", "peak RSS"], rows)
    print()
    print(
        f"in-process status read: {snap_s:.3f} s (queries alone: "
        f"{sum(p[1] for p in plans):.3f} s); interpreter start-up and the fast path's "
        f"imports: ~{startup:.2f} s of each command"
    )
    for label, seconds in figures.items():
        print(
            f"{label}: median {seconds:.2f} s, target ≤ {TARGET_SECONDS} s: "
            f"{verdict(seconds, TARGET_SECONDS)}"
        )
    print_profile(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
