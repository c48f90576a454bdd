"""The continuous-batching model of one inference server, without I/O or a clock.

The simulated server (``orchestrator.sim.server``) steps it in real time, scaled; the
offline scheduler (``orchestrator.sim.offline``) steps it in simulated time, as fast as
Python runs it. Both answer with the same server, so a run through HTTP and its ideal
schedule differ only in when requests reach the queue.

Each step admits queued requests while the cache (less what the running ones are
expected to still need) holds them, then decodes one token of every running request;
when the cache cannot hold the step's tokens, the newest running requests are retracted
to the front of the queue, as vLLM preempts (with ``retraction="sglang"``, those
SGLang's ``retract_decode`` picks, to the back: see ``_retract_sglang``).

With ``admission="fifo"`` it schedules as vLLM's v1 scheduler
(``vllm/v1/core/sched/scheduler.py``): the running requests first, each needing a slot
for its next token, the newest preempted (freed, to be computed again) until they fit;
then, only in a step that preempted none, queued requests in order while the batch has
room and their tokens fit the cache now, nothing reserved for what they will generate.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from orchestrator.sim.config import SimConfig

__all__ = ["BatchModel", "Seq"]

#: SGLang's admission estimate: a running request is expected to still need this share of
#: its ``max_tokens``. It starts cautious, grows bolder each step, and goes back to
#: cautious when the cache overflows.
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = (NEW_TOKEN_RATIO_INIT - NEW_TOKEN_RATIO_MIN) / 600
#: SGLang's retraction frees room for this many more decode steps of what stays.
RETRACT_DECODE_STEPS = 20


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the batching model; ``tag`` is its owner's (a future, an id)."""

    prompt: int
    target: int  # tokens it will generate
    limit: int  # tokens the server must expect it may generate (its max_tokens)
    tag: Any = None
    cached: int = 0  # prompt tokens its prefix cache held: not prefilled when first admitted
    generated: int = 0
    place: str = "queued"  # queued | running | done

    @property
    def kv(self) -> int:
        return self.prompt + self.generated


class BatchModel:
    """Queue, batch and KV cache of one server; ``step`` advances it by one decode step."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.capacity = config.kv_tokens or math.inf
        self.max_running = config.max_running or math.inf
        self.queue: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.kv_used = 0
        self.ratio = NEW_TOKEN_RATIO_INIT
        self.retracted = 0
        self.steps = 0
        self.peak_running = 0
        self.peak_queued = 0
        self.peak_usage = 0.0

    def fits(self, tokens: int) -> bool:
        return tokens <= self.capacity

    @property
    def usage(self) -> float:
        return self.kv_used / self.config.kv_tokens if self.config.kv_tokens else 0.0

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queue)

    def add(self, seq: Seq) -> None:
        """Queue a request (behind those already waiting)."""
        seq.limit = max(seq.limit, seq.target)
        self.queue.append(seq)
        self.peak_queued = max(self.peak_queued, len(self.queue))

    def drop(self, seq: Seq) -> None:
        """Forget a request that left before its end (its client went away)."""
        if seq.place == "queued":
            self.queue.remove(seq)
        elif seq.place == "running":
            self.running.remove(seq)
            self.kv_used -= seq.kv
        seq.place = "done"

    def step(self) -> tuple[float, int, list[Seq]]:
        """One scheduling round and decode step: its simulated seconds, the tokens it
        decoded (the batch) and the requests it finished."""
        if self.config.admission == "fifo":
            prefill = 0 if self._retract() else self._admit_fifo()
        else:
            prefill = self._admit()
            self._retract()
        batch = len(self.running)
        self.peak_running = max(self.peak_running, batch)
        self.peak_queued = max(self.peak_queued, len(self.queue))
        if self.config.kv_tokens:
            self.peak_usage = max(self.peak_usage, (self.kv_used + batch) / self.config.kv_tokens)
        kept: list[Seq] = []
        finished: list[Seq] = []
        for seq in self.running:
            seq.generated += 1
            if seq.generated >= seq.target:
                self.kv_used -= seq.prompt + seq.generated - 1
                seq.place = "done"
                finished.append(seq)
            else:
                kept.append(seq)
        self.kv_used += len(kept)
        self.running = kept
        self.steps += 1
        self.ratio = max(NEW_TOKEN_RATIO_MIN, self.ratio - NEW_TOKEN_RATIO_DECAY)
        config = self.config
        seconds = (
            config.step_time + config.step_per_request * batch + config.prefill_per_token * prefill
        )
        return seconds, batch, finished

    def _admit(self) -> int:
        """Move queued requests into the batch while the cache holds them; returns the
        tokens to prefill."""
        prefill = 0
        ratio = self.ratio
        reserved = sum(ratio * (s.limit - s.generated) for s in self.running)
        while self.queue and len(self.running) < self.max_running:
            seq = self.queue[0]
            need = seq.kv + ratio * (seq.limit - seq.generated)
            if self.running and self.kv_used + reserved + need > self.capacity:
                break
            reserved += ratio * (seq.limit - seq.generated)
            prefill += self._start()
        return prefill

    def _admit_fifo(self) -> int:
        """vLLM's admission: the head of the queue while the batch has room and the cache
        holds the running requests' next tokens, its own tokens and its first new one."""
        prefill = 0
        while self.queue and len(self.running) < self.max_running:
            need = self.kv_used + len(self.running) + self.queue[0].kv + 1
            if self.running and need > self.capacity:
                break
            prefill += self._start()
        return prefill

    def _start(self) -> int:
        """Move the head of the queue into the batch; returns the tokens to prefill."""
        seq = self.queue.popleft()
        seq.place = "running"
        self.running.append(seq)
        self.kv_used += seq.kv
        prefill = seq.kv - seq.cached
        seq.cached = 0  # retracted and admitted again, it is prefilled whole
        return prefill

    def _retract(self) -> int:
        """Every running request adds a token to the cache; retract the newest until they
        fit. Returns how many were retracted."""
        if self.config.retraction == "sglang":
            return self._retract_sglang()
        retracted = 0
        while len(self.running) > 1 and self.kv_used + len(self.running) > self.capacity:
            seq = self.running.pop()
            self.kv_used -= seq.kv
            seq.place = "queued"
            self.queue.appendleft(seq)
            retracted += 1
            self.ratio = NEW_TOKEN_RATIO_INIT
        self.retracted += retracted
        return retracted

    def _retract_sglang(self) -> int:
        """SGLang's ``retract_decode``: the fewest generated tokens first (the longest
        prompt among equals), until the rest have room for ``RETRACT_DECODE_STEPS`` more
        steps; they wait at the back of the queue, and the admission estimate starts again
        from what the rest have generated of their ``max_tokens``."""
        if self.kv_used + len(self.running) <= self.capacity:
            return 0
        keep = sorted(self.running, key=lambda s: (s.generated, -s.prompt), reverse=True)
        retracted: list[Seq] = []
        while len(keep) > 1 and (
            not retracted or self.kv_used + len(keep) * RETRACT_DECODE_STEPS > self.capacity
        ):
            seq = keep.pop()
            self.kv_used -= seq.kv
            seq.place = "queued"
            retracted.append(seq)
        self.queue.extend(retracted)
        self.running = [seq for seq in self.running if seq.place == "running"]
        self.retracted += len(retracted)
        decoded = sum(seq.generated for seq in keep) + RETRACT_DECODE_STEPS * len(keep)
        self.ratio = min(1.0, decoded / (sum(seq.limit for seq in keep) + 1))
        return len(retracted)

    def decode_rate(self, batch: int) -> float:
        """Tokens per second a batch of ``batch`` requests generates, prefill aside."""
        config = self.config
        return batch / (config.step_time + config.step_per_request * batch)

    def as_json(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "queued": len(self.queue),
            "kv_used": self.kv_used,
            "kv_tokens": self.config.kv_tokens,
            "token_usage": self.usage,
            "peak_running": self.peak_running,
            "peak_queued": self.peak_queued,
            "peak_token_usage": self.peak_usage,
            "retracted": self.retracted,
            "steps": self.steps,
        }
