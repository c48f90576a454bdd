"""Usable turns per ``--regenerate`` mode on simulated agentic traces.

Each mode (``last``, ``all``, ``each``) regenerates the same software-engineering traces
(``orchestrator.sim.traces``: tool calls and their results, then a final answer)
through the real commands: ``enqueue``, ``run`` against the simulated server, and
``export --per-turn --exclude-flag tool_mismatch``, whose rows are the turns a draft
model can train on (``--per-turn`` alone: every turn generated). The simulated server
calls the first tool offered on a fraction of requests (``--tool-call-rate``) and
answers in words otherwise, so a regenerated turn rarely makes the recorded calls:
``all`` stops a trace there (flagged ``tool_mismatch``), ``each`` asks every turn
against the recorded history. Every exported answer is checked against the server's
answer to the history it holds (``orchestrator.sim.answer_matches``).

    python benchmarks/bench_regenerate_modes.py --traces 200
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from common import ORCH, SimServer, print_machine, print_table, workdir

from orchestrator.items.conversation import targets
from orchestrator.sim import answer_matches
from orchestrator.sim.traces import swe_traces

MODES = ("last", "all", "each")


def orch(*args: str) -> str:
    """Run one command; its output, or stop with its error."""
    done = subprocess.run([*ORCH, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"orchestrator {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def exported(db: Path, out: Path, mode: str, *extra: str) -> list[dict[str, Any]]:
    orch("export", str(out), "--db", str(db), "--dataset", mode, "--provenance", *extra)
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def answered(row: dict[str, Any]) -> int:
    """The assistant turns a row holds after its first user message: those generated."""
    seen_user, count = False, 0
    for message in row["messages"]:
        seen_user = seen_user or message["role"] == "user"
        count += seen_user and message["role"] == "assistant"
    return count


def checked(rows: list[dict[str, Any]]) -> int:
    """Rows whose last message is the server's answer to the messages before it."""
    return sum(answer_matches(r["messages"][:-1], r["messages"][-1]) for r in rows)


def measure(work: Path, traces: list[dict[str, Any]], rate: float) -> list[list[Any]]:
    path = work / "traces.jsonl"
    path.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in traces))
    db = work / "modes.db"
    db.unlink(missing_ok=True)
    table = []
    with SimServer(mean_tokens=32, extra=("--tool-call-rate", str(rate))) as sim:
        for mode in MODES:
            orch("enqueue", str(path), "--dataset", mode, "--regenerate", mode, "--db", str(db))
            start = time.perf_counter()
            orch("run", "--server", sim.url, "--db", str(db), "--dataset", mode, "--exit-when-done")
            seconds = time.perf_counter() - start
            rows = exported(db, work / f"{mode}.jsonl", mode)
            turns = exported(db, work / f"{mode}.turns.jsonl", mode, "--per-turn")
            usable = exported(
                db,
                work / f"{mode}.usable.jsonl",
                mode,
                "--per-turn",
                "--exclude-flag",
                "tool_mismatch",
            )
            stopped = [r for r in rows if "tool_mismatch" in r["flags"]]
            at = Counter(answered(r) for r in stopped)
            table.append(
                [
                    mode,
                    len(rows),
                    len(turns),
                    len(stopped),
                    ", ".join(f"{k}: {n}" for k, n in sorted(at.items())) or "-",
                    len(usable),
                    checked(turns),
                    f"{seconds:.1f}",
                ]
            )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-call-rate", type=float, default=0.5)
    parser.add_argument("--workdir", type=Path, help="keep the files here")
    args = parser.parse_args(argv)
    print_machine()
    traces = swe_traces(args.traces, args.seed)
    held = sum(len(targets(t["messages"])) for t in traces)
    print(
        f"{len(traces)} traces, {held} assistant turns to regenerate "
        f"(2 to 6 tool-call turns and a final answer each); tool call rate {args.tool_call_rate}"
    )
    with workdir(args.workdir) as work:
        table = measure(work, traces, args.tool_call_rate)
    print_table(
        [
            "mode",
            "rows",
            "turns generated",
            "stopped tool_mismatch",
            "stopped after turns",
            "usable turns",
            "answers checked",
            "run s",
        ],
        table,
    )
    print(
        "usable turns: export --per-turn --exclude-flag tool_mismatch rows; answers checked: "
        "exported turns whose answer is the server's to the history the row holds"
    )


if __name__ == "__main__":
    main()
