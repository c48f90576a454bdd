"""``run --batch-api`` against the simulated provider, its worker SIGKILLed again and again.

The prompts go through the simulated Batch API (``orchestrator sim-server``, which counts
on its side every request submitted and billed); the worker is SIGKILLed at a random
moment ``--kills`` times and started again each time, then run to the end. Measured:

* requests submitted twice (the provider's ``duplicate_requests``) and items lost (not
  done at the end): both must be 0;
* the export against an online run's of the same prompts: byte-identical;
* requests and bytes per batch;
* the run's own polling: looks at a batch per hour of the batch's life;
* the time from the provider's completion of a batch to the last of its answers being
  in the database.

    python benchmarks/bench_batch_api.py --items 10000 --kills 10
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import ORCH, SimServer, print_machine, print_table, workdir, write_prompts


def orch(*args: str) -> str:
    done = subprocess.run([*ORCH, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"orchestrator {args[0]} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def provider_batches(url: str) -> dict[str, dict[str, Any]]:
    """Every batch the provider holds, by id."""
    found: dict[str, dict[str, Any]] = {}
    after = ""
    while True:
        page = get(f"{url}/v1/batches?limit=100" + (f"&after={after}" if after else ""))
        found |= {b["id"]: b for b in page["data"]}
        if not page.get("has_more") or not page["data"]:
            return found
        after = page["data"][-1]["id"]


def run_killed(db: Path, url: str, run_args: list[str], kills: int, seed: int) -> float:
    """The run, SIGKILLed ``kills`` times, then to the end; its wall seconds."""
    rng = random.Random(seed)
    started = time.monotonic()
    for _ in range(kills):
        proc = subprocess.Popen(
            [*ORCH, "run", *run_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(1.0, 8.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with open(db.parent / "final.log", "w") as log:
        done = subprocess.run([*ORCH, "--log-json", "run", *run_args], stderr=log)
    if done.returncode != 0:
        raise SystemExit(f"the last run failed: see {db.parent / 'final.log'}")
    return time.monotonic() - started


def answer_delays(db: Path, batches: dict[str, dict[str, Any]]) -> list[float]:
    """Per batch: seconds from the provider's completion to its last answer written."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT b.provider_id, max(o.created_at) FROM batches b"
            " JOIN batch_entries e ON e.batch_id = b.id JOIN outputs o ON o.item_id = e.item_id"
            " WHERE b.provider_id IS NOT NULL GROUP BY b.provider_id"
        ).fetchall()
    delays = []
    for provider_id, last in rows:
        done = (batches.get(provider_id) or {}).get("completed_at")
        if done and last and last >= done:
            delays.append(last - done)
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--batch-requests", type=int, default=1000)
    parser.add_argument("--batch-delay", type=float, default=20.0)
    parser.add_argument("--poll", type=float, default=5.0, help="--batch-poll")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    print_machine()
    with workdir(args.dir) as work:
        prompts = write_prompts(work / "in.jsonl", args.items)
        batch_db, online_db = work / "batch.db", work / "online.db"
        extra = ("--batch-delay", str(args.batch_delay))
        with SimServer(extra=extra) as sim:
            for db in (batch_db, online_db):
                orch("enqueue", str(prompts), "-d", "d", "--db", str(db), "--max-tokens", "16")
            run_args = [
                "--server", sim.url, "--db", str(batch_db), "--exit-when-done",
                "--batch-api", "--batch-requests", str(args.batch_requests),
                "--batch-poll", str(args.poll), "--lease-seconds", "5",
            ]  # fmt: skip
            wall = run_killed(batch_db, sim.url, run_args, args.kills, args.seed)
            stats = get(sim.url + "/sim/stats")["batch_api"]
            batches = provider_batches(sim.url)
            orch("run", "--server", sim.url, "--db", str(online_db), "--exit-when-done")
        orch("export", str(work / "batch.jsonl"), "--db", str(batch_db))
        orch("export", str(work / "online.jsonl"), "--db", str(online_db))
        same = (work / "batch.jsonl").read_bytes() == (work / "online.jsonl").read_bytes()
        with sqlite3.connect(batch_db) as conn:
            done = conn.execute("SELECT count(*) FROM items WHERE state = 'done'").fetchone()[0]
            sizes = conn.execute(
                "SELECT requests, bytes, created_at, updated_at FROM batches"
                " WHERE provider_id IS NOT NULL"
            ).fetchall()
        delays = answer_delays(batch_db, batches)
        made, hours = looks(work)
        print_table(
            ["figure", "value"],
            [
                ["prompts", f"{args.items:,}"],
                ["SIGKILLs", args.kills],
                ["wall (s)", f"{wall:,.0f}"],
                ["requests submitted", f"{stats['requests_submitted']:,}"],
                ["requests submitted twice", stats["duplicate_requests"]],
                ["items lost (not done)", args.items - done],
                ["export = online run's", "byte-identical" if same else "DIFFERENT"],
                ["batches created", f"{len(batches):,}"],
                ["requests per batch (mean, max)",
                 f"{statistics.mean(s[0] for s in sizes):,.0f}, {max(s[0] for s in sizes):,}"],
                ["bytes per batch (mean)", f"{statistics.mean(s[1] for s in sizes):,.0f}"],
                ["looks at a batch per hour followed (last run)",
                 f"{made / hours:,.0f} ({made} in {hours * 3600:,.0f} s)" if hours else "-"],
                [f"  steady state, --batch-poll {args.poll:g}", f"{3600 / args.poll:,.0f}"],
                ["  steady state, --batch-poll 60 (default)", "60"],
                ["completion → answers written, s (median, max)",
                 f"{statistics.median(delays):.2f}, {max(delays):.2f}" if delays else "-"],
            ],
        )  # fmt: skip


def looks(work: Path) -> tuple[int, float]:
    """The looks at batches the final run's worker made, and the hours it followed them
    (its ``batch_collected`` events)."""
    n, seconds = 0, 0.0
    for line in (work / "final.log").read_text().splitlines():
        if '"batch_collected"' in line:
            event = json.loads(line)
            n += event["looks"]
            seconds += event["followed_s"]
    return n, seconds / 3600


if __name__ == "__main__":
    main()
