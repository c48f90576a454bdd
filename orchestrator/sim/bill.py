"""What the simulated provider would charge: a ledger of every billed answer.

Each answer of status 200 is billed (online, streamed or not, and each line of a batch's
output file), its tokens read from the answer's own ``usage``, priced per million tokens
(``--price-input``, ``--price-cached-input``, ``--price-output``), batch lines at
``--batch-discount`` off. ``GET /sim/bill`` says the totals; ``duplicates`` counts billed
requests whose body had been billed before, the figure that shows whether a client paid
twice for one prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from orchestrator.sim.config import SimConfig

__all__ = ["Account", "Bill", "answer_usd", "canonical_body"]

#: Fields that say how an answer is delivered, not what is asked: left out of the body
#: compared for duplicates, so a prompt streamed online and sent again in a batch counts.
_DELIVERY_FIELDS = ("stream", "stream_options")


def canonical_body(body: dict[str, Any]) -> bytes:
    """A request body as compared for duplicates: sorted keys, delivery fields left out."""
    kept = {k: v for k, v in body.items() if k not in _DELIVERY_FIELDS}
    return orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)


def usage_tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    """Prompt, cached and completion tokens of an answer's ``usage`` (cached: 0 when the
    answer does not say)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        int(usage.get("prompt_tokens") or 0),
        int(cached or 0),
        int(usage.get("completion_tokens") or 0),
    )


def answer_usd(config: SimConfig, usage: dict[str, Any], *, batch: bool) -> float:
    """The USD one answer costs: uncached prompt, cached prompt and completion tokens at
    their prices a million, a batch line at the batch discount."""
    prompt, cached, completion = usage_tokens(usage)
    cached_price = (
        config.price_input if config.price_cached_input is None else (config.price_cached_input)
    )
    usd = (
        (prompt - cached) * config.price_input
        + cached * cached_price
        + completion * config.price_output
    ) / 1e6
    return usd * (1 - config.batch_discount) if batch else usd


@dataclass(slots=True)
class Account:
    """The totals of one kind of answer (online or batch)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "usd": self.usd,
        }


class Bill:
    """The ledger of a running server (one event loop: no locking)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.online = Account()
        self.batch = Account()
        self.duplicates = 0
        self._seen: set[bytes] = set()

    def charge(self, body: dict[str, Any], usage: dict[str, Any], *, batch: bool) -> None:
        """Bill one answer of ``body`` whose ``usage`` it says."""
        account = self.batch if batch else self.online
        prompt, cached, completion = usage_tokens(usage)
        account.requests += 1
        account.prompt_tokens += prompt
        account.cached_tokens += cached
        account.completion_tokens += completion
        account.usd += answer_usd(self.config, usage, batch=batch)
        key = hashlib.sha256(canonical_body(body)).digest()
        if key in self._seen:
            self.duplicates += 1
        self._seen.add(key)

    def as_json(self) -> dict[str, Any]:
        return {
            "online": self.online.as_json(),
            "batch": self.batch.as_json(),
            "usd": self.online.usd + self.batch.usd,
        }
