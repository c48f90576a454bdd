"""What a run costs at the prices the operator gives: so far, to go, and wasted.

Two ways a run is paid for, and a server may be either: a GPU server by the hour
(``--gpu-hour-cost``, USD per server-hour, whatever it does meanwhile), a hosted API by
the token (``--price-input`` / ``--price-output``, USD per million prompt and completion
tokens, the way providers list them). Each server of a servers file may carry its own
(``gpu_hour_cost=``, ``price_input=``, ``price_output=``); the options are the default of
those that do not.

* GPU: the run's servers cost the sum of their hourly prices for as long as the run has
  gone (its first answer's start to now, or to its last answer) and for the ETA to go;
  the wasted share of that is the share of generated tokens thrown away (GPU time taken
  as proportional to tokens generated).
* Tokens: every prompt and completion token sent and generated, at the mean of the
  token-priced servers' prices (requests spread over the servers). Thrown-away answers
  cost their completion tokens and, each, a mean prompt; the work to go, the requests
  left at their dataset's mean prompt and answer.

Pure arithmetic over the status document and the plan: no I/O, no store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from orchestrator.items.answer_length import BYTES_PER_TOKEN
from orchestrator.settings import checks

__all__ = ["Prices", "RunPrices", "plan_cost", "run_prices", "status_cost"]

MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class Prices:
    """One server's prices (or the default of every server), each None when not given."""

    gpu_hour_cost: float | None = None
    price_input: float | None = None
    price_output: float | None = None

    def __post_init__(self) -> None:
        checks.check_all({f.name: getattr(self, f.name) for f in fields(self)}, checks.PRICES)

    @property
    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    @property
    def by_token(self) -> bool:
        return self.price_input is not None or self.price_output is not None

    def over(self, default: Prices) -> Prices:
        """These prices, or the default's where this server names none of its own: a
        server priced by the token is not also priced by the hour, nor the reverse."""
        if self.given:
            return self
        return default


@dataclass(frozen=True, slots=True)
class RunPrices:
    """The prices of the run's servers pooled: the hourly sum, and the mean token prices."""

    gpu_hourly: float | None
    gpu_servers: int
    price_input: float | None
    price_output: float | None

    @property
    def given(self) -> bool:
        return self.gpu_hourly is not None or self.by_token

    @property
    def by_token(self) -> bool:
        return self.price_input is not None or self.price_output is not None

    def basis(self) -> str:
        parts = []
        if self.gpu_hourly is not None:
            parts.append(f"${self.gpu_hourly:,.2f}/hour for {self.gpu_servers} GPU server(s)")
        if self.by_token:
            rates = f"${self.price_input or 0:g} in / ${self.price_output or 0:g} out"
            parts.append(f"{rates} per million tokens")
        return "; ".join(parts)


def run_prices(default: Prices, servers: Sequence[Prices] = ()) -> RunPrices:
    """The run's prices: each listed server's own or the default (no servers listed: one
    server at the default prices)."""
    each = [own.over(default) for own in servers] or [default]
    hourly = [p.gpu_hour_cost for p in each if p.gpu_hour_cost is not None]
    tokened = [p for p in each if p.by_token]

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(tokened) if known else None

    return RunPrices(
        gpu_hourly=sum(hourly) if hourly else None,
        gpu_servers=len(hourly),
        price_input=mean([p.price_input for p in tokened]),
        price_output=mean([p.price_output for p in tokened]),
    )


def _tokens_cost(prices: RunPrices, prompt: float, completion: float) -> float:
    return (
        prompt * (prices.price_input or 0.0) + completion * (prices.price_output or 0.0)
    ) / MILLION


def _rounded(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in doc.items()}


def status_cost(snap: Mapping[str, Any], prices: RunPrices) -> dict[str, Any] | None:
    """The cost block of the status document (``cost``), or None without prices."""
    if not prices.given:
        return None
    totals = snap["totals"]
    wasted = totals.get("wasted") or {}
    so_far = thrown = 0.0
    to_go: float | None = 0.0
    by_cause: dict[str, float] = dict.fromkeys((wasted.get("by_cause") or {}), 0.0)
    if prices.gpu_hourly is not None:
        hours = totals["overall"]["elapsed_s"] / 3600
        so_far += prices.gpu_hourly * hours
        eta = totals.get("eta_seconds")
        # No ETA yet (no answer to learn from) with work left: to go is not known.
        to_go = None if eta is None and _left(totals) else prices.gpu_hourly * (eta or 0) / 3600
        share = wasted.get("share") or 0.0
        thrown += prices.gpu_hourly * hours * share
        for cause, f in (wasted.get("by_cause") or {}).items():
            by_cause[cause] += prices.gpu_hourly * hours * (f.get("share") or 0.0)
    if prices.by_token:
        spent, left, lost, lost_by = _token_figures(snap, prices)
        so_far += spent
        to_go = None if to_go is None else to_go + left
        thrown += lost
        for cause, amount in lost_by.items():
            by_cause[cause] = by_cause.get(cause, 0.0) + amount
    doc = {
        "currency": "USD",
        "basis": prices.basis(),
        "gpu_hourly": prices.gpu_hourly,
        "gpu_servers": prices.gpu_servers,
        "price_input": prices.price_input,
        "price_output": prices.price_output,
        "so_far": so_far,
        "to_go": to_go,
        "total": None if to_go is None else so_far + to_go,
        "wasted": thrown,
    }
    return _rounded(doc) | {"wasted_by_cause": _rounded(by_cause)}


def _left(totals: Mapping[str, Any]) -> int:
    counts = totals["counts"]
    return int(counts["pending"] + counts["running"])


def _token_figures(
    snap: Mapping[str, Any], prices: RunPrices
) -> tuple[float, float, float, dict[str, float]]:
    """Token-priced spend so far (answers kept and thrown away), to go, thrown away, and
    thrown away by cause, summed over the datasets."""
    spent = left = lost = 0.0
    lost_by: dict[str, float] = {}
    for entry in snap["datasets"]:
        prompt = entry.get("prompt_tokens") or {}
        done = entry["overall"]["done"]
        mean_prompt = prompt.get("total", 0) / done if done else 0.0
        mean_answer = entry["completion_tokens"].get("mean") or 0.0
        kept = _tokens_cost(prices, prompt.get("total", 0), entry["completion_tokens"]["total"])
        wasted = entry.get("wasted") or {}
        thrown = 0.0
        for cause, f in (wasted.get("by_cause") or {}).items():
            amount = _tokens_cost(prices, f["requests"] * mean_prompt, f["tokens"])
            lost_by[cause] = lost_by.get(cause, 0.0) + amount
            thrown += amount
        spent += kept + thrown
        lost += thrown
        left += _left(entry) * _tokens_cost(prices, mean_prompt, mean_answer)
    return spent, left, lost, lost_by


def plan_cost(plan: Any, prices: RunPrices) -> dict[str, Any] | None:
    """What a planned run costs (``orchestrator.runfile.plan.RunPlan``): the tokens done
    so far and to go, at the plan's rate for the hours; None without prices."""
    if not prices.given:
        return None
    so_far = to_go = 0.0
    if prices.gpu_hourly is not None:
        rate = plan.tokens_per_second
        done_tokens = max(plan.generated_tokens - plan.remaining_tokens, 0)
        so_far += prices.gpu_hourly * done_tokens / rate / 3600
        to_go += prices.gpu_hourly * plan.duration_seconds / 3600
    if prices.by_token:
        for d in plan.datasets:
            if not d.requests:
                continue
            prompt = d.request_bytes / max(d.rows, 1) / _bytes_per_token()
            left = max(d.requests - d.done, 0)
            done_tokens = max(d.generated_tokens - d.remaining_tokens, 0)
            so_far += _tokens_cost(prices, d.done * prompt, done_tokens)
            to_go += _tokens_cost(prices, left * prompt, d.remaining_tokens)
    doc = {
        "currency": "USD",
        "basis": prices.basis(),
        "so_far": so_far,
        "to_go": to_go,
        "total": so_far + to_go,
    }
    return _rounded(doc)


def _bytes_per_token() -> int:
    return BYTES_PER_TOKEN
