"""The end of a run: running requests get the grace period, the rest is released.

A release goes through the committer, after any outcome already queued for the same
item, so a result that made it in time is kept and its release is fenced out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import structlog

from orchestrator.items import error_classes as ec
from orchestrator.store import Failure
from orchestrator.store.waste import STOPPED, Waste
from orchestrator.worker.claim import Claimed, Claims
from orchestrator.worker.committer import Committer
from orchestrator.worker.config import WorkerStats
from orchestrator.worker.outcomes import Release

log = structlog.get_logger("orchestrator.worker")


async def drain(
    claims: Claims, committer: Committer, stats: WorkerStats, grace: Callable[[], float]
) -> None:
    """Let running requests finish within ``grace()`` seconds (a forced stop makes it
    0 meanwhile, which cuts the wait short); cancel and release the rest."""
    await _claim_settled(claims)
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
    # A request cancelled mid-way threw its work away: what its stream said of it, if
    # it said (else unknown); an item never started cost nothing.
    cancelled = [
        (h.lease, dataclasses.replace(failure, waste=Waste(STOPPED, _said(h))))
        for h in leftovers
        if h.cancel_reason == "shutdown"
    ]
    for lease, why in cancelled + [(lease, failure) for lease in unstarted]:
        if lease.item_id in claims.held:
            committer.submit(Release(lease, why, 0.0))
    if leftovers or unstarted:
        await committer.close()
        # cut: requests the grace period did not see answered; the rest never started.
        log.info("released_at_shutdown", items=stats.released - released_before,
                 cut=len(leftovers), unstarted=len(unstarted))  # fmt: skip


#: The longest a stop waits for a claim being written when it came (a round takes
#: milliseconds; a lock held by another process may make it longer).
CLAIM_SETTLE_SECONDS = 2.0


async def _claim_settled(claims: Claims) -> None:
    """A claim the committer was writing when the stop came is delivered after it: wait
    for it, so that its items are released with the rest rather than left running in the
    database until their leases run out."""
    deadline = time.monotonic() + CLAIM_SETTLE_SECONDS
    # A poll, not an event: the flag is the committer's, set and cleared in its rounds.
    while claims.claiming and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


def _said(held: Claimed) -> int | None:
    return held.streamed.tokens if held.streamed is not None else None


async def first(*aws: Any) -> None:
    """Wait until the first of several awaitables finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def until_set(*events: asyncio.Event, seconds: float | None) -> bool:
    """Wait until one of ``events`` is set when looked at, or ``seconds`` have passed on
    the clock (None: no limit); False when the time ran out. A wake-up by an event set
    and cleared again before this resumed (a server that flaps) is no reason to stop
    waiting: the event's state and the time elapsed decide, not the wake-up."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not any(event.is_set() for event in events):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        timer = [] if left is None else [asyncio.sleep(left)]
        await first(*(event.wait() for event in events), *timer)
    return True
