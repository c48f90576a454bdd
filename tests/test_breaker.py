"""The circuit breaker on its own: which rejections are held, when it trips, and what an
answer or a context-length error decides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.worker.breaker import Breaker, cause

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
        ("http_400", "Invalid model name passed in model=gpt-x", True),
        ("http_413", "payload too large", False),
        ("http_500", "internal error", False),
        ("timeout", "no answer", False),
    ],
)
def test_what_may_be_run_level(error_class: str, message: str, run_level: bool) -> None:
    assert (cause(error_class, message) is not None) == run_level


def test_trips_on_the_threshold_th_different_item() -> None:
    breaker: Breaker[str] = Breaker(threshold=3)
    server, dataset = "http://s:1", 7
    assert breaker.rejected(server, dataset, 1, "http_401", "HTTP 401: no key", "a")
    assert breaker.rejected(server, dataset, 2, "http_401", "HTTP 401: no key", "b")
    assert breaker.tripped is None
    assert breaker.rejected(server, dataset, 2, "http_401", "HTTP 401: no key", "b")  # again
    assert breaker.tripped is None
    assert breaker.rejected(server, dataset, 3, "http_401", "HTTP 401: no key", "c")
    assert breaker.tripped is not None
    trip = breaker.tripped
    assert (trip.server, trip.datasets, trip.items) == (server, (dataset,), 3)
    assert "API key" in trip.advice
    assert sorted(breaker.take_all()) == ["a", "b", "c"]
    assert len(breaker) == 0


def test_an_answer_in_between_fails_what_was_held_there_only() -> None:
    breaker: Breaker[str] = Breaker(threshold=2)
    assert breaker.rejected("s", 1, 1, "http_400", "HTTP 400: bad", "a")
    assert breaker.rejected("s", 2, 2, "http_400", "HTTP 400: bad", "b")
    assert breaker.answered("s", 1) == ["a"]  # item a was rejected on its own
    assert breaker.answered("t", 2) == []  # another server's answer says nothing here
    assert breaker.rejected("s", 1, 3, "http_400", "HTTP 400: bad", "c")
    assert breaker.tripped is None  # the answer broke the run: c is the first again
    assert breaker.rejected("s", 2, 4, "http_400", "HTTP 400: bad", "d")
    assert breaker.tripped is not None and breaker.tripped.datasets == (2,)


def test_different_400_messages_do_not_add_up() -> None:
    breaker: Breaker[int] = Breaker(threshold=2)
    assert breaker.rejected("s", "d", 1, "http_400", "HTTP 400: bad a", 1)
    assert breaker.rejected("s", "d", 2, "http_400", "HTTP 400: bad b", 2)
    assert breaker.tripped is None
    assert breaker.rejected("s", "d", 3, "http_400", "HTTP 400: bad a", 3)
    assert breaker.tripped is not None and breaker.tripped.message == "HTTP 400: bad a"


def test_an_item_own_rejection_is_not_held() -> None:
    breaker: Breaker[int] = Breaker(threshold=1)
    assert not breaker.rejected("s", "d", 1, "http_400", VLLM_CONTEXT.format(n=5000, p=4488), 1)
    assert breaker.tripped is None and len(breaker) == 0


@settings(deadline=None)  # a busy machine is slow, not wrong
@given(st.lists(st.integers(min_value=4097, max_value=100_000), min_size=1, max_size=200))
def test_context_length_errors_never_trip(lengths: list[int]) -> None:
    """However many long items in a row, even of the same length: they fail alone."""
    breaker: Breaker[int] = Breaker(threshold=2)
    for item, n in enumerate(lengths):
        message = "HTTP 400: " + VLLM_CONTEXT.format(n=n, p=n - 512)
        assert not breaker.rejected("s", "d", item, "http_400", message, item)
    assert breaker.tripped is None


@settings(deadline=None)  # a busy machine is slow, not wrong
@given(
    st.lists(
        st.tuples(st.sampled_from(["reject", "answer"]), st.integers(0, 3)),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=6),
)
def test_trips_exactly_when_a_dataset_has_threshold_items_in_a_row(
    events: list[tuple[str, int]], threshold: int
) -> None:
    """A model of the rule, with nothing else out: per dataset, the 400s since its last
    answer."""
    breaker: Breaker[int] = Breaker(threshold)
    since_answer: dict[int, set[int]] = {}
    tripped_at = None
    for step, (what, dataset) in enumerate(events):
        if what == "answer":
            failed = breaker.answered("s", dataset)
            if tripped_at is None:
                assert sorted(failed) == sorted(since_answer.pop(dataset, set()))
            continue
        breaker.rejected("s", dataset, step, "http_400", "HTTP 400: bad parameter", step)
        since_answer.setdefault(dataset, set()).add(step)
        if tripped_at is None and len(since_answer[dataset]) >= threshold:
            tripped_at = step
        assert (breaker.tripped is not None) == (tripped_at is not None)


@settings(deadline=None)  # a busy machine is slow, not wrong
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=6),
)
def test_a_server_level_refusal_counts_across_datasets(datasets: list[int], threshold: int) -> None:
    """A wrong key or model name: the items of every dataset add up, per server."""
    breaker: Breaker[int] = Breaker(threshold)
    for item, dataset in enumerate(datasets):
        breaker.rejected("s", dataset, item, "http_404", f"HTTP 404: no model m{dataset}", item)
        assert (breaker.tripped is not None) == (item + 1 >= threshold)
    if breaker.tripped is not None:
        assert breaker.tripped.datasets == tuple(dict.fromkeys(datasets[:threshold]))


@pytest.mark.parametrize(
    ("error_class", "message"),
    [
        ("http_404", "HTTP 404: The model `MODEL` does not exist."),
        ("http_400", "HTTP 400: Invalid model name passed in model=MODEL"),
        ("http_400", "HTTP 400: MODEL is not a valid model ID"),
        ("http_422", "HTTP 422: model 'MODEL.5' not found"),
    ],
)
def test_an_unknown_model_counts_across_datasets_whatever_the_status(
    error_class: str, message: str
) -> None:
    breaker: Breaker[int] = Breaker(threshold=3)
    for dataset in range(3):
        said = message.replace("MODEL", f"model-{dataset}")
        assert breaker.rejected("s", dataset, dataset, error_class, said, dataset)
    assert breaker.tripped is not None and breaker.tripped.datasets == (0, 1, 2)
    assert "model name" in breaker.tripped.advice


def test_an_answer_clears_a_server_level_run_of_its_own_dataset_only() -> None:
    breaker: Breaker[str] = Breaker(threshold=3)
    assert breaker.rejected("s", 1, 1, "http_404", "HTTP 404: no model a", "a")
    assert breaker.rejected("s", 2, 2, "http_404", "HTTP 404: no model b", "b")
    assert breaker.answered("s", 1) == ["a"]  # dataset 1's model exists: a was its own
    assert breaker.rejected("s", 3, 3, "http_404", "HTTP 404: no model c", "c")
    assert breaker.tripped is None
    assert breaker.rejected("t", 3, 4, "http_404", "HTTP 404: no model c", "d")
    assert breaker.tripped is None  # another server counts on its own
    assert breaker.rejected("s", 3, 5, "http_404", "HTTP 404: no model c", "e")
    assert breaker.tripped is not None
    assert (breaker.tripped.server, breaker.tripped.datasets) == ("s", (2, 3))


@settings(deadline=None)  # a busy machine is slow, not wrong
@given(
    st.integers(min_value=5, max_value=300),
    st.data(),
)
def test_a_burst_with_bad_items_waits_for_the_answers_sent_before(
    burst: int, data: st.DataObject
) -> None:
    """A burst of requests out at once, some refused the same way, one answered, in any
    order: the refusals before the answer fail alone with it; the breaker trips only
    on five or more after it, once every request sent before is back."""
    breaker: Breaker[int] = Breaker(threshold=5)
    for item in range(burst):
        breaker.sent(item, "d")
    answered = data.draw(st.integers(0, burst - 1))
    refused = data.draw(st.sets(st.integers(0, burst - 1).filter(lambda i: i != answered)))
    order = data.draw(st.permutations([*refused, answered]))
    failed: list[int] = []
    for step, item in enumerate(order):
        if item == answered:
            failed += breaker.answered("s", "d")
        else:
            assert breaker.rejected("s", "d", item, "http_400", "HTTP 400: alternate", item)
        breaker.back(item)
        assert breaker.tripped is None or step == len(order) - 1
    before = order[: order.index(answered)]
    assert sorted(failed) == sorted(before)
    everything_back = len(order) == burst  # the rest may still answer
    after = len(order) - len(before) - 1
    assert (breaker.tripped is not None) == (after >= 5 and everything_back)


def test_a_refusal_of_every_request_out_trips_once_they_are_back() -> None:
    """A setting that is wrong for all: the breaker waits for the requests sent before
    it filled, no longer; those sent after do not hold it."""
    breaker: Breaker[int] = Breaker(threshold=2)
    for item in range(4):
        breaker.sent(item, "d")
    refused = "HTTP 400: 'n' is not allowed"
    for item in (0, 1, 2):
        breaker.rejected("s", "d", item, "http_400", refused, item)
        breaker.back(item)
        if item >= 1:  # full since item 1: what goes out now does not hold it
            breaker.sent(10 + item, "d")
    assert breaker.tripped is None  # item 3, sent before, may still answer
    breaker.rejected("s", "d", 3, "http_400", refused, 3)
    assert breaker.back(3) is not None
    assert breaker.tripped is not None and breaker.tripped.items == 4
    assert sorted(breaker.take_all()) == [0, 1, 2, 3]


ECHOED = [
    # FastAPI's 422, each echoing its request body.
    (
        'HTTP 422: {"detail":[{"type":"missing","loc":["body","model"],"msg":"Field required",'
        '"input":{"messages":[{"role":"user","content":"CONTENT"}],"max_tokens":N}}]}'
    ),
    # The same, as vLLM puts pydantic's errors into its message (a Python repr).
    (
        "HTTP 400: [{'type': 'missing', 'loc': ('body', 'messages', N, 'content'), 'msg': "
        "'Field required', 'input': {'role': 'user', 'content': 'CONTENT'}}]"
    ),
    # pydantic's own text, naming the position and the value.
    (
        "HTTP 400: 1 validation error for ChatCompletionRequest\nmessages.N.content\n  Input "
        "should be a valid string [type=string_type, input_value='CONTENT', input_type=str]"
    ),
    "HTTP 400: Invalid image URL: 'https://images.example/CONTENT.png'",
    'HTTP 400: messages[N].content: "CONTENT" is not a valid image URL',
]

_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=80
)


@settings(deadline=None)  # a busy machine is slow, not wrong
@given(st.sampled_from(ECHOED), _TEXT, _TEXT, st.integers(0, 99), st.integers(0, 99))
def test_what_a_server_echoes_of_the_request_does_not_tell_refusals_apart(
    template: str, one: str, two: str, n: int, m: int
) -> None:
    def message(text: str, number: int) -> str:
        # Content, not a name: it has a space (quotes and backslashes left out).
        quoted = "a " + text.replace("\\", "").replace("'", "").replace('"', "")
        return template.replace("CONTENT", quoted).replace("N", str(number))

    assert cause("http_400", message(one, n)) == cause("http_400", message(two, m))


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("'chat_template_kwargs' must be an object", "'tools' must be a list"),
        ("simulated bad request (#3)", "simulated bad request (#4)"),  # the item's own
        ("max_tokens must be at most 4096, got 8192", "max_tokens must be at most 2048, got 8192"),
        ("body.model: Field required", "body.messages: Field required"),
    ],
)
def test_different_refusals_stay_apart(one: str, two: str) -> None:
    assert cause("http_400", f"HTTP 400: {one}") != cause("http_400", f"HTTP 400: {two}")
