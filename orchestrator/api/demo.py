"""``orchestrator demo``: a whole run on the simulated server, from JSONL to export.

Everything a real run does happens here for real (a server process over loopback, the
SQLite queue, the worker, the export); only the GPU is simulated. Interrupted and
started again, it resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import click
import orjson

from orchestrator.errors import StorageError
from orchestrator.formats import iter_records
from orchestrator.formats.export import export_jsonl
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.monitor.status import snapshot
from orchestrator.monitor.text import duration
from orchestrator.sim import answer_matches, write_sample
from orchestrator.store import DatasetSpec, enqueue, open_database
from orchestrator.worker import Worker, WorkerConfig

DATASET = "demo"
SIM_ARGS = ["--latency", "0.05", "--per-token", "0.0005", "--mean-tokens", "96"]


async def start_sim_server(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``sim-server`` on a free port; returns the process and its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.sim.server", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
    if "listening on" not in line:
        proc.kill()
        raise StorageError(f"the simulated server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[-1]


async def _show_progress(database: object, worker: Worker, total: int) -> None:
    started = time.monotonic()
    first_done: int | None = None
    while True:
        await asyncio.sleep(0.5)
        snap = await snapshot(database, window=10)  # type: ignore[arg-type]
        t = snap["totals"]
        done = t["counts"]["done"]
        if first_done is None:
            first_done = done
        elapsed = time.monotonic() - started
        rate = (done - first_done) / elapsed if elapsed > 0 else 0.0
        left = t["counts"]["pending"] + t["counts"]["running"]
        eta = left / rate if rate > 0 else None
        click.echo(
            f"\r  {done:>7,}/{total:,} done  {t['counts']['failed']:,} failed  "
            f"{worker.in_flight:>3} in flight  {rate:7.1f} req/s  "
            f"{t['recent']['tokens_per_s']:8.0f} tok/s  ETA {duration(eta):>6}   ",
            nl=False,
            err=True,
        )


async def run_demo(workdir: Path, *, items: int, concurrency: int) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    sample = workdir / "sample.jsonl"
    db_path = workdir / "demo.db"
    out = workdir / "export.jsonl"
    if not sample.exists():
        write_sample(sample, n=items)
        click.echo(f"wrote {items:,} sample prompts to {sample}")
    proc, url = await start_sim_server(*SIM_ARGS)
    click.echo(f"simulated inference server at {url} (pid {proc.pid})")
    database = await open_database(str(db_path))
    try:
        report = await enqueue(
            database,
            DatasetSpec(DATASET, {"max_tokens": 256}),
            iter_records(sample),
            path=str(sample),
        )
        click.echo(
            f"enqueued {report.added:,} new items into {db_path} "
            f"({report.already_present:,} already there)"
        )
        config = WorkerConfig(servers=(url,), concurrency=concurrency, exit_when_done=True)
        async with InferenceClient(ClientConfig(request_timeout=60)) as client:
            worker = Worker(database, client, config)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, worker.request_stop)
            total = (await snapshot(database))["totals"]["counts"]["total"]
            click.echo("running (Ctrl-C stops cleanly; run the demo again to resume):")
            progress = asyncio.create_task(_show_progress(database, worker, total))
            try:
                stats = await worker.run()
            finally:
                progress.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await progress
                click.echo("", err=True)
        snap = await snapshot(database)
        left = snap["totals"]["counts"]["pending"] + snap["totals"]["counts"]["running"]
        if left:
            click.echo(f"stopped with {left:,} items left; run `orchestrator demo` to resume")
            return
        n = await export_jsonl(database, out)
        mismatched = _verify(out)
        click.echo(
            f"done: {stats.completed:,} answers this run, {snap['totals']['counts']['done']:,} "
            f"in total; exported {n:,} lines to {out}"
        )
        click.echo(
            "verified: every exported answer belongs to its own prompt"
            if mismatched == 0
            else f"WARNING: {mismatched} answers do not match their prompts"
        )
        click.echo(f"next: orchestrator status --db {db_path}")
    finally:
        await database.close()
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()


def _verify(path: Path) -> int:
    """Count exported lines whose answer was not made for their own prompt."""
    bad = 0
    with open(path, "rb") as fh:
        for raw in fh:
            line = orjson.loads(raw)
            *prompt, answer = line["messages"]
            if not answer_matches(prompt, answer["content"]):
                bad += 1
    return bad


__all__ = ["run_demo", "start_sim_server"]
