"""Makespan after a crash: a worker SIGKILLed at 40 % of a run and started again at once.

The items in flight at a worker's death come back to the queue. If they are run one at
a time (as they were, lest one of them kill the worker again), a run of long answers
ends hours late: on a GPU node batching 64 requests, the last ones go at a sixty-fourth
of its speed. The workload is ``bench_makespan``'s (eight datasets, every line holding
its original answer, so the orchestrator claims the longest first), on one simulated
GPU node (its batching model, at most 64 requests running); the orchestrator runs with
``--concurrency auto``:

* ``uninterrupted``: one ``orchestrator run`` to the end;
* ``SIGKILL at 40 %``: the same, SIGKILLed (its requests in flight) once 40 % of the
  items are done, and started again at once, to the end.

Makespan is first request to last answer on the server's simulated clock (idle time,
such as the restart, scaled back in), divided by the ideal schedule of the same server
(every request queued at t=0, longest answer first).

    .venv/bin/python benchmarks/bench_crash.py [--prompts 1500] [--time-scale 0.05]
        [--before DIR] [--json out.json]

``--before DIR`` also runs another checkout (e.g. ``git worktree add DIR main``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import subprocess
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import makespan_workload as workload
from bench_makespan import SERVER, Outcome, from_trace, orch, server_args
from common import REPO, SimServer, print_machine, print_table

from orchestrator.sim.config import SimConfig
from orchestrator.sim.offline import longest_first, schedule

#: The modelled GPU node of ``bench_makespan``, decoding at most this many at once.
MAX_RUNNING = 64
KILL_AT = 0.4


def _done(db: Path) -> int:
    try:
        with closing(sqlite3.connect(db, timeout=5)) as conn:
            return conn.execute("SELECT count(*) FROM items WHERE state = 'done'").fetchone()[0]
    except sqlite3.Error:
        return 0


def _run(repo: Path, db: Path, url: str, log: Any) -> subprocess.Popen[str]:
    return orch(
        repo, "--log-json", "--log-level", "info", "run", "--server", url,
        "--exit-when-done", "--db", str(db), "--grace", "0", "--concurrency", "auto",
        stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def one_run(
    name: str, work: Path, repo: Path, prompts: int, time_scale: float, *, kill: bool
) -> tuple[Outcome, dict[str, Any]]:
    """Enqueue the run file into a fresh database and run it to the end, SIGKILLed once
    at ``KILL_AT`` of the items done when ``kill``; the figures, and what the kill left."""
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    db, trace = work / f"{slug}.db", work / f"{slug}.trace.jsonl"
    for path in (db, trace):
        path.unlink(missing_ok=True)
    extra = (*server_args(time_scale, trace, work / "lengths.json"), "--max-running", "64")
    facts: dict[str, Any] = {}
    with SimServer(mean_tokens=64, extra=extra) as sim:
        enq = orch(
            repo, "enqueue", "--config", str(work / "run.toml"), "--db", str(db),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        if enq.wait() != 0:
            raise SystemExit(f"enqueue failed: {enq.stderr.read() if enq.stderr else ''}")
        started = time.monotonic()
        with open(work / f"{slug}.log", "w") as log:
            run = _run(repo, db, sim.url, log)
            if kill:
                while _done(db) < KILL_AT * prompts and run.poll() is None:
                    time.sleep(0.2)
                run.send_signal(signal.SIGKILL)
                run.wait()
                with closing(sqlite3.connect(db)) as conn:
                    facts["in_flight_at_kill"] = conn.execute(
                        "SELECT count(*) FROM items WHERE state = 'running'"
                    ).fetchone()[0]
                run = _run(repo, db, sim.url, log)
            code = run.wait()
        if code != 0:
            raise SystemExit(f"{name}: run exited {code}; see {work / f'{slug}.log'}")
        wall = time.monotonic() - started
        retracted = sim.stats()["batch"]["retracted"]
    return from_trace(name, trace, wall, retracted), facts


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--before", type=Path, help="also run this checkout's orchestrator")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", type=Path, help="keep data, databases, traces, logs here")
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    print_machine()
    with tempfile.TemporaryDirectory(prefix="bench-crash-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = workload.write(work, args.prompts)
        config = SimConfig(**SERVER, max_running=MAX_RUNNING)  # type: ignore[arg-type]
        ideal = schedule(config, longest_first(workload.requests(rows)))
        print(f"{len(rows):,} prompts; ideal {ideal.makespan:,.0f} s (simulated)", flush=True)
        repos = [("after", REPO)] + ([("before", args.before)] if args.before else [])
        table: list[list[str]] = []
        figures: list[dict[str, Any]] = []
        for label, repo in repos:
            for kill in (False, True):
                name = f"{label}, {'SIGKILL at 40 %' if kill else 'uninterrupted'}"
                outcome, facts = one_run(name, work, repo, len(rows), args.time_scale, kill=kill)
                ratio = outcome.makespan / ideal.makespan
                print(
                    f"{name}: {outcome.makespan:,.0f} s, {ratio:.2f}x ideal, "
                    f"{outcome.answers:,} answers, {outcome.wall:.0f} s wall {facts}",
                    flush=True,
                )
                table.append([
                    name, f"{outcome.makespan:,.0f}", f"{ratio:.2f}",
                    f"{outcome.tail:.1%}", str(facts.get("in_flight_at_kill", "-")),
                ])  # fmt: skip
                figures.append({"name": name, "makespan": outcome.makespan, "ratio": ratio,
                                "tail": outcome.tail, **facts})  # fmt: skip
        print_table(["run", "makespan s", "÷ ideal", "tail", "in flight at kill"], table)
        if args.json:
            doc = {"prompts": len(rows), "ideal": ideal.makespan, "runs": figures}
            args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
