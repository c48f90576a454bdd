"""The simulated server's batching model stepped offline, in simulated time, without HTTP.

What a run's makespan is measured against: the same server (``orchestrator.sim.batching``)
given the same requests, either all at once in a chosen order (the ideal schedule is
longest answer first, every request queued at t=0), or by a client that keeps a fixed
number of requests at the server and sends the next, in order, the moment one finishes
(an order's own cost, without any client overhead).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from orchestrator.sim.batching import BatchModel, Seq
from orchestrator.sim.config import SimConfig

__all__ = ["Request", "Schedule", "longest_first", "schedule", "tail_share"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its prompt tokens, the answer tokens it will generate, its max_tokens."""

    prompt: int
    tokens: int
    limit: int


@dataclass(slots=True)
class Schedule:
    """How a schedule went: its makespan, when each request finished (in the order given),
    and every step as ``(t at its end, batch, queued)``."""

    makespan: float = 0.0
    finished: list[float] = field(default_factory=list)
    steps: list[tuple[float, int, int]] = field(default_factory=list)
    generated: int = 0
    peak_rate: float = 0.0
    """The most tokens per second a step decoded at (prefill aside)."""
    retracted: int = 0


def longest_first(requests: Iterable[Request]) -> list[Request]:
    """The requests by answer length, longest first (ties keep their order)."""
    return sorted(requests, key=lambda r: -r.tokens)


def schedule(
    config: SimConfig, requests: Sequence[Request], *, in_flight: int | None = None
) -> Schedule:
    """Step the server over ``requests`` sent in their order: all queued at t=0, or with
    ``in_flight``, at most that many at the server at once, the next sent as one finishes.
    """
    model = BatchModel(config)
    result = Schedule(finished=[0.0] * len(requests))
    sent = 0
    limit = len(requests) if in_flight is None else max(1, in_flight)
    at_server = 0
    clock = 0.0
    while sent < len(requests) or model.busy:
        while sent < len(requests) and at_server < limit:
            r = requests[sent]
            model.add(Seq(r.prompt, r.tokens, r.limit, sent))
            sent += 1
            at_server += 1
        seconds, batch, finished = model.step()
        clock += seconds
        result.generated += batch
        if batch:
            result.peak_rate = max(result.peak_rate, model.decode_rate(batch))
        for seq in finished:
            result.finished[seq.tag] = clock
            at_server -= 1
        result.steps.append((clock, batch, len(model.queue)))
    result.makespan = clock
    result.retracted = model.retracted
    return result


def tail_share(finished: Sequence[float], makespan: float, share: float = 0.99) -> float:
    """The time from ``share`` of the answers done to the last, as a share of the makespan."""
    if not finished or makespan <= 0:
        return 0.0
    times = sorted(finished)
    at = times[max(0, min(len(times) - 1, int(share * len(times)) - 1))]
    return (times[-1] - at) / makespan
