"""The servers a worker sends to, each with its own concurrency cap and health.

A request goes to the least-loaded healthy server, load being its requests in flight over
its cap, so a slow server fills its own slots and the others keep going. A server that
refuses connections, or fails several requests in a row while another one answers, is
taken out of rotation and probed on ``/health`` until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

import orjson
import structlog

from orchestrator.inference import probes, server_metrics
from orchestrator.inference.autoconcurrency import Sample
from orchestrator.inference.failures import RequestFailed
from orchestrator.inference.pacing import LIMITED_REPORT_EVERY, Pacer
from orchestrator.inference.routing import (
    BALANCE_THRESHOLD,
    CACHE_THRESHOLD,
    PrefixIndex,
    prefix_blocks,
)
from orchestrator.items import error_classes as ec

if TYPE_CHECKING:
    from orchestrator.inference.autoconcurrency import Controller
    from orchestrator.inference.client import InferenceClient


log = structlog.get_logger("orchestrator.inference.pool")

#: Seconds between two reports of a server that stays unreachable.
REPORT_EVERY = 60.0

#: How long the tuner's look at a server's ``/metrics`` may take. A server busy with our
#: own requests can leave it queued behind them for many seconds (llama.cpp serves one
#: connection per HTTP thread); a look still running holds the server's cap meanwhile.
METRICS_TIMEOUT = 30.0
#: Looks at ``/metrics`` failed in a row, with none ever answered, after which a server
#: is taken to have none and is tuned on the worker's own tokens per second instead.
METRICS_TRIES = 3

#: Failures that say something about the server rather than the request: enough of them
#: in a row take a server out of rotation while another one answers.
SERVER_FAULTS = frozenset(
    {ec.DISCONNECT, ec.TIMEOUT, ec.STREAM_IDLE, ec.STREAM_CUT, ec.BAD_RESPONSE, ec.ABORTED}
)


def _clock(epoch: float | None) -> str | None:
    """An ISO local time for logs ("since when")."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


class PoolSettings(Protocol):
    """What the pool reads of the worker's configuration."""

    @property
    def probe_min(self) -> float: ...
    @property
    def probe_max(self) -> float: ...
    @property
    def failure_limit(self) -> int: ...
    @property
    def rate_limited_warn_after(self) -> float: ...


@dataclass(slots=True)
class ServerState:
    """One server as the worker sees it."""

    url: str
    cap: int
    controller: Controller | None = None  # set when the cap adapts
    healthy: bool = False
    in_flight: int = 0
    failures: int = 0  # times taken out since it last answered: paces the probes
    errors: int = 0  # server-side request failures in a row
    down_reason: str | None = None
    down_since: float | None = None  # wall clock of the failure that took it out
    vetted: bool = False  # its /v1/models looked at, once, before its first request
    probe: asyncio.Task[None] | None = None
    # Answers since the tuner last looked: how many, their tokens and summed latency.
    answers: int = 0
    tokens: int = 0
    latency: float = 0.0
    # The tuner's looks at its /metrics: the one running, seconds since its controller
    # last had a sample, failed looks in a row, whether any ever answered.
    scrape: asyncio.Task[dict[str, float | None]] | None = None
    unsampled: float = 0.0
    metrics_misses: int = 0
    metrics_seen: bool = False
    # A launched server's deaths (orchestrator.inference.launch): a request that ends in another
    # epoch than it began died with the server, and costs its item no attempt.
    epoch: int = 0
    retired: bool = False  # a launched server given up on: never probed again
    pacer: Pacer = dataclasses.field(default_factory=Pacer)
    # 429s since its last answer: since when (wall clock), how many, how many since the
    # last warning, and when the next warning may be said (monotonic; None: none said).
    limited_since: float | None = None
    limited_count: int = 0
    limited_unsaid: int = 0
    limited_report_at: float | None = None

    @property
    def blind(self) -> bool:
        """Never served metrics, and failed every look: tuned without them."""
        return not self.metrics_seen and self.metrics_misses >= METRICS_TRIES

    @property
    def load(self) -> float:
        return self.in_flight / self.cap


class ServerPool:
    """The servers a worker may use: least-loaded healthy one first, the rest probed.

    It keeps each server's accounting (requests in flight, health, failures in a row,
    the answers the tuner looks at): the worker tells it what happened through its
    methods and reads ``states`` only.
    """

    def __init__(
        self,
        caps: Mapping[str, int],
        client: InferenceClient,
        config: PoolSettings,
        *,
        controllers: Mapping[str, Controller] | None = None,
        budgets: Mapping[str, tuple[int | None, int | None]] | None = None,
        on_change: Callable[[], None] | None = None,
    ):
        self.client = client
        self.config = config
        controllers = controllers or {}
        budgets = budgets or {}
        self.states = {
            url: ServerState(
                url,
                cap,
                controller=controllers.get(url),
                pacer=Pacer(*budgets.get(url, (None, None))),
            )
            for url, cap in caps.items()
        }
        self.prefixes = PrefixIndex(self.states)
        self.available = asyncio.Event()
        self._on_change = on_change or (lambda: None)
        #: Looks at a server once, when it first answers, before any request goes to it;
        #: False keeps it out (the worker is stopping).
        self.vet: Callable[[str], Awaitable[bool]] | None = None

    def start(self) -> None:
        for server in self.states:
            self.mark_down(server, "not probed yet", quiet=True)

    def healthy(self) -> list[str]:
        return [s for s, st in self.states.items() if st.healthy]

    def capacity(self) -> int:
        """Requests the healthy servers take at once: what the worker keeps in flight."""
        return sum(st.cap for st in self.states.values() if st.healthy)

    def widest(self) -> int:
        """The most sequences one request may ask of one server (``n`` samples): the
        largest cap of a healthy server. llama.cpp refuses an ``n`` above its slots."""
        return max((st.cap for st in self.states.values() if st.healthy), default=0)

    def pick(
        self, prompt: object = None, previous: str | None = None, width: int = 1
    ) -> str | None:
        """The server for a request: the one holding most of ``prompt``'s prefix when it
        holds at least ``CACHE_THRESHOLD`` of it and is not much busier than the
        least-loaded one (``BALANCE_THRESHOLD``), else the healthy server with the lowest
        in-flight/cap (the first listed on a tie). The prompt is then taken as cached
        on the server picked. ``prompt`` is its text, or the request's messages, made
        text only when there is a choice of server (one server has nothing to choose);
        ``previous``, the server that answered the conversation's turn before, takes it
        while it has a slot free (see :meth:`_holder`); ``width``: the sequences the
        request asks for (``n``), which the server holding the prefix must have room for
        (the samples of a prompt asked side by side go to another server when its holder
        is full, as a busy holder's do)."""
        best: ServerState | None = None
        load = math.inf
        for state in self.states.values():
            if state.healthy and state.load < load:
                best, load = state, state.load
        if best is None or not prompt or len(self.states) < 2:
            return None if best is None else best.url
        text = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        hashes = prefix_blocks(text)
        if hashes:
            best = self._holder(hashes, load, previous, width) or best
            self.prefixes.add(best.url, hashes)
        return best.url

    def _holder(
        self, hashes: list[int], lowest: float, previous: str | None = None, width: int = 1
    ) -> ServerState | None:
        """The healthy server holding most of the prompt, if enough and not too busy.

        ``previous`` answered the conversation's turn before this one, and kept its slot
        for this turn while that answer was written: it holds the whole prompt but the
        new user message, the answer included, which the index (fed the prompts sent)
        does not know of. It takes the turn whenever it has a slot free."""
        if previous is not None:
            state = self.states.get(previous)
            if state is not None and state.healthy and state.in_flight < state.cap:
                return state
        holder: ServerState | None = None
        most = 0
        for state in self.states.values():
            if state.healthy and (n := self.prefixes.matched(state.url, hashes)) > most:
                holder, most = state, n
        if holder is None or most < CACHE_THRESHOLD * len(hashes):
            return None
        if holder.load - lowest > BALANCE_THRESHOLD or holder.in_flight + width > holder.cap:
            return None
        return holder

    def set_cap(self, server: str, cap: int) -> None:
        self.states[server].cap = cap
        self._on_change()

    def mark_down(self, server: str, reason: str, *, quiet: bool = False) -> None:
        state = self.states[server]
        if state.retired or (state.probe is not None and not state.probe.done()):
            return
        state.healthy = False
        self.prefixes.forget(server)
        state.failures += 1
        state.errors = 0
        state.down_reason = reason
        if not quiet:
            log.warning("server_down", server=server, reason=reason)
        if not self.healthy():
            self.available.clear()
        state.probe = asyncio.create_task(self._probe(server), name=f"probe {server}")
        state.probe.add_done_callback(lambda task: self._probe_ended(server, task))
        self._on_change()

    def server_died(self, server: str, reason: str) -> None:
        """A launched server's process died or was found wedged: out of rotation at
        once, and its requests in flight are known to have died with it."""
        self.states[server].epoch += 1
        self.mark_down(server, reason)

    def retire(self, server: str, reason: str) -> None:
        """A launched server given up on: out for good, no longer probed."""
        state = self.states[server]
        state.retired = True
        state.healthy = False
        state.down_reason = reason
        if state.probe is not None:
            state.probe.cancel()
        if not self.healthy():
            self.available.clear()
        self._on_change()

    def all_retired(self) -> bool:
        return all(st.retired for st in self.states.values())

    def _probe_ended(self, server: str, task: asyncio.Task[None]) -> None:
        """A prober that died would leave its server out for good and the worker waiting
        in silence: say why, and probe again (paced as after any failure)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error(
            "probe_crashed", server=server, error=f"{type(exc).__name__}: {exc}", exc_info=exc
        )
        if self.states[server].probe is task:
            self.mark_down(server, f"the health probe failed: {type(exc).__name__}: {exc}")

    async def _probe(self, server: str) -> None:
        """Poll ``/health`` until the server answers. Why it does not is said at once, then
        every ``REPORT_EVERY`` seconds and whenever the reason changes, with since when."""
        state = self.states[server]
        delay = self.config.probe_min * min(2 ** max(state.failures - 2, 0), 8)
        started = time.monotonic()
        state.down_since = state.down_since or time.time()
        reported: tuple[str, float] | None = None
        initial = state.down_reason == "not probed yet"
        while True:
            await asyncio.sleep(delay)
            result = await probes.probe(
                self.client.session, server, self.client.config.health_timeout
            )
            if result.ok:
                break
            state.down_reason = result.reason
            now = time.monotonic()
            if reported is None or reported[0] != result.reason or now >= reported[1]:
                log.warning(
                    "server_unreachable",
                    server=server,
                    reason=result.reason,
                    since=_clock(state.down_since),
                    waited_s=round(now - started),
                )
                reported = (result.reason, now + REPORT_EVERY)
            delay = min(delay * 2, self.config.probe_max)
        if not state.vetted:
            state.vetted = True
            if result.reason:
                log.info("server_health_note", server=server, note=result.reason)
            if self.vet is not None and not await self.vet(server):
                return  # the worker is stopping: this server is wrong for the run
        state.healthy = True
        state.down_reason = None
        state.down_since = None
        self.available.set()
        if not initial or reported is not None:
            log.info("server_up", server=server, down_for_s=round(time.monotonic() - started, 1))
        if initial:
            state.failures = 0
        self._on_change()

    def unreachable(self) -> list[tuple[str, str, float | None]]:
        """Each server that is down: its URL, why, and since when (epoch seconds)."""
        return [
            (url, st.down_reason or "not reachable", st.down_since)
            for url, st in self.states.items()
            if not st.healthy
        ]

    def request_started(self, server: str, sequences: int = 1) -> None:
        """A request went to ``server``: it counts towards its load until it ends, as
        many slots as it asks sequences of (``n`` samples take ``n`` slots)."""
        self.states[server].in_flight += sequences

    def request_ended(self, server: str, sequences: int = 1) -> None:
        self.states[server].in_flight -= sequences

    def succeeded(self, server: str, tokens: int = 0, latency: float = 0.0) -> None:
        """An answer: the server is well, and the tuner's figures grow."""
        state = self.states[server]
        state.failures = 0
        state.errors = 0
        state.answers += 1
        state.tokens += tokens
        state.latency += latency

    def failed(self, server: str, error_class: str) -> None:
        """A request failed; several server-side failures in a row take the server out
        while another one answers (with no other, pausing would gain nothing)."""
        state = self.states[server]
        if error_class not in SERVER_FAULTS and not error_class.startswith("http_5"):
            return
        state.errors += 1
        others = any(s.healthy for s in self.states.values() if s is not state)
        if state.errors >= self.config.failure_limit and state.healthy and others:
            self.mark_down(server, f"{state.errors} failures in a row ({error_class})")

    async def pace(self, server: str, tokens: int) -> int:
        """Wait until the server's budgets take a request of ``tokens`` estimated tokens;
        its ticket, for :meth:`paced`."""
        return await self.states[server].pacer.acquire(tokens)

    def paced(self, server: str, ticket: int, outcome: object) -> float | None:
        """How a paced request went (a ``Completion`` or the exception): its headers and
        usage teach the server's pacer. For a 429, the seconds the server has answered
        nothing but 429 when that is past ``rate_limited_warn_after``, else None."""
        state = self.states[server]
        limits = getattr(outcome, "rate_limits", None)
        if isinstance(outcome, BaseException):
            if getattr(outcome, "error_class", None) != ec.RATE_LIMITED:
                state.pacer.failed(ticket, limits)
                return None
            wait = state.pacer.limited(ticket, getattr(outcome, "retry_after", None), limits)
            return self._limited(state, wait)
        usage = getattr(outcome, "usage", None) or {}
        used = usage.get("total_tokens")
        if used is None and "completion_tokens" in usage:
            used = (usage.get("prompt_tokens") or 0) + usage["completion_tokens"]
        state.pacer.answered(ticket, limits, used)
        if state.limited_report_at is not None:
            assert state.limited_since is not None
            log.info(
                "server_rate_limit_lifted",
                server=server,
                limited_for_s=round(time.time() - state.limited_since),
                rate_limited=state.limited_count,
            )
        state.limited_since, state.limited_count, state.limited_report_at = None, 0, None
        return None

    def _limited(self, state: ServerState, wait: float) -> float | None:
        """Count a 429; past ``rate_limited_warn_after`` without an answer, say so: one
        warning, then one every ``LIMITED_REPORT_EVERY`` summing up those between."""
        now = time.time()
        state.limited_since = state.limited_since or now
        state.limited_count += 1
        state.limited_unsaid += 1
        elapsed = now - state.limited_since
        if elapsed < self.config.rate_limited_warn_after:
            return None
        tick = time.monotonic()
        if state.limited_report_at is None or tick >= state.limited_report_at:
            log.warning(
                "server_rate_limited",
                server=state.url,
                limited_for_s=round(elapsed),
                since=_clock(state.limited_since),
                rate_limited=state.limited_count,
                since_last_warning=state.limited_unsaid,
                retry_in_s=round(wait, 2),
                hint="every answer is a 429: check the key's quota and --rpm/--tpm",
            )
            state.limited_unsaid = 0
            state.limited_report_at = tick + LIMITED_REPORT_EVERY
        return elapsed

    def tuned(self) -> list[ServerState]:
        """The servers whose cap adapts (``concurrency=auto``)."""
        return [st for st in self.states.values() if st.controller is not None]

    async def tune(self, elapsed: float) -> None:
        """Look at each healthy adapted server (its answers over the last ``elapsed``
        seconds and its ``/metrics``) and set its cap as its controller says.

        A look at ``/metrics`` is waited for up to ``probe_max`` seconds, then left to
        run (up to ``METRICS_TIMEOUT``) while the server's cap holds: a slow or failed
        look is no reason to tune a server blind, which would ramp up a server already
        too busy to answer. Only a server that never answered one is tuned without."""
        tuned = [st for st in self.tuned() if st.healthy]
        for state in tuned:
            state.unsampled += elapsed
            if state.scrape is None:
                state.scrape = asyncio.create_task(
                    self.metrics(state.url), name=f"metrics {state.url}"
                )
                # Read even when the server goes down before the look is used.
                state.scrape.add_done_callback(lambda t: t.cancelled() or t.exception())
        waiting = {st.scrape for st in tuned if st.scrape is not None and not st.blind}
        if waiting:
            await asyncio.wait(waiting, timeout=self.config.probe_max)
        for state in tuned:
            ready, view = self._looked(state)
            if ready:
                self._update(state, view)

    def _looked(self, state: ServerState) -> tuple[bool, dict[str, float | None] | None]:
        """What the last look at the server's ``/metrics`` gave: (False, None) when its
        controller gets no sample this time, else (True, its figures or None)."""
        task = state.scrape
        if task is None or not task.done():
            return state.blind, None
        state.scrape = None
        try:
            view = task.result()
        except RequestFailed as exc:
            state.metrics_misses += 1
            if state.metrics_misses == METRICS_TRIES:
                seen = state.metrics_seen
                event = "server_metrics_unreadable" if seen else "server_metrics_unavailable"
                log.info(event, server=state.url, reason=str(exc), looks=METRICS_TRIES)
            return state.blind, None
        if state.metrics_misses >= METRICS_TRIES:
            log.info("server_metrics_available", server=state.url)
        state.metrics_seen = True
        state.metrics_misses = 0
        return True, view

    def _update(self, state: ServerState, view: dict[str, float | None] | None) -> None:
        """Give the server's controller its sample; a change of cap is logged."""
        assert state.controller is not None
        change = state.controller.update(self._sample(state, state.unsampled, view))
        state.unsampled = 0.0
        if change is not None:
            log.info(
                "concurrency_changed",
                server=state.url,
                old=change.old,
                new=change.new,
                reason=change.reason,
            )
            self.set_cap(state.url, change.new)

    @staticmethod
    def _sample(state: ServerState, elapsed: float, view: dict[str, float | None] | None) -> Sample:
        """The server's figures since the last look, which start again from zero."""
        sample = Sample(
            elapsed=elapsed,
            in_flight=state.in_flight,
            tokens_per_s=state.tokens / elapsed if elapsed > 0 else None,
            latency=state.latency / state.answers if state.answers else None,
            **(view or {}),
        )
        state.answers = state.tokens = 0
        state.latency = 0.0
        return sample

    async def metrics(self, server: str) -> dict[str, float | None]:
        """The server's queue, running requests, KV-cache usage and retractions (or
        preemptions) from its ``/metrics``; ``RequestFailed`` when it gives none we know."""
        text = await probes.metrics_text(self.client.session, server, METRICS_TIMEOUT)
        view = server_metrics.tuning_view(text)
        if view is None:
            raise probes.RequestFailed("no SGLang, vLLM or llama.cpp figures in /metrics")
        return view

    async def close(self) -> None:
        running = [task for st in self.states.values() for task in (st.probe, st.scrape)]
        tasks = [task for task in running if task is not None and not task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
