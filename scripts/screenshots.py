"""The README's pictures: the dashboard (docs/img/dashboard.png) and ``watch`` (docs/img/watch.svg).

Fills a database with a real multi-dataset run against the simulated server (answers
of different lengths, some server errors and bad requests), with workers writing a
sample every few seconds, then captures the dashboard in headless Chromium and renders
``watch``'s view with rich.

    python scripts/screenshots.py [--seconds 150] [--out docs/img]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator import logs  # noqa: E402
from orchestrator.formats import iter_records  # noqa: E402
from orchestrator.inference.client import ClientConfig, InferenceClient  # noqa: E402
from orchestrator.monitor.dashboard import SqliteSource, make_app  # noqa: E402
from orchestrator.sim import SimConfig, serve  # noqa: E402
from orchestrator.store import DatasetSpec, enqueue, open_database  # noqa: E402
from orchestrator.worker import Worker, WorkerConfig  # noqa: E402
from tests.browser import Browser  # noqa: E402
from tests.helpers import prompts, write_jsonl  # noqa: E402

DATASETS = {
    "code": (9000, 2048),
    "chat": (12000, 512),
    "math": (7500, 1024),
    "agentic": (2400, 4096),
}


async def shoot(db: Path, work: Path, out: Path, seconds: float) -> None:
    """Run for a while, then take both pictures mid-run, with the worker still going."""
    runner, port = await serve(
        SimConfig(
            mean_tokens=600, latency=0.05, per_token=0.0004, faults={"500": 0.01, "400": 0.005}
        ),
        "127.0.0.1",
        0,
    )
    url = f"http://127.0.0.1:{port}"
    database = await open_database(str(db))
    try:
        for name, (n, max_tokens) in DATASETS.items():
            path = write_jsonl(work / f"{name}.jsonl", prompts(n, prefix=name))
            spec = DatasetSpec(name, {"max_tokens": max_tokens})
            await enqueue(database, spec, iter_records(path), path=str(path))
        config = WorkerConfig(servers=(url,), concurrency=48, lease_seconds=8, sample_every=5)
        async with InferenceClient(ClientConfig(request_timeout=30)) as client:
            worker = Worker(database, client, config)
            task = asyncio.create_task(worker.run())
            await asyncio.sleep(seconds)
            await capture(db, out, url)
            await asyncio.to_thread(watch_svg, db, out, url)
            worker.request_stop()
            await task
    finally:
        await database.close()
    await runner.cleanup()


async def capture(db: Path, out: Path, server: str) -> None:
    from aiohttp import web

    source = SqliteSource(str(db))
    runner = web.AppRunner(make_app(source, servers=(server,)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with Browser(1400, 900) as browser:
            await browser.open(f"http://127.0.0.1:{runner.addresses[0][1]}/")
            await browser.wait_for("document.querySelectorAll('[data-lengths]').length > 0")
            await asyncio.sleep(0.5)
            await browser.screenshot(out / "dashboard.png")
    finally:
        await runner.cleanup()


def watch_svg(db: Path, out: Path, server: str) -> None:
    from rich.console import Console

    from orchestrator.inference.server_metrics import scrape
    from orchestrator.monitor.live import render
    from orchestrator.monitor.status import read as read_status
    from orchestrator.store.reader import open_reader

    reader = open_reader(str(db))
    assert reader is not None
    with reader:
        snap = read_status(reader)
    snap["database"] = "run.db"
    snap["servers"] = [scrape(server)]
    console = Console(record=True, width=130, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(snap))
    (out / "watch.svg").write_text(console.export_svg(title="orchestrator watch"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    logs.configure("warning")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="orch-shots-") as tmp:
        work = Path(tmp)
        db = work / "run.db"
        asyncio.run(shoot(db, work, args.out, args.seconds))
    print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'watch.svg'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
