"""A hosted provider's rate limits, simulated: token buckets of requests and tokens a
minute that answer 429 with ``Retry-After`` when empty, and the ``x-ratelimit-*``
headers (OpenAI's names and formats) on every answer.

A bucket holds at most ``burst`` and refills at ``per_minute / 60`` a second. A request
takes one request; its prompt and answer tokens are taken from the tokens bucket when
it is admitted, which needs that many there (or a full bucket, for a request larger
than the bucket). Refused, it takes nothing. The buckets run in real time: they are
not scaled by ``--time-scale``, whose limits the headers would then misstate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

#: The two kinds of budget, as the headers name them.
UNITS = ("requests", "tokens")
_KEYS = {"rpm": "requests", "tpm": "tokens"}
_EXPECTED = "expected rpm=N[,burst=B] or tpm=N[,burst=B]"


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One budget: ``unit`` (requests or tokens), refilled ``per_minute``, at most
    ``burst`` at once."""

    unit: str
    per_minute: float
    burst: float

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"rate limit unit must be one of {', '.join(UNITS)}")
        for name in ("per_minute", "burst"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"rate limit {name} must be a finite number > 0, got {value!r}")


def parse_rate_limit(spec: str) -> BucketSpec:
    """``rpm=300,burst=25`` or ``tpm=100000,burst=20000``; without ``burst``, a whole
    minute's worth (OpenAI's limits refill over a minute)."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad rate limit {spec!r}: {_EXPECTED}")
        fields[key.strip().lower()] = value.strip()
    kinds = [k for k in fields if k in _KEYS]
    unknown = set(fields) - set(_KEYS) - {"burst"}
    if len(kinds) != 1 or unknown:
        raise ValueError(f"bad rate limit {spec!r}: {_EXPECTED}")
    try:
        per_minute = float(fields[kinds[0]])
        burst = float(fields.get("burst", per_minute))
    except ValueError:
        raise ValueError(f"bad rate limit {spec!r}: the values must be numbers") from None
    try:
        return BucketSpec(_KEYS[kinds[0]], per_minute, burst)
    except ValueError as exc:
        raise ValueError(f"bad rate limit {spec!r}: {exc}") from None


class Bucket:
    """One token bucket, refilled as time passes."""

    def __init__(self, spec: BucketSpec) -> None:
        self.spec = spec
        self.rate = spec.per_minute / 60
        self.level = spec.burst
        self.stamp = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.spec.burst, self.level + self.rate * (now - self.stamp))
        self.stamp = now

    def wait(self, need: float) -> float:
        """Seconds until ``need`` (at most a full bucket) is there."""
        return max(0.0, (min(need, self.spec.burst) - self.level) / self.rate)

    def headers(self) -> dict[str, str]:
        unit = self.spec.unit
        reset = (self.spec.burst - self.level) / self.rate
        return {
            f"x-ratelimit-limit-{unit}": f"{self.spec.per_minute:g}",
            f"x-ratelimit-remaining-{unit}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{unit}": duration(reset),
        }


def duration(seconds: float) -> str:
    """Seconds as OpenAI writes them: ``120ms``, ``1s``, ``6m0s``, ``1h2m3.5s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes else text


class Limiter:
    """The provider's buckets; ``admit`` decides a request, ``headers`` says the state."""

    def __init__(self, specs: tuple[BucketSpec, ...]) -> None:
        self.buckets = {spec.unit: Bucket(spec) for spec in specs}

    def admit(self, tokens: int) -> float | None:
        """Take a request of ``tokens`` from the buckets; None when admitted, else the
        seconds until it would be (its ``Retry-After``), having taken nothing."""
        needs = {"requests": 1.0, "tokens": float(tokens)}
        for bucket in self.buckets.values():
            bucket.refill()
        wait = max(bucket.wait(needs[unit]) for unit, bucket in self.buckets.items())
        if wait > 0:
            return wait
        for unit, bucket in self.buckets.items():
            bucket.level -= needs[unit]
        return None

    def headers(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for bucket in self.buckets.values():
            bucket.refill()
            found |= bucket.headers()
        return found
