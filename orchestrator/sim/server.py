"""A simulated OpenAI-compatible inference server.

It stands in for an SGLang/vLLM server wherever a GPU is not wanted: tests, rehearsals of a
run, benchmarks of the orchestrator itself and the demo. Answers are deterministic and carry
the digest of the request they answer, so a caller can prove that every stored answer
belongs to its prompt. Failures real servers show under load (5xx, 429, resets, hangs,
garbage bodies, restarts) can be injected at chosen rates to rehearse recovery.

It can also answer as a reasoning model does, with the thinking in a separate field (a
server with a reasoning parser) or left in the content between ``<think>`` tags (one
without), and with tool calls when the request offers tools, so that everything a client
must take apart can be exercised without a GPU.

Run it with ``python -m orchestrator.sim.server --port 30000 --fault 500=0.05``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

import click
import orjson
from aiohttp import web

from orchestrator.items.quality import split_think
from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim.batching import BatchModel, Seq
from orchestrator.sim.config import FAULT_KINDS, SimConfig
from orchestrator.sim.exposition import Figures, metrics_text
from orchestrator.sim.length_model import dataset_of, quantile
from orchestrator.sim.options import sim_config, sim_options
from orchestrator.sim.prefix import PrefixCache, prompt_words
from orchestrator.sim.ratelimit import Limiter

__all__ = [
    "answer_matches",
    "build_app",
    "main",
    "request_digest",
    "run_forever",
    "serve",
]

#: How thinking is wrapped in the content, as chat templates do; tags count as no tokens.
_THINK_OPEN = "<think>\n"
_THINK_CLOSE = "\n</think>\n\n"

_TOOL_CHOICES = ("none", "auto", "required")

#: Words of the filler text; short and plain so that one word is one "token".
_FILLER = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
    "chi", "psi", "omega", "river", "stone", "cloud", "field", "light", "shadow", "signal",
    "vector", "matrix", "kernel", "tensor", "batch", "token", "cache", "queue", "worker",
    "answer", "prompt", "model", "layer", "north", "south", "east", "west", "amber", "cobalt",
    "copper", "silver", "violet", "green", "orange", "purple", "quiet", "swift",
)  # fmt: skip

#: Words per streamed chunk: a few, like a server that flushes every couple of decode steps.
_CHUNK_WORDS = 4

#: KV-cache size the ``sglang:token_usage`` gauge is measured against.
_KV_CAPACITY_TOKENS = 262_144

#: Window of ``sglang:gen_throughput``, in seconds.
_THROUGHPUT_WINDOW = 10

_LATENCY_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

_JSON = "application/json"


def request_digest(messages: Any, seed: Any = None) -> str:
    """Digest of a request's messages; key order does not matter, content does. With a
    ``seed`` (a request's, or choice ``i`` of a request with ``n``: seed + i), another
    digest: the answer is another draw, the same for the same seed."""
    digest = hashlib.sha256(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    if seed is None:
        return digest
    return hashlib.sha256(f"{digest}:{seed}".encode()).hexdigest()[:16]


def choice_seeds(body: dict[str, Any], n: int) -> list[Any]:
    """The seed each of a request's ``n`` choices is drawn with: choice ``i`` of a
    request seeded ``s`` as a request seeded ``s + i`` would be (unseeded: the first as
    an unseeded request, the others each their own)."""
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(n)]
    return [None, *(f"choice-{i}" for i in range(1, n))]


def answer_matches(messages: Any, answer: Any, seed: Any = None) -> bool:
    """Whether ``answer`` is a simulated answer to ``messages`` (and not to another prompt).

    ``answer`` is the content string, or the whole assistant message: then every part it
    has (content, reasoning, each tool call's arguments) must carry the digest, and it must
    have one, so a truncated answer that is all reasoning is still proven. A ``<think>``
    block left in a content string is checked as reasoning. ``seed``: the answer must be
    the draw of that seed.
    """
    digest = request_digest(messages, seed)
    if isinstance(answer, str):
        reasoning, content, _ = split_think(answer)
        return _content_matches(content, digest) and (
            reasoning is None or _starts_with(reasoning, _reasoning_tag(digest))
        )
    if not isinstance(answer, dict):
        return False
    content = answer.get("content")
    reasoning = answer.get("reasoning_content")
    if reasoning is None:
        reasoning = answer.get("reasoning")
    if reasoning is None and isinstance(content, str):
        reasoning, content, _ = split_think(content)
    calls = answer.get("tool_calls") or []
    parts = 0
    if content is not None and (not isinstance(content, str) or content.strip()):
        if not _content_matches(content, digest):
            return False
        parts += 1
    if reasoning is not None:
        if not _starts_with(reasoning, _reasoning_tag(digest)):
            return False
        parts += 1
    for call in calls:
        if not _call_matches(call, digest):
            return False
        parts += 1
    return parts > 0


def _content_matches(content: Any, digest: str) -> bool:
    """Plain content starts with the digest's tag; a JSON answer with its ``sim`` key."""
    if isinstance(content, str) and content.startswith('{"sim": '):
        return content.startswith(f'{{"sim": "{digest}"')
    return _starts_with(content, f"[sim:{digest}]")


def _starts_with(text: Any, tag: str) -> bool:
    if not isinstance(text, str):
        return False
    first = text.split(maxsplit=1)
    return bool(first) and first[0] == tag


def _call_matches(call: Any, digest: str) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return False
    try:
        doc = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        # Cut by max_tokens: the digest is the first thing written, so the prefix holds it.
        return arguments.startswith(_tool_arguments(digest, [], complete=False))
    return isinstance(doc, dict) and doc.get("sim") == digest


def _reasoning_tag(digest: str) -> str:
    return f"[sim-reasoning:{digest}]"


def _completion_length(digest: str, mean_tokens: int) -> int:
    low = max(1, mean_tokens // 2)
    high = max(low, (3 * mean_tokens) // 2)
    return low + int(digest[:8], 16) % (high - low + 1)


def _lengths(
    body: dict[str, Any], digest: str, config: SimConfig, *, thinking: bool
) -> tuple[int, int]:
    """Answer and reasoning lengths: from the dataset's distribution when the length model
    has one (split by its reasoning share), else about ``mean_tokens`` each."""
    model = config.length_model
    spec = model.distribution(dataset_of(body)) if model is not None else None
    if spec is None:
        answer = _completion_length(digest, config.mean_tokens)
        # Another slice of the digest, so reasoning and answer lengths vary independently.
        return answer, _completion_length(digest[8:], config.mean_tokens) if thinking else 0
    total = spec.tokens(quantile(digest, config.seed))
    reasoning = min(round(total * spec.reasoning), total - 1) if thinking else 0
    return total - reasoning, reasoning


def _answer_words(digest: str, seed: int, n: int) -> list[str]:
    # A str seed is hashed with sha512 by random.seed, so this is stable across processes.
    rng = random.Random(f"{seed}:{digest}")
    return [f"[sim:{digest}]", *rng.choices(_FILLER, k=n - 1)]


def _reasoning_words(digest: str, seed: int, n: int) -> list[str]:
    rng = random.Random(f"{seed}:{digest}:reasoning")
    return [_reasoning_tag(digest), *rng.choices(_FILLER, k=n - 1)]


def _tool_arguments(digest: str, words: list[str], *, complete: bool) -> str:
    """The JSON arguments of a simulated tool call made of ``words`` (the first one stands
    for the digest); a call cut by max_tokens is a prefix of the complete one, as streamed."""
    text = f'{{"sim": "{digest}"'
    if len(words) > 1:
        text += ', "text": "' + " ".join(words[1:])
    if complete:
        text += '"}' if len(words) > 1 else "}"
    return text


def _count_prompt_tokens(messages: list[Any]) -> int:
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            count += len(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    count += len(part["text"].split())
    return count


class _Stats:
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
        self.latency_buckets = [0] * len(_LATENCY_BUCKETS)
        self.latency_sum = 0.0
        # (whole second, tokens generated in it), newest last; bounded by the window.
        self.recent_tokens: deque[list[int]] = deque()

    def record_completion(self, prompt: int, completion: int, seconds: float) -> None:
        self.completed += 1
        self.prompt_tokens += prompt
        self.generation_tokens += completion
        self.latency_sum += seconds
        for i, bound in enumerate(_LATENCY_BUCKETS):
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


class _Batcher:
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


class _State:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = _Stats()
        self.batcher = _Batcher(config) if config.batching else None
        self.prefix = PrefixCache(config.prefix_cache) if config.prefix_cache else None
        self.limiter = Limiter(config.rate_limits) if config.rate_limits else None
        self.fault_rng = random.Random(config.seed)
        self.started = time.monotonic()
        self.closing = asyncio.Event()
        self.next_id = 0
        # Cumulative upper bounds of each fault kind's slice of [0, 1).
        self.fault_table: list[tuple[float, str]] = []
        edge = 0.0
        for kind in FAULT_KINDS:
            rate = config.faults.get(kind, 0.0)
            if rate > 0:
                edge += rate
                self.fault_table.append((edge, kind))

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


_STATE = web.AppKey("sim_state", _State)


def _error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON, headers=headers)


def _bad_request(message: str) -> web.Response:
    return _error(400, message, "BadRequestError")


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


@web.middleware
async def _outage_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[_STATE]
    if state.in_outage():
        state.stats.outage_rejected += 1
        return _error(503, "server unavailable (simulated outage)", "ServiceUnavailableError")
    return await handler(request)


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[_STATE].config.api_key
    authorized = request.headers.get("Authorization") == f"Bearer {key}"
    if key and request.path.startswith("/v1/") and not authorized:
        return _error(401, "invalid or missing API key", "AuthenticationError")
    return await handler(request)


def _validate(state: _State, raw: bytes, *, plain: bool = False) -> dict[str, Any] | web.Response:
    """The request body, or the refusal a server gives it; ``plain``: a raw completion's
    (a ``prompt`` string where a chat request has messages)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _bad_request(f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _bad_request("request body must be a JSON object")
    missing = [name for name in state.config.required_fields if name not in body]
    if missing:
        return _unprocessable(body, missing)
    if plain:
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            return _bad_request("'prompt' must be a non-empty string")
        if "messages" in body:
            return _bad_request("a completion takes a 'prompt', not 'messages'")
        if body.get("logprobs") is not None and sim_tokens.asked(body, True) is None:
            return _bad_request("'logprobs' must be a non-negative integer")
        body = {**body, "messages": [{"role": "user", "content": body["prompt"]}]}
    messages = body.get("messages")
    if messages is None:
        return _bad_request("'messages' is a required property")
    if not isinstance(messages, list):
        return _bad_request("'messages' must be a list of message objects")
    if not messages:
        return _bad_request("'messages' must contain at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return _bad_request(f"messages[{i}] must be an object with a string 'role'")
    model = body.get("model")
    if not state.config.serves(model):
        return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1):
            return _bad_request(f"'{key}' must be a positive integer, got {value!r}")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        return _bad_request("'stream' must be a boolean")
    n = body.get("n", 1)
    if type(n) is not int or not 1 <= n <= 128:
        return _bad_request(f"'n' must be an integer from 1 to 128, got {n!r}")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        return _bad_request(f"'seed' must be an integer, got {seed!r}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return _bad_request("'chat_template_kwargs' must be an object")
    problem = _check_tools(body.get("tools"), body.get("tool_choice"))
    if problem:
        return _bad_request(problem)
    text = orjson.dumps(messages).decode()
    for marker, message in state.config.refusals.items():
        if marker in text:
            return _bad_request(message)
    return body


def _unprocessable(body: dict[str, Any], missing: list[str]) -> web.Response:
    """FastAPI's answer to a body that fails validation: each error echoes its input,
    here the whole request, so no two requests get the same text."""
    detail = [
        {"type": "missing", "loc": ["body", name], "msg": "Field required", "input": body}
        for name in missing
    ]
    return web.Response(status=422, body=orjson.dumps({"detail": detail}), content_type=_JSON)


def _check_tools(tools: Any, choice: Any) -> str | None:
    """What is wrong with a request's ``tools`` and ``tool_choice``, as a server says it."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            return "'tools' must be a list of tool objects"
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return f"tools[{i}] must be an object with a 'function' that has a string 'name'"
            names.append(function["name"])
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required" or isinstance(choice, dict):
        if not names:
            return "when using 'tool_choice', 'tools' must be set"
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if name not in names:
                return f"'tool_choice' names a function that is not in 'tools': {name!r}"
        return None
    return f"'tool_choice' must be one of {', '.join(_TOOL_CHOICES)} or name a function"


@dataclass(frozen=True, slots=True)
class _Answer:
    """What the simulated model generated for one request, before it is put into JSON or
    SSE; both renderings come from it, so a streamed answer equals the plain one."""

    digest: str
    thinking: bool  # the answer starts with reasoning (mode on, not turned off per request)
    reasoning: list[str]  # reasoning words generated, possibly cut by max_tokens
    reasoning_closed: bool  # the thinking ended before the token budget did
    words: list[str]  # answer words: the content, or the tool call's argument tokens
    tool: str | None  # name of the called function, when the answer is a tool call
    finish_reason: str
    json_kind: str | None = None  # asked for JSON: valid, invalid_json or schema_mismatch

    @property
    def tokens(self) -> int:
        return len(self.reasoning) + len(self.words)

    @property
    def calls_tool(self) -> bool:
        return self.tool is not None and bool(self.words)


def _thinking_off(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def _tool_to_call(body: dict[str, Any], digest: str, config: SimConfig) -> str | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    first = str(tools[0]["function"]["name"])
    if choice == "required":
        return first
    draw = random.Random(f"{config.seed}:{digest}:tools").random()
    return first if draw < config.tool_call_rate else None


def _generate(
    body: dict[str, Any], digest: str, config: SimConfig, *, empty: bool, plain: bool = False
) -> _Answer:
    """The answer to ``body``: reasoning first, then content or a tool call, cut by the
    request's token limit wherever it falls. A raw completion (``plain``) is text only."""
    thinking = config.reasoning != "none" and not _thinking_off(body) and not empty
    thinking = thinking and not plain
    tool = None if empty or plain else _tool_to_call(body, digest, config)
    answer_length, reasoning_length = _lengths(body, digest, config, thinking=thinking)
    full = reasoning_length + answer_length
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = min(full, limit) if limit else full
    finish_reason = "length" if budget < full else "tool_calls" if tool else "stop"
    if empty:
        return _Answer(digest, False, [], True, [], None, finish_reason)
    in_reasoning = min(reasoning_length, budget)
    reasoning = _reasoning_words(digest, config.seed, reasoning_length)[:in_reasoning]
    words = _answer_words(digest, config.seed, answer_length)[: budget - in_reasoning]
    closed = in_reasoning == reasoning_length
    kind = _json_kind(body, digest, config) if tool is None else None
    return _Answer(digest, thinking, reasoning, closed, words, tool, finish_reason, kind)


def json_answer_kind(digest: str, seed: int, invalid_rate: float, mismatch_rate: float) -> str:
    """What a request asking for JSON is answered with: ``valid``, ``invalid_json`` or
    ``schema_mismatch``, fixed by its digest (an oracle recomputes it)."""
    draw = random.Random(f"{seed}:{digest}:json").random()
    if draw < invalid_rate:
        return "invalid_json"
    return "schema_mismatch" if draw < invalid_rate + mismatch_rate else "valid"


def _json_kind(body: dict[str, Any], digest: str, config: SimConfig) -> str | None:
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        return None
    return json_answer_kind(
        digest, config.seed, config.json_invalid_rate, config.json_mismatch_rate
    )


def _json_content(digest: str, words: list[str], kind: str, *, complete: bool) -> str:
    """A JSON answer made of ``words`` (the first stands for the digest), as far as it got:
    complete, it parses, unless its kind is ``invalid_json``."""
    key = "words" if kind == "schema_mismatch" else "text"
    text = _tool_arguments(digest, words, complete=complete and kind != "invalid_json")
    return text.replace('"text": "', f'"{key}": "', 1)


def _tool_call(answer: _Answer) -> dict[str, Any]:
    complete = answer.finish_reason != "length"
    return {
        "id": f"call_{answer.digest}",
        "type": "function",
        "function": {
            "name": answer.tool,
            "arguments": _tool_arguments(answer.digest, answer.words, complete=complete),
        },
    }


def _message(answer: _Answer, config: SimConfig) -> dict[str, Any]:
    """The assistant message of a non-streaming answer."""
    # A tool call's answer is in the call; its content is null, or only the thinking.
    text = " ".join(answer.words) if answer.tool is None else ""
    if answer.json_kind is not None:
        complete = answer.finish_reason != "length"
        text = _json_content(answer.digest, answer.words, answer.json_kind, complete=complete)
    thought = " ".join(answer.reasoning)
    close = _THINK_CLOSE if answer.reasoning_closed else ""
    message: dict[str, Any] = {"role": "assistant"}
    mode = config.reasoning if answer.thinking else "none"
    if mode == "none":
        message["content"] = text if answer.tool is None else None
    elif mode == "field":
        message["content"] = text or None
        message[config.reasoning_field] = thought or None
    elif mode == "think":
        message["content"] = _THINK_OPEN + thought + close + text
    else:  # think-end
        message["content"] = thought + close + text
    if answer.calls_tool:
        message["tool_calls"] = [_tool_call(answer)]
    return message


def _deltas(answer: _Answer, config: SimConfig) -> list[tuple[dict[str, Any], int]]:
    """The streamed deltas of an answer, after the role chunk, with the tokens each holds."""
    deltas: list[tuple[dict[str, Any], int]] = []
    mode = config.reasoning if answer.thinking else "none"
    for i, piece in enumerate(_pieces(answer.reasoning)):
        text = " ".join(piece) if i == 0 else " " + " ".join(piece)
        if mode == "field":
            deltas.append(({config.reasoning_field: text}, len(piece)))
        else:
            opening = _THINK_OPEN if mode == "think" and i == 0 else ""
            deltas.append(({"content": opening + text}, len(piece)))
    if mode in ("think", "think-end") and answer.reasoning_closed:
        deltas.append(({"content": _THINK_CLOSE}, 0))
    if answer.calls_tool:
        call = _tool_call(answer)
        head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
        deltas.append(({"tool_calls": [{"index": 0, **head}]}, 0))
        sent, count = "", 0
        for piece in _pieces(answer.words):
            count += len(piece)
            upto = _tool_arguments(answer.digest, answer.words[:count], complete=False)
            if count == len(answer.words):
                upto = call["function"]["arguments"]
            part = {"index": 0, "function": {"arguments": upto[len(sent) :]}}
            deltas.append(({"tool_calls": [part]}, len(piece)))
            sent = upto
    elif answer.json_kind is not None:
        deltas.extend(_json_deltas(answer))
    elif answer.tool is None:
        for i, piece in enumerate(_pieces(answer.words)):
            text = " ".join(piece)
            deltas.append(({"content": text if i == 0 else " " + text}, len(piece)))
    return deltas


def _json_deltas(answer: _Answer) -> list[tuple[dict[str, Any], int]]:
    """A JSON answer's content deltas: each adds its words to the text sent so far, and the
    last one ends it as the whole answer does."""
    assert answer.json_kind is not None
    deltas: list[tuple[dict[str, Any], int]] = []
    sent, count = "", 0
    complete = answer.finish_reason != "length"
    for piece in _pieces(answer.words):
        count += len(piece)
        last = count == len(answer.words)
        upto = _json_content(
            answer.digest, answer.words[:count], answer.json_kind, complete=complete and last
        )
        deltas.append(({"content": upto[len(sent) :]}, len(piece)))
        sent = upto
    return deltas


@dataclass(frozen=True, slots=True)
class _Shape:
    """How an answer's choices are written: a chat message or a raw completion's text
    (``plain``), with the token ids and logprobs the request asked for (``texts``: each
    generated token's text, reasoning first)."""

    body: dict[str, Any]
    digest: str
    plain: bool
    texts: list[str]

    def choice(
        self,
        message: dict[str, Any],
        start: int,
        count: int,
        *,
        streamed: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        """Choice ``index`` holding ``message`` (a delta when ``streamed``) and tokens
        ``start .. start + count``."""
        if self.plain:
            choice: dict[str, Any] = {"index": index, "text": message.get("content") or ""}
        else:
            choice = {"index": index, "delta" if streamed else "message": message}
        if count:
            texts = self.texts[start : start + count]
            choice |= sim_tokens.choice_fields(self.body, self.digest, texts, start, raw=self.plain)
        return choice


def _pieces(words: list[str]) -> list[list[str]]:
    return [words[i : i + _CHUNK_WORDS] for i in range(0, len(words), _CHUNK_WORDS)]


async def _completions(request: web.Request) -> web.StreamResponse:
    """``/v1/completions``: a plain prompt, answered as a base model would (text only)."""
    return await _chat_completions(request, plain=True)


async def _chat_completions(request: web.Request, *, plain: bool = False) -> web.StreamResponse:
    state = request.app[_STATE]
    stats = state.stats
    stats.chat_requests += 1
    stats.running += 1
    stats.peak_running = max(stats.peak_running, stats.running)
    sequences = 0
    try:
        sequences = await _sequences(request, state.config)
        stats.sequences += sequences
        stats.peak_sequences = max(stats.peak_sequences, stats.sequences)
        return await _answer_chat(request, state, plain=plain)
    except asyncio.CancelledError:
        # The client went away (handler cancellation) or the server is stopping.
        stats.aborted += 1
        raise
    except ConnectionError:
        stats.aborted += 1
        return web.Response(status=499)
    finally:
        stats.running -= 1
        stats.sequences -= sequences


async def _sequences(request: web.Request, config: SimConfig) -> int:
    """The sequences a request asks the server to generate at once (its ``n``), as a
    batching server gives each a slot; the body is read here and again, from aiohttp's
    copy, when it is answered."""
    if config.ignore_n:
        return 1
    try:
        n = orjson.loads(await request.read()).get("n", 1)
    except (orjson.JSONDecodeError, AttributeError):
        return 1
    return n if isinstance(n, int) and n > 1 else 1


async def _answer_chat(
    request: web.Request, state: _State, *, plain: bool = False
) -> web.StreamResponse:
    config, stats = state.config, state.stats
    begun = time.monotonic()
    raw = await request.read()
    checked = _validate(state, raw, plain=plain)
    if isinstance(checked, web.Response):
        stats.invalid += 1
        return checked
    body = checked
    stream = body.get("stream") is True

    fault = state.draw_fault()
    if fault is not None:
        stats.faults[fault] += 1
        faulty = await _fault_response(request, state, fault, body, stream)
        if faulty is not None:
            return faulty

    messages: list[Any] = body["messages"]
    choices = 1 if config.ignore_n else body.get("n", 1)
    asked = body["prompt"] if plain else messages
    answers = [
        _generate(body, request_digest(asked, seed), config, empty=fault == "empty", plain=plain)
        for seed in choice_seeds(body, choices)
    ]
    answer = answers[0]
    digest = answer.digest
    n = sum(a.tokens for a in answers)
    prompt_tokens = _count_prompt_tokens(messages)
    refused = _refusal(state, body, prompt_tokens, n)
    if refused is not None:
        stats.invalid += 1
        return refused
    limited = _rate_limited(state, prompt_tokens + n)
    if limited is not None:
        return limited
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 2 * config.mean_tokens
    cached = state.prefix.serve(prompt_words(messages), answer.words) if state.prefix else None
    state.next_id += 1
    completion_id = f"{'cmpl' if plain else 'chatcmpl'}-{digest}{state.next_id:08x}"
    shapes = [
        _Shape(body, a.digest, plain, sim_tokens.texts_of([a.reasoning, a.words])) for a in answers
    ]

    response: web.StreamResponse
    stats.running_tokens += prompt_tokens + n
    try:
        if stream:
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            continuous = include_usage and options.get("continuous_usage_stats") is True
            response = await _stream_answer(
                request, state, completion_id=completion_id, answers=answers,
                prompt_tokens=prompt_tokens, cached=cached, include_usage=include_usage,
                continuous=continuous, cut=fault == "malformed", stall=fault == "stall",
                limit=limit, model=_served(body, config), shapes=shapes,
            )  # fmt: skip
        else:
            response = await _whole_answer(
                request, state, body, answers, completion_id, prompt_tokens, limit, fault,
                cached, shapes=shapes,
            )  # fmt: skip
    finally:
        stats.running_tokens -= prompt_tokens + n
    if fault is None and response.status != 499:  # 499: the client left before the answer
        stats.record_completion(prompt_tokens, n, time.monotonic() - begun)
    return response


def _rate_limited(state: _State, tokens: int) -> web.Response | None:
    """The simulated provider's 429 when its bucket is empty (None: admitted)."""
    wait = state.limiter.admit(tokens) if state.limiter else None
    if wait is None:
        return None
    state.stats.rate_limited += 1
    return _error(
        429,
        "simulated provider: rate limit reached, try again later",
        "RateLimitError",
        headers={
            "Retry-After": f"{max(1, math.ceil(wait))}",
            "retry-after-ms": f"{wait * 1000:.0f}",
        },
    )


async def _fault_response(
    request: web.Request, state: _State, fault: str, body: dict[str, Any], stream: bool
) -> web.StreamResponse | None:
    """The answer a drawn fault gives before any generation; None for the faults that
    show in the answer itself (malformed, stall when streaming, empty)."""
    config = state.config
    if fault == "500":
        return _error(500, "simulated internal server error", "InternalServerError")
    if fault == "503":
        return _error(503, "simulated overload: server unavailable", "ServiceUnavailableError")
    if fault == "429":
        return _error(
            429,
            "simulated rate limit: too many requests",
            "RateLimitError",
            headers={"Retry-After": f"{config.retry_after:g}"},
        )
    if fault == "400":
        # A refusal of this request alone: each message differs, as a real one
        # names what in the request it refuses.
        return _bad_request(f"simulated bad request (#{state.stats.faults[fault]})")
    if fault == "reset":
        return await _reset(request, stream)
    if fault == "hang" or (fault == "stall" and not stream):
        return await _hang(request, state)
    if fault == "nochoices":
        doc = {"id": "chatcmpl-x", "object": "chat.completion", "model": _served(body, config)}
        return web.Response(body=orjson.dumps({**doc, "choices": []}), content_type=_JSON)
    if fault == "html":
        page = "<html><body><h1>502 Bad Gateway</h1></body></html>"
        return web.Response(status=200, text=page, content_type="text/html")
    return None


def _refusal(
    state: _State, body: dict[str, Any], prompt_tokens: int, n: int
) -> web.Response | None:
    """vLLM's 400 for a request longer than the context, or one too big for the cache."""
    config = state.config
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    if config.max_model_len and prompt_tokens + asked > config.max_model_len:
        return _bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_tokens + asked} tokens ({prompt_tokens} in the messages, "
            f"{asked} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    if state.batcher is not None and not state.batcher.fits(prompt_tokens + n):
        return _bad_request(
            f"the prompt and answer ({prompt_tokens + n} tokens) do not fit in the KV cache "
            f"({config.kv_tokens} tokens)"
        )
    return None


async def _whole_answer(
    request: web.Request,
    state: _State,
    body: dict[str, Any],
    answers: list[_Answer],
    completion_id: str,
    prompt_tokens: int,
    limit: int,
    fault: str | None,
    cached: int | None = None,
    *,
    shapes: list[_Shape],
) -> web.StreamResponse:
    """The answer in one body, once the time it takes to generate has passed (the
    longest choice's: a request's choices are generated side by side)."""
    config, n = state.config, max(a.tokens for a in answers)
    if state.batcher is not None:
        await state.batcher.generate(prompt_tokens, n, limit, cached or 0)
    else:
        await _sleep(config.latency + config.per_token * n + _prefill(state, prompt_tokens, cached))
    if _client_gone(request):
        state.stats.aborted += 1
        return web.Response(status=499)
    if fault == "malformed":
        truncated = f'{{"id": "{completion_id}", "object": "chat.completion", "choices": [{{'
        return web.Response(status=200, body=truncated.encode(), content_type=_JSON)
    doc = {
        "id": completion_id,
        "object": "text_completion" if shapes[0].plain else "chat.completion",
        "created": int(time.time()),
        "model": _served(body, config),
        "choices": [
            {
                **shape.choice(_message(each, config), 0, len(shape.texts), index=i),
                "finish_reason": each.finish_reason,
            }
            for i, (each, shape) in enumerate(zip(answers, shapes, strict=True))
        ],
        "usage": _usage(prompt_tokens, sum(a.tokens for a in answers), cached),
    }
    return web.Response(body=orjson.dumps(doc), content_type=_JSON)


def _prefill(state: _State, prompt_tokens: int, cached: int | None) -> float:
    """Without batching, the seconds the uncached prompt tokens take, when the server
    models a prefix cache (without one the prompt is free, as it always was)."""
    if cached is None:
        return 0.0
    return state.config.prefill_per_token * (prompt_tokens - cached)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    if cached is not None:
        return {
            **_usage(prompt_tokens, completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _reset(request: web.Request, stream: bool) -> web.StreamResponse:
    """The connection reset once the answer has begun: a request cut mid-way. (One closed
    before any byte, on a pooled connection, is a keep-alive connection the server had
    dropped, which a client sends again on a new one at no cost.)"""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else _JSON})
    await resp.prepare(request)
    await resp.write(b"data: {" if stream else b'{"id": ')
    if request.transport is not None:
        request.transport.abort()
    return resp


async def _hang(request: web.Request, state: _State) -> web.StreamResponse:
    """Never answer; return only once the client is gone or the server stops."""
    while not _client_gone(request) and not state.closing.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closing.wait(), timeout=0.1)
    if _client_gone(request):
        state.stats.aborted += 1
    elif request.transport is not None:
        # Stopping: drop the connection as a dying server would, never send an answer.
        request.transport.abort()
    return web.Response(status=499)


async def _stream_answer(
    request: web.Request,
    state: _State,
    *,
    completion_id: str,
    answers: list[_Answer],
    prompt_tokens: int,
    include_usage: bool,
    cut: bool,
    cached: int | None = None,
    continuous: bool = False,
    stall: bool = False,
    limit: int = 0,
    model: str = "",
    shapes: list[_Shape] | None = None,
) -> web.StreamResponse:
    config = state.config
    batcher = state.batcher
    created = int(time.time())
    shapes = shapes or [_Shape({}, a.digest, False, []) for a in answers]
    at = [0] * len(answers)  # each choice's position of the first token of its next delta

    def chunk(
        delta: dict[str, Any],
        finish: str | None,
        index: int = 0,
        tokens: int = 0,
        so_far: int | None = None,
    ) -> bytes:
        choice = shapes[index].choice(delta, at[index], tokens, streamed=True, index=index)
        at[index] += tokens
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "text_completion" if shapes[0].plain else "chat.completion.chunk",
            "created": created,
            "model": model or _served({}, config),
            "choices": [{**choice, "finish_reason": finish}],
        }
        if so_far is not None:
            # vLLM's continuous_usage_stats: usage in every chunk, its completion tokens
            # those of the chunk's choice alone (the last chunk's are the request's).
            payload["usage"] = _usage(prompt_tokens, so_far, cached)
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    longest = max(a.tokens for a in answers)
    response = await _stream_started(request, state, prompt_tokens, longest, limit, cached)
    if not shapes[0].plain:
        for i in range(len(answers)):
            await response.write(chunk({"role": "assistant", "content": ""}, None, i))
    entries = _entries(answers, config)
    # A malformed stream stops after about half of its deltas, without finish_reason/[DONE];
    # a stalled one sends the same half, then nothing, keeping the connection open.
    sent = entries[: max(1, (len(entries) - 1) // 2)] if cut or stall else entries
    so_far, each = 0, [0] * len(answers)
    try:
        for index, delta, tokens, finish in sent:
            await _sleep(0 if batcher is not None or finish else config.per_token * tokens)
            so_far += tokens
            each[index] += tokens
            usage_now = each[index] if continuous and finish is None else None
            await response.write(chunk(delta, finish, index, tokens, usage_now))
    except (ConnectionError, asyncio.CancelledError):
        # The client left mid-stream: what it was sent is generated and thrown away.
        state.stats.aborted_tokens += so_far
        raise
    if stall:
        await _hang(request, state)
        return response
    if not cut:
        if include_usage:
            usage = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model or _served({}, config),
                "choices": [],
                "usage": _usage(prompt_tokens, sum(a.tokens for a in answers), cached),
            }
            await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _entries(
    answers: list[_Answer], config: SimConfig
) -> list[tuple[int, dict[str, Any], int, str | None]]:
    """What a stream sends: each choice's deltas then its finish, one choice after the
    other (index, delta, tokens, finish reason)."""
    entries: list[tuple[int, dict[str, Any], int, str | None]] = []
    for i, each in enumerate(answers):
        entries += [(i, delta, tokens, None) for delta, tokens in _deltas(each, config)]
        entries.append((i, {}, 0, each.finish_reason))
    return entries


async def _stream_started(
    request: web.Request,
    state: _State,
    prompt_tokens: int,
    tokens: int,
    limit: int,
    cached: int | None,
) -> web.StreamResponse:
    """The stream's response, once the answer (its longest choice, of ``tokens``) is
    ready to go: the batching model answers once the whole answer is generated, the plain
    one after its latency and prefill."""
    if state.batcher is not None:
        await state.batcher.generate(prompt_tokens, tokens, limit, cached or 0)
    else:
        await _sleep(state.config.latency + _prefill(state, prompt_tokens, cached))
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    created = int(time.time() - state.uptime())
    context = {"max_model_len": state.config.max_model_len} if state.config.max_model_len else {}
    body = {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "sim", **context}
            for name in state.config.served
        ],
    }
    return web.Response(body=orjson.dumps(body), content_type=_JSON)


def _served(body: dict[str, Any], config: SimConfig) -> str:
    """The model name an answer carries: the one asked for, else the first served."""
    return body.get("model") or config.served[0]


def _metrics_text(state: _State) -> str:
    stats = state.stats
    batcher = state.batcher
    if batcher is not None:
        running, queued = len(batcher.model.running), len(batcher.model.queue)
        usage, throughput = batcher.model.usage, batcher.throughput()
    else:
        running, queued = stats.running, 0
        usage = min(1.0, stats.running_tokens / _KV_CAPACITY_TOKENS)
        throughput = stats.throughput(state.uptime())
    figures = Figures(
        running=running,
        queued=queued,
        usage=usage,
        throughput=throughput,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        completed=stats.completed,
        aborted=stats.aborted,
        retracted=batcher.model.retracted if batcher is not None else 0,
        latency=list(zip(_LATENCY_BUCKETS, stats.latency_buckets, strict=True)),
        latency_sum=stats.latency_sum,
    )
    config = state.config
    return metrics_text(config.metric_names, config.served[0], figures)


async def _metrics(request: web.Request) -> web.Response:
    text = _metrics_text(request.app[_STATE])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _sim_stats(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    body = {**state.stats.as_json(), "uptime": state.uptime(), "in_outage": state.in_outage()}
    if state.batcher is not None:
        body["batch"] = state.batcher.as_json()
    return web.Response(body=orjson.dumps(body), content_type=_JSON)


def build_app(config: SimConfig) -> web.Application:
    """The simulated server as an aiohttp application (outage clock starts at startup)."""
    app = web.Application(
        middlewares=[_outage_middleware, _auth_middleware], client_max_size=64 * 1024**2
    )
    state = _State(config)
    app[_STATE] = state

    async def on_startup(app: web.Application) -> None:
        state.started = time.monotonic()

    async def on_shutdown(app: web.Application) -> None:
        # Release hanging requests so that shutdown does not wait for their clients.
        state.closing.set()

    async def on_cleanup(app: web.Application) -> None:
        if state.batcher is not None:
            await state.batcher.close()

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        # Every chat answer, a 429 or a stream too, says the buckets as they are now.
        if (
            state.limiter is not None
            and state.config.rate_limit_headers
            and request.path == "/v1/chat/completions"
        ):
            response.headers.update(state.limiter.headers())

    app.on_response_prepare.append(on_prepare)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/stats", _sim_stats)
    return app


async def serve(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start the server in the running loop; returns the runner (``await runner.cleanup()``
    to stop) and the bound port, which matters when ``port`` is 0."""
    runner = web.AppRunner(
        build_app(config), access_log=None, handler_cancellation=True, shutdown_timeout=5.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


def run_forever(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve until SIGINT/SIGTERM; announces the bound port on one stdout line."""

    async def run() -> None:
        runner, bound = await serve(config, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            shown = f"[{host}]" if ":" in host else host
            print(f"sim-server listening on http://{shown}:{bound}", flush=True)
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await runner.cleanup()

    asyncio.run(run())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@sim_options(module=True)
def _command(host: str, port: int, **options: Any) -> None:
    """Simulated OpenAI-compatible inference server."""
    run_forever(sim_config(options), host, port)


def main(argv: list[str] | None = None) -> None:
    """Command line of ``python -m orchestrator.sim.server``: the options of
    ``orchestrator sim-server`` (``orchestrator.sim.options``); exits when it stops."""
    _command.main(argv, prog_name="python -m orchestrator.sim.server")


if __name__ == "__main__":
    main()
