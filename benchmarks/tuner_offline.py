"""``--concurrency auto``'s controller against a server's batching model, offline.

The makespan workload (``makespan_workload``), sent longest predicted answer first by a
client that keeps the controller's cap of requests at the server and looks at its
figures (running, queued, cache usage, retractions) every ``--look`` simulated seconds,
as the worker looks at ``/metrics``; the same at a fixed 256 for comparison. No HTTP
and no clock: a sweep of caches and caps runs in seconds, which is what lets it show
how the controller behaves where the server preempts often.

    .venv/bin/python benchmarks/tuner_offline.py [--prompts 1500] [--look 1 10]
        [--server-models vllm vllm-256] [--kv-tokens 200000 120000 80000]

``--look 10`` is what a run of ``bench_makespan.py`` at clock ×0.1 sees (one look a
real second); 1 is a run on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import makespan_workload as workload
from bench_makespan import SERVER, SERVER_MODELS
from common import print_table

from orchestrator.inference.autoconcurrency import Controller, Sample
from orchestrator.sim.batching import BatchModel, Seq
from orchestrator.sim.config import SimConfig
from orchestrator.sim.offline import Request, longest_first, schedule


def drive(
    config: SimConfig, requests: Sequence[Request], look: float, fixed: int | None = None
) -> tuple[float, int, float, int]:
    """Makespan, retractions, mean running and the lowest cap a back-off set (0: none)."""
    model = BatchModel(config)
    controller = Controller()
    cap = fixed or controller.cap
    lowest = 0
    sent = at_server = 0
    clock = area = 0.0
    next_look = look
    while sent < len(requests) or model.busy:
        while sent < len(requests) and at_server < cap:
            r = requests[sent]
            model.add(Seq(r.prompt, r.tokens, r.limit))
            sent += 1
            at_server += 1
        seconds, batch, finished = model.step()
        clock += seconds
        area += batch * seconds
        at_server -= len(finished)
        if fixed is None and clock >= next_look:
            next_look = clock + look
            sample = Sample(
                elapsed=look,
                in_flight=at_server,
                queued=len(model.queue),
                running=len(model.running),
                kv_usage=model.usage,
                retractions=model.retracted,
            )
            change = controller.update(sample)
            if change is not None:
                cap = change.new
                if change.reason in ("queue", "retractions"):
                    lowest = min(lowest or cap, cap)
    return clock, model.retracted, area / clock, lowest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--look", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument(
        "--server-models", nargs="+", default=["vllm", "vllm-256"], choices=list(SERVER_MODELS)
    )
    parser.add_argument("--kv-tokens", type=int, nargs="+", default=[200_000, 120_000, 80_000])
    args = parser.parse_args()
    rows = list(workload.lines(args.prompts))
    requests = workload.requests(rows)
    ratio = {d.name: d.ratio for d in workload.DATASETS}

    def predicted(i: int) -> float:
        return min(rows[i].original * ratio[rows[i].dataset], rows[i].max_tokens)

    ordered = [requests[i] for i in sorted(range(len(rows)), key=lambda i: -predicted(i))]
    table = []
    for model in args.server_models:
        for kv in args.kv_tokens:
            config = SimConfig(**{**SERVER, "kv_tokens": kv}, **SERVER_MODELS[model])
            ideal = schedule(config, longest_first(requests)).makespan
            row = [model, f"{kv:,}", f"{ideal:,.0f}"]
            for look in args.look:
                makespan, retracted, running, lowest = drive(config, ordered, look)
                row.append(f"{makespan / ideal:.3f} ({retracted}; {running:.1f}; {lowest})")
            makespan, retracted, running, _ = drive(config, ordered, 1.0, fixed=256)
            row.append(f"{makespan / ideal:.3f} ({retracted}; {running:.1f})")
            table.append(row)
    looks = [
        f"auto, a look every {look:g} s (retracted; running; lowest cap)" for look in args.look
    ]
    print_table(["server model", "KV tokens", "ideal s", *looks, "fixed 256"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
