"""The end of a run: running requests get the grace period, the rest is released.

A release goes through the committer, after any outcome already queued for the same
item, so a result that made it in time is kept and its release is fenced out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import structlog

from orchestrator import error_classes as ec
from orchestrator.store import Failure
from orchestrator.worker.claim import Claims
from orchestrator.worker.committer import Committer
from orchestrator.worker.config import WorkerStats
from orchestrator.worker.outcomes import Release

log = structlog.get_logger("orchestrator.worker")


async def drain(
    claims: Claims, committer: Committer, stats: WorkerStats, grace: Callable[[], float]
) -> None:
    """Let running requests finish within ``grace()`` seconds (a forced stop makes it
    0 meanwhile, which cuts the wait short); cancel and release the rest."""
    unstarted = list(claims.buffer)
    claims.buffer.clear()
    running = [h for h in claims.held.values() if h.task is not None and not h.task.done()]
    tasks = [h.task for h in running if h.task is not None]
    if tasks and grace() > 0:
        log.info("draining", in_flight=len(tasks), grace_s=grace())
        done_waiting = asyncio.create_task(asyncio.wait(tasks, timeout=grace()))
        while not done_waiting.done():
            await first(asyncio.shield(done_waiting), asyncio.sleep(0.2))
            if grace() == 0:
                break
        done_waiting.cancel()
    leftovers = [h for h in running if h.task is not None and not h.task.done()]
    for held in leftovers:
        held.cancel_reason = held.cancel_reason or "shutdown"
        held.task.cancel()  # type: ignore[union-attr]
    for held in leftovers:
        with contextlib.suppress(asyncio.CancelledError):
            await held.task  # type: ignore[misc]
    released_before = stats.released
    failure = Failure(ec.SHUTDOWN, "released at worker shutdown")
    for lease in [h.lease for h in leftovers if h.cancel_reason == "shutdown"] + unstarted:
        if lease.item_id in claims.held:
            committer.submit(Release(lease, failure, 0.0))
    if leftovers or unstarted:
        await committer.close()
        # cut: requests the grace period did not see answered; the rest never started.
        log.info("released_at_shutdown", items=stats.released - released_before,
                 cut=len(leftovers), unstarted=len(unstarted))  # fmt: skip


async def first(*aws: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
