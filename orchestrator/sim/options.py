"""The simulated server's command-line options, defined once.

``orchestrator sim-server`` and ``python -m orchestrator.sim.server`` are built from this
table: the same options, defaults (``SimConfig``'s) and help. The module form also takes
``--fault`` for ``--error-rate`` (the name tests and benchmarks use) and leaves the
checking of values to ``SimConfig``, whose messages name the field.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import click

from orchestrator.sim.config import (
    ADMISSIONS,
    BATCH_FAULTS,
    METRIC_NAMES,
    PROMPT_IDS,
    REASONING_FIELDS,
    REASONING_MODES,
    RETRACTIONS,
    SimConfig,
    parse_fault,
    parse_outage,
    parse_refusal,
)
from orchestrator.sim.ratelimit import parse_rate_limit
from orchestrator.sim.template import HISTORY_MODES

F = TypeVar("F", bound=Callable[..., Any])

_DEFAULTS = {f.name: f.default for f in fields(SimConfig) if f.init}


@dataclass(frozen=True, slots=True)
class SimOption:
    """One option: its flag, the SimConfig field it fills (or the listening address's
    ``host``/``port``), and how click parses it."""

    flag: str
    name: str
    type: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    help: str | None = None
    metavar: str | None = None
    multiple: bool = False
    show_default: bool = True
    default: Any = None
    module_flags: tuple[str, ...] = ()
    module_default: Any = None
    is_flag: bool = False

    def click_type(self, checked: bool) -> Any:
        """The click type; with ``checked``, bounded as SimConfig bounds the field."""
        if isinstance(self.type, tuple):
            return click.Choice(self.type)
        if not checked or (self.low is None and self.high is None):
            return self.type
        bounded = click.IntRange if self.type is int else click.FloatRange
        return bounded(min=self.low, max=self.high, min_open=self.low_open)

    def click_option(self, *, module: bool) -> Callable[[F], F]:
        default = self.default if self.name in ("host", "port") else _DEFAULTS.get(self.name)
        if module and self.module_default is not None:
            default = self.module_default
        flags = (self.flag, *(self.module_flags if module else ()))
        if self.is_flag:
            on = bool(module and self.module_default)
            return click.option(*flags, self.name, is_flag=True, default=on, help=self.help)
        return click.option(
            *flags,
            self.name,
            type=self.click_type(checked=not module),
            default=() if self.multiple else default,
            show_default=self.show_default,
            multiple=self.multiple,
            metavar=self.metavar,
            help=self.help,
        )


OPTIONS: tuple[SimOption, ...] = (
    SimOption("--host", "host", default="127.0.0.1"),
    SimOption(
        "--port",
        "port",
        int,
        0,
        65535,
        default=30000,
        module_default=0,
        help="0 picks a free port; the listening line says which.",
    ),
    SimOption(
        "--model",
        "model",
        multiple=True,
        show_default=False,
        help="A model name served, listed in /v1/models (repeat for several, as vLLM's"
        " --served-model-name); requests naming another get vLLM's 404. Default: sim-model.",
    ),
    SimOption(
        "--any-model",
        "any_model",
        is_flag=True,
        module_default=True,
        help="With no --model: answer to any model name (as llama.cpp does), not only"
        " sim-model (as vLLM does). Always so in `python -m orchestrator.sim.server`.",
    ),
    SimOption(
        "--ignore-n",
        "ignore_n",
        is_flag=True,
        help="Answer one choice whatever n a request asks for, as some servers do.",
    ),
    SimOption(
        "--max-model-len",
        "max_model_len",
        int,
        0,
        show_default=False,
        help="Context length: a request whose prompt and max_tokens exceed it gets a 400.",
    ),
    SimOption("--latency", "latency", float, 0, help="Seconds per request."),
    SimOption("--per-token", "per_token", float, 0, help="Seconds per generated token."),
    SimOption("--mean-tokens", "mean_tokens", int, 1),
    SimOption("--seed", "seed", int),
    SimOption(
        "--error-rate",
        "faults",
        metavar="KIND=RATE",
        multiple=True,
        show_default=False,
        module_flags=("--fault",),
        help="Inject faults: 500, 503, 429, 400, reset, hang, malformed (e.g. 500=0.05).",
    ),
    SimOption(
        "--outage",
        "outages",
        metavar="START:DURATION",
        multiple=True,
        show_default=False,
        help="Answer 503 everywhere from START for DURATION seconds.",
    ),
    SimOption(
        "--refuse",
        "refusals",
        metavar="TEXT=MESSAGE",
        multiple=True,
        show_default=False,
        help="A request whose messages contain TEXT gets HTTP 400 MESSAGE (a bad item).",
    ),
    SimOption(
        "--require-field",
        "required_fields",
        metavar="NAME",
        multiple=True,
        show_default=False,
        help="A request without this body field gets FastAPI's 422, echoing the body.",
    ),
    SimOption("--retry-after", "retry_after", float, 0),
    SimOption(
        "--rate-limit",
        "rate_limits",
        metavar="rpm=N[,burst=B]|tpm=N[,burst=B]",
        multiple=True,
        show_default=False,
        help="A hosted provider's budget a minute (a token bucket, real time): 429 with "
        "Retry-After when empty, x-ratelimit-* headers on every answer. Once per kind.",
    ),
    SimOption(
        "--rate-limit-headers",
        "rate_limit_headers",
        bool,
        help="Whether --rate-limit's buckets send x-ratelimit-* headers (false: only 429s).",
    ),
    SimOption(
        "--reasoning",
        "reasoning",
        REASONING_MODES,
        help="Answer with thinking: in a separate field (a server with a reasoning parser), "
        "in the content between <think> tags (one without), or ending with </think> alone.",
    ),
    SimOption(
        "--reasoning-field",
        "reasoning_field",
        REASONING_FIELDS,
        help="Field of --reasoning field: SGLang and older vLLM, or newer vLLM.",
    ),
    SimOption(
        "--history-reasoning",
        "history_reasoning",
        HISTORY_MODES,
        help="What the chat template makes of earlier turns' reasoning: renders it, ignores "
        "it, requires it on a tool-call turn (while thinking), or refuses the field (400).",
    ),
    SimOption(
        "--prompt-ids",
        "prompt_ids",
        PROMPT_IDS,
        help="Where a request with return_token_ids finds its prompt's ids: in the answer "
        "and /tokenize, only /tokenize (as llama.cpp), or nowhere.",
    ),
    SimOption(
        "--tool-call-rate",
        "tool_call_rate",
        float,
        0,
        1,
        help="Fraction of requests offering tools (tool_choice auto) answered with a tool call.",
    ),
    SimOption(
        "--json-invalid-rate",
        "json_invalid_rate",
        float,
        0,
        1,
        help="Fraction of requests asking for JSON (response_format) answered with broken JSON.",
    ),
    SimOption(
        "--json-mismatch-rate",
        "json_mismatch_rate",
        float,
        0,
        1,
        help="Fraction of requests asking for JSON answered with JSON missing the schema's text.",
    ),
    SimOption(
        "--kv-tokens",
        "kv_tokens",
        int,
        0,
        show_default=False,
        help="Batch continuously, as SGLang does, with a KV cache of this many tokens.",
    ),
    SimOption(
        "--max-running",
        "max_running",
        int,
        0,
        show_default=False,
        help="Batch continuously, at most this many requests decoded together.",
    ),
    SimOption(
        "--admission",
        "admission",
        ADMISSIONS,
        help="Batching: reserve (SGLang: room for a share of each running request's "
        "max_tokens too) or fifo (vLLM: first come first served while the prompt fits now, "
        "none let in by a step that preempted).",
    ),
    SimOption(
        "--retraction",
        "retraction",
        RETRACTIONS,
        help="Batching, when the cache overflows: newest (the newest running, to the head of "
        "the queue, as vLLM) or sglang (the fewest generated, to its back, room kept for 20 "
        "steps).",
    ),
    SimOption(
        "--metric-names",
        "metric_names",
        METRIC_NAMES,
        help="Whose names /metrics uses: sglang (sglang:num_queue_reqs, ...) or vllm "
        "(vllm:num_requests_waiting, ...).",
    ),
    SimOption(
        "--step-time", "step_time", float, 0, help="Batching: seconds of one decode step ..."
    ),
    SimOption(
        "--step-per-request",
        "step_per_request",
        float,
        0,
        help="... plus this much per request in the batch.",
    ),
    SimOption(
        "--prefill-per-token",
        "prefill_per_token",
        float,
        0,
        help="Batching: seconds per prompt token prefilled.",
    ),
    SimOption(
        "--prefix-cache",
        "prefix_cache",
        int,
        0,
        show_default=False,
        help="A prefix cache of this many prompt tokens: repeated prompt starts are reported"
        " as cached_tokens and not prefilled.",
    ),
    SimOption(
        "--length-model",
        "length_model",
        metavar="FILE",
        show_default=False,
        help="Answer lengths by dataset (JSON; the request's metadata.dataset picks one): "
        "lognormal, drawn from each prompt's digest.",
    ),
    SimOption(
        "--trace",
        "trace",
        metavar="FILE",
        show_default=False,
        help="Batching: write every decode step to FILE (JSON lines, simulated time).",
    ),
    SimOption(
        "--time-scale",
        "time_scale",
        float,
        0,
        low_open=True,
        help="Batching: multiplies every simulated duration (0.1 runs ten times faster).",
    ),
    SimOption(
        "--batch-api/--no-batch-api",
        "batch_api",
        bool,
        help="Serve OpenAI's Files and Batch API (/v1/files, /v1/batches); without it "
        "they answer 404.",
    ),
    SimOption(
        "--batch-delay",
        "batch_delay",
        float,
        0,
        help="Batch API: seconds from a batch's creation to its completion.",
    ),
    SimOption(
        "--batch-window",
        "batch_window",
        float,
        0,
        low_open=True,
        help="Batch API: seconds after which an unfinished batch expires (OpenAI's 24h).",
    ),
    SimOption(
        "--batch-max-requests",
        "batch_max_requests",
        int,
        1,
        help="Batch API: most lines of an input file; more fails the batch.",
    ),
    SimOption(
        "--batch-max-bytes",
        "batch_max_bytes",
        int,
        1,
        help="Batch API: most bytes of an input file; more fails the batch.",
    ),
    SimOption(
        "--batch-token-limit",
        "batch_token_limit",
        int,
        1,
        show_default=False,
        help="Batch API: prompt tokens enqueued across live batches at most; a batch "
        "passing it fails with token_limit_exceeded.",
    ),
    SimOption(
        "--batch-fail-rate",
        "batch_fail_rate",
        float,
        0,
        1,
        help="Batch API: fraction of lines (drawn from their custom_id) answered with a "
        "500 server_error in the error file.",
    ),
    SimOption(
        "--batch-fault",
        "batch_faults",
        BATCH_FAULTS,
        multiple=True,
        show_default=False,
        help="Batch API fault, once, on the first batch it can strike: missing_output, "
        "truncated_output, lost_batch (repeat for several).",
    ),
    SimOption(
        "--price-input",
        "price_input",
        float,
        0,
        help="/sim/bill: USD per million prompt tokens.",
    ),
    SimOption(
        "--price-cached-input",
        "price_cached_input",
        float,
        0,
        show_default=False,
        help="/sim/bill: USD per million cached prompt tokens. Default: --price-input.",
    ),
    SimOption(
        "--price-output",
        "price_output",
        float,
        0,
        help="/sim/bill: USD per million completion tokens.",
    ),
    SimOption(
        "--batch-discount",
        "batch_discount",
        float,
        0,
        1,
        help="/sim/bill: fraction of the price taken off for batch lines.",
    ),
)


def sim_options(*, module: bool = False) -> Callable[[F], F]:
    """Every option of the table on a click command (``module``: the module's form)."""

    def add(command: F) -> F:
        for option in reversed(OPTIONS):
            command = option.click_option(module=module)(command)
        return command

    return add


def sim_config(values: dict[str, Any]) -> SimConfig:
    """The server's configuration from the parsed options (host and port left out);
    a value SimConfig refuses is a bad parameter (exit 2)."""
    given = {k: v for k, v in values.items() if k not in ("host", "port")}
    try:
        given["faults"] = dict(parse_fault(f) for f in given.get("faults", ()))
        given["outages"] = [parse_outage(o) for o in given.get("outages", ())]
        given["refusals"] = dict(parse_refusal(r) for r in given.get("refusals", ()))
        given["required_fields"] = tuple(given.get("required_fields", ()))
        given["batch_faults"] = tuple(given.get("batch_faults", ()))
        given["model"] = tuple(given.get("model") or ()) or None
        if given.get("rate_limits"):
            given["rate_limits"] = tuple(parse_rate_limit(r) for r in given["rate_limits"])
        else:
            given["rate_limits"] = ()
        if given.get("length_model"):
            from orchestrator.sim.length_model import load_length_model  # lazy: start-up

            given["length_model"] = load_length_model(given["length_model"])
        # From the environment, never the command line, where ps would show it.
        return SimConfig(**given, api_key=os.environ.get("SIM_API_KEY") or None)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
