"""What supervising a launched server costs: llama.cpp's llama-server started by hand
against the same server under the run's watchdog and supervisor.

Per pass: seconds from start to ready (``/health`` 200) started directly, and started by
the supervisor (watchdog process, log pipe, ``/health`` and ``/v1/models``); the
watchdog's resident memory; seconds from a SIGKILL of the server to its restart being
ready again (``--restart-backoff 0``); seconds to stop it (SIGTERM to its group).

Targets: ready <= 0.5 s slower than by hand; watchdog <= 30 MB; restart <= 2 s.

    python benchmarks/bench_launch.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from common import print_against, print_machine, print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import llama_server

TARGET_EXTRA_S = 0.5
TARGET_RSS_MB = 30.0
TARGET_RESTART_S = 2.0
ARGS = "-c 8192 -np 4 -t 1 --metrics"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def by_hand() -> float:
    server = llama_server.LlamaServer(context=8192, slots=4)
    started = time.monotonic()
    server.start()
    ready = time.monotonic() - started
    server.stop()
    return ready


async def supervised(work: Path) -> tuple[float, float, float, float]:
    import aiohttp

    from orchestrator.inference.launch.spec import LaunchSpec, SuperviseSettings
    from orchestrator.inference.launch.supervisor import Supervisor

    binary, model = llama_server.binary_path(), llama_server.model_path()
    command = shlex.join([str(binary), "-m", str(model), "-a", llama_server.MODEL_ALIAS])
    spec = LaunchSpec(f"{command} --host 127.0.0.1 --port {{port}} {ARGS}")
    settings = SuperviseSettings(restart_backoff=0, health_every=1.0)
    supervisor = Supervisor([spec], settings, work)
    server = supervisor.servers[0]
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        await supervisor.start(session, asyncio.Event())
        ready = time.monotonic() - started
        assert server.process is not None and server.process.proc is not None
        memory = rss_mb(server.process.proc.pid)
        supervisor.watch()
        pid = server.process.server_pid()
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while not (server.restarts == 1 and server.state == "up"):  # noqa: ASYNC110 (polled)
            await asyncio.sleep(0.01)
        restart = time.monotonic() - killed
        stopping = time.monotonic()
        await supervisor.stop()
        stop = time.monotonic() - stopping
    return ready, memory, restart, stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="passes; medians shown")
    args = parser.parse_args(argv)
    if llama_server.main(["--check"]) != 0:
        raise SystemExit("llama-server is not built: python3 scripts/llama_server.py")
    print_machine()
    hand, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            hand.append(by_hand())
            runs.append(asyncio.run(supervised(Path(tmp) / str(i))))
    ready, memory, restart, stop = (median(r[k] for r in runs) for k in range(4))
    direct = median(hand)
    print()
    print_table(
        ["ready by hand s", "ready supervised s", "watchdog MB", "restart s", "stop s"],
        [[f"{direct:.2f}", f"{ready:.2f}", f"{memory:.1f}", f"{restart:.2f}", f"{stop:.2f}"]],
    )
    print()
    extra = ready - direct
    line = f"ready, supervised - by hand: {extra:+.2f} s"
    print_against(line, extra, TARGET_EXTRA_S, f"{TARGET_EXTRA_S}")
    line = f"watchdog resident: {memory:.1f} MB"
    print_against(line, memory, TARGET_RSS_MB, f"{TARGET_RSS_MB:g}")
    line = f"restart after SIGKILL: {restart:.2f} s"
    print_against(line, restart, TARGET_RESTART_S, f"{TARGET_RESTART_S:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
