"""What the simulated model generates for a request, and the proof that an answer is it.

Every answer is fixed by the request: its digest (:func:`request_digest`) seeds the
lengths, the words, whether a tool is called and how a JSON answer goes, so a caller
(the tests' oracle, ``orchestrator.api.demo``) can check that a stored answer belongs to
its prompt (:func:`answer_matches`). Apart from the HTTP side of the server
(``orchestrator.sim.server``) because nothing here knows of requests as HTTP: it is
the model, not the server.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import orjson

from orchestrator.items.quality import split_think
from orchestrator.sim import template
from orchestrator.sim.config import SimConfig
from orchestrator.sim.length_model import dataset_of, quantile

#: Words of the filler text; short and plain so that one word is one "token".
_FILLER = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
    "chi", "psi", "omega", "river", "stone", "cloud", "field", "light", "shadow", "signal",
    "vector", "matrix", "kernel", "tensor", "batch", "token", "cache", "queue", "worker",
    "answer", "prompt", "model", "layer", "north", "south", "east", "west", "amber", "cobalt",
    "copper", "silver", "violet", "green", "orange", "purple", "quiet", "swift",
)  # fmt: skip


def request_digest(messages: Any, seed: Any = None) -> str:
    """Digest of a request's messages; key order does not matter, content does. With a
    ``seed`` (a request's, or choice ``i`` of a request with ``n``: seed + i), another
    digest: the answer is another draw, the same for the same seed."""
    seen = template.seen(messages)
    digest = hashlib.sha256(orjson.dumps(seen, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
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
        return arguments.startswith(tool_arguments(digest, [], complete=False))
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


def tool_arguments(digest: str, words: list[str], *, complete: bool) -> str:
    """The JSON arguments of a simulated tool call made of ``words`` (the first one stands
    for the digest); a call cut by max_tokens is a prefix of the complete one, as streamed."""
    text = f'{{"sim": "{digest}"'
    if len(words) > 1:
        text += ', "text": "' + " ".join(words[1:])
    if complete:
        text += '"}' if len(words) > 1 else "}"
    return text


def count_prompt_tokens(messages: list[Any]) -> int:
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


@dataclass(frozen=True, slots=True)
class SimAnswer:
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


def thinking_off(body: dict[str, Any]) -> bool:
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


def generate(
    body: dict[str, Any], digest: str, config: SimConfig, *, empty: bool, plain: bool = False
) -> SimAnswer:
    """The answer to ``body``: reasoning first, then content or a tool call, cut by the
    request's token limit wherever it falls. A raw completion (``plain``) is text only."""
    thinking = config.reasoning != "none" and not thinking_off(body) and not empty
    thinking = thinking and not plain
    tool = None if empty or plain else _tool_to_call(body, digest, config)
    answer_length, reasoning_length = _lengths(body, digest, config, thinking=thinking)
    full = reasoning_length + answer_length
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = min(full, limit) if limit else full
    finish_reason = "length" if budget < full else "tool_calls" if tool else "stop"
    if empty:
        return SimAnswer(digest, False, [], True, [], None, finish_reason)
    in_reasoning = min(reasoning_length, budget)
    reasoning = _reasoning_words(digest, config.seed, reasoning_length)[:in_reasoning]
    words = _answer_words(digest, config.seed, answer_length)[: budget - in_reasoning]
    closed = in_reasoning == reasoning_length
    kind = _json_kind(body, digest, config) if tool is None else None
    return SimAnswer(digest, thinking, reasoning, closed, words, tool, finish_reason, kind)


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
