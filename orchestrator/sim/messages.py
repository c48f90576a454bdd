"""A generated answer (``orchestrator.sim.generation``) as a server writes it: the
assistant message of a whole answer, the deltas of a stream, each choice's fields with
the token ids and logprobs asked for, and the usage counts.

Both renderings come from one generated answer, so a streamed answer equals the plain
one; kept apart from the timing and writing of responses (``orchestrator.sim.responses``)
because these are pure functions of the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim.config import SimConfig
from orchestrator.sim.generation import SimAnswer, tool_arguments

#: How thinking is wrapped in the content, as chat templates do; tags count as no tokens.
_THINK_OPEN = "<think>\n"
_THINK_CLOSE = "\n</think>\n\n"


#: Words per streamed chunk: a few, like a server that flushes every couple of decode steps.
_CHUNK_WORDS = 4


def _json_content(digest: str, words: list[str], kind: str, *, complete: bool) -> str:
    """A JSON answer made of ``words`` (the first stands for the digest), as far as it got:
    complete, it parses, unless its kind is ``invalid_json``."""
    key = "words" if kind == "schema_mismatch" else "text"
    text = tool_arguments(digest, words, complete=complete and kind != "invalid_json")
    return text.replace('"text": "', f'"{key}": "', 1)


def _tool_call(answer: SimAnswer) -> dict[str, Any]:
    complete = answer.finish_reason != "length"
    return {
        "id": f"call_{answer.digest}",
        "type": "function",
        "function": {
            "name": answer.tool,
            "arguments": tool_arguments(answer.digest, answer.words, complete=complete),
        },
    }


def whole_message(answer: SimAnswer, config: SimConfig) -> dict[str, Any]:
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


def spelling(answer: SimAnswer, config: SimConfig) -> str:
    """The answer's text as its ids spell it: reasoning, content, then each call's
    arguments, as a model writes them before a parser takes them apart."""
    message = whole_message(answer, config)
    parts = [message.get(config.reasoning_field), message.get("content")]
    parts += [c["function"]["arguments"] for c in message.get("tool_calls") or ()]
    return "\n".join(p for p in parts if isinstance(p, str) and p)


def stream_deltas(answer: SimAnswer, config: SimConfig) -> list[tuple[dict[str, Any], int]]:
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
            upto = tool_arguments(answer.digest, answer.words[:count], complete=False)
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


def _json_deltas(answer: SimAnswer) -> list[tuple[dict[str, Any], int]]:
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
class Shape:
    """How an answer's choices are written: a chat message or a raw completion's text
    (``plain``), with the token ids and logprobs the request asked for (``texts``: each
    generated token's text, reasoning first)."""

    body: dict[str, Any]
    digest: str
    plain: bool
    texts: list[str]
    #: The prompt's ids, said with the first tokens (None: not asked, or not said).
    prompt_ids: list[int] | None = None

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
        if self.prompt_ids is not None and start == 0 and (count or not streamed):
            choice["prompt_token_ids"] = self.prompt_ids
        return choice


def _pieces(words: list[str]) -> list[list[str]]:
    return [words[i : i + _CHUNK_WORDS] for i in range(0, len(words), _CHUNK_WORDS)]


def usage_counts(
    prompt_tokens: int, completion_tokens: int, cached: int | None = None
) -> dict[str, Any]:
    if cached is not None:
        return {
            **usage_counts(prompt_tokens, completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def served_model(body: dict[str, Any], config: SimConfig) -> str:
    """The model name an answer carries: the one asked for, else the first served."""
    return body.get("model") or config.served[0]
