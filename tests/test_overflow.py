"""The context-length refusal parser over the wordings of vLLM, SGLang and llama.cpp, and
the decisions the worker takes from it (``orchestrator.worker.classify``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.errors import PermanentError
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker import classify, overflow

# Each server's words (from their sources), with the figures each one states.
Wording = Callable[[int, int, int], str]
WORDINGS: dict[str, tuple[Wording, set[str]]] = {
    "vllm": (
        lambda n, p, c: (
            f"This model's maximum context length is {n} tokens. However, you "
            f"requested {p + c} tokens ({p} in the messages, {c} in the completion). Please "
            "reduce the length of the messages or completion."
        ),
        {"prompt", "completion", "total"},
    ),
    "vllm-newer": (
        lambda n, p, c: (
            f"This model's maximum context length is {n} tokens. However, you "
            f"requested {c} output tokens and your prompt contains {p} input tokens, for a "
            f"total of {p + c} tokens. Please reduce the length of the input prompt or the "
            "number of requested output tokens."
        ),
        {"prompt", "completion", "total"},
    ),
    "vllm-too-large": (
        lambda n, p, c: (
            f"'max_tokens' or 'max_completion_tokens' is too large: {c}. This "
            f"model's maximum context length is {n} tokens and your request has {p} input "
            f"tokens ({c} > {n} - {p})."
        ),
        {"prompt", "completion"},
    ),
    "sglang": (
        lambda n, p, c: (
            "Requested token count exceeds the model's maximum context length "
            f"of {n} tokens. You requested a total of {p + c} tokens: {p} tokens from the input "
            f"messages and {c} tokens for the completion. Please reduce the number of tokens in "
            "the input messages or the completion to fit within the limit."
        ),
        {"prompt", "completion", "total"},
    ),
    "sglang-input": (
        lambda n, p, c: (
            f"The input ({p} tokens) is longer than the model's context length ({n} tokens)."
        ),
        {"prompt"},
    ),
    "sglang-scheduler": (
        lambda n, p, c: (
            f"Input length ({p} tokens) exceeds the maximum allowed length ({n} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        ),
        {"prompt"},
    ),
    "llamacpp": (
        lambda n, p, c: (
            f"request ({p} tokens) exceeds the available context size ({n} "
            "tokens), try increasing it"
        ),
        {"prompt"},
    ),
    "llamacpp-input": (
        lambda n, p, c: (
            f"input ({p} tokens) is larger than the max context size ({n} tokens). skipping"
        ),
        {"prompt"},
    ),
}


@given(
    wording=st.sampled_from(sorted(WORDINGS)),
    limit=st.integers(1, 2**31 - 1),
    prompt=st.integers(1, 2**31 - 1),
    completion=st.integers(1, 2**31 - 1),
    prefix=st.sampled_from(["", "HTTP 400: ", "HTTP 400: Bad request!: "]),
)
def test_every_wording_gives_its_numbers(
    wording: str, limit: int, prompt: int, completion: int, prefix: str
) -> None:
    render, states = WORDINGS[wording]
    said = overflow.parse(prefix + render(limit, prompt, completion))
    assert said is not None
    assert said.limit == limit
    assert said.prompt == prompt
    assert said.prompt_tokens(completion) == prompt
    assert said.completion == (completion if "completion" in states else None)
    assert said.total == (prompt + completion if "total" in states else None)


@given(limit=st.integers(2, 10**7), total=st.integers(2, 10**7), asked=st.integers(1, 10**7))
def test_a_total_alone_gives_the_prompt_from_the_max_tokens_sent(
    limit: int, total: int, asked: int
) -> None:
    said = overflow.parse(
        f"This model's maximum context length is {limit} tokens, however you requested "
        f"{total} tokens."
    )
    assert said is not None and said.limit == limit and said.prompt is None
    assert said.prompt_tokens(asked) == (total - asked if total > asked else None)


@pytest.mark.parametrize(
    "message",
    [
        "HTTP 400: simulated bad request (#3)",
        "HTTP 400: The model `x` does not exist.",
        "HTTP 422: body.messages: field required",
        "HTTP 400: the prompt and answer (900 tokens) do not fit in the KV cache (800 tokens)",
        "",
    ],
)
def test_other_refusals_are_not_overflows(message: str) -> None:
    assert overflow.parse(message) is None


@given(st.text())
def test_any_text_parses_or_not_without_error(text: str) -> None:
    said = overflow.parse(text)
    assert said is None or said.limit >= 0


def test_a_limit_from_v1_models_completes_a_refusal_without_one() -> None:
    assert overflow.parse("input (5000 tokens) is too long") is None
    said = overflow.parse("input (5000 tokens) is too long", limit=4096)
    assert said == overflow.Overflow(limit=4096, prompt=5000)


def _info(on_overflow: str) -> DatasetInfo:
    return DatasetInfo(
        id=1,
        name="d",
        params={},
        concurrency=None,
        priority=0,
        paused=False,
        source_path=None,
        source_sha256=None,
        input_format=None,
        created_at=0.0,
        on_overflow=on_overflow,
    )


@given(
    limit=st.integers(2, 10**6),
    prompt=st.integers(1, 10**6),
    asked=st.integers(1, 10**6),
    key=st.sampled_from(["max_tokens", "max_completion_tokens"]),
)
def test_fit_lowers_max_tokens_to_what_the_context_leaves(
    limit: int, prompt: int, asked: int, key: str
) -> None:
    body = {"messages": [], key: asked}
    said = overflow.Overflow(limit=limit, prompt=prompt, completion=asked)
    smaller = classify.fitted(_info("fit"), body, said)
    if prompt >= limit or limit - prompt >= asked:
        assert smaller is None  # the prompt fills the context, or nothing to lower
    else:
        assert smaller == {"messages": [], key: limit - prompt}
        assert prompt + smaller[key] == limit
    assert classify.fitted(_info("fail"), body, said) is None


def test_only_a_400_or_413_is_read_as_an_overflow() -> None:
    text = "HTTP 400: This model's maximum context length is 10 tokens. However, you requested"
    text += " 20 tokens (5 in the messages, 15 in the completion)."
    refusal = PermanentError(text, error_class="http_400")
    assert classify.overflowed(refusal, {"max_tokens": 15}, None) == overflow.Overflow(
        limit=10, prompt=5, completion=15, total=20
    )
    other = PermanentError(text, error_class="http_404")
    assert classify.overflowed(other, {"max_tokens": 15}, None) is None
