"""The circuit breaker on its own: which rejections are held, when it trips, and what an
answer or a context-length error decides."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.breaker import Breaker, cause

VLLM_CONTEXT = (
    "This model's maximum context length is 4096 tokens. However, you requested {n} tokens "
    "({p} in the messages, 512 in the completion). Please reduce the length of the messages "
    "or completion."
)


@pytest.mark.parametrize(
    ("error_class", "message", "run_level"),
    [
        ("http_401", "invalid or missing API key", True),
        ("http_403", "forbidden", True),
        ("http_404", "The model `x` does not exist.", True),
        ("http_400", "'chat_template_kwargs' must be an object", True),
        ("http_422", "temperature: Input should be a valid number", True),
        ("http_400", VLLM_CONTEXT.format(n=5000, p=4488), False),
        ("http_400", "the request exceeds the available context size, try increasing it", False),
        ("http_400", "Input length (5000 tokens) exceeds the maximum allowed length", False),
        ("http_413", "payload too large", False),
        ("http_500", "internal error", False),
        ("timeout", "no answer", False),
    ],
)
def test_what_may_be_run_level(error_class: str, message: str, run_level: bool) -> None:
    assert (cause(error_class, message) is not None) == run_level


def test_trips_on_the_threshold_th_different_item() -> None:
    breaker: Breaker[str] = Breaker(threshold=3)
    key = ("http://s:1", 7)
    assert breaker.rejected(key, 1, "http_401", "HTTP 401: no key", "a")
    assert breaker.rejected(key, 2, "http_401", "HTTP 401: no key", "b")
    assert breaker.tripped is None
    assert breaker.rejected(key, 2, "http_401", "HTTP 401: no key", "b")  # the same item again
    assert breaker.tripped is None
    assert breaker.rejected(key, 3, "http_401", "HTTP 401: no key", "c")
    assert breaker.tripped is not None
    assert (breaker.tripped.key, breaker.tripped.items) == (key, 3)
    assert "API key" in breaker.tripped.advice
    assert sorted(breaker.take_all()) == ["a", "b", "c"]
    assert len(breaker) == 0


def test_an_answer_in_between_fails_what_was_held_there_only() -> None:
    breaker: Breaker[str] = Breaker(threshold=2)
    here, there = ("s", 1), ("s", 2)
    assert breaker.rejected(here, 1, "http_400", "HTTP 400: bad", "a")
    assert breaker.rejected(there, 2, "http_400", "HTTP 400: bad", "b")
    assert breaker.answered(here) == ["a"]  # item a was rejected on its own
    assert breaker.rejected(here, 3, "http_400", "HTTP 400: bad", "c")
    assert breaker.tripped is None  # the answer broke the run: c is the first again
    assert breaker.rejected(there, 4, "http_400", "HTTP 400: bad", "d")
    assert breaker.tripped is not None and breaker.tripped.key == there


def test_different_400_messages_do_not_add_up() -> None:
    breaker: Breaker[int] = Breaker(threshold=2)
    assert breaker.rejected("k", 1, "http_400", "HTTP 400: bad a", 1)
    assert breaker.rejected("k", 2, "http_400", "HTTP 400: bad b", 2)
    assert breaker.tripped is None
    assert breaker.rejected("k", 3, "http_400", "HTTP 400: bad a", 3)
    assert breaker.tripped is not None and breaker.tripped.message == "HTTP 400: bad a"


def test_an_item_own_rejection_is_not_held() -> None:
    breaker: Breaker[int] = Breaker(threshold=1)
    assert not breaker.rejected("k", 1, "http_400", VLLM_CONTEXT.format(n=5000, p=4488), 1)
    assert breaker.tripped is None and len(breaker) == 0


@given(st.lists(st.integers(min_value=4097, max_value=100_000), min_size=1, max_size=200))
def test_context_length_errors_never_trip(lengths: list[int]) -> None:
    """However many long items in a row, even of the same length: they fail alone."""
    breaker: Breaker[int] = Breaker(threshold=2)
    for item, n in enumerate(lengths):
        message = "HTTP 400: " + VLLM_CONTEXT.format(n=n, p=n - 512)
        assert not breaker.rejected("k", item, "http_400", message, item)
    assert breaker.tripped is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["reject", "answer"]), st.integers(0, 3)),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=6),
)
def test_trips_exactly_when_a_key_has_threshold_items_in_a_row(
    events: list[tuple[str, int]], threshold: int
) -> None:
    """A model of the rule: per key, the rejections since its last answer."""
    breaker: Breaker[int] = Breaker(threshold)
    since_answer: dict[int, set[int]] = {}
    tripped_at = None
    for step, (what, key) in enumerate(events):
        if what == "answer":
            failed = breaker.answered(key)
            if tripped_at is None:
                assert sorted(failed) == sorted(since_answer.pop(key, set()))
            continue
        breaker.rejected(key, step, "http_404", "HTTP 404: no such model", step)
        since_answer.setdefault(key, set()).add(step)
        if tripped_at is None and len(since_answer[key]) >= threshold:
            tripped_at = step
        assert (breaker.tripped is not None) == (tripped_at is not None)
