"""``--concurrency auto`` against fixed concurrencies, on two continuous-batching servers.

Each server is the simulated server with its batching model on (a KV-cache budget, a
decode step that slows as the batch grows, prefill cost, retraction on overflow), one
small and one large. For each, a fixed set of prompts is queued in a fresh SQLite file
and worked on by a real ``orchestrator run`` process, once per fixed ``--concurrency``
and once with ``--concurrency auto``. A run stops when its items are done or after
``--run-limit`` seconds (the slow, low-concurrency runs).

Figures, per run: generated tokens per second over the whole run (first request sent to
last answer committed) and in its steady part (answers committed between the first 10 %
and the last 10 % of the run's answers), plus the server's own view (peak batch, peak
queue, retractions). The simulated servers run with a time scale, so the tokens per
second are of the compressed clock: compare them within a server, not with a GPU.

    .venv/bin/python benchmarks/bench_autoconcurrency.py [--items 2400] [--chart out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import PYTHON, REPO, SimServer

#: name -> simulated server options: small (a 60k-token cache, slower steps), large.
SERVERS: dict[str, list[str]] = {
    "small": [
        "--kv-tokens", "60000", "--step-time", "0.02", "--step-per-request", "0.0004",
        "--prefill-per-token", "0.00002", "--time-scale", "0.05",
    ],
    "large": [
        "--kv-tokens", "400000", "--max-running", "256", "--step-time", "0.015",
        "--step-per-request", "0.0001", "--prefill-per-token", "0.00001",
        "--time-scale", "0.1",
    ],
}  # fmt: skip

FIXED = (8, 16, 32, 64, 128, 256)
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "field", "light")


@dataclass
class Result:
    server: str
    concurrency: str
    answers: int
    tokens: int
    seconds: float
    tok_s: float
    steady_tok_s: float
    peak_batch: int
    peak_queue: int
    retracted: int
    final_cap: str


def write_prompts(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(150))
            row = {"id": f"p{i:06d}", "messages": [{"role": "user", "content": f"{i} {words}"}]}
            fh.write(json.dumps(row) + "\n")


def orch(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "ORCHESTRATOR_LOG_LEVEL": "warning"}
    return subprocess.Popen(
        [PYTHON, "-m", "orchestrator", *args], cwd=REPO, env=env, text=True, **kwargs
    )


def one_run(
    name: str, concurrency: str, prompts: Path, work: Path, items: int, limit: float
) -> Result:
    db = work / f"{name}-{concurrency}.db"
    with SimServer(mean_tokens=1000, extra=tuple(SERVERS[name])) as sim:
        enq = orch(
            "enqueue", str(prompts), "--dataset", "bench", "--max-tokens", "2048",
            "--db", str(db), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = enq.communicate()
        if enq.returncode != 0:
            raise RuntimeError(err)
        log_path = work / f"run-{name}-{concurrency}.log"
        with open(log_path, "w") as log:
            run = orch(
                "--log-json", "--log-level", "info", "run", "--server", sim.url,
                "--concurrency", concurrency, "--exit-when-done", "--db", str(db),
                "--grace", "0", stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                run.wait(limit)
            except subprocess.TimeoutExpired:
                run.send_signal(signal.SIGTERM)
                run.wait(30)
        batch = sim.stats()["batch"]
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT created_at - latency, created_at, completion_tokens FROM outputs "
            "ORDER BY created_at"
        ).fetchall()
    tokens = sum(r[2] for r in rows)
    seconds = rows[-1][1] - min(r[0] for r in rows) if rows else 0.0
    lo, hi = len(rows) // 10, len(rows) - len(rows) // 10
    steady = rows[lo:hi]
    window = steady[-1][1] - steady[0][1] if len(steady) > 1 else 0.0
    steady_tokens = sum(r[2] for r in steady[1:])
    final_cap = concurrency
    if concurrency == "auto":
        caps = [
            json.loads(line)
            for line in log_path.read_text().splitlines()
            if '"concurrency_changed"' in line
        ]
        final_cap = f"auto→{caps[-1]['new']}" if caps else "auto→8"
    return Result(
        server=name,
        concurrency=concurrency,
        answers=len(rows),
        tokens=tokens,
        seconds=seconds,
        tok_s=tokens / seconds if seconds else 0.0,
        steady_tok_s=steady_tokens / window if window else 0.0,
        peak_batch=batch["peak_running"],
        peak_queue=batch["peak_queued"],
        retracted=batch["retracted"],
        final_cap=final_cap,
    )


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SERVERS), figsize=(11, 4))
    for ax, name in zip(axes, SERVERS, strict=True):
        fixed = [r for r in results if r.server == name and r.concurrency != "auto"]
        auto = [r for r in results if r.server == name and r.concurrency == "auto"]
        xs = [int(r.concurrency) for r in fixed]
        ax.plot(xs, [r.steady_tok_s for r in fixed], "o-", label="fixed, steady")
        ax.plot(xs, [r.tok_s for r in fixed], "o--", alpha=0.6, label="fixed, whole run")
        for r in auto:
            ax.axhline(r.steady_tok_s, color="C2", label=f"auto, steady ({r.final_cap})")
            ax.axhline(r.tok_s, color="C2", ls="--", alpha=0.6, label="auto, whole run")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("--concurrency")
        ax.set_ylabel("generated tok/s (simulated clock)")
        ax.set_title(f"{name} server")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2400)
    parser.add_argument("--run-limit", type=float, default=60.0)
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--fixed", type=int, nargs="+", default=list(FIXED))
    parser.add_argument("--chart", type=Path, help="write a PNG chart here (needs matplotlib)")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--keep", type=Path, help="keep the databases and logs here")
    args = parser.parse_args()

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, args.items)
        for name in args.servers:
            for concurrency in [*map(str, args.fixed), "auto"]:
                started = time.monotonic()
                r = one_run(name, concurrency, prompts, work, args.items, args.run_limit)
                results.append(r)
                print(
                    f"{name:5} {r.final_cap:>9}: {r.answers:4} answers, {r.tok_s:8.0f} tok/s "
                    f"whole, {r.steady_tok_s:8.0f} steady; peak batch {r.peak_batch}, "
                    f"peak queue {r.peak_queue}, retracted {r.retracted} "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    print()
    print("| server | concurrency | answers | tok/s (whole run) | tok/s (steady) "
          "| peak batch | peak queue | retracted |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r.server} | {r.final_cap} | {r.answers} | {r.tok_s:,.0f} | "
            f"{r.steady_tok_s:,.0f} | {r.peak_batch} | {r.peak_queue} | {r.retracted} |"
        )
    print()
    for name in args.servers:
        fixed = [r for r in results if r.server == name and r.concurrency != "auto"]
        auto = next(r for r in results if r.server == name and r.concurrency == "auto")
        best = max(fixed, key=lambda r: r.tok_s)
        best_steady = max(fixed, key=lambda r: r.steady_tok_s)
        print(
            f"{name}: auto {auto.tok_s / best.tok_s:.1%} of the best fixed "
            f"(--concurrency {best.concurrency}) over the whole run, "
            f"{auto.steady_tok_s / best_steady.steady_tok_s:.1%} "
            f"(vs {best_steady.concurrency}) in the steady part"
        )
    if args.chart:
        chart(results, args.chart)
        print(f"chart: {args.chart}")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
