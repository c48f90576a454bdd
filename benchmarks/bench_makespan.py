"""Makespan of an EAGLE-3 regeneration run: the orchestrator against the ideal schedule.

What decides when a user's data is ready is how well the run keeps the server busy with
useful work from the first request to the last. One workload (``makespan_workload``:
eight datasets in the proportions of an 83,288-prompt run, answer lengths per dataset
from the simulated server's length model), one simulated server sized like one GPU node
(about 850 generated tok/s at full batch, a KV cache for about 100 average requests),
and four ways through it:

* ``orchestrator``: every dataset enqueued from one run file, ``orchestrator run
  --concurrency auto`` (real subprocesses, a fresh SQLite file);
* ``one after another``: datasets in turn, each at a fixed concurrency (150 for short
  prompts, 32 for long ones), by a plain aiohttp loop: the way it is done without a queue;
* ``ideal``: the server's batching model stepped offline (``orchestrator.sim.offline``),
  every request queued at t=0, longest answer first;
* ``lower bound``: total generated tokens over the fastest rate a step of the ideal
  schedule decoded at.

Each HTTP strategy gets its own server, which writes every decode step to a trace on its
simulated clock (``--trace``): the makespan is first request to last answer on that
clock, so a busy machine slows a run down without changing its figure. The tail is the
time from 99 % of the answers done to the last, as a share of the makespan.

    .venv/bin/python benchmarks/bench_makespan.py [--prompts 3000] [--time-scale 0.1]
        [--strategies orchestrator sequential] [--json out.json] [--keep DIR]
        [--server-models default vllm vllm-256 sglang] [--answers with without]

``--server-models`` sweeps the server's scheduling (``SERVER_MODELS``: SGLang's admission
or vLLM's, a batch cap, whose metric names) and ``--answers`` whether the lines hold
their original answers (without them, lengths are predicted per dataset); each pair gets
its own ideal schedule, on that server, and a table, then one summary of ÷ ideal.

``--run-arg`` passes options to ``orchestrator run`` (e.g. ``--run-arg=--concurrency=256``),
``--repo DIR`` runs another checkout's orchestrator against the same server and data,
``--label`` names such a run in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import makespan_workload as workload
from common import PYTHON, REPO, SimServer, print_machine, print_table

from orchestrator.sim.config import SimConfig
from orchestrator.sim.offline import Schedule, longest_first, schedule, tail_share

#: One GPU node: 850 tok/s at a batch of 100, a cache that holds about 100 requests once
#: the admission estimate has settled (SGLang reserves part of each max_tokens).
SERVER = {
    "kv_tokens": 200_000,
    "step_time": 0.03,
    "step_per_request": 0.000876,
    "prefill_per_token": 0.00002,
}
#: The servers the sweep runs on (``--server-models``): the same node, scheduled three
#: ways. ``default``: SGLang's admission (room for a share of each request's max_tokens),
#: no batch cap, SGLang's metric names. ``vllm``: vLLM's v1 scheduler, 64 sequences at
#: most (``--max-num-seqs``), first come first served while the prompt fits the cache,
#: the newest preempted when it overflows, vLLM's metric names; ``vllm-256``: the same at
#: vLLM's default of 256 sequences, where the cache, not the cap, bounds the batch.
#: ``sglang``: SGLang with ``--max-running-requests 64`` and its own retraction (the
#: fewest generated first, to the back of the queue).
SERVER_MODELS: dict[str, dict[str, Any]] = {
    "default": {},
    "vllm": {"max_running": 64, "admission": "fifo", "metric_names": "vllm"},
    "vllm-256": {"max_running": 256, "admission": "fifo", "metric_names": "vllm"},
    "sglang": {
        "max_running": 64,
        "admission": "reserve",
        "retraction": "sglang",
        "metric_names": "sglang",
    },
}
SHORT_CONCURRENCY, LONG_CONCURRENCY = 150, 32
BIN_SECONDS = 10.0


@dataclass
class Outcome:
    """One strategy's figures, on the simulated clock."""

    name: str
    makespan: float
    tail: float
    answers: int
    tokens: int
    wall: float = 0.0
    retracted: int = 0
    timeline: list[tuple[float, float, float]] = field(default_factory=list)
    """Per ``BIN_SECONDS`` of simulated time: (start, mean running, generated tok/s)."""


def server_args(time_scale: float, lengths: Path, model: str) -> list[str]:
    """The simulated server's options for one of ``SERVER_MODELS`` (its trace aside)."""
    options = [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_MODELS[model].items()]
    return [
        *options,
        "--kv-tokens", str(SERVER["kv_tokens"]), "--step-time", str(SERVER["step_time"]),
        "--step-per-request", str(SERVER["step_per_request"]),
        "--prefill-per-token", str(SERVER["prefill_per_token"]),
        "--time-scale", str(time_scale), "--length-model", str(lengths),
    ]  # fmt: skip


def from_trace(name: str, trace: Path, wall: float, retracted: int) -> Outcome:
    """A strategy's figures from its server's trace."""
    finished: list[float] = []
    tokens = 0
    bins: dict[int, list[float]] = {}
    previous = 0.0
    for raw in trace.read_text().splitlines():
        step = json.loads(raw)
        t = step["t"]
        tokens += step["batch"]
        finished.extend([t] * step["finished"])
        b = bins.setdefault(int(t // BIN_SECONDS), [0.0, 0.0])
        b[0] += step["batch"] * (t - previous)  # request-seconds
        b[1] += step["batch"]
        previous = t
    makespan = max(finished) if finished else 0.0
    timeline = [
        (k * BIN_SECONDS, v[0] / BIN_SECONDS, v[1] / BIN_SECONDS) for k, v in sorted(bins.items())
    ]
    return Outcome(
        name,
        makespan,
        tail_share(finished, makespan),
        len(finished),
        tokens,
        wall,
        retracted,
        timeline,
    )


def from_schedule(name: str, result: Schedule) -> Outcome:
    bins: dict[int, list[float]] = {}
    previous = 0.0
    for t, batch, _ in result.steps:
        b = bins.setdefault(int(t // BIN_SECONDS), [0.0, 0.0])
        b[0] += batch * (t - previous)
        b[1] += batch
        previous = t
    timeline = [
        (k * BIN_SECONDS, v[0] / BIN_SECONDS, v[1] / BIN_SECONDS) for k, v in sorted(bins.items())
    ]
    return Outcome(
        name,
        result.makespan,
        tail_share(result.finished, result.makespan),
        len(result.finished),
        result.generated,
        retracted=result.retracted,
        timeline=timeline,
    )


def orch(repo: Path, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "ORCHESTRATOR_LOG_LEVEL": "warning", "PYTHONPATH": str(repo)}
    return subprocess.Popen(
        [PYTHON, "-m", "orchestrator", *args], cwd=repo, env=env, text=True, **kwargs
    )


def run_orchestrator(
    name: str, work: Path, repo: Path, server: list[str], run_args: list[str], run_file: str
) -> Outcome:
    """Enqueue the run file into a fresh database, then one ``orchestrator run`` to the end."""
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    db = work / f"{slug}.db"
    trace = work / f"{slug}.trace.jsonl"
    config = work / f"{slug}.toml"
    config.write_text(run_file)
    for path in (db, trace):
        path.unlink(missing_ok=True)
    with SimServer(mean_tokens=64, extra=(*server, "--trace", str(trace))) as sim:
        enq = orch(
            repo, "enqueue", "--config", str(config), "--db", str(db),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = enq.communicate()
        if enq.returncode != 0:
            raise SystemExit(f"enqueue failed: {err}")
        log_path = work / f"{slug}.log"
        started = time.monotonic()
        with open(log_path, "w") as log:
            run = orch(
                repo, "--log-json", "--log-level", "info", "run", "--server", sim.url,
                "--exit-when-done", "--db", str(db), "--grace", "0", *run_args,
                stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            code = run.wait()
        wall = time.monotonic() - started
        if code != 0:
            raise SystemExit(f"run exited {code}; see {log_path}")
        retracted = sim.stats()["batch"]["retracted"]
    return from_trace(name, trace, wall, retracted)


async def _one_after_another(url: str, rows: list[workload.Line]) -> None:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for d in workload.DATASETS:
            gate = asyncio.Semaphore(LONG_CONCURRENCY if d.long else SHORT_CONCURRENCY)

            async def ask(line: workload.Line, gate: asyncio.Semaphore = gate) -> None:
                body = {
                    "model": "sim-model",
                    "messages": line.messages,
                    "max_tokens": line.max_tokens,
                    "metadata": {"dataset": line.dataset},
                }
                async with gate, session.post(url + "/v1/chat/completions", json=body) as resp:
                    resp.raise_for_status()
                    await resp.read()

            await asyncio.gather(*(ask(r) for r in rows if r.dataset == d.name))


def run_sequential(work: Path, rows: list[workload.Line], server: list[str]) -> Outcome:
    trace = work / "sequential.trace.jsonl"
    trace.unlink(missing_ok=True)
    with SimServer(mean_tokens=64, extra=(*server, "--trace", str(trace))) as sim:
        started = time.monotonic()
        asyncio.run(_one_after_another(sim.url, rows))
        wall = time.monotonic() - started
        retracted = sim.stats()["batch"]["retracted"]
    return from_trace("one after another (150 / 32)", trace, wall, retracted)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument(
        "--strategies",
        nargs="*",
        default=["orchestrator", "sequential"],
        choices=["orchestrator", "sequential", "capped", "fixed"],
        help="capped: the orchestrator with the per-dataset caps 150 / 32 in the run file; "
        "fixed: the orchestrator at --concurrency 256",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="also run this checkout's orchestrator (e.g. `git archive main | tar -x -C DIR`)",
    )
    parser.add_argument("--run-arg", action="append", default=[], help="an option for run")
    parser.add_argument("--repo", type=Path, default=REPO, help="the orchestrator to run")
    parser.add_argument("--label", default="orchestrator, --concurrency auto")
    parser.add_argument("--json", type=Path, help="write every figure and timeline here")
    parser.add_argument(
        "--levers", action="store_true", help="also each claim order's own cost, offline"
    )
    parser.add_argument("--keep", type=Path, help="keep data, databases, traces, logs here")
    parser.add_argument(
        "--server-models",
        nargs="+",
        default=["default"],
        choices=list(SERVER_MODELS),
        help="the servers to run on (SERVER_MODELS)",
    )
    parser.add_argument(
        "--answers",
        nargs="+",
        default=["with"],
        choices=["with", "without"],
        help="lines with their original answers, without (bare prompts), or both",
    )
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    print_machine()
    run_args = [a for arg in args.run_arg for a in arg.split("=", 1)]
    if "--concurrency" not in run_args:
        run_args += ["--concurrency", "auto"]
    sweeps = []
    with tempfile.TemporaryDirectory(prefix="bench-makespan-") as tmp:
        root = args.keep or Path(tmp)
        for model in args.server_models:
            for answers in args.answers:
                work = root / f"{model}-{answers}"
                work.mkdir(parents=True, exist_ok=True)
                sweeps.append(sweep(args, work, model, answers == "with", run_args))
    if len(sweeps) > 1:
        print("\n÷ ideal, each server model:")
        summary(sweeps)
    if args.json:
        args.json.write_text(json.dumps({"sweeps": sweeps}))
        print(f"figures: {args.json}")
    return 0


def sweep(
    args: argparse.Namespace, work: Path, model: str, answers: bool, run_args: list[str]
) -> dict[str, Any]:
    """Every strategy on one server model, the lines with or without their answers."""
    rows = workload.write(work, args.prompts, answers=answers)
    config = SimConfig(**SERVER, **SERVER_MODELS[model])
    ideal = schedule(config, longest_first(workload.requests(rows)))
    outcomes = [from_schedule("ideal (offline, longest first)", ideal)]
    lower = ideal.generated / ideal.peak_rate
    print(
        f"\nserver model {model}, lines {'with' if answers else 'without'} their answers: "
        f"{len(rows):,} prompts, {ideal.generated:,} tokens to generate; ideal "
        f"{ideal.makespan:,.0f} s, lower bound {lower:,.0f} s (simulated)",
        flush=True,
    )
    if args.levers:
        offline_levers(rows, config, ideal)
    server = server_args(args.time_scale, work / "lengths.json", model)
    runs = [(s, args.repo) for s in args.strategies]
    if args.before is not None:
        runs.insert(0, ("before", args.before))
    for strategy, repo in runs:
        started = time.monotonic()
        if strategy == "sequential":
            outcome = run_sequential(work, rows, server)
        else:
            name, extra, capped = _variant(strategy, args.label)
            run_file = workload.run_file(caps=capped)
            outcome = run_orchestrator(name, work, repo, server, [*run_args, *extra], run_file)
        outcomes.append(outcome)
        print(
            f"{outcome.name}: {outcome.makespan:,.0f} s "
            f"({outcome.makespan / ideal.makespan:.3f} x ideal), tail {outcome.tail:.1%}, "
            f"{outcome.answers:,} answers, {outcome.retracted} retracted, "
            f"{time.monotonic() - started:.0f} s wall",
            flush=True,
        )
    report(outcomes, ideal, lower)
    return {
        "server_model": model,
        "answers": answers,
        "prompts": len(rows),
        "tokens": ideal.generated,
        "lower_bound": lower,
        "time_scale": args.time_scale,
        "outcomes": [o.__dict__ for o in outcomes],
    }


def summary(sweeps: list[dict[str, Any]]) -> None:
    """One row per server model and lines with or without answers: each run ÷ ideal."""
    names = [o["name"] for o in sweeps[0]["outcomes"][1:]]
    rows = []
    for doc in sweeps:
        ideal = doc["outcomes"][0]["makespan"]
        by_name = {o["name"]: o for o in doc["outcomes"]}
        cells = []
        for name in names:
            o = by_name.get(name)
            cells.append(f"{o['makespan'] / ideal:.3f} ({o['retracted']})" if o else "-")
        answers = "with" if doc["answers"] else "without"
        rows.append([doc["server_model"], answers, f"{ideal:,.0f}", *cells])
    header = ["server model", "answers in lines", "ideal s"]
    print_table([*header, *(f"{n} (retracted)" for n in names)], rows)


def offline_levers(rows: list[workload.Line], config: SimConfig, ideal: Schedule) -> None:
    """Each order's own cost: the offline server fed by a client that keeps 120 requests
    at it (running plus a queue) and sends the next the moment one finishes, no HTTP."""
    ratio = {d.name: d.ratio for d in workload.DATASETS}
    means = {d.name: d.mean for d in workload.DATASETS}
    requests = workload.requests(rows)
    scouts = [i for d in workload.DATASETS for i in _first(rows, d.name, 16)]

    def predicted(i: int, scale: bool = True) -> float:
        r = rows[i]
        return min(r.original * (ratio[r.dataset] if scale else 1.0), r.max_tokens)

    by_work: dict[int, float] = {}
    for d in workload.DATASETS:
        mine = sorted((i for i, r in enumerate(rows) if r.dataset == d.name), key=predicted)
        total, done = sum(predicted(i) for i in mine), 0.0
        for i in reversed(mine):
            by_work[i] = done / total
            done += predicted(i)
    orders = {
        "input order (enqueue order, dataset by dataset)": list(range(len(rows))),
        "the long-answer datasets first, input order within": sorted(
            range(len(rows)), key=lambda i: -means[rows[i].dataset]
        ),
        "longest first by the line's own answer (no scale)": sorted(
            range(len(rows)), key=lambda i: -predicted(i, scale=False)
        ),
        "longest first, scaled per dataset (the default)": sorted(
            range(len(rows)), key=lambda i: -predicted(i)
        ),
        "  the same after 16 scouts per dataset in input order": scouts
        + sorted(set(range(len(rows))) - set(scouts), key=lambda i: -predicted(i)),
        "datasets mixed in proportion to their work, longest first within": sorted(
            range(len(rows)), key=lambda i: by_work[i]
        ),
        "longest first by the true length": sorted(range(len(rows)), key=lambda i: -rows[i].tokens),
    }
    table = []
    for name, order in orders.items():
        result = schedule(config, [requests[i] for i in order], in_flight=120)
        table.append(
            [
                name,
                f"{result.makespan:,.0f}",
                f"{result.makespan / ideal.makespan:.3f}",
                f"{tail_share(result.finished, result.makespan):.1%}",
                f"{result.generated / len(result.steps):.0f}",
            ]
        )
    print()
    print_table(
        ["order (offline, 120 in flight)", "makespan s", "÷ ideal", "tail", "mean batch"], table
    )


def _first(rows: list[workload.Line], dataset: str, n: int) -> list[int]:
    return [i for i, r in enumerate(rows) if r.dataset == dataset][:n]


def _variant(strategy: str, label: str) -> tuple[str, list[str], bool]:
    """A strategy's name, its extra ``run`` options, and whether the run file has caps."""
    if strategy == "capped":
        return f"{label}, caps 150 / 32", [], True
    if strategy == "fixed":
        return "orchestrator, --concurrency 256", ["--concurrency", "256"], False
    if strategy == "before":
        return "before (--before DIR), --concurrency auto", [], False
    return label, [], False


def report(outcomes: list[Outcome], ideal: Schedule, lower: float) -> None:
    sequential = next((o for o in outcomes if o.name.startswith("one after")), None)
    rows = []
    for o in outcomes:
        rows.append(
            [
                o.name,
                f"{o.makespan:,.0f}",
                f"{o.makespan / ideal.makespan:.3f}",
                f"{o.makespan / lower:.3f}",
                f"{sequential.makespan / o.makespan:.2f}x" if sequential else "-",
                f"{o.tail:.1%}",
                f"{o.tokens / o.makespan:,.0f}" if o.makespan else "-",
                f"{o.answers:,}",
                str(o.retracted),
                f"{o.wall:,.0f}" if o.wall else "-",
            ]
        )
    rows.append(["lower bound (tokens / peak rate)", f"{lower:,.0f}", "", "1.000", *[""] * 6])
    print()
    print_table(
        [
            "strategy", "makespan s", "÷ ideal", "÷ lower bound", "speed-up over one after another",
            "tail", "tok/s", "answers", "retracted", "wall s",
        ],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
