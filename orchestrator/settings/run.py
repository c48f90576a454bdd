"""A run's settings, listed once: each with its default, its rule and its help.

``orchestrator run`` makes its options from this list (``orchestrator.cli.run``), the
Python API's ``Queue.run`` takes the same names with the same defaults (a test holds
the two together), and both hand the worker one :class:`RunSettings`, checked once here
by the rules of ``orchestrator.settings.checks``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.settings import checks
from orchestrator.settings.checks import (
    FLAG,
    INT_MAX,
    Cap,
    Integer,
    Names,
    Number,
    OrNone,
    Rule,
    check_all,
)
from orchestrator.settings.prices import PRICE_HELP

_KEEP = object()


@dataclass(frozen=True, slots=True)
class Setting:
    """How one setting is given: its rule, its help, and the option's shape where the
    command differs from the API (``cli_default``: a service runs until stopped)."""

    rule: Rule
    help: str
    metavar: str | None = None
    option: str | None = None  # the option's name when not the field's (--dataset)
    cli_default: Any = _KEEP
    negatable: bool = False  # --stream/--no-stream

    def flag(self) -> bool:
        return self.rule is FLAG


def _setting(default: Any, rule: Rule, **shape: Any) -> Any:
    """A field of the settings: its default, its rule and the option's shape (the help is
    in ``_HELP``, where the texts read as one list)."""
    return field(default=default, metadata={"rule": rule, "shape": shape})


_SECONDS = "SECONDS"

#: The token prices a run takes (for ``budget``): ``orchestrator.settings.prices.Prices``'
#: fields, the servers file's own ones winning for its servers.
TOKEN_PRICES = ("price_input", "price_cached_input", "price_output", "batch_discount")

# Each setting's help, shown by ``orchestrator run --help`` and documented for ``Queue.run``.
_HELP = {
    "concurrency": "Most requests in flight per server (the worker's total is the sum over the "
    "healthy servers); 'auto' adapts each server's to what it takes, from its /metrics.",
    "datasets": "Only work on these datasets.",
    "exit_when_done": "Exit once no item is pending or running: 0 when every item is done, 6 when "
    "some failed, 7 when items of paused datasets are left pending (8: launched servers would not "
    "stay up).",
    "give_up_after": "Stop (exit 4) when no server has answered for this long; by default a "
    "worker waits for its servers as long as it takes.",
    "rpm": "Most requests a minute sent to each server (a hosted API's limit; per server: rpm=N "
    "in --servers-file). Without it a server's x-ratelimit-* headers set the pace.",
    "tpm": "Most tokens a minute sent to each server (prompt estimate plus max_tokens, corrected "
    "by each answer's usage; per server: tpm=N in --servers-file).",
    "rate_limited_warn_after": "Warn (log and status) when a server has answered nothing but HTTP "
    "429 this long.",
    "request_timeout": "Seconds a whole request may take, streamed or not (long reasoning answers "
    "need long).",
    "lease_seconds": "Lease length; renewed every quarter of it while a request is in flight.",
    "max_attempts": "Attempts at an item before it fails (docs/OPERATIONS.md says which count).",
    "retry_backoff": "First retry delay in seconds; doubles per attempt (±25 %), capped at 300.",
    "grace": "Seconds in-flight requests get to finish after SIGTERM/SIGINT.",
    "stream": "Stream answers (then --stream-idle-timeout also bounds silence).",
    "stream_usage": "Ask streams for usage in every chunk (vLLM's and SGLang's "
    "continuous_usage_stats): a request cut by a stop then counts the tokens it had generated "
    "(status, wasted).",
    "stream_idle_timeout": "Seconds a stream may go without a data event (SSE comments do not "
    "count).",
    "max_response_mb": "Most MiB of one answer's body; a larger one fails the item "
    "(response_too_large) before it fills memory and the database.",
    "batch_api": "Send every server's requests through its Batch API (/v1/files, /v1/batches; "
    "per server: batch_api=yes|no in --servers-file): answers within the provider's window, "
    "at its batch price; a restarted run adopts its live batches, never paying twice.",
    "batch_requests": "Most requests in one batch (the provider's limit is the most: OpenAI's "
    "is 50,000). A batch server holds twice this many items in flight.",
    "batch_mb": "Most MiB of one batch's input file (OpenAI's limit is 200).",
    "batch_poll": "Most seconds between two looks at a live batch (the first comes after a "
    "second, then the wait doubles up to this).",
    "budget": "Most USD to spend at the token prices (what the providers billed, answers thrown "
    "away included): no item is claimed that the money left would not pay for at the mean "
    "billed so far, counting those in flight; in-flight work is written, then the run exits 9. "
    "Needs a token price (--price-input, ... or a servers file's).",
    **{name: PRICE_HELP[name] for name in TOKEN_PRICES},
}


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What ``orchestrator run`` and ``Queue.run`` take beyond the servers; made into the
    worker's and the client's configuration by ``orchestrator.api.running.configs``."""

    concurrency: int | str = _setting(64, Cap(), metavar="N|auto")
    datasets: tuple[str, ...] = _setting((), Names("a dataset name"), option="--dataset")
    exit_when_done: bool = _setting(True, FLAG, cli_default=False)
    give_up_after: float | None = _setting(
        None, OrNone(Number(minimum=0, above=True)), metavar=_SECONDS
    )
    rpm: int | None = _setting(None, OrNone(Integer(1, INT_MAX)), metavar="N")
    tpm: int | None = _setting(None, OrNone(Integer(1, INT_MAX)), metavar="N")
    rate_limited_warn_after: float = _setting(
        600.0, Number(minimum=0, above=True), metavar=_SECONDS
    )
    request_timeout: float = _setting(3600.0, Number(minimum=1))
    lease_seconds: float = _setting(120.0, Number(minimum=2))
    max_attempts: int = _setting(8, Integer(minimum=1))
    retry_backoff: float = _setting(2.0, Number(minimum=0.01))
    grace: float = _setting(30.0, Number(minimum=0))
    stream: bool = _setting(False, FLAG, negatable=True)
    stream_usage: bool = _setting(False, FLAG)
    stream_idle_timeout: float = _setting(120.0, Number(minimum=1))
    max_response_mb: float = _setting(64.0, Number(minimum=0.001))
    batch_api: bool = _setting(False, FLAG)
    batch_requests: int = _setting(10_000, Integer(1, 50_000), metavar="N")
    batch_mb: float = _setting(200.0, Number(minimum=0.001), metavar="MIB")
    batch_poll: float = _setting(60.0, Number(minimum=0.01), metavar=_SECONDS)
    budget: float | None = _setting(None, checks.BUDGET, metavar="USD")
    price_input: float | None = _setting(None, checks.PRICE, metavar="USD")
    price_cached_input: float | None = _setting(None, checks.PRICE, metavar="USD")
    price_output: float | None = _setting(None, checks.PRICE, metavar="USD")
    batch_discount: float | None = _setting(None, checks.DISCOUNT, metavar="FRACTION")

    def __post_init__(self) -> None:
        check_all({name: getattr(self, name) for name in RUN}, RUN)

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> RunSettings:
        """The settings among ``values`` (a call's arguments, say); the rest ignored."""
        return cls(**{name: values[name] for name in RUN if name in values})


def settings() -> list[tuple[dataclasses.Field[Any], Setting]]:
    """Each setting's field (name, default) and how it is given, in the list's order."""
    return [
        (f, Setting(f.metadata["rule"], _HELP[f.name], **f.metadata["shape"]))
        for f in dataclasses.fields(RunSettings)
    ]


#: Each setting's rule by name: what every way of giving it is checked by.
RUN: dict[str, Rule] = {f.name: s.rule for f, s in settings()}
