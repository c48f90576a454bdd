"""What a run costs at the prices the operator gives: so far, to go, and wasted.

Two ways a run is paid for, and a server may be either: a GPU server by the hour
(``--gpu-hour-cost``, USD per server-hour, whatever it does meanwhile), a hosted API by
the token (``--price-input`` / ``--price-cached-input`` / ``--price-output``, USD per
million prompt, cached prompt and completion tokens, the way providers list them, and
``--batch-discount``, the share a provider's Batch API takes off). Each server of a
servers file may carry its own (``gpu_hour_cost=``, ``price_input=``, ...); the options
are the default of those that do not.

* GPU: the run's servers cost the sum of their hourly prices for as long as the run has
  gone (its first answer's start to now, or to its last answer) and for the ETA to go;
  the wasted share of that is the share of generated tokens thrown away (GPU time taken
  as proportional to tokens generated).
* Tokens: exactly what the providers billed, from the store's ledger (``store.spend``: a
  row per dataset, server, model, batched or not, and kept or the cause it was thrown
  away for), each row at its server's prices; the work to go, each dataset's items left
  at its billed cost per item done so far.

Pure arithmetic over the status document and the plan: no I/O, no store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from orchestrator.items.answer_length import BYTES_PER_TOKEN
from orchestrator.settings import checks

__all__ = [
    "BATCH_DISCOUNT",
    "KEPT",
    "PRICE_HELP",
    "Prices",
    "RunPrices",
    "budget_room",
    "plan_cost",
    "run_prices",
    "status_cost",
]

MILLION = 1_000_000

#: What a provider's Batch API takes off its online prices when no price says otherwise.
BATCH_DISCOUNT = 0.5

#: Each price's help, by its field's name: the options of ``status``, ``plan`` and ``run``
#: (``--price-input``, ...) and ``Queue.run``'s arguments say the same.
PRICE_HELP = {
    "gpu_hour_cost": "Price of one server-hour (a GPU server's rent), for the run's cost.",
    "price_input": "Price per million prompt tokens (a hosted API's input price).",
    "price_cached_input": "Price per million cached prompt tokens (a provider's prompt-cache "
    "price); the input price when not given.",
    "price_output": "Price per million completion tokens (a hosted API's output price).",
    "batch_discount": "Share taken off the token prices of answers that came from a provider's "
    "Batch API (0.5 when not given).",
}

#: The ledger's kind of the answers kept (the others are ``store.waste`` causes).
KEPT = "kept"


@dataclass(frozen=True, slots=True)
class Prices:
    """One server's prices (or the default of every server), each None when not given."""

    gpu_hour_cost: float | None = None
    price_input: float | None = None
    price_output: float | None = None
    price_cached_input: float | None = None
    batch_discount: float | None = None

    def __post_init__(self) -> None:
        checks.check_all({f.name: getattr(self, f.name) for f in fields(self)}, checks.PRICES)

    @property
    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    @property
    def by_token(self) -> bool:
        return any(
            p is not None for p in (self.price_input, self.price_output, self.price_cached_input)
        )

    @property
    def cached_input(self) -> float:
        """The price of a cached prompt token: the input price unless one is given."""
        if self.price_cached_input is not None:
            return self.price_cached_input
        return self.price_input or 0.0

    @property
    def discount(self) -> float:
        return BATCH_DISCOUNT if self.batch_discount is None else self.batch_discount

    def billed(self, prompt: int, cached: int, completion: int, batched: bool) -> float:
        """USD for tokens as a provider bills them: the cached part of the prompt at the
        cached price, the Batch API's lines at its discount; 0 for a server not priced
        by the token (its hours are its cost)."""
        if not self.by_token:
            return 0.0
        fresh = max(prompt - cached, 0)
        usd = (
            fresh * (self.price_input or 0.0)
            + cached * self.cached_input
            + completion * (self.price_output or 0.0)
        ) / MILLION
        return usd * (1 - self.discount) if batched else usd

    def over(self, default: Prices) -> Prices:
        """These prices, or the default's where this server names none of its own: a
        server priced by the token is not also priced by the hour, nor the reverse."""
        if self.given:
            return self
        return default


@dataclass(frozen=True, slots=True)
class RunPrices:
    """The prices of the run's servers: each server's own (over the default), and pooled
    (the hourly sum, and the mean token prices, to say them in a line)."""

    gpu_hourly: float | None
    gpu_servers: int
    price_input: float | None
    price_output: float | None
    price_cached_input: float | None = None
    batch_discount: float | None = None
    default: Prices = field(default_factory=Prices)
    servers: Mapping[str, Prices] = field(default_factory=dict)

    @property
    def given(self) -> bool:
        return self.gpu_hourly is not None or self.by_token

    @property
    def by_token(self) -> bool:
        return self.default.by_token or any(p.by_token for p in self.servers.values())

    def of(self, server: str | None) -> Prices:
        """The prices a server's answers are billed at: its own, else the default."""
        if server is not None:
            own = self.servers.get(server_key(server))
            if own is not None:
                return own
        return self.default

    def basis(self) -> str:
        parts = []
        if self.gpu_hourly is not None:
            parts.append(f"${self.gpu_hourly:,.2f}/hour for {self.gpu_servers} GPU server(s)")
        if self.by_token:
            rates = f"${self.price_input or 0:g} in / ${self.price_output or 0:g} out"
            if self.price_cached_input is not None:
                rates += f" / ${self.price_cached_input:g} cached"
            parts.append(f"{rates} per million tokens")
            if self.batch_discount is not None:
                parts.append(f"batch {self.batch_discount:.0%} off")
        return "; ".join(parts)


def run_prices(default: Prices, servers: Sequence[Prices] | Mapping[str, Prices] = ()) -> RunPrices:
    """The run's prices: each listed server's own or the default (no servers listed: one
    server at the default prices); by URL when the servers are named."""
    named = dict(servers) if isinstance(servers, Mapping) else {}
    listed = list(named.values()) if named else list(servers)  # type: ignore[arg-type]
    each = [own.over(default) for own in listed] or [default]
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
        price_cached_input=mean([p.price_cached_input for p in tokened]),
        batch_discount=mean([p.batch_discount for p in tokened]),
        default=default,
        servers={server_key(url): own.over(default) for url, own in named.items()},
    )


def server_key(url: str) -> str:
    """A server's URL as its answers name it: no userinfo (never stored), no last '/'."""
    head, sep, rest = url.strip().partition("://")
    if sep and "@" in rest:
        rest = rest.rpartition("@")[2]  # as ``_util.urls.take_userinfo`` takes it
    return f"{head}{sep}{rest}".rstrip("/")


def _tokens_cost(prices: RunPrices, prompt: float, completion: float) -> float:
    return (
        prompt * (prices.price_input or 0.0) + completion * (prices.price_output or 0.0)
    ) / MILLION


def _rounded(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in doc.items()}


def row_cost(row: Mapping[str, Any], prices: RunPrices) -> float:
    """USD of one ledger row (as the status document has it), at its server's prices."""
    return prices.of(row.get("server")).billed(
        int(row["prompt_tokens"]),
        int(row["cached_tokens"]),
        int(row["completion_tokens"]),
        bool(row["batched"]),
    )


def ledger_cost(rows: Iterable[Mapping[str, Any]], prices: RunPrices) -> tuple[float, int]:
    """USD of ledger rows, and the requests they billed."""
    rows = list(rows)
    return sum(row_cost(r, prices) for r in rows), sum(int(r["requests"]) for r in rows)


def budget_room(
    limit: float, spent: float, per_request: float | None, running: int, want: int
) -> int:
    """How many of ``want`` items may still be claimed under a budget: each item in
    flight or claimed is expected to cost ``per_request`` (the billed mean so far). With
    nothing billed yet, one claim goes out alone: its answers tell the mean."""
    if per_request is None:
        return want if running == 0 and spent < limit else 0
    if per_request <= 0:
        return want if spent <= limit else 0
    room = math.floor((limit - spent) / per_request + 1e-9) - running
    return max(0, min(want, room))


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
    datasets: dict[str, dict[str, Any]] = {}
    if prices.by_token:
        for entry in snap["datasets"]:
            datasets[entry["name"]] = figures = _dataset_tokens(entry, prices)
            so_far += figures["so_far"]
            left = figures["to_go"]
            to_go = None if to_go is None or left is None else to_go + left
            thrown += figures["wasted"]
            for cause, amount in figures["wasted_by_cause"].items():
                by_cause[cause] = by_cause.get(cause, 0.0) + amount
    doc = {
        "currency": "USD",
        "basis": prices.basis(),
        "gpu_hourly": prices.gpu_hourly,
        "gpu_servers": prices.gpu_servers,
        "price_input": prices.price_input,
        "price_cached_input": prices.price_cached_input,
        "price_output": prices.price_output,
        "batch_discount": prices.batch_discount,
        "so_far": so_far,
        "to_go": to_go,
        "total": None if to_go is None else so_far + to_go,
        "wasted": thrown,
    }
    extra: dict[str, Any] = {"wasted_by_cause": _rounded(by_cause)}
    if prices.by_token:
        extra["billed"] = _billed_totals(snap["datasets"])
        extra["datasets"] = datasets
    return _rounded(doc) | extra


def _left(totals: Mapping[str, Any]) -> int:
    counts = totals["counts"]
    return int(counts["pending"] + counts["running"])


_BILLED = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _billed_totals(entries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The tokens billed over every dataset, as the provider's invoice counts them."""
    sums = dict.fromkeys(_BILLED, 0)
    for entry in entries:
        for row in entry.get("billed") or []:
            for key in _BILLED:
                sums[key] += int(row[key])
    return sums


def _dataset_tokens(entry: Mapping[str, Any], prices: RunPrices) -> dict[str, Any]:
    """One dataset's token-priced cost: billed so far (kept and thrown away, from its
    ledger rows), to go (its items left at its billed cost per item done), and thrown
    away by cause. To go is None while items are left and none is done to learn from."""
    rows = entry.get("billed") or []
    kept = sum(row_cost(r, prices) for r in rows if r["kind"] == KEPT)
    by_cause: dict[str, float] = {}
    for row in rows:
        if row["kind"] != KEPT:
            by_cause[row["kind"]] = by_cause.get(row["kind"], 0.0) + row_cost(row, prices)
    spent = kept + sum(by_cause.values())
    done = int(entry["counts"]["done"])
    left = _left(entry)
    to_go = (spent / done) * left if done else (None if left else 0.0)
    doc = {
        "so_far": spent,
        "to_go": to_go,
        "total": None if to_go is None else spent + to_go,
        "wasted": sum(by_cause.values()),
        "per_item": spent / done if done else None,
    }
    return _rounded(doc) | {"wasted_by_cause": _rounded(by_cause)}


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
