"""Where a worker's run goes, by queue operation: calls, items per call, time inside.

It runs the real ``Worker`` in this process (on uvloop, as ``orchestrator run`` does)
against the simulated server (a subprocess), with counting wrappers around the
``Queue`` methods and the write transactions; the core code is used as is. A worker
writes in rounds (``write_round``: every outcome queued since the last round, plus a
claim for the free slots, in one transaction): the table says how many rounds a run
takes, how many items each carries, and how long each takes from call to return. A
line after it says how busy the slots were: requests running on average, and how often
no claimed item waited for a slot that freed (the prefetch had run out).

``--writes-on-loop`` runs each round's transaction on the event loop's thread instead of
the writer thread, to measure what the hop to the thread costs (the GIL hand-offs).

    python benchmarks/run_breakdown.py [--items 20000] [--concurrency 64] [--writes-on-loop]
                                       [--postgres SERVER_URL] [--statements]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    SimServer,
    enqueue_argv,
    fresh_database,
    print_machine,
    print_table,
    run_measured,
    workdir,
    write_prompts,
)

# operation -> [calls, items, seconds]
TALLY: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])


def _size(result: Any) -> int:
    try:
        return len(result)
    except TypeError:
        return 1


def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            entry = TALLY[name]
            entry[0] += 1
            entry[2] += time.perf_counter() - start
            if name == "renew":
                entry[1] += _size(args[1])

    return wrapper


def instrument(writes_on_loop: bool) -> None:
    from orchestrator.store import queue as queue_mod
    from orchestrator.store.engine import Database

    queue_cls = queue_mod.Queue
    original_round = queue_cls.write_round

    async def write_round(self: Any, work: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = await original_round(self, work, **kwargs)
        spent = time.perf_counter() - start
        settled = sum(
            len(getattr(work, kind)) for kind in ("complete", "advance", "retry", "release", "fail")
        )
        for name, n in (("round: outcomes", settled), ("round: claimed", len(result.leases))):
            entry = TALLY[name]
            entry[0] += 1
            entry[1] += n
            entry[2] += spent
        return result

    queue_cls.write_round = write_round  # type: ignore[method-assign]
    for name in ("renew", "reap", "remaining"):
        setattr(queue_cls, name, counted(name, getattr(queue_cls, name)))

    if writes_on_loop:

        async def run_write(self: Any, fn: Callable[[Any], Any]) -> Any:
            async with self._write_lock:
                return self._write_in_thread(fn)

        Database.run_write = run_write  # type: ignore[method-assign]


async def run_worker(db: Path | str, url: str, concurrency: int) -> tuple[float, int]:
    from orchestrator.inference.client import InferenceClient
    from orchestrator.store import open_database
    from orchestrator.worker import Worker, WorkerConfig

    database = await open_database(str(db))
    try:
        config = WorkerConfig(servers=(url,), concurrency=concurrency, exit_when_done=True)
        async with InferenceClient() as client:
            start = time.perf_counter()
            stats = await Worker(database, client, config).run()
            return time.perf_counter() - start, stats.completed
    finally:
        await database.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--writes-on-loop", action="store_true")
    parser.add_argument(
        "--statements", action="store_true", help="time each statement the run executes"
    )
    parser.add_argument(
        "--postgres",
        metavar="SERVER_URL",
        help="run on a fresh database on this PostgreSQL server, dropped afterwards",
    )
    args = parser.parse_args(argv)
    print_machine()

    from orchestrator import logs
    from orchestrator._util import aio

    logs.configure("warning", json=True)
    instrument(args.writes_on_loop)
    track_slots()
    if args.statements:
        time_statements()
    with workdir(args.workdir) as work:
        prompts = write_prompts(work / "prompts.jsonl", args.items)
        with fresh_database(work, args.postgres, "orchestrator_breakdown") as db:
            run_measured(enqueue_argv(prompts, db)).check()
            with SimServer(mean_tokens=8) as server:
                seconds, done = aio.run(run_worker(db, server.url, args.concurrency))

    print(f"\n{done:,} done in {seconds:.1f} s ({done / seconds:,.0f} req/s, in-process)\n")
    rows = []
    for name, (calls, items, spent) in sorted(TALLY.items(), key=lambda kv: -kv[1][2]):
        rows.append(
            [
                name,
                f"{calls:,.0f}",
                f"{items / calls:.1f}" if items and calls else "-",
                f"{spent:.2f}",
                f"{1000 * spent / calls:.2f}" if calls else "-",
                f"{spent / seconds:.0%}",
            ]
        )
    print_table(
        ["operation", "calls", "items/call", "seconds inside", "ms/call", "share of run"], rows
    )
    print(
        "\n'seconds inside' is wall time from call to return: it includes waiting for the "
        "process's write lock, the writer thread and the event loop, so shares overlap and "
        "do not add up (the two round lines are the same rounds, counted by what they carry)."
    )
    print_slots(args.concurrency)
    if args.statements:
        print_statements()
    return 0


class _Slots:
    """The worker's slots over time: requests running, and whether any claimed item waits
    for a slot (the prefetch), integrated over every change of either."""

    since: float | None = None
    first: float | None = None
    running = 0
    waiting = 0
    busy_slot_s = 0.0
    none_waiting_s = 0.0


def track_slots() -> None:
    """Wrap the claims' every change of running and prefetched items."""
    from orchestrator.worker.claim import Claims

    def after(name: str) -> None:
        original = getattr(Claims, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            now = time.perf_counter()
            if _Slots.since is not None:
                spent = now - _Slots.since
                _Slots.busy_slot_s += _Slots.running * spent
                _Slots.none_waiting_s += spent if not _Slots.waiting else 0.0
            _Slots.first = _Slots.first or now
            _Slots.since, _Slots.running, _Slots.waiting = now, self.active, len(self.buffer)
            return result

        setattr(Claims, name, wrapper)

    for name in ("fill", "slot_freed", "deliver"):
        after(name)


def print_slots(concurrency: int) -> None:
    if _Slots.first is None or _Slots.since is None or _Slots.since <= _Slots.first:
        return
    span = _Slots.since - _Slots.first
    print(
        f"\nslots: {_Slots.busy_slot_s / span:.1f} of {concurrency} running on average; "
        f"no claimed item waiting for a slot {_Slots.none_waiting_s / span:.0%} of the time"
    )


# statement text (white space folded, cut) -> [executions, seconds, distinct full texts,
# database server CPU seconds]
STATEMENTS: dict[str, list[Any]] = defaultdict(lambda: [0, 0.0, set(), 0.0])
# PostgreSQL backend process of each connection (its CPU is read from /proc: a local server)
BACKENDS: dict[int, int] = {}


def _backend_cpu(pid: int | None) -> float:
    """CPU seconds a local PostgreSQL backend has run (``schedstat``: nanoseconds)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def time_statements() -> None:
    """Time every statement the run executes, by its text's start: which statements a
    round's time goes to, and how many distinct texts each has (a text per round size
    is a statement prepared again each time). On a local PostgreSQL server, also the CPU
    its backend spent on each (the server's own cost, apart from the wait)."""
    import sqlalchemy as sa
    from sqlalchemy import event

    @event.listens_for(sa.pool.Pool, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        if "asyncpg" in type(dbapi_conn).__module__:
            cursor = dbapi_conn.cursor()
            cursor.execute("SELECT pg_backend_pid()")
            BACKENDS[id(dbapi_conn)] = cursor.fetchone()[0]
            cursor.close()

    @event.listens_for(sa.engine.Engine, "before_cursor_execute")
    def _before(conn: Any, _cursor: Any, _stmt: str, *_: Any) -> None:
        pid = BACKENDS.get(id(conn.connection.dbapi_connection))
        conn.info["statement_started"] = (time.perf_counter(), pid, _backend_cpu(pid))

    @event.listens_for(sa.engine.Engine, "after_cursor_execute")
    def _after(conn: Any, _cursor: Any, stmt: str, *_: Any) -> None:
        started, pid, cpu = conn.info.pop("statement_started")
        entry = STATEMENTS[" ".join(stmt.split())[:72]]
        entry[0] += 1
        entry[1] += time.perf_counter() - started
        entry[2].add(stmt)
        entry[3] += _backend_cpu(pid) - cpu


def print_statements() -> None:
    rows = [
        [
            text,
            f"{n:,}",
            f"{1000 * spent / n:.2f}",
            f"{1000 * cpu / n:.2f}" if BACKENDS else "-",
            f"{spent:.2f}",
            f"{len(texts):,}",
        ]
        for text, (n, spent, texts, cpu) in sorted(STATEMENTS.items(), key=lambda kv: -kv[1][1])[:8]
    ]
    print()
    print_table(
        ["statement", "executions", "ms each", "server CPU ms each", "seconds", "texts"], rows
    )
    print(
        "\nTimed by SQLAlchemy's cursor events (raw sqlite3 statements of the SQLite hot "
        "path are not seen; on PostgreSQL every statement is). 'ms each' is wall time, the "
        "wait for the event loop included; the server's CPU is its backend's, read from "
        "/proc (a server on this machine)."
    )


if __name__ == "__main__":
    raise SystemExit(main())
