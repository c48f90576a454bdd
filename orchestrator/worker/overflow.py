"""A server's refusal of a request longer than its context, read for its numbers.

A long agentic trace plus ``max_tokens`` 16,384 often exceeds the context a server was
started with. It answers 400 with a sentence whose wording differs by server and version:

* vLLM: "This model's maximum context length is N tokens. However, you requested M
  tokens (P in the messages, C in the completion)."; newer: "... However, you requested
  C output tokens and your prompt contains P input tokens, for a total of M tokens", or
  "... and your request has P input tokens".
* SGLang: "Requested token count exceeds the model's maximum context length of N tokens.
  You requested a total of M tokens: P tokens from the input messages and C tokens for
  the completion."; a prompt alone: "The input (P tokens) is longer than the model's
  context length (N tokens).", or, its scheduler against the KV pool: "Input length (P
  tokens) exceeds the maximum allowed length (N tokens)."
* llama.cpp (only the prompt is checked; generation stops at the context): "request (P
  tokens) exceeds the available context size (N tokens), try increasing it", or "input
  (P tokens) is larger than the max context size (N tokens)".

The numbers are parsed, not the sentences: each figure has a few phrasings, looked for
wherever they are. Pure: the worker's classification uses it (``orchestrator.worker``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Overflow", "parse"]

_N = r"(\d[\d,]*)"

_LIMIT = (
    rf"maximum context length (?:is|of) {_N}",
    rf"context length \({_N} tokens\)",
    rf"(?:available|max) context size \({_N} tokens\)",
    rf"maximum allowed (?:input )?length (?:of )?\(?{_N}",
)
_PROMPT = (
    rf"\({_N} in the messages",
    rf"{_N} tokens from the input messages",
    rf"{_N} input tokens",
    rf"\b(?:input|request) \({_N} tokens\)",
    rf"input length \({_N} tokens\)",
)
_COMPLETION = (
    rf"{_N} in the completion",
    rf"{_N} tokens for the completion",
    rf"{_N} output tokens",
    rf"is too large: {_N}",
)
_TOTAL = (
    rf"you requested (?:a total of )?{_N} tokens",
    rf"for a total of {_N} tokens",
)


def _compiled(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p, re.IGNORECASE) for p in patterns)


_LIMITS, _PROMPTS, _COMPLETIONS, _TOTALS = map(_compiled, (_LIMIT, _PROMPT, _COMPLETION, _TOTAL))


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        found = pattern.search(text)
        if found is not None:
            return int(found.group(1).replace(",", ""))
    return None


@dataclass(frozen=True, slots=True)
class Overflow:
    """What a context-length refusal said: the server's limit, and where the server says
    them, the prompt's tokens, the completion asked for and their total."""

    limit: int
    prompt: int | None = None
    completion: int | None = None
    total: int | None = None

    def prompt_tokens(self, sent_max_tokens: int | None) -> int | None:
        """The prompt's tokens: said, or the total less the completion asked for."""
        if self.prompt is not None:
            return self.prompt
        asked = self.completion if self.completion is not None else sent_max_tokens
        if self.total is not None and asked is not None and self.total > asked:
            return self.total - asked
        return None

    def describe(self, sent_max_tokens: int | None) -> str:
        """The numbers, as an item's failure message gives them."""
        prompt = self.prompt_tokens(sent_max_tokens)
        said = f"the prompt has {prompt:,} tokens" if prompt is not None else "the prompt"
        asked = self.completion if self.completion is not None else sent_max_tokens
        more = f", max_tokens {asked:,}" if asked is not None else ""
        return f"{said}{more}; the server's context is {self.limit:,} tokens"


def parse(message: str, *, limit: int | None = None) -> Overflow | None:
    """The numbers of a context-length refusal; None when ``message`` is not one.

    ``limit``: the context the server says it has elsewhere (``max_model_len`` in its
    ``/v1/models``), for a refusal that gives the prompt's length but not the limit.
    """
    said = _first(_LIMITS, message)
    prompt = _first(_PROMPTS, message)
    if said is None and (limit is None or prompt is None):
        return None
    return Overflow(
        limit=said if said is not None else limit,  # type: ignore[arg-type]
        prompt=prompt,
        completion=_first(_COMPLETIONS, message),
        total=_first(_TOTALS, message),
    )
