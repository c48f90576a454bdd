"""What a running simulated server holds: its counters, the batching model stepped in
real time, its prefix cache and rate limits, and the fault draw.

One :class:`State` per application (``STATE`` is its key); the handlers
(``orchestrator.sim.server``) and what they call read and count through it. Kept apart
because its parts live as long as the server, where everything else lives for a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict, deque
from typing import IO, Any

import orjson
from aiohttp import web

from orchestrator.sim.batching import BatchModel, Seq
from orchestrator.sim.bill import Bill
from orchestrator.sim.config import FAULT_KINDS, SimConfig
from orchestrator.sim.prefix import PrefixCache
from orchestrator.sim.ratelimit import Limiter

#: Window of ``sglang:gen_throughput``, in seconds.
_THROUGHPUT_WINDOW = 10

LATENCY_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


class Stats:
    """Counters behind ``/metrics`` and ``/sim/stats``; one event loop, so no locking."""

    def __init__(self) -> None:
        self.chat_requests = 0
        self.completed = 0
        self.invalid = 0
        self.aborted = 0
        # Completion tokens streamed to clients that left before the end of the answer.
        self.aborted_tokens = 0
        self.running = 0
        self.peak_running = 0
        # Sequences being generated (a request of n choices is n), and the most at once.
        self.sequences = 0
        self.peak_sequences = 0
        self.running_tokens = 0
        self.outage_rejected = 0
        self.rate_limited = 0  # 429s of the provider's buckets (--rate-limit)
        self.faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        # (whole second, tokens generated in it), newest last; bounded by the window.
        self.recent_tokens: deque[list[int]] = deque()

    def record_completion(self, prompt: int, completion: int, seconds: float) -> None:
        self.completed += 1
        self.prompt_tokens += prompt
        self.generation_tokens += completion
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1
        now = int(time.monotonic())
        if self.recent_tokens and self.recent_tokens[-1][0] == now:
            self.recent_tokens[-1][1] += completion
        else:
            self.recent_tokens.append([now, completion])
        self._prune(now)

    def _prune(self, now: int) -> None:
        while self.recent_tokens and self.recent_tokens[0][0] <= now - _THROUGHPUT_WINDOW:
            self.recent_tokens.popleft()

    def throughput(self, uptime: float) -> float:
        self._prune(int(time.monotonic()))
        window = min(float(_THROUGHPUT_WINDOW), max(uptime, 1.0))
        return sum(tokens for _, tokens in self.recent_tokens) / window

    def as_json(self) -> dict[str, Any]:
        return {
            "chat_requests": self.chat_requests,
            "completed": self.completed,
            "invalid": self.invalid,
            "faults": dict(self.faults),
            "aborted": self.aborted,
            "aborted_tokens": self.aborted_tokens,
            "running": self.running,
            "peak_running": self.peak_running,
            "peak_sequences": self.peak_sequences,
            "outage_rejected": self.outage_rejected,
            "rate_limited": self.rate_limited,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }


class Batcher:
    """The batching model (``orchestrator.sim.batching``) stepped in real time, scaled by
    ``time_scale``: one task advances it; requests wait on futures, so a few hundred of
    them cost little CPU.

    It keeps the simulated clock too: every step's seconds, plus idle time scaled back,
    from the first request on. A machine too busy to keep up slows the steps down but
    not this clock, so a run's simulated duration does not depend on the load of the
    machine it ran on. ``--trace FILE`` writes each step on it, one JSON line.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.model = BatchModel(config)
        self.clock = 0.0
        self.recent_tokens: deque[list[int]] = deque()  # (second, tokens decoded)
        self._idle_since: float | None = None
        self._trace: IO[str] | None = None
        if config.trace:
            self._trace = open(config.trace, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def fits(self, tokens: int) -> bool:
        return self.model.fits(tokens)

    def throughput(self) -> float:
        now = int(time.monotonic())
        while self.recent_tokens and self.recent_tokens[0][0] <= now - _THROUGHPUT_WINDOW:
            self.recent_tokens.popleft()
        if not self.recent_tokens:
            return 0.0
        window = min(_THROUGHPUT_WINDOW, now - self.recent_tokens[0][0] + 1)
        return sum(tokens for _, tokens in self.recent_tokens) / window

    async def generate(self, prompt: int, target: int, limit: int, cached: int = 0) -> None:
        """Wait until the request has generated ``target`` tokens (``cached`` of its prompt
        tokens held by the prefix cache are not prefilled)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq = Seq(prompt, target, limit, done, cached=cached)
        self.model.add(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sim batcher")
        self._wake.set()
        try:
            await done
        finally:
            self.model.drop(seq)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:
            if not self.model.busy:
                self._wake.clear()
                self._idle_since = loop.time()
                await self._wake.wait()
                clock = loop.time()
                if self.model.steps:
                    self.clock += (clock - self._idle_since) / self.config.time_scale
                continue
            clock += self._step() * self.config.time_scale
            delay = clock - loop.time()
            if delay < -1.0:
                clock = loop.time()  # far behind (a busy machine): do not race to catch up
            await asyncio.sleep(max(delay, 0.0))

    def _step(self) -> float:
        """One step of the model; wakes the requests it finished, returns its seconds."""
        seconds, batch, finished = self.model.step()
        for seq in finished:
            if not seq.tag.done():
                seq.tag.set_result(None)
        self.clock += seconds
        now = int(time.monotonic())
        if self.recent_tokens and self.recent_tokens[-1][0] == now:
            self.recent_tokens[-1][1] += batch
        else:
            self.recent_tokens.append([now, batch])
        if self._trace is not None:
            line = {
                "t": round(self.clock, 4),
                "batch": batch,
                "queued": len(self.model.queue),
                "finished": len(finished),
                "kv": self.model.kv_used,
            }
            self._trace.write(orjson.dumps(line).decode() + "\n")
        return seconds

    def as_json(self) -> dict[str, Any]:
        return {**self.model.as_json(), "clock": self.clock}


class State:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = Stats()
        self.batcher = Batcher(config) if config.batching else None
        self.prefix = PrefixCache(config.prefix_cache) if config.prefix_cache else None
        self.limiter = Limiter(config.rate_limits) if config.rate_limits else None
        self.bill = Bill(config)  # what the answers would cost (/sim/bill)
        self.fault_rng = random.Random(config.seed)
        self.started = time.monotonic()
        self.closing = asyncio.Event()
        self.next_id = 0
        #: The text of each recent answer asked with its ids, by its ids: /detokenize.
        self.spelled: OrderedDict[tuple[int, ...], str] = OrderedDict()
        # Cumulative upper bounds of each fault kind's slice of [0, 1).
        self.fault_table: list[tuple[float, str]] = []
        edge = 0.0
        for kind in FAULT_KINDS:
            rate = config.faults.get(kind, 0.0)
            if rate > 0:
                edge += rate
                self.fault_table.append((edge, kind))

    def remember_spelling(self, ids: list[int], text: str) -> None:
        """What ``/detokenize`` says of ``ids``: the last 4,096 answers are kept."""
        self.spelled[tuple(ids)] = text
        while len(self.spelled) > 4096:
            self.spelled.popitem(last=False)

    def uptime(self) -> float:
        return time.monotonic() - self.started

    def in_outage(self) -> bool:
        now = self.uptime()
        return any(start <= now < start + duration for start, duration in self.config.outages)

    def draw_fault(self) -> str | None:
        if not self.fault_table:
            return None
        x = self.fault_rng.random()
        for edge, kind in self.fault_table:
            if x < edge:
                return kind
        return None


STATE = web.AppKey("sim_state", State)
