"""``--concurrency auto``: how many requests one server gets, adapted to what it takes.

A continuous-batching server (SGLang, vLLM) runs as many requests as fit in its KV cache
(or its ``--max-running-requests``) and queues the rest. Too few requests from us leave
the cache half empty and the GPU under-used; too many only lengthen the server's queue,
and once the cache overflows the server retracts (SGLang) or preempts (vLLM) requests
and computes them again. The best cap keeps the server's queue short but never empty.

``Controller`` is pure: it is fed one ``Sample`` per look at the server (every second or
two) and answers with a new cap when one is due. With the server's ``/metrics`` it:

* ramps up quickly (from ``start``, quadrupling while the KV cache is under a quarter
  full, doubling while under half) while the server queues nothing, then by an eighth at
  a time;
* holds while a short queue stands (the target) or the cache is nearly full;
* backs off to what the server runs plus a small queue when a longer queue builds, and
  by a tenth when the server retracts or preempts requests, never below what it still
  runs: vLLM admits what fits its cache now and preempts again as those grow, whatever
  we send, so a cut under its batch only empties it.

Without metrics (a server that does not publish them) it climbs while our own generated
tokens per second keep rising; once a raise brings nothing it steps back and trims the cap
while fewer requests cost no throughput (they only add latency).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Change", "Controller", "Limits", "Sample"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of an adapted cap, and where it starts."""

    minimum: int = 1
    maximum: int = 1024
    start: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.start <= self.maximum:
            raise ValueError(
                f"need 1 <= minimum <= start <= maximum, got {self.minimum}, {self.start}, "
                f"{self.maximum}"
            )

    def clamp(self, value: float) -> int:
        return max(self.minimum, min(self.maximum, int(value)))


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at a server; None where it is not known (no ``/metrics``).

    ``retractions`` is the server's running total (a counter), ``tokens_per_s`` and
    ``latency`` are what our own answers showed since the previous sample.
    """

    elapsed: float
    in_flight: int
    tokens_per_s: float | None = None
    latency: float | None = None
    queued: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    retractions: float | None = None

    @property
    def has_metrics(self) -> bool:
        return self.queued is not None or self.kv_usage is not None


@dataclass(frozen=True, slots=True)
class Change:
    old: int
    new: int
    reason: str


class Controller:
    """The cap of one server; ``update`` with each new sample."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        kv_high: float = 0.9,
        queue_share: float = 0.1,
        queue_min: int = 2,
    ):
        self.limits = limits or Limits()
        self.cap = self.limits.start
        self.kv_high = kv_high
        self.queue_share = queue_share
        self.queue_min = queue_min
        self._ramping = True
        self._hold = 0.0  # seconds before the next raise
        self._retractions: float | None = None
        # Without metrics: throughput seen at this cap, and the raise being judged.
        self._seen: list[float] = []
        self._trim = False  # the next trial lowers the cap
        self._trial: tuple[int, float] | None = None  # (cap before, throughput before)
        self._settle = 0.0

    def update(self, sample: Sample) -> Change | None:
        old = self.cap
        if sample.has_metrics:
            new, reason = self._with_metrics(sample)
        else:
            new, reason = self._without_metrics(sample)
        new = self.limits.clamp(new)
        if new == old:
            return None
        self.cap = new
        return Change(old, new, reason)

    # ------------------------------------------------------------------ with /metrics

    def _allowance(self, running: float) -> float:
        """The queue we aim for: short, but enough that the server never idles."""
        return max(float(self.queue_min), self.queue_share * running)

    def _with_metrics(self, s: Sample) -> tuple[int, str]:
        self._hold = max(0.0, self._hold - s.elapsed)
        retracted = 0.0
        if s.retractions is not None:
            if self._retractions is not None:
                retracted = max(0.0, s.retractions - self._retractions)
            self._retractions = s.retractions
        running = s.running if s.running is not None else float(s.in_flight)
        queued = s.queued or 0.0
        kv = s.kv_usage
        if retracted > 0:
            # The cache overflowed: it holds fewer requests than it took. Not below what
            # it still runs: those are already admitted, and vLLM preempts again as long
            # as they grow, whatever we send; a cut under them only empties the batch.
            self._ramping = False
            self._hold = 2 * max(s.elapsed, 1.0)
            cut = max(running, min(self.cap, running + queued) * 0.9)
            return int(min(self.cap, cut)), "retractions"
        if queued > 2 * self._allowance(running):
            self._ramping = False
            self._hold = 2 * max(s.elapsed, 1.0)
            target = running + self._allowance(running)
            return (int(target), "queue") if target < self.cap else (self.cap, "")
        if kv is not None and kv >= self.kv_high:
            self._ramping = False
            return self.cap, ""
        if queued > 0 or self._hold > 0 or s.in_flight < 0.8 * self.cap:
            # A short queue is the target; a cap we do not fill says nothing.
            return self.cap, ""
        if self._ramping and (kv is None or kv < self.kv_high / 2):
            # Too many costs a short wait in the server's queue, too few costs throughput:
            # far from full, quadruple.
            return self.cap * (4 if kv is not None and kv < self.kv_high / 4 else 2), "ramp"
        self._ramping = False
        return self.cap + max(1, self.cap // 8), "room"

    # ------------------------------------------------------------------ without

    def _without_metrics(self, s: Sample) -> tuple[int, str]:
        if s.tokens_per_s is None:
            return self.cap, ""
        self._seen.append(s.tokens_per_s)
        # Judge a cap only after the requests it let in have had time to answer.
        self._settle -= s.elapsed
        if self._settle > 0:
            return self.cap, ""
        # The first look after a change still mixes in the cap before it.
        seen = self._seen[1:] or self._seen
        tput = sum(seen) / len(seen)
        self._seen = []
        self._settle = max(2 * s.elapsed, 2 * (s.latency or 0.0))
        if s.in_flight < 0.8 * self.cap:
            self._trial = None
            return self.cap, ""
        if self._trial is not None:
            before_cap, before = self._trial
            self._trial = None
            if before_cap < self.cap and tput < before * 1.05:
                # The raise brought nothing: the server was already full. Try fewer next.
                self._ramping = False
                self._trim = True
                self._settle *= 2
                return before_cap, "no_gain"
            if before_cap > self.cap and tput < before * 0.97:
                # Fewer cost throughput: go back, and look upwards next time.
                self._trim = False
                self._settle *= 4
                return before_cap, "loss"
        self._trial = (self.cap, tput)
        if self._ramping:
            return self.cap * 2, "ramp"
        step = max(1, self.cap // 8)
        if self._trim:
            return self.cap - step, "trim"
        return self.cap + step, "probe"
