"""The one check of request parameters, wherever they are given: ``enqueue`` options
(``--max-tokens``, ``--temperature``, ``--top-p``, ``--param``), a run file's keys and an
input line's own fields. The same value is refused with the same words in all three.

A value a server cannot use must stop at the door: NaN and infinities have no JSON form
(they go out as ``null``, and the server's defaults are used for the whole dataset), a
negative temperature or a zero ``max_tokens`` fails every request, and a ``max_tokens``
past 32 bits fits no column or server. A model is a name: a string with something in it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator.items import token_ids
from orchestrator.items.structured import format_problem

#: Most ``max_tokens`` a request may ask for: the token columns are 32-bit.
MAX_TOKENS = 2**31 - 1

#: Body fields no parameter may set: the worker decides them.
REFUSED: dict[str, str] = {
    "messages": "comes from the input rows",
    "stream": "decided by the worker (run --stream)",
    "stream_options": "decided by the worker (run --stream)",
    "history_reasoning": "a dataset setting (--history-reasoning), not a body field",
}

#: Keys where an assistant message holds its reasoning: SGLang and older vLLM say
#: ``reasoning_content``, newer vLLM ``reasoning``.
REASONING_KEYS = ("reasoning_content", "reasoning")


def request_settings(params: Mapping[str, Any], history_reasoning: str = "keep") -> dict[str, Any]:
    """What decides a dataset's requests, as outputs name it (their ``params_hash``): the
    body parameters, and ``history_reasoning`` where it is not the default (so that the
    sets named before it existed keep their names). :func:`item_body` reads it back."""
    if history_reasoning == "keep":
        return dict(params)
    return {**params, "history_reasoning": history_reasoning}


def item_body(
    dataset_params: Mapping[str, Any], request: Mapping[str, Any], seed: int | None = None
) -> dict[str, Any]:
    """The body an item is sent with: its dataset's settings (:func:`request_settings`),
    the item's own fields over them, and the sample's seed when the prompt has several
    (``orchestrator.items.samples``). The worker sends it and ``inspect`` shows it; both
    build it here, so what is shown is what goes out (the worker then sets ``stream``).

    The history goes with the reasoning of its assistant turns unless the dataset drops
    it: models that think in a tool loop render it from the history, and their template,
    not this code, decides what of it the model sees."""
    body = {**dataset_params, **request}
    history = body.pop("history_reasoning", "keep")  # a setting, never a body field
    if history == "drop" and isinstance(body.get("messages"), list):
        body["messages"] = without_reasoning(body["messages"])
    if token_ids.asked(body):
        # One switch asks every server for its ids, each in the fields it reads.
        body = {**token_ids.REQUEST_FIELDS, **body}
    if seed is not None:
        body["seed"] = seed
    return body


def without_reasoning(messages: list[Any]) -> list[Any]:
    """The messages with no assistant turn's reasoning: for a server that refuses it."""
    return [
        {k: v for k, v in m.items() if k not in REASONING_KEYS}
        if isinstance(m, dict) and m.get("role") == "assistant"
        else m
        for m in messages
    ]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _max_tokens(value: object) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        return "an integer"
    if value < 1:
        return "at least 1"
    if value > MAX_TOKENS:
        return f"at most {MAX_TOKENS}"
    return ""


def _temperature(value: object) -> str:
    if not _is_number(value):
        return "a number"
    if not math.isfinite(value):  # type: ignore[arg-type]
        return "a finite number"
    return "at least 0" if value < 0 else ""  # type: ignore[operator]


def _top_p(value: object) -> str:
    if not _is_number(value):
        return "a number"
    if not math.isfinite(value):  # type: ignore[arg-type]
        return "a finite number"
    return "" if 0 < value <= 1 else "in (0, 1]"  # type: ignore[operator]


def _n(value: object) -> str:
    # One answer per request: each item stores one output (--samples asks for more).
    if value == 1 and not isinstance(value, bool):
        return ""
    return "1 (one answer per request)"


def _object(value: object) -> str:
    return "" if isinstance(value, dict) else "an object"


def _model(value: object) -> str:
    if not isinstance(value, str):
        return "a string"
    return "" if value.strip() else "a non-empty string"


CHECKS = {
    "model": _model,
    "max_tokens": _max_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "n": _n,
    "response_format": _object,
}


def expected(name: str, value: object) -> str:
    """What ``name`` must be when ``value`` will not do (``"at least 0"``); "" when it is
    fine or ``name`` is not one of the checked parameters."""
    check = CHECKS.get(name)
    return check(value) if check is not None else ""


def shown(value: object) -> str:
    """A refused value as the messages give it."""
    return repr(value) if _is_number(value) else type(value).__name__


def problems(body: Mapping[str, object]) -> list[tuple[str, str]]:
    """Each refused field of a request body and why: ``[("temperature", "must be at least
    0, got -5")]``."""
    found: list[tuple[str, str]] = []
    for name, value in body.items():
        if name in REFUSED:
            found.append((name, f"cannot be set: {REFUSED[name]}"))
        elif want := expected(name, value):
            found.append((name, f"must be {want}, got {shown(value)}"))
        elif why := unusable(name, value):
            found.append((name, why))
    return found


def unusable(name: str, value: object) -> str:
    """Why a value of the right type still cannot be sent ("" when it can): a
    ``response_format`` whose schema cannot check the answers (an unresolvable
    ``$ref``) would fail every answer's check in the worker."""
    if name != "response_format":
        return ""

    return format_problem(value)


def token_id_params(wanted: bool | None) -> dict[str, Any]:
    """The request field that asks for the server's own prompt and generated token ids
    (``items.token_ids``); ``item_body`` adds what llama.cpp reads beside it."""
    return {"return_token_ids": True} if wanted else {}


def logprob_params(endpoint: str, logprobs: int | None) -> dict[str, Any]:
    """The request fields that ask for ``logprobs`` top alternatives per token: chat
    takes ``logprobs: true`` and ``top_logprobs``, a raw completion ``logprobs: K``."""
    if logprobs is None:
        return {}
    if endpoint == "completions":
        return {"logprobs": logprobs}
    return {"logprobs": True, "top_logprobs": logprobs}
