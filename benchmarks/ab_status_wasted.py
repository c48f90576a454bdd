"""What reading the tokens thrown away costs ``status``: the in-process status read of
one database with and without the ``wasted`` query, alternated.

    python benchmarks/ab_status_wasted.py DB [--repeat 5]

DB: a database at the current schema, such as the one ``bench_status.py --workdir W``
leaves in W (``mixed-1000000.db``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from orchestrator.monitor.status import snapshot_fast
from orchestrator.store import stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with_query = dict(stats._QUERIES)
    without = {k: v for k, v in with_query.items() if k != "wasted"}
    document = stats._document

    def no_waste(rows: Any, *a: Any, **k: Any) -> Any:
        return document({**rows, "wasted": []}, *a, **k)

    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.repeat):
        for name in ("without", "with"):
            stats._QUERIES.clear()
            stats._QUERIES.update(with_query if name == "with" else without)
            stats._document = document if name == "with" else no_waste  # type: ignore[assignment]
            start = time.perf_counter()
            snapshot_fast(args.db)
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name:8s} median {statistics.median(seconds):.3f} s, min {min(seconds):.3f} s")


if __name__ == "__main__":
    main()
