"""The live progress line of ``run`` on a terminal, kept below the log lines.

It reads the worker's own counters every second and the queue's counts from the store
at a low rate (every 2 s at least, and never more than 5 % of the time: one grouped
count over an index), so that watching a run does not slow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator import logs
from orchestrator.monitor.text import duration, percent, servers_down
from orchestrator.store import crashes
from orchestrator.store.queue import Queue
from orchestrator.worker.keeper import servers_view

if TYPE_CHECKING:
    from orchestrator.store.engine import Database
    from orchestrator.worker import Worker

REDRAW_SECONDS = 1.0
COUNT_SECONDS = 2.0  # the least time between two reads of the queue's counts
COUNT_SHARE = 0.05  # ... and the most of the time those reads may take
RATE_WINDOW = 30.0  # seconds over which req/s and tok/s are averaged


@dataclass
class Counts:
    """The queue's items by state (those of the worker's datasets, when it has some)."""

    done: int = 0
    failed: int = 0
    pending: int = 0
    running: int = 0
    #: Of the items left, those in flight when a worker died, and those of them rationed
    #: (``store.crashes``): they run a group at a time, not at the pace of the rest.
    after_crash: int = 0
    rationed: int = 0

    @property
    def total(self) -> int:
        return self.done + self.failed + self.pending + self.running


def tally(rows: Sequence[Sequence[Any]], datasets: Sequence[str]) -> Counts:
    counts = Counts()
    for name, state, n in rows:
        if (not datasets or name in datasets) and hasattr(counts, state):
            setattr(counts, state, getattr(counts, state) + n)
    return counts


class ProgressLine:
    """Samples of the worker's counters and the queue's counts, rendered as one line."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.counts: Counts | None = None
        # (monotonic time, answers, completion tokens, done in the queue)
        self.samples: deque[tuple[float, int, int, int]] = deque()

    def sample(self, now: float) -> None:
        stats = self.worker.stats
        done = self.counts.done if self.counts else 0
        self.samples.append((now, stats.completed, stats.completion_tokens, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()

    def rates(self) -> tuple[float, float, float]:
        """Answers/s and tokens/s of this worker, and items done/s in the whole queue."""
        if len(self.samples) < 2:
            return 0.0, 0.0, 0.0
        (t0, a0, k0, d0), (t1, a1, k1, d1) = self.samples[0], self.samples[-1]
        span = t1 - t0
        if span <= 0:
            return 0.0, 0.0, 0.0
        return (a1 - a0) / span, (k1 - k0) / span, max(d1 - d0, 0) / span

    def render(self, width: int) -> str:
        stats = self.worker.stats
        req_s, tok_s, queue_s = self.rates()
        c = self.counts
        if c is None:
            head = f"{stats.completed:,} done by this worker"
            eta = None
        else:
            head = f"{c.done:,}/{c.total:,} done {percent(c.done, c.total):>6}"
            # Other workers' answers count too: the queue's own pace when it moved.
            pace = queue_s if queue_s > 0 else req_s
            eta = (c.pending + c.running - c.rationed) / pace if pace > 0 else None
        failed = c.failed if c is not None else stats.failed
        down = self._down()
        # No server answers: the pace of the minutes before says nothing of the end.
        shown = "? (waiting for a server)" if down else duration(eta)
        line = (
            f"{head}  {req_s:,.1f} req/s  {tok_s:,.0f} tok/s  ETA {shown}{_crashed(c)}  "
            f"failed {failed:,}  retries {stats.retried:,}  in flight {self.worker.in_flight}"
        )
        if down:
            line += f"  NO SERVER REACHABLE: {down}"
        return line[: max(width - 1, 10)]

    def _down(self) -> str:
        """The servers down and why, when none is reachable; "" while one is."""
        if self.worker.pool.available.is_set():
            return ""
        view = servers_view(self.worker)
        return servers_down({"servers_down": view.down}, time.time()) or "none left"


def _crashed(c: Counts | None) -> str:
    """What the line says of the items left after crashes: those rationed are not in the
    ETA (a group at a time, they go at no pace the rest of the run shows)."""
    if c is None or not c.after_crash:
        return ""
    if c.rationed:
        return f" + {c.rationed:,} rationed after crashes"
    return f" ({c.after_crash:,} back after a crash)"


def _width() -> int:
    """The terminal's width, from stderr itself (stdout may be a file or /dev/null)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return shutil.get_terminal_size().columns


async def _read_counts(database: Database, datasets: Sequence[str]) -> Counts:
    counts = await Queue(database).counts()
    found = tally([(name, state, n) for (name, state), n in counts.items()], datasets)
    crashed = await crashes.left_after_crash(database, datasets)
    found.after_crash, found.rationed = crashed["items"], crashed["rationed"]
    return found


async def show_progress(database: Database, worker: Worker) -> None:
    """Redraw the progress line every second until cancelled (then it is taken away)."""
    line = ProgressLine(worker)
    next_count = 0.0
    try:
        while True:
            now = time.monotonic()
            if now >= next_count:
                with contextlib.suppress(Exception):  # a busy database: keep the old counts
                    line.counts = await _read_counts(database, worker.config.datasets)
                took = time.monotonic() - now
                next_count = now + max(COUNT_SECONDS, took / COUNT_SHARE)
            line.sample(time.monotonic())
            logs.set_status_line(line.render(_width()))
            await asyncio.sleep(REDRAW_SECONDS)
    finally:
        logs.set_status_line("")


def start(database: Database, worker: Worker) -> asyncio.Task[None] | None:
    """The progress line's task when stderr is a terminal showing readable logs, else
    None: piped or under systemd, the JSON events (``progress``) say the same."""
    if logs.json_lines() or not sys.stderr.isatty():
        return None
    return asyncio.create_task(show_progress(database, worker), name="progress line")


async def stop(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["ProgressLine", "show_progress", "start", "stop", "tally"]
