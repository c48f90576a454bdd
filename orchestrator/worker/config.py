"""How a worker runs (its configuration), what it reports (its counts), and who hears of
its life (a service manager)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from orchestrator.errors import ConfigError
from orchestrator.inference.autoconcurrency import Limits
from orchestrator.inference.batchapi import BatchLimits
from orchestrator.inference.servers_file import Cap
from orchestrator.settings.checks import check_all, checked
from orchestrator.settings.prices import RunPrices
from orchestrator.settings.run import RUN


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How a worker runs. Defaults suit long reasoning answers on a self-hosted server.

    ``lease_seconds`` is how long a claimed item stays ours without a renewal; leases are
    renewed every quarter of it, so a crashed worker's items return within that time (at
    once, for a worker on the same host). ``max_attempts`` counts claims: an item that
    keeps failing, or keeps killing its worker, fails after that many.

    ``concurrency`` is per server (``server_caps`` overrides it for some): the worker keeps
    the sum of its healthy servers' caps in flight. ``"auto"`` adapts a server's cap to
    what it takes (``orchestrator.inference.autoconcurrency``), within ``auto_limits``, looking at
    it every ``auto_interval`` seconds.

    ``rpm`` and ``tpm`` cap the requests and tokens a minute sent to each server
    (``server_budgets`` overrides them for some, as ``(rpm, tpm)``); without them a
    server's ``x-ratelimit-*`` headers set its pace (``orchestrator.inference.pacing.Pacer``). A
    server that has answered nothing but 429 for ``rate_limited_warn_after`` seconds is
    warned about.
    """

    servers: tuple[str, ...]
    concurrency: Cap = 64
    server_caps: Mapping[str, Cap] = dataclasses.field(default_factory=dict)
    auto_limits: Limits = dataclasses.field(default_factory=Limits)
    auto_interval: float = 1.0
    failure_limit: int = 5
    rpm: int | None = None
    tpm: int | None = None
    server_budgets: Mapping[str, tuple[int | None, int | None]] = dataclasses.field(
        default_factory=dict
    )
    rate_limited_warn_after: float = 600.0
    datasets: tuple[str, ...] = ()
    exit_when_done: bool = False
    lease_seconds: float = 120.0
    max_attempts: int = 8
    grace_seconds: float = 30.0
    backoff_base: float = 2.0
    backoff_cap: float = 300.0
    poll_interval: float = 0.5
    probe_min: float = 0.5
    probe_max: float = 5.0
    checkpoint_every: float = 60.0
    progress_every: float = 30.0
    # The run's history for the dashboard (orchestrator.store.samples); 0: none.
    sample_every: float = 60.0
    # Seconds without any reachable server after which the run stops (None: wait on).
    give_up_after: float | None = None
    # Different items rejected the same way in a row that stop the run (orchestrator.worker.guard).
    breaker_items: int = 5
    # Seconds a dataset's trial request in flight unrefused opens it (orchestrator.worker.guard).
    trial_seconds: float = 2.0
    # The servers whose requests go through their Batch API (orchestrator.worker.batches).
    batch_servers: frozenset[str] = frozenset()
    batch_limits: BatchLimits = dataclasses.field(default_factory=BatchLimits)
    # Most USD to spend at the token prices (run --budget; orchestrator.worker.budget), and
    # the prices each server's answers are billed at. None: no budget.
    budget: float | None = None
    prices: RunPrices | None = None

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("at least one --server is needed")
        for cap in (self.concurrency, *self.server_caps.values()):
            checked("concurrency", cap, RUN["concurrency"])
        for rpm, tpm in (
            (self.rpm, self.tpm),
            *self.server_budgets.values(),
        ):
            check_all({"rpm": rpm, "tpm": tpm}, RUN)
        limited = set(self.server_caps) | set(self.server_budgets) | self.batch_servers
        unknown = limited - set(self.servers)
        if unknown:
            raise ConfigError(f"a limit is given for servers not in use: {sorted(unknown)}")
        # The settings a run is given, by the rules its options and arguments have.
        given = {"lease_seconds": self.lease_seconds, "max_attempts": self.max_attempts}
        given |= {"grace": self.grace_seconds, "give_up_after": self.give_up_after}
        given |= {"rate_limited_warn_after": self.rate_limited_warn_after}
        check_all(given, RUN)
        if self.failure_limit < 1:
            raise ConfigError("failure_limit must be at least 1")
        if self.breaker_items < 1:
            raise ConfigError("breaker_items must be at least 1")
        check_all({"budget": self.budget}, RUN)
        if self.budget is not None and (self.prices is None or not self.prices.by_token):
            raise ConfigError(
                "--budget counts what the providers bill by the token: give a token price "
                "(--price-input, --price-output, or price_input= in the servers file)"
            )


class Notifier(Protocol):
    """Who hears about the worker's life (a service manager, for one)."""

    def ready(self) -> None: ...
    def stopping(self) -> None: ...
    def status(self, text: str) -> None: ...


class Silent:
    """The notifier of a worker that no service manager watches."""

    def ready(self) -> None:
        pass

    def stopping(self) -> None:
        pass

    def status(self, text: str) -> None:
        pass


@dataclass(slots=True)
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lost: int = 0
    completion_tokens: int = 0
    turns: int = 0  # turns of multi-turn items generated before their last one
    dropped: int = 0  # outcomes given up at shutdown: the database took none of them


def stats_fields(stats: WorkerStats) -> dict[str, int]:
    """The counts as log fields."""
    return dataclasses.asdict(stats)


def backoff_delay(attempt: int, *, base: float, cap: float, retry_after: float | None) -> float:
    """Capped exponential backoff with ±25 % jitter; a server's Retry-After wins if longer,
    up to ``cap`` too (``1e308``, ``inf``, a date in 9999 wait ``cap``)."""
    delay = min(cap, base * 2 ** max(attempt - 1, 0)) * random.uniform(0.75, 1.25)
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay
