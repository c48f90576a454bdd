"""What the simulated server says to a request it will not answer: the body it refuses
(invalid JSON, bad fields, tools, a model it does not serve, ``--refuse``, FastAPI's 422),
a prompt too long for the context or the KV cache, and a provider's 429.

Each refusal is worded and shaped as the server it copies words it (vLLM's error object),
so a client's classification is tested against real texts. Kept apart from the answering
(``orchestrator.sim.server``) because these are the checks before any generation.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim import template
from orchestrator.sim.generation import thinking_off
from orchestrator.sim.runtime import State

_TOOL_CHOICES = ("none", "auto", "required")


JSON_TYPE = "application/json"


def error_response(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type=JSON_TYPE, headers=headers
    )


def bad_request(message: str) -> web.Response:
    return error_response(400, message, "BadRequestError")


def validate(state: State, raw: bytes, *, plain: bool = False) -> dict[str, Any] | web.Response:
    """The request body, or the refusal a server gives it; ``plain``: a raw completion's
    (a ``prompt`` string where a chat request has messages)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return bad_request(f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return bad_request("request body must be a JSON object")
    missing = [name for name in state.config.required_fields if name not in body]
    if missing:
        return _unprocessable(body, missing)
    if plain:
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            return bad_request("'prompt' must be a non-empty string")
        if "messages" in body:
            return bad_request("a completion takes a 'prompt', not 'messages'")
        if body.get("logprobs") is not None and sim_tokens.asked(body, True) is None:
            return bad_request("'logprobs' must be a non-negative integer")
        body = {**body, "messages": [{"role": "user", "content": body["prompt"]}]}
    messages = body.get("messages")
    if messages is None:
        return bad_request("'messages' is a required property")
    if not isinstance(messages, list):
        return bad_request("'messages' must be a list of message objects")
    if not messages:
        return bad_request("'messages' must contain at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return bad_request(f"messages[{i}] must be an object with a string 'role'")
    model = body.get("model")
    if not state.config.serves(model):
        return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1):
            return bad_request(f"'{key}' must be a positive integer, got {value!r}")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        return bad_request("'stream' must be a boolean")
    n = body.get("n", 1)
    if type(n) is not int or not 1 <= n <= 128:
        return bad_request(f"'n' must be an integer from 1 to 128, got {n!r}")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        return bad_request(f"'seed' must be an integer, got {seed!r}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return bad_request("'chat_template_kwargs' must be an object")
    problem = _check_tools(body.get("tools"), body.get("tool_choice"))
    if problem:
        return bad_request(problem)
    thinking = state.config.reasoning != "none" and not thinking_off(body)
    problem = template.refusal(messages, state.config.history_reasoning, thinking)
    if problem:
        return bad_request(problem)
    text = orjson.dumps(messages).decode()
    for marker, message in state.config.refusals.items():
        if marker in text:
            return bad_request(message)
    return body


def _unprocessable(body: dict[str, Any], missing: list[str]) -> web.Response:
    """FastAPI's answer to a body that fails validation: each error echoes its input,
    here the whole request, so no two requests get the same text."""
    detail = [
        {"type": "missing", "loc": ["body", name], "msg": "Field required", "input": body}
        for name in missing
    ]
    return web.Response(status=422, body=orjson.dumps({"detail": detail}), content_type=JSON_TYPE)


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


def rate_limited(state: State, tokens: int) -> web.Response | None:
    """The simulated provider's 429 when its bucket is empty (None: admitted)."""
    wait = state.limiter.admit(tokens) if state.limiter else None
    if wait is None:
        return None
    state.stats.rate_limited += 1
    return error_response(
        429,
        "simulated provider: rate limit reached, try again later",
        "RateLimitError",
        headers={
            "Retry-After": f"{max(1, math.ceil(wait))}",
            "retry-after-ms": f"{wait * 1000:.0f}",
        },
    )


def refusal(state: State, body: dict[str, Any], prompt_tokens: int, n: int) -> web.Response | None:
    """vLLM's 400 for a request longer than the context, or one too big for the cache."""
    config = state.config
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    if config.max_model_len and prompt_tokens + asked > config.max_model_len:
        return bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_tokens + asked} tokens ({prompt_tokens} in the messages, "
            f"{asked} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    if state.batcher is not None and not state.batcher.fits(prompt_tokens + n):
        return bad_request(
            f"the prompt and answer ({prompt_tokens + n} tokens) do not fit in the KV cache "
            f"({config.kv_tokens} tokens)"
        )
    return None
