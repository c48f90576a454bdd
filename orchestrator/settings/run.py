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


def _setting(default: Any, rule: Rule, help: str, **shape: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(rule, help, **shape)})


_SECONDS = "SECONDS"


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What ``orchestrator run`` and ``Queue.run`` take beyond the servers; made into the
    worker's and the client's configuration by ``orchestrator.api.running.configs``."""

    concurrency: int | str = _setting(
        64, Cap(), "Most requests in flight per server (the worker's total is the sum over "
        "the healthy servers); 'auto' adapts each server's to what it takes, from its "
        "/metrics.", metavar="N|auto",
    )  # fmt: skip
    datasets: tuple[str, ...] = _setting(
        (), Names("a dataset name"), "Only work on these datasets.", option="--dataset"
    )
    exit_when_done: bool = _setting(
        True, FLAG, "Exit once no item is pending or running: 0 when every item is done, 6 "
        "when some failed, 7 when items of paused datasets are left pending (8: launched "
        "servers would not stay up).", cli_default=False,
    )  # fmt: skip
    give_up_after: float | None = _setting(
        None, OrNone(Number(minimum=0, above=True)), "Stop (exit 4) when no server has "
        "answered for this long; by default a worker waits for its servers as long as it "
        "takes.", metavar=_SECONDS,
    )  # fmt: skip
    rpm: int | None = _setting(
        None, OrNone(Integer(1, INT_MAX)), "Most requests a minute sent to each server (a "
        "hosted API's limit; per server: rpm=N in --servers-file). Without it a server's "
        "x-ratelimit-* headers set the pace.", metavar="N",
    )  # fmt: skip
    tpm: int | None = _setting(
        None, OrNone(Integer(1, INT_MAX)), "Most tokens a minute sent to each server "
        "(prompt estimate plus max_tokens, corrected by each answer's usage; per server: "
        "tpm=N in --servers-file).", metavar="N",
    )  # fmt: skip
    rate_limited_warn_after: float = _setting(
        600.0, Number(minimum=0, above=True), "Warn (log and status) when a server has "
        "answered nothing but HTTP 429 this long.", metavar=_SECONDS,
    )  # fmt: skip
    request_timeout: float = _setting(
        3600.0, Number(minimum=1), "Seconds a whole request may take, streamed or not "
        "(long reasoning answers need long).",
    )  # fmt: skip
    lease_seconds: float = _setting(
        120.0, Number(minimum=2), "Lease length; renewed every quarter of it while a "
        "request is in flight.",
    )  # fmt: skip
    max_attempts: int = _setting(
        8, Integer(minimum=1), "Attempts at an item before it fails (docs/OPERATIONS.md "
        "says which count).",
    )  # fmt: skip
    retry_backoff: float = _setting(
        2.0, Number(minimum=0.01), "First retry delay in seconds; doubles per attempt "
        "(±25 %), capped at 300.",
    )  # fmt: skip
    grace: float = _setting(
        30.0, Number(minimum=0), "Seconds in-flight requests get to finish after "
        "SIGTERM/SIGINT.",
    )  # fmt: skip
    stream: bool = _setting(
        False, FLAG, "Stream answers (then --stream-idle-timeout also bounds silence).",
        negatable=True,
    )  # fmt: skip
    stream_usage: bool = _setting(
        False, FLAG, "Ask streams for usage in every chunk (vLLM's and SGLang's "
        "continuous_usage_stats): a request cut by a stop then counts the tokens it had "
        "generated (status, wasted).",
    )  # fmt: skip
    stream_idle_timeout: float = _setting(
        120.0, Number(minimum=1), "Seconds a stream may go without a data event (SSE "
        "comments do not count).",
    )  # fmt: skip
    max_response_mb: float = _setting(
        64.0, Number(minimum=0.001), "Most MiB of one answer's body; a larger one fails "
        "the item (response_too_large) before it fills memory and the database.",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_all({name: getattr(self, name) for name in RUN}, RUN)

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> RunSettings:
        """The settings among ``values`` (a call's arguments, say); the rest ignored."""
        return cls(**{name: values[name] for name in RUN if name in values})


def settings() -> list[tuple[dataclasses.Field[Any], Setting]]:
    """Each setting's field (name, default) and how it is given, in the list's order."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(RunSettings)]


#: Each setting's rule by name: what every way of giving it is checked by.
RUN: dict[str, Rule] = {f.name: s.rule for f, s in settings()}
