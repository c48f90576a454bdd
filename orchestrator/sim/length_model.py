"""Answer lengths per dataset for the simulated server (``--length-model FILE``).

Real runs mix datasets whose answers differ tenfold in length, with long tails up to
``max_tokens``; what order the requests reach the server in then decides when the run
ends. The model gives each dataset a lognormal length distribution and draws each
request's length from the digest of its messages, so the same prompt gets the same
length in every run and under every client: strategies compared on it do the same work.

The file is JSON::

    {"default": {"mean": 300, "sigma": 0.8},
     "datasets": {"code": {"mean": 600, "sigma": 0.9},
                  "math": {"mean": 800, "sigma": 1.0, "reasoning": 0.7}}}

``mean`` is the mean length in tokens, ``sigma`` the standard deviation of its
logarithm (0: every answer ``mean`` long), ``reasoning`` the share spent thinking when
the server reasons (default 0.5). A request names its dataset in its ``metadata``
object (``{"metadata": {"dataset": "code"}}``, which ``enqueue --param
'metadata={"dataset": "code"}'`` adds to every request of a dataset); one without, or
of a dataset the file does not list, is drawn from ``default``, or without one gets the
server's ``--mean-tokens`` lengths. The request's ``max_tokens`` still cuts the answer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import orjson

__all__ = ["LengthModel", "Lognormal", "dataset_of", "load_length_model"]

_NORMAL = NormalDist()
_FIELDS = frozenset({"mean", "sigma", "reasoning"})


@dataclass(frozen=True, slots=True)
class Lognormal:
    """One dataset's answer lengths: lognormal with this mean (tokens) and log-sigma."""

    mean: float
    sigma: float
    reasoning: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"mean must be a number of tokens >= 1, got {self.mean!r}")
        if not (math.isfinite(self.sigma) and 0 <= self.sigma <= 5):
            raise ValueError(f"sigma must be within [0, 5], got {self.sigma!r}")
        if not 0 <= self.reasoning < 1:
            raise ValueError(f"reasoning must be within [0, 1), got {self.reasoning!r}")

    def tokens(self, u: float) -> int:
        """The length at quantile ``u`` of the distribution, at least 1."""
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        return max(1, round(math.exp(mu + self.sigma * _NORMAL.inv_cdf(u))))


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Distributions by dataset name, and the one for the rest (None: ``--mean-tokens``)."""

    datasets: dict[str, Lognormal] = field(default_factory=dict)
    default: Lognormal | None = None

    def distribution(self, dataset: str | None) -> Lognormal | None:
        found = self.datasets.get(dataset) if dataset is not None else None
        return found if found is not None else self.default

    def tokens(self, dataset: str | None, digest: str, seed: int = 0) -> int | None:
        """The answer length of the request with this digest (``request_digest``), or None
        when no distribution applies. Deterministic: a hash of the seed and the digest
        picks the quantile."""
        spec = self.distribution(dataset)
        if spec is None:
            return None
        return spec.tokens(quantile(digest, seed))


def quantile(digest: str, seed: int = 0) -> float:
    """A uniform number in (0, 1) fixed by the request's digest and the seed."""
    h = hashlib.sha256(f"{seed}:{digest}:length".encode()).digest()
    return (int.from_bytes(h[:7], "big") + 0.5) / 2**56


def dataset_of(body: dict[str, Any]) -> str | None:
    """The dataset a request names in ``metadata.dataset``, if any."""
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        name = metadata.get("dataset")
        if isinstance(name, str):
            return name
    return None


def load_length_model(path: str | Path) -> LengthModel:
    """Read a length model file; ``ValueError`` naming the file and what is wrong."""
    try:
        doc = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(doc, dict) or not set(doc) <= {"default", "datasets"}:
        raise ValueError(f'{path}: expected an object with "default" and/or "datasets"')
    datasets = doc.get("datasets", {})
    if not isinstance(datasets, dict):
        raise ValueError(f'{path}: "datasets" must map dataset names to distributions')
    parsed = {name: _lognormal(path, f"datasets.{name}", spec) for name, spec in datasets.items()}
    default = doc.get("default")
    return LengthModel(parsed, None if default is None else _lognormal(path, "default", default))


def _lognormal(path: str | Path, where: str, spec: Any) -> Lognormal:
    if not isinstance(spec, dict) or "mean" not in spec or not set(spec) <= _FIELDS:
        raise ValueError(f'{path}: {where}: expected {{"mean": N, "sigma": S[, "reasoning": R]}}')
    values = {k: spec[k] for k in spec}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {where}.{key} must be a number, got {value!r}")
    try:
        return Lognormal(
            float(values["mean"]),
            float(values.get("sigma", 0.0)),
            float(values.get("reasoning", 0.5)),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {where}: {exc}") from None
