"""One periodic sample (``orchestrator.store.samples``) on a million items, and its reads.

A running worker writes a sample every minute for the dashboard's charts, inside a
write transaction: whatever it costs, every other worker's commits wait that long.
Target: ≤ 100 ms for 1,000,000 items in mixed states, and a few milliseconds of it in
the write transaction (the counts by state are read before it). The first sample of a
database sums every answer so far (once); each later one reads the counts by state and
what arrived since the previous sample. Also timed: the dashboard's reads (the whole
history, the completion-length histogram).

    python benchmarks/bench_samples.py [--items 1000000] [--workdir DIR] [--repeat 5]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from common import (
    items_args,
    print_states,
    print_table,
    timed,
    upgraded_db,
    verdict,
    workdir,
)

TARGET_SECONDS = 0.1


async def measure(db: Path, repeat: int) -> list[tuple[str, float]]:
    from orchestrator.store import open_database, samples
    from orchestrator.store.reader import open_reader

    database = await open_database(str(db))
    try:
        async with database.write() as conn:
            await conn.exec_driver_sql("DELETE FROM samples")
            await conn.exec_driver_sql("DELETE FROM server_samples")
        # The part spent in the write transaction (holding the write lock), timed apart.
        locked: list[float] = []
        write = database.run_write

        async def timed_write(fn: Any) -> Any:
            with timed() as watch:
                result = await write(fn)
            locked.append(watch.seconds)
            return result

        database.run_write = timed_write  # type: ignore[method-assign]
        start = time.time()
        with timed() as first:
            await samples.record(database, interval=60, now=start)
        later = []
        for i in range(1, repeat + 1):
            # A minute apart, as a worker writes them; the answers in between are the
            # last minute's of the prepared run (its commit times are spread out).
            with timed() as watch:
                written = await samples.record(database, interval=60, now=start + 60 * i)
            assert written > 0, "sample skipped"
            later.append(watch.seconds)
        held = locked[1:]
        with timed() as skip:
            await samples.record(database, interval=60, now=start + 60 * repeat + 1)
    finally:
        await database.close()
    reader = open_reader(str(db))
    assert reader is not None
    with reader, timed() as hist:
        samples.read_history(reader)
    reader = open_reader(str(db))
    assert reader is not None
    with reader, timed() as lengths:
        samples.read_lengths(reader)
    return [
        ("first sample (sums every answer once)", first.seconds),
        (f"later sample (median of {repeat})", statistics.median(later)),
        (f"later sample (max of {repeat})", max(later)),
        (f"later sample: write transaction (median of {repeat})", statistics.median(held)),
        (f"later sample: write transaction (max of {repeat})", max(held)),
        ("skipped (a sample is younger than the interval)", skip.seconds),
        ("dashboard read: whole history", hist.seconds),
        ("dashboard read: length histogram", lengths.seconds),
    ]


def main(argv: list[str] | None = None) -> int:
    args = items_args(argv, __doc__, repeat=5, repeat_help="later samples to time")
    with workdir(args.workdir) as work:
        db = upgraded_db(work, args.items, "mixed")
        print_states(db)
        rows = asyncio.run(measure(db, args.repeat))
    print_table(
        ["what", "ms"],
        [(what, f"{seconds * 1000:.1f}") for what, seconds in rows],
    )
    later = dict(rows)[f"later sample (max of {args.repeat})"]
    print(f"later sample: {later * 1000:.1f} ms {verdict(later, TARGET_SECONDS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
