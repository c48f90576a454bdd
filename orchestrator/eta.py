"""When a run will finish: the claim order replayed over the work left.

Extrapolating early progress linearly is wrong by half on real runs: datasets differ
tenfold in answer length, a dataset capped at 32 requests runs beside others, and the
order of datasets decides which run together. So the forecast measures the work left in
request-seconds (each dataset's items left times its own mean answer time, which follows
its completion length at the server's current load) and replays how workers share their
slots out (priority first, each dataset up to its cap), with as many slots as the
workers kept busy over the recent window (Little's law). A dataset without answers
yet borrows an answer time from the others, scaled to its ``max_tokens``.

Pure arithmetic on figures the store reads, so it is tested without a database.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Forecast", "Work", "forecast"]

# Items in flight are about half done, on average.
_RUNNING_WEIGHT = 0.5
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Work:
    """One dataset's work left and what its latest answers cost.

    ``seconds`` and ``tokens`` are the mean answer time and completion length of its
    latest ``sample`` answers (None without any); ``in_flight`` is how many of its
    requests were in flight on average over the recent window.
    """

    dataset_id: int
    pending: int
    running: int
    priority: int = 0
    cap: int | None = None
    paused: bool = False
    seconds: float | None = None
    tokens: float | None = None
    sample: int = 0
    max_tokens: int | None = None
    in_flight: float = 0.0

    @property
    def items_left(self) -> float:
        return self.pending + _RUNNING_WEIGHT * self.running


@dataclass(frozen=True, slots=True)
class Forecast:
    """Seconds from now until each dataset, and the whole run, is finished.

    None means no forecast can be made yet (nothing answered, nobody working) or, for a
    dataset, that it is paused; the total leaves paused datasets out. ``slots`` is the
    concurrency the forecast assumed.
    """

    datasets: dict[int, float | None]
    total: float | None
    slots: float


def forecast(work: Sequence[Work], *, live_in_flight: int = 0) -> Forecast:
    """Replay the claim order over the work left; see the module's docstring."""
    finished = {w.dataset_id: 0.0 for w in work if w.items_left <= 0}
    todo = [w for w in work if w.items_left > 0 and not w.paused]
    per_item = _item_seconds(work)
    # Workers' own count includes items claimed ahead of a free slot: the measure over
    # the window is the better one whenever there is one.
    slots = sum(w.in_flight for w in work) or float(live_in_flight)
    result: dict[int, float | None] = {w.dataset_id: None for w in work}
    result.update(finished)
    if not todo:
        return Forecast(result, 0.0 if not any(w.paused for w in work) else None, slots)
    if slots <= 0 or any(per_item.get(w.dataset_id) is None for w in todo):
        return Forecast(result, None, slots)
    ends = _replay(todo, per_item, slots)
    result.update(ends)
    return Forecast(result, max(ends.values()), slots)


def _item_seconds(work: Sequence[Work]) -> dict[int, float | None]:
    """Each dataset's answer time: its own mean, or a prior from the others' answers."""
    measured = [w for w in work if w.sample > 0 and w.seconds is not None]
    out: dict[int, float | None] = {w.dataset_id: w.seconds for w in measured}
    if not measured:
        return out
    intercept, slope = _fit(measured)
    weight = sum(w.sample for w in measured)
    mean_tokens = sum(w.sample * (w.tokens or 0.0) for w in measured) / weight
    with_max = [w for w in measured if w.max_tokens and w.tokens is not None]
    fill = (
        sum(w.sample * (w.tokens or 0.0) for w in with_max)
        / sum(w.sample * (w.max_tokens or 0) for w in with_max)
        if with_max
        else None
    )
    for w in work:
        if w.dataset_id in out:
            continue
        tokens = mean_tokens
        if w.max_tokens and fill is not None:
            tokens = min(w.max_tokens * fill, float(w.max_tokens))
        out[w.dataset_id] = intercept + slope * tokens
    return out


def _fit(measured: Sequence[Work]) -> tuple[float, float]:
    """Answer time as ``a + b * tokens`` over the datasets measured, weighted by sample.

    With one dataset, or lengths too alike to tell ``a`` from ``b``, time is taken as
    proportional to length.
    """
    points = [(w.tokens or 0.0, w.seconds or 0.0, float(w.sample)) for w in measured]
    weight = sum(p[2] for p in points)
    mean_x = sum(x * n for x, _, n in points) / weight
    mean_y = sum(y * n for _, y, n in points) / weight
    var = sum(n * (x - mean_x) ** 2 for x, _, n in points)
    if var > _EPS * max(mean_x * mean_x * weight, 1.0):
        slope = sum(n * (x - mean_x) * (y - mean_y) for x, y, n in points) / var
        intercept = mean_y - slope * mean_x
        if slope >= 0 and intercept >= 0:
            return intercept, slope
    return 0.0, (mean_y / mean_x if mean_x > 0 else 0.0)


def _replay(
    todo: Sequence[Work], per_item: dict[int, float | None], slots: float
) -> dict[int, float]:
    """Finish times of a fluid replay: slots go out by priority, each dataset up to its cap
    and to the items it has left, and are handed on whenever a dataset finishes."""
    order = sorted(todo, key=lambda w: (-w.priority, w.dataset_id))
    seconds = {w.dataset_id: max(per_item[w.dataset_id] or 0.0, _EPS) for w in order}
    left = {w.dataset_id: w.items_left * seconds[w.dataset_id] for w in order}
    ends: dict[int, float] = {}
    now = 0.0
    while left:
        free = slots
        rates: dict[int, float] = {}
        for w in order:
            if w.dataset_id not in left or free <= _EPS:
                continue
            items = math.ceil(left[w.dataset_id] / seconds[w.dataset_id] - _EPS)
            share = min(free, float(w.cap) if w.cap else math.inf, float(max(items, 1)))
            rates[w.dataset_id] = share
            free -= share
        step = min(left[d] / rate for d, rate in rates.items())
        now += step
        for d, rate in rates.items():
            left[d] -= rate * step
            if left[d] <= _EPS * max(seconds[d], 1.0):
                del left[d]
                ends[d] = now
    return ends
