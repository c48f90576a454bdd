"""The chart of ``bench_makespan.py --json FILE``: the server's running requests and
generated tokens per second over the simulated time, one line per strategy.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/plot_makespan.py FIGURES.json docs/img/makespan.png [--skip TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figures", type=Path, help="the JSON that bench_makespan.py wrote")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument(
        "--sweep", type=int, default=0, help="which server model and answers (in run order)"
    )
    parser.add_argument(
        "--skip", action="append", default=[], help="leave out strategies whose name has this"
    )
    args = parser.parse_args()
    doc = json.loads(args.figures.read_text())
    doc = doc.get("sweeps", [doc])[args.sweep]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (running, tokens) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    shown = [o for o in doc["outcomes"] if not any(text in o["name"] for text in args.skip)]
    for n, outcome in enumerate(shown):
        timeline = outcome["timeline"]
        if not timeline:
            continue
        t = [row[0] / 60 for row in timeline]
        label = f"{outcome['name']}: {outcome['makespan'] / 60:,.1f} min"
        style = {"color": f"C{n}", "lw": 1.2, "alpha": 0.9}
        running.plot(t, [row[1] for row in timeline], label=label, **style)
        tokens.plot(t, [row[2] for row in timeline], **style)
        for ax in (running, tokens):
            ax.axvline(outcome["makespan"] / 60, color=f"C{n}", ls=":", lw=0.8)
    lower = doc["lower_bound"] / 60
    tokens.axvline(lower, color="grey", ls="--", lw=0.8, label=f"lower bound: {lower:,.1f} min")
    running.set_ylabel("running requests")
    tokens.set_ylabel("generated tok/s")
    tokens.set_xlabel("simulated minutes since the first request")
    running.set_title(
        f"{doc['prompts']:,} prompts, {doc['tokens']:,} tokens, one simulated GPU node "
        "(10 s bins; dotted: each strategy's last answer)",
        fontsize=10,
    )
    running.legend(fontsize=8, loc="lower center")
    tokens.legend(fontsize=8, loc="lower center")
    for ax in (running, tokens):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"chart: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
