"""The making of an answer, apart from HTTP: a request body in, the answer decided
(:func:`plan_answer`) and written as the one JSON document a non-streamed request gets
(:func:`answer_document`).

The online handler (``orchestrator.sim.server``) draws its faults, waits the time the
answer takes and writes it to the connection; the Batch API (``orchestrator.sim.batchapi``)
calls :func:`answer_body` for each line of a batch, so a prompt answered in a batch gets
the message, usage and ids it would have got online.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim import template
from orchestrator.sim.generation import (
    SimAnswer,
    choice_seeds,
    count_prompt_tokens,
    generate,
    request_digest,
)
from orchestrator.sim.messages import Shape, served_model, spelling, usage_counts, whole_message
from orchestrator.sim.prefix import prompt_words
from orchestrator.sim.refusals import rate_limited, refusal, validate
from orchestrator.sim.runtime import State

__all__ = ["Plan", "answer_body", "answer_document", "plan_answer"]


@dataclass(slots=True)
class Plan:
    """An answer decided, not yet written: its choices, their shapes and its counts."""

    body: dict[str, Any]
    plain: bool
    answers: list[SimAnswer]
    completion_id: str
    prompt_tokens: int
    tokens: int  # completion tokens of all choices
    limit: int  # the token budget the server expects the request may use
    cached: int | None
    shapes: list[Shape]


def plan_answer(
    state: State, body: dict[str, Any], *, plain: bool, fault: str | None, online: bool = True
) -> Plan | web.Response:
    """The answer to a validated ``body``, or the refusal the server gives it (context or
    cache too small; ``online``: the provider's 429 too, and refusals counted invalid)."""
    config, stats = state.config, state.stats
    messages: list[Any] = body["messages"]
    choices = 1 if config.ignore_n else body.get("n", 1)
    asked = body["prompt"] if plain else template.seen(messages, config.history_reasoning)
    answers = [
        generate(body, request_digest(asked, seed), config, empty=fault == "empty", plain=plain)
        for seed in choice_seeds(body, choices)
    ]
    answer = answers[0]
    n = sum(a.tokens for a in answers)
    prompt_tokens = count_prompt_tokens(messages)
    refused = refusal(state, body, prompt_tokens, n)
    if refused is not None:
        stats.invalid += online
        return refused
    limited = rate_limited(state, prompt_tokens + n) if online else None
    if limited is not None:
        return limited
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 2 * config.mean_tokens
    cached = state.prefix.serve(prompt_words(messages), answer.words) if state.prefix else None
    state.next_id += 1
    completion_id = f"{'cmpl' if plain else 'chatcmpl'}-{answer.digest}{state.next_id:08x}"
    said = body.get("return_token_ids") is True and config.prompt_ids == "response"
    ids = sim_tokens.prompt_ids(prompt_words(messages)) if said else None
    if body.get("return_token_ids") is True:
        for a in answers:
            state.remember_spelling(sim_tokens.answer_ids(a.digest, a.tokens), spelling(a, config))
    # A bad_ids fault: the ids said are another answer's, the text this one's.
    bad = ":bad-ids" if fault == "bad_ids" else ""
    shapes = [
        Shape(body, a.digest + bad, plain, sim_tokens.texts_of([a.reasoning, a.words]), ids)
        for a in answers
    ]
    return Plan(body, plain, answers, completion_id, prompt_tokens, n, limit, cached, shapes)


def answer_document(state: State, plan: Plan) -> dict[str, Any]:
    """The JSON a non-streamed request is answered with."""
    config = state.config
    return {
        "id": plan.completion_id,
        "object": "text_completion" if plan.plain else "chat.completion",
        "created": int(time.time()),
        "model": served_model(plan.body, config),
        "choices": [
            {
                **shape.choice(whole_message(each, config), 0, len(shape.texts), index=i),
                "finish_reason": each.finish_reason,
            }
            for i, (each, shape) in enumerate(zip(plan.answers, plan.shapes, strict=True))
        ],
        "usage": usage_counts(plan.prompt_tokens, plan.tokens, plan.cached),
    }


def answer_body(state: State, body: Any, *, plain: bool) -> tuple[int, dict[str, Any]]:
    """The status and JSON the online endpoint (``/v1/completions`` when ``plain``, else
    ``/v1/chat/completions``) answers ``body`` with, not streamed, at once: no fault drawn,
    no rate limit, no waiting. What a batch line gets."""
    checked = validate(state, orjson.dumps(body), plain=plain)
    if isinstance(checked, web.Response):
        return checked.status, _json_of(checked)
    plan = plan_answer(state, checked, plain=plain, fault=None, online=False)
    if isinstance(plan, web.Response):
        return plan.status, _json_of(plan)
    return 200, answer_document(state, plan)


def _json_of(response: web.Response) -> dict[str, Any]:
    raw = response.body
    doc = orjson.loads(raw if isinstance(raw, bytes) else b"{}")
    return doc if isinstance(doc, dict) else {"detail": doc}
