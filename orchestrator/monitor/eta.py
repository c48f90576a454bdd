"""When a run will finish: the claim order replayed over the work left.

Extrapolating early progress linearly is wrong by half on real runs: datasets differ
tenfold in answer length, a dataset capped at 32 requests runs beside others, and the
order of datasets decides which run together. So the forecast measures the work left in
request-seconds (each dataset's items left times its own mean answer time, which follows
its completion length at the server's current load) and replays how workers share their
slots out (priority first, each dataset up to its cap), with as many slots as the
workers kept busy over the recent window (Little's law). A dataset without answers
yet borrows an answer time from the others, scaled to its ``max_tokens``.

Items are claimed longest predicted answer first (``orchestrator.items.answer_length``), so a
dataset's latest answers are longer than those it has left: where items carry a
prediction, their work is their predicted tokens times the seconds the latest answers
took per predicted token. The datasets of one priority are claimed from together, so
they share the slots in proportion to their work left and end about together.

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
    #: Of the items left, those with a predicted length (``predicted_pending`` and
    #: ``predicted_running`` of them), the sums of their predictions, and the seconds the
    #: latest answers with a prediction took per predicted token (None: none measured).
    predicted_pending: int = 0
    predicted_running: int = 0
    predicted_pending_tokens: int = 0
    predicted_running_tokens: int = 0
    seconds_per_predicted: float | None = None

    @property
    def items_left(self) -> float:
        return self.pending + _RUNNING_WEIGHT * self.running

    def work(self, per_item: float) -> float:
        """Request-seconds left: predicted items by their predictions, the rest at
        ``per_item`` each."""
        if self.seconds_per_predicted is None:
            return self.items_left * per_item
        predicted = self.predicted_pending + _RUNNING_WEIGHT * self.predicted_running
        tokens = self.predicted_pending_tokens + _RUNNING_WEIGHT * self.predicted_running_tokens
        plain = max(self.items_left - predicted, 0.0)
        return plain * per_item + tokens * self.seconds_per_predicted


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
    """Finish times of a fluid replay: slots go out by priority, shared among the
    datasets of one priority in proportion to their work left, each up to its cap and
    to the items it has left, and are handed on whenever a dataset finishes."""
    order = sorted(todo, key=lambda w: (-w.priority, w.dataset_id))
    left = {w.dataset_id: w.work(max(per_item[w.dataset_id] or 0.0, _EPS)) for w in order}
    # The mean request-seconds of an item left: how many items a dataset's work still is.
    seconds = {w.dataset_id: max(left[w.dataset_id] / w.items_left, _EPS) for w in order}
    priorities = sorted({w.priority for w in order}, reverse=True)
    levels = [[w for w in order if w.priority == p] for p in priorities]
    ends: dict[int, float] = {}
    now = 0.0
    while left:
        free = slots
        rates: dict[int, float] = {}
        for level in levels:
            if free <= _EPS:
                break
            limits = {
                w.dataset_id: min(
                    float(w.cap) if w.cap else math.inf,
                    float(max(math.ceil(left[w.dataset_id] / seconds[w.dataset_id] - _EPS), 1)),
                )
                for w in level
                if w.dataset_id in left
            }
            shares = _water_fill(free, limits, {d: left[d] for d in limits})
            rates.update(shares)
            free -= sum(shares.values())
        step = min(left[d] / rate for d, rate in rates.items() if rate > 0)
        now += step
        for d, rate in rates.items():
            left[d] -= rate * step
            if left[d] <= _EPS * max(seconds[d], 1.0):
                del left[d]
                ends[d] = now
    return ends


def _water_fill(
    free: float, limits: dict[int, float], weights: dict[int, float]
) -> dict[int, float]:
    """``free`` slots shared in proportion to ``weights``, none above its limit; what a
    limited dataset cannot take goes to the others."""
    shares: dict[int, float] = {}
    open_ = dict(weights)
    while open_ and free > _EPS:
        total = sum(open_.values())
        capped = {d: limits[d] for d, weight in open_.items() if free * weight / total >= limits[d]}
        if not capped:
            shares.update({d: free * weight / total for d, weight in open_.items()})
            return shares
        for d, limit in capped.items():
            shares[d] = limit
            free -= limit
            del open_[d]
    return shares
