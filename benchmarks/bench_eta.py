"""ETA rehearsal: how far from the real finish is the ETA that ``status`` shows?

A run of four datasets whose answers differ tenfold in length (the simulated server cuts
each at its dataset's ``max_tokens``), one of them capped at a few requests, run to the
end by a real worker. Every ``--every`` seconds the status document is read as
``status`` reads it, and the predicted finish (now + ETA) is compared with the moment the
last answer was committed. The script's old way, items left over the average rate since
the start, is shown beside it.

    .venv/bin/python benchmarks/bench_eta.py --scale 1 --chart benchmarks/eta.png
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
from common import ORCH, REPO, SimServer, add_common_args, print_machine, print_table, workdir

from orchestrator.monitor.status import read as read_status
from orchestrator.store.reader import open_reader

# name, items (at --scale 1), max_tokens, concurrency cap. Claimed in this order: the
# short chat answers go first, which is what fools an extrapolation of the early pace.
DATASETS: tuple[tuple[str, int, int, int | None], ...] = (
    ("chat", 6000, 40, None),
    ("code", 1500, 300, None),
    ("agentic", 400, 1600, 6),
    ("math", 1000, 900, None),
)
MARKS = (0.1, 0.25, 0.5, 0.75, 0.9)


def write_run(work: Path, scale: float, cap: int) -> Path:
    lines = ["[defaults]", 'model = "sim-model"', ""]
    for name, n, max_tokens, capped in DATASETS:
        path = work / f"{name}.jsonl"
        with path.open("wb") as fh:
            for i in range(max(1, int(n * scale))):
                fh.write(orjson.dumps({"id": f"{name}-{i}", "prompt": f"{name} task {i}"}))
                fh.write(b"\n")
        lines += ["[[dataset]]", f'name = "{name}"', f'file = "{path}"', 'format = "prompt"']
        lines += [f"max_tokens = {max_tokens}"]
        if cap and capped:
            lines += [f"concurrency = {capped if cap < 0 else cap}"]
        lines.append("")
    run = work / "run.toml"
    run.write_text("\n".join(lines))
    return run


def observe(db: Path, worker: subprocess.Popen[bytes], every: float) -> list[dict[str, Any]]:
    """Status as ``status`` sees it, every few seconds, until the worker exits."""
    seen: list[dict[str, Any]] = []
    while worker.poll() is None:
        time.sleep(every)
        reader = open_reader(str(db))
        if reader is None:
            continue
        with reader:
            doc = read_status(reader)
        totals = doc["totals"]
        left = totals["counts"]["pending"] + totals["counts"]["running"]
        rate = totals["overall"]["requests_per_s"]
        seen.append(
            {
                "at": doc["generated_at"],
                "progress": totals["progress"],
                "eta": totals["eta_seconds"],
                "naive": left / rate if rate else None,
                "slots": totals["eta_slots"],
                "datasets": {d["name"]: d["eta_seconds"] for d in doc["datasets"]},
            }
        )
    return seen


def finish_time(db: Path) -> tuple[float, float]:
    reader = open_reader(str(db))
    assert reader is not None
    with reader:
        doc = read_status(reader)
    totals = doc["totals"]["overall"]
    return float(totals["started_at"]), float(totals["last_done_at"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every dataset's size")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--cap",
        type=int,
        default=-1,
        help="concurrency cap of the capped dataset: -1 as listed, 0 none",
    )
    parser.add_argument("--every", type=float, default=2.0, help="seconds between readings")
    parser.add_argument("--chart", type=Path, help="write a PNG of the predicted finish")
    parser.add_argument(
        "--readings",
        type=Path,
        help="report (and chart) a run kept with --workdir, from its readings.json",
    )
    add_common_args(parser, pinning=False)
    args = parser.parse_args()
    if args.readings:
        kept = orjson.loads(args.readings.read_bytes())
        report(kept["readings"], kept["start"], kept["end"])
        if args.chart:
            chart(kept["readings"], kept["start"], kept["end"], args.chart)
        return
    print_machine()
    with workdir(args.workdir) as work:
        db = work / "eta.db"
        run = write_run(work, args.scale, args.cap)
        subprocess.run([*ORCH, "enqueue", "--config", str(run), "--db", str(db)], check=True)
        sim = SimServer(mean_tokens=800, latency=0.05, extra=("--per-token", "0.0005"))
        with sim:
            argv = [*ORCH, "run", "--server", sim.url, "--db", str(db)]
            argv += ["--concurrency", str(args.concurrency), "--exit-when-done"]
            with open(work / "worker.log", "wb") as log:
                worker = subprocess.Popen(
                    argv, cwd=REPO, stdout=log, stderr=log, stdin=subprocess.DEVNULL
                )
                seen = observe(db, worker, args.every)
            if worker.returncode != 0:
                raise SystemExit(f"worker exited {worker.returncode}; see {work}/worker.log")
        start, end = finish_time(db)
        (work / "readings.json").write_bytes(
            orjson.dumps({"start": start, "end": end, "readings": seen})
        )
    report(seen, start, end)
    if args.chart:
        chart(seen, start, end, args.chart)


def _errors(entry: dict[str, Any], key: str, start: float, end: float) -> tuple[float, float]:
    """Error of the predicted finish, as a share of the run's length and of the time left."""
    predicted = entry["at"] + entry[key]
    return (predicted - end) / (end - start), (predicted - end) / max(end - entry["at"], 1e-9)


def report(seen: list[dict[str, Any]], start: float, end: float) -> None:
    length = end - start
    print(f"run: {length:.0f} s from first request to last answer, {len(seen)} readings\n")
    rows = []
    for mark in MARKS:
        at = start + mark * length
        entry = min(seen, key=lambda e: abs(e["at"] - at))
        row: list[Any] = [f"{mark:.0%}", f"{entry['progress']:.0%}"]
        for key in ("eta", "naive"):
            if entry[key] is None:
                row += ["-", "-"]
                continue
            of_run, of_left = _errors(entry, key, start, end)
            row += [f"{of_run:+.1%}", f"{of_left:+.1%}"]
        rows.append(row)
    print_table(
        ["elapsed", "items done", "ETA err/run", "ETA err/left", "naive err/run", "naive err/left"],
        rows,
    )
    window = [e for e in seen if start + 0.1 * length <= e["at"] <= start + 0.9 * length]
    for key in ("eta", "naive"):
        worst = max(
            (abs(_errors(e, key, start, end)[1]) for e in window if e[key] is not None),
            default=float("nan"),
        )
        print(f"worst error of {key} against the time left, from 10 % to 90 %: {worst:.1%}")


def chart(seen: list[dict[str, Any]], start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = [(e["at"] - start) / 60 for e in seen]
    for key, label in (("eta", "status ETA"), ("naive", "items left / average rate")):
        ys = [(e["at"] + e[key] - start) / 60 if e[key] is not None else None for e in seen]
        ax.plot(xs, ys, label=label)
    ax.axhline((end - start) / 60, color="black", linestyle="--", label="real finish")
    # Within 15 % of the time left: the band narrows to the real finish.
    left = [(end - e["at"]) / 60 for e in seen]
    real = (end - start) / 60
    ax.fill_between(
        xs,
        [real - 0.15 * x for x in left],
        [real + 0.15 * x for x in left],
        color="grey",
        alpha=0.2,
        label="±15 % of the time left",
    )
    ax.set_xlabel("minutes into the run")
    ax.set_ylabel("predicted finish (minutes)")
    ax.set_title("ETA rehearsal: datasets of different answer lengths")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"chart: {out}")


if __name__ == "__main__":
    main()
