"""How the simulated server behaves (``SimConfig``) and the command-line specs it takes.

Kept apart from the server, which loads aiohttp: the ``sim-server`` command's options
(``orchestrator.sim.options``) are built from these at every ``orchestrator`` start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.sim.length_model import LengthModel
    from orchestrator.sim.ratelimit import BucketSpec

#: Fault kinds in the order their probability ranges are laid out on ``[0, 1)``.
FAULT_KINDS: tuple[str, ...] = (
    "500",
    "503",
    "429",
    "400",
    "reset",
    "hang",
    "malformed",
    "stall",
    "empty",
    "nochoices",
    "html",
    "bad_ids",
)

#: How reasoning is answered: not at all; in a separate message field; in the content
#: between ``<think>`` tags; in the content ending with ``</think>`` alone, as from chat
#: templates that open the block in the prompt.
REASONING_MODES: tuple[str, ...] = ("none", "field", "think", "think-end")

#: Where the prompt's ids are said: in the answer (vLLM, SGLang) and /tokenize, only from
#: /tokenize, or nowhere.
PROMPT_IDS: tuple[str, ...] = ("response", "tokenize", "none")

#: Names of the separate reasoning field: SGLang and older vLLM, newer vLLM.
REASONING_FIELDS: tuple[str, ...] = ("reasoning_content", "reasoning")

#: How a batching server admits queued requests: ``reserve`` (SGLang: the cache must also
#: hold an estimated share of every running request's remaining ``max_tokens``) or
#: ``fifo`` (vLLM's v1 scheduler: first come first served while the request's tokens fit
#: the free cache now, nothing reserved for what it will generate).
ADMISSIONS: tuple[str, ...] = ("reserve", "fifo")

#: What a batching server does when its cache cannot hold the next decode step:
#: ``newest`` retracts the newest running requests, just enough, to the head of the queue
#: (vLLM's preemption); ``sglang`` those with the fewest generated tokens (the longest
#: prompt first among equals) until 20 more steps fit, to the back of the queue, and
#: sets its admission estimate from what stays (SGLang's ``retract_decode``).
RETRACTIONS: tuple[str, ...] = ("newest", "sglang")

#: Whose names ``/metrics`` uses: SGLang's (``sglang:num_queue_reqs``, ``sglang:token_usage``,
#: ``sglang:num_retracted_requests``) or vLLM's (``vllm:num_requests_waiting``,
#: ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions``).
METRIC_NAMES: tuple[str, ...] = ("sglang", "vllm")

#: Faults of the Batch API (``--batch-fault``), each striking the first batch it can, once:
#: its output file's content answers 404, its output is cut in the middle of its last
#: line, or the completed batch is forgotten (404, gone from the list).
BATCH_FAULTS: tuple[str, ...] = ("missing_output", "truncated_output", "lost_batch")

#: The name ``/v1/models`` lists when no model is pinned.
DEFAULT_MODEL = "sim-model"


@dataclass
class SimConfig:
    """How the simulated server behaves.

    Attributes:
        model: the model name served, or several (vLLM's ``--served-model-name a b``):
            ``/v1/models`` lists them and a request naming another gets vLLM's 404
            ``The model `X` does not exist.``; None serves ``DEFAULT_MODEL``.
        any_model: with no ``model``, answer to any name (as llama.cpp does) rather
            than refuse those other than ``DEFAULT_MODEL`` as vLLM does. True here and
            in ``python -m orchestrator.sim.server`` (the tests' and benchmarks'
            harness); ``orchestrator sim-server`` refuses unless given ``--any-model``.
        latency: base seconds spent on every answer (time to first token when streaming).
        per_token: extra seconds per generated token, so long answers take longer.
        seed: seeds both the filler words and the fault draws.
        mean_tokens: mean completion length; each request's length is fixed by its digest,
            spread about uniformly over ``[mean/2, 3*mean/2]``, at least 1.
        faults: fault kind -> fraction of (valid) chat requests that get it. Kinds are
            ``FAULT_KINDS``; fractions in ``[0, 1]`` and at most 1 in total.
        outages: ``(start, duration)`` windows, in seconds since the server started, during
            which every endpoint answers 503, like a server that is restarting.
        retry_after: value of the ``Retry-After`` header sent with 429.
        api_key: when set, ``/v1/*`` requests without ``Authorization: Bearer <key>`` get
            401, as from a server started with ``--api-key``.
        reasoning: one of ``REASONING_MODES``. With reasoning, each answer starts with a
            deterministic thinking text about as long as the answer, counted in
            ``completion_tokens`` and against ``max_tokens``; a request sending
            ``chat_template_kwargs`` ``{"enable_thinking": false}`` or ``{"thinking": false}``
            gets none.
        reasoning_field: the message field of ``reasoning="field"``, one of
            ``REASONING_FIELDS``.
        tool_call_rate: fraction of requests offering ``tools`` (with ``tool_choice`` auto
            or absent) that are answered with a call of the first tool; which ones is fixed
            by the request's digest. ``tool_choice`` "required" or naming a function always
            calls, "none" never.
        json_invalid_rate: fraction of requests asking for JSON (``response_format``
            ``json_object`` or ``json_schema``) answered with JSON that does not parse (its
            closing brace left out); which ones is fixed by the request's digest
            (``json_answer_kind``), so an oracle knows. The others answer
            ``{"sim": DIGEST, "text": WORDS}``, cut like any answer by ``max_tokens``.
        json_mismatch_rate: fraction answered with JSON of another shape, ``{"sim":
            DIGEST, "words": WORDS}``: it parses, and misses a schema's ``text``.
        kv_tokens: KV-cache size in tokens. With it (or ``max_running``) the server batches
            as SGLang does (``latency`` and ``per_token`` then do not apply): requests wait
            in a queue until they fit, are decoded together one token per step, and when
            the cache overflows as sequences grow the newest are retracted (re-queued, to
            be prefilled again). 0: no cache limit.
        max_running: most requests decoded together (0: as many as fit in the cache), as
            SGLang's ``--max-running-requests`` and vLLM's ``--max-num-seqs``.
        admission: one of ``ADMISSIONS``: how queued requests are let into the batch.
            With ``fifo`` a running request that finds no room for its next token retracts
            the newest running ones (vLLM's preemption by recompute) and nothing is
            admitted in that step, as vLLM's scheduler does.
        retraction: one of ``RETRACTIONS``: which running requests a cache overflow
            retracts, and where in the queue they wait.
        metric_names: one of ``METRIC_NAMES``: whose names ``/metrics`` gives its figures.
        step_time: seconds of one decode step, plus ``step_per_request`` per request in
            the batch: the larger the batch, the slower each request and the higher the
            total throughput, up to ``1 / step_per_request`` tokens/s.
        step_per_request: see ``step_time``.
        prefill_per_token: seconds per token prefilled (prompts, and the generated tokens
            of a retracted request when it is admitted again).
        time_scale: multiplies every simulated duration of the batching model, so a
            benchmark of a slow server finishes in seconds.
        ignore_n: answer one choice whatever ``n`` a request asks for (as a server
            without ``n`` does); otherwise choice ``i`` of a request seeded ``s`` is the
            answer to that request seeded ``s + i``.
        max_model_len: the context length (0: none): a request whose prompt and
            ``max_tokens`` exceed it gets vLLM's 400, which names its own lengths.
        history_reasoning: one of ``sim.template.HISTORY_MODES``: what the chat template
            makes of earlier turns' reasoning (rendered, ignored, required on a tool-call
            turn while thinking, or refused).
        prompt_ids: one of ``PROMPT_IDS``: where a request asking ``return_token_ids``
            finds its prompt's ids: in the answer (and ``/tokenize``), only from
            ``/tokenize`` (as llama.cpp, whose answers carry none), or nowhere.
        refusals: text -> message: a request whose messages contain the text gets a 400
            with that message, the same for every such request (a bad item among good
            ones: an image URL the server cannot fetch, roles that do not alternate).
        required_fields: body fields a request must have, else FastAPI's 422, whose
            ``detail`` echoes the whole request body (``input``), as pydantic does.
        length_model: answer lengths by dataset (``orchestrator.sim.length_model``), drawn
            from each request's digest; None: ``mean_tokens`` for every request.
        trace: a file the batching model writes each decode step to, one JSON line:
            ``t`` (simulated seconds since the first request, idle time included),
            ``batch`` (requests decoded, one token each), ``queued``, ``finished``
            (answers completed by the step) and ``kv`` (cache tokens in use).
        prefix_cache: prompt tokens of a prefix cache (0: none): a prompt repeating the
            start of one seen lately has those tokens reported as
            ``usage.prompt_tokens_details.cached_tokens`` and not prefilled (batching),
            or, without batching, the others cost ``prefill_per_token`` each.
        rate_limits: a hosted provider's budgets (``orchestrator.sim.ratelimit``):
            requests and tokens a minute, each a token bucket; a request finding one
            empty gets 429 with ``Retry-After``, and every answer of
            ``/v1/chat/completions`` carries the ``x-ratelimit-*`` headers unless
            ``rate_limit_headers`` is False (a provider that says nothing ahead).
        batch_api: serve OpenAI's Files and Batch API (``orchestrator.sim.batchapi``);
            False: those paths answer 404, as a server without them.
        batch_max_requests, batch_max_bytes: the most lines and bytes of a batch's
            input file; more fails the batch at validation.
        batch_fail_rate: fraction of batch lines (drawn from the custom_id) answered
            with a 500 ``server_error`` in the error file.
        batch_delay: seconds from a batch's creation to its completion, its lines
            answered evenly over them.
        batch_window: seconds after which an unfinished batch expires.
        batch_token_limit: prompt tokens enqueued across live batches at most (None: no
            limit); a batch that would pass it fails with ``token_limit_exceeded``.
        batch_faults: ``BATCH_FAULTS`` to inject, each once.
        price_input, price_cached_input, price_output: USD per million prompt, cached
            prompt (None: the prompt price) and completion tokens, for ``/sim/bill``.
        batch_discount: fraction of the price taken off for batch lines.
    """

    model: str | tuple[str, ...] | None = None
    any_model: bool = True
    latency: float = 0.0
    per_token: float = 0.0
    seed: int = 0
    mean_tokens: int = 64
    faults: dict[str, float] = field(default_factory=dict)
    outages: list[tuple[float, float]] = field(default_factory=list)
    retry_after: float = 1.0
    api_key: str | None = field(default=None, repr=False)
    reasoning: str = "none"
    reasoning_field: str = "reasoning_content"
    history_reasoning: str = "render"
    prompt_ids: str = "response"
    tool_call_rate: float = 0.5
    json_invalid_rate: float = 0.0
    json_mismatch_rate: float = 0.0
    kv_tokens: int = 0
    max_running: int = 0
    admission: str = "reserve"
    retraction: str = "newest"
    metric_names: str = "sglang"
    step_time: float = 0.01
    step_per_request: float = 0.0002
    prefill_per_token: float = 0.00002
    time_scale: float = 1.0
    max_model_len: int = 0
    ignore_n: bool = False
    refusals: dict[str, str] = field(default_factory=dict)
    required_fields: tuple[str, ...] = ()
    length_model: LengthModel | None = None
    trace: str | None = None
    prefix_cache: int = 0
    rate_limits: tuple[BucketSpec, ...] = ()
    rate_limit_headers: bool = True
    batch_api: bool = True
    batch_max_requests: int = 50_000
    batch_max_bytes: int = 200_000_000
    batch_fail_rate: float = 0.0
    batch_delay: float = 2.0
    batch_window: float = 86_400.0
    batch_token_limit: int | None = None
    batch_faults: tuple[str, ...] = ()
    price_input: float = 0.0
    price_cached_input: float | None = None
    price_output: float = 0.0
    batch_discount: float = 0.5

    @property
    def served(self) -> tuple[str, ...]:
        """The model names ``/v1/models`` lists."""
        if self.model is None:
            return (DEFAULT_MODEL,)
        return (self.model,) if isinstance(self.model, str) else tuple(self.model)

    def serves(self, name: object) -> bool:
        """Whether a request naming ``name`` (None: none) is answered."""
        pinned = self.model is not None
        return name is None or name in self.served or (self.any_model and not pinned)

    @property
    def batching(self) -> bool:
        return self.kv_tokens > 0 or self.max_running > 0

    def __post_init__(self) -> None:
        if self.model is not None and not all(self.served):
            raise ValueError("model name must not be empty")
        if self.reasoning not in REASONING_MODES:
            raise ValueError(
                f"unknown reasoning mode {self.reasoning!r}; known: {', '.join(REASONING_MODES)}"
            )
        if self.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"unknown reasoning field {self.reasoning_field!r}; "
                f"known: {', '.join(REASONING_FIELDS)}"
            )
        for name, known in (
            ("admission", ADMISSIONS),
            ("retraction", RETRACTIONS),
            ("metric_names", METRIC_NAMES),
        ):
            if getattr(self, name) not in known:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}; known: {', '.join(known)}"
                )
        rates = (self.json_invalid_rate, self.json_mismatch_rate)
        if not all(0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0:
            raise ValueError(f"json rates must be within [0, 1], at most 1 together, got {rates}")
        if not 0.0 <= self.tool_call_rate <= 1.0:
            raise ValueError(f"tool_call_rate must be within [0, 1], got {self.tool_call_rate!r}")
        for name in ("kv_tokens", "max_running", "max_model_len", "prefix_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not math.isfinite(self.time_scale) or self.time_scale <= 0:
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale!r}")
        for name in (
            "latency",
            "per_token",
            "retry_after",
            "step_time",
            "step_per_request",
            "prefill_per_token",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.mean_tokens < 1:
            raise ValueError(f"mean_tokens must be >= 1, got {self.mean_tokens!r}")
        for kind, rate in self.faults.items():
            if kind not in FAULT_KINDS:
                raise ValueError(
                    f"unknown fault kind {kind!r}; known kinds: {', '.join(FAULT_KINDS)}"
                )
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate for {kind!r} must be within [0, 1], got {rate!r}")
        total = sum(self.faults.values())
        if total > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {total:g}, more than 1")
        self._check_batch()
        units = [spec.unit for spec in self.rate_limits]
        if len(set(units)) != len(units):
            raise ValueError("one rate limit of each kind (rpm, tpm) at most")
        for text, message in self.refusals.items():
            if not text or not message:
                raise ValueError(f"refusal {text!r}={message!r} needs a text and a message")
        for start, duration in self.outages:
            if start < 0 or duration <= 0:
                raise ValueError(
                    f"outage ({start!r}, {duration!r}) needs start >= 0 and duration > 0"
                )

    def _check_batch(self) -> None:
        """The Batch API's and the bill's settings."""
        for name in ("batch_max_requests", "batch_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch_token_limit is not None and self.batch_token_limit < 1:
            raise ValueError(f"batch_token_limit must be >= 1, got {self.batch_token_limit!r}")
        for name in ("batch_fail_rate", "batch_discount"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)!r}")
        prices = ("batch_delay", "price_input", "price_output", "price_cached_input")
        for name in prices:
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(self.batch_window) or self.batch_window <= 0:
            raise ValueError(f"batch_window must be a number > 0, got {self.batch_window!r}")
        unknown = [f for f in self.batch_faults if f not in BATCH_FAULTS]
        if unknown:
            raise ValueError(
                f"unknown batch fault {unknown[0]!r}; known: {', '.join(BATCH_FAULTS)}"
            )


def parse_fault(spec: str) -> tuple[str, float]:
    """Parse a CLI fault spec such as ``500=0.05`` or ``reset=0.02``."""
    kind, sep, rate_text = spec.partition("=")
    kind = kind.strip().lower()
    if not sep or not kind or not rate_text.strip():
        raise ValueError(f"bad fault spec {spec!r}: expected KIND=RATE, e.g. 500=0.05")
    if kind not in FAULT_KINDS:
        raise ValueError(
            f"bad fault spec {spec!r}: unknown kind {kind!r}; known kinds: {', '.join(FAULT_KINDS)}"
        )
    try:
        rate = float(rate_text)
    except ValueError:
        raise ValueError(f"bad fault spec {spec!r}: rate {rate_text!r} is not a number") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"bad fault spec {spec!r}: rate must be within [0, 1]")
    return kind, rate


def parse_outage(spec: str) -> tuple[float, float]:
    """Parse a CLI outage spec ``START:DURATION`` (seconds since the server started)."""
    start_text, sep, duration_text = spec.partition(":")
    if not sep:
        raise ValueError(f"bad outage spec {spec!r}: expected START:DURATION, e.g. 30:10")
    try:
        start, duration = float(start_text), float(duration_text)
    except ValueError:
        raise ValueError(
            f"bad outage spec {spec!r}: START and DURATION must be numbers of seconds"
        ) from None
    if not (math.isfinite(start) and math.isfinite(duration)) or start < 0 or duration <= 0:
        raise ValueError(f"bad outage spec {spec!r}: needs START >= 0 and DURATION > 0")
    return start, duration


def parse_refusal(spec: str) -> tuple[str, str]:
    """Parse a CLI refusal spec ``TEXT=MESSAGE``: requests containing TEXT get a 400."""
    text, sep, message = spec.partition("=")
    if not sep or not text or not message.strip():
        raise ValueError(
            f"bad refusal spec {spec!r}: expected TEXT=MESSAGE, e.g. 'BAD=Invalid image URL'"
        )
    return text, message.strip()
