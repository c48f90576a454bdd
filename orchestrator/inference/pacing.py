"""Pacing a hosted API: requests and tokens a minute, held until both budgets have room."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import orjson
import structlog

if TYPE_CHECKING:
    from orchestrator.inference.failures import Allowance, RateLimits


log = structlog.get_logger("orchestrator.inference.pacing")


# ------------------------------------------------------------------------ pacing
# A hosted API limits requests and tokens per minute, not a GPU: a request it has no
# budget for comes back as a 429, which the provider counts against the key. Each server
# has a pacer that holds a request before it is sent until both budgets have room.

#: Seconds of budget a cap given as ``--rpm``/``--tpm`` may be spent in at once: small,
#: since the provider's own burst is unknown; its headers, once seen, tell it.
CAP_BURST_SECONDS = 1.0
#: Longest the first request to a server is waited for, alone, before the others go
#: unpaced: its headers say whether the server paces (a hosted API), and a self-hosted
#: server that says nothing loses no more than this at the start of a run.
LEARN_SECONDS = 2.0
#: Share of a provider's bucket (as its headers say) kept back, and one request at least.
HEADROOM = 0.02
#: Backoff after a 429 that says no ``Retry-After``: doubles from the first, up to the last.
LIMITED_BACKOFF = (1.0, 60.0)
#: Seconds between two warnings about a server that still answers only 429.
LIMITED_REPORT_EVERY = 60.0


def request_tokens(body: Mapping[str, object]) -> int:
    """A request's tokens as a provider counts them before it answers: its prompt
    (about four characters a token, as OpenAI's guide says) plus ``max_tokens``."""
    prompt = body.get("messages") or body.get("prompt") or ""
    text = prompt if isinstance(prompt, str) else orjson.dumps(prompt)
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    return len(text) // 4 + 1 + (limit if isinstance(limit, int) else 0)


class _Bucket:
    """One budget (requests or tokens): ``rate`` a second, at most ``size`` at once;
    ``level`` may go below zero, a debt paid off before the next request goes."""

    __slots__ = ("given", "level", "rate", "size", "stamp")

    def __init__(self, per_minute: float | None, clock: float) -> None:
        self.given = bool(per_minute)  # a cap given: the headers' limit does not replace it
        self.rate = per_minute / 60 if per_minute else None
        self.size = max(1.0, self.rate * CAP_BURST_SECONDS) if self.rate else 0.0
        self.level = self.size
        self.stamp = clock

    def refill(self, now: float) -> None:
        if self.rate is not None:
            self.level = min(self.size, self.level + self.rate * (now - self.stamp))
        self.stamp = now

    def wait(self, need: float) -> float:
        """Seconds until ``need`` (no more than the whole bucket) is there."""
        if self.rate is None:
            return 0.0
        short = min(need, self.size) - self.level
        return max(0.0, short / self.rate)

    def learn(self, said: Allowance, since: float) -> None:
        """The provider's account: its limit a minute, what is left, and the seconds
        until its bucket is full again; ``since``: what is in flight beside it."""
        if said.limit and not self.given:
            self.rate = said.limit / 60
        remaining = said.remaining
        if self.rate is None or remaining is None:
            return
        full = remaining + self.rate * said.reset if said.reset is not None else remaining
        self.size = max(self.size, 1.0, full)
        # A little is kept back: requests reach the provider in another order, and a
        # moment later or earlier, than they were sent.
        reserve = max(1.0, HEADROOM * self.size)
        self.level = min(self.size, remaining - since - reserve)


class Pacer:
    """Holds a server's requests until its request and token budgets have room.

    The budgets are the caps given (``rpm``, ``tpm``), else learned from the server's
    ``x-ratelimit-*`` headers: its first request goes alone, up to ``LEARN_SECONDS``,
    and a server that sends none is not paced. A request is counted with its estimated
    tokens when it is sent, corrected by the usage its answer reports. What a header
    says is left is taken less every other request still in flight, which it may not
    have counted yet. A 429 pauses every request to a paced server until its
    ``Retry-After`` (or a backoff).
    """

    def __init__(self, rpm: int | None = None, tpm: int | None = None) -> None:
        now = time.monotonic()
        self.requests = _Bucket(rpm, now)
        self.tokens = _Bucket(tpm, now)
        self.learning = not (rpm or tpm)
        self.paused_until = 0.0
        self.backoff = LIMITED_BACKOFF[0]
        self.sent = 0  # requests sent so far: the ticket of the next one
        self._flying: dict[int, int] = {}  # ticket -> estimated tokens, until it ends
        self._flying_tokens = 0
        self._applied = -1  # the newest ticket whose headers were applied
        self._lock = asyncio.Lock()
        self._learned = asyncio.Event()
        self._probing = False

    @property
    def unpaced(self) -> bool:
        """No budget given or learned, and nothing left to learn: every request goes at
        once (a self-hosted server), without the lock and the clock reads."""
        return not self.learning and self.requests.rate is None and self.tokens.rate is None

    async def acquire(self, tokens: int) -> int:
        """Wait until a request of ``tokens`` estimated tokens may go; its ticket."""
        if self.unpaced and not self._lock.locked():
            return self._take(tokens)
        async with self._lock:
            while self.learning and self._probing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._learned.wait(), LEARN_SECONDS)
                if not self._learned.is_set():
                    self.learning = False  # it says nothing in time: not paced
            # The budgets refill with time, not on an event: sleep until there is room.
            while (wait := self._wait(tokens)) > 0:  # noqa: ASYNC110
                await asyncio.sleep(wait)
            self._probing = self.learning
            return self._take(tokens)

    def _take(self, tokens: int) -> int:
        """Count a request that goes now against the budgets; its ticket."""
        self.requests.level -= 1
        self.tokens.level -= tokens
        ticket = self.sent
        self.sent += 1
        self._flying[ticket] = tokens
        self._flying_tokens += tokens
        return ticket

    def _wait(self, tokens: int) -> float:
        now = time.monotonic()
        self.requests.refill(now)
        self.tokens.refill(now)
        paused = self.paused_until - now
        return max(paused, self.requests.wait(1), self.tokens.wait(tokens))

    def answered(self, ticket: int, limits: RateLimits | None, used: int | None) -> None:
        """An answer: its headers teach the budgets, its usage corrects the estimate."""
        estimate = self._landed(ticket)
        if used is not None and self.tokens.rate is not None:
            self.tokens.level += estimate - used
        self.backoff = LIMITED_BACKOFF[0]
        self._heard(ticket, limits)

    def failed(self, ticket: int, limits: RateLimits | None) -> None:
        """A request that got no answer (not a 429): nothing was learned of its tokens."""
        self._landed(ticket)
        self._heard(ticket, limits)

    def limited(self, ticket: int, retry_after: float | None, limits: RateLimits | None) -> float:
        """A 429: every request waits until ``retry_after`` or the backoff; the wait.
        Only a paced server (its budget given or learned) is paused so: from another,
        a 429 is a single request's (a proxy's, a fault's), and its item waits alone."""
        self._landed(ticket)
        self._heard(ticket, limits)
        if self.requests.rate is None and self.tokens.rate is None:
            return retry_after or 0.0
        if retry_after is None:
            retry_after = self.backoff
            self.backoff = min(self.backoff * 2, LIMITED_BACKOFF[1])
        self.paused_until = max(self.paused_until, time.monotonic() + retry_after)
        self.requests.level = min(self.requests.level, 0.0)
        return retry_after

    def _landed(self, ticket: int) -> int:
        """The request is no longer in flight: its estimated tokens."""
        estimate = self._flying.pop(ticket, 0)
        self._flying_tokens -= estimate
        return estimate

    def _heard(self, ticket: int, limits: RateLimits | None) -> None:
        """What the server's headers said, when newer than what was applied before."""
        if self.learning:
            self.learning = self._probing = False
            self._learned.set()
        if limits is None or ticket <= self._applied:
            return
        self._applied = ticket
        now = time.monotonic()
        self.requests.refill(now)
        self.tokens.refill(now)
        self.requests.learn(limits.requests, len(self._flying))
        self.tokens.learn(limits.tokens, self._flying_tokens)
