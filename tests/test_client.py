"""The inference client against the simulated server: answers, and every error class."""

from __future__ import annotations

import socket
from typing import Any

import orjson
import pytest

from orchestrator.errors import PermanentError, ServerUnavailable, TransientError
from orchestrator.inference.client import ClientConfig, InferenceClient, base_url
from orchestrator.inference.completions import Completion
from orchestrator.items.quality import (
    EMPTY_CONTENT,
    REASONING_ONLY,
    TRUNCATED,
    UNCLOSED_THINK,
    flag_names,
)
from orchestrator.sim import answer_matches, request_digest
from tests.conftest import StartSim
from tests.helpers import chat

MESSAGES = [{"role": "user", "content": "What is a lease?"}]


@pytest.fixture
async def client() -> InferenceClient:
    async with InferenceClient(ClientConfig(request_timeout=2, stream_idle_timeout=1)) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stream", [False, True])
async def test_answer_is_parsed(sim: StartSim, stream: bool) -> None:
    url = await sim(mean_tokens=20)
    async with InferenceClient(ClientConfig(stream=stream)) as client:
        got = await chat(client, url, {"messages": MESSAGES, "max_tokens": 5})
    assert answer_matches(MESSAGES, got.content)
    assert got.finish_reason == "length"
    assert got.usage and got.usage["completion_tokens"] == 5
    assert got.message == {"role": "assistant", "content": got.content}
    assert got.model == "sim-model" and got.server == url and got.latency > 0
    assert got.flags == TRUNCATED and got.reasoning is None and got.tool_calls is None


def test_base_url_forms() -> None:
    assert base_url("http://h:1/") == base_url("http://h:1/v1") == base_url("h:1") == "http://h:1"


@pytest.mark.parametrize(
    ("fault", "error", "error_class"),
    [
        ("500", TransientError, "http_500"),
        ("429", TransientError, "rate_limited"),
        ("503", ServerUnavailable, "http_503"),
        ("400", PermanentError, "http_400"),
        ("reset", TransientError, "disconnect"),
        ("hang", TransientError, "timeout"),
        ("malformed", TransientError, "bad_response"),
    ],
)
async def test_faults_are_classified(
    sim: StartSim, client: InferenceClient, fault: str, error: type, error_class: str
) -> None:
    url = await sim(faults={fault: 1.0}, retry_after=7)
    with pytest.raises(error) as info:
        await chat(client, url, {"messages": MESSAGES})
    assert type(info.value) is error
    assert info.value.error_class == error_class
    if fault == "429":
        assert info.value.retry_after == 7


async def test_stream_faults(sim: StartSim) -> None:
    async with InferenceClient(ClientConfig(stream=True, stream_idle_timeout=1)) as client:
        cut = await sim(faults={"malformed": 1.0})
        with pytest.raises(TransientError) as info:
            await chat(client, cut, {"messages": MESSAGES})
        assert info.value.error_class == "stream_cut"
        stalled = await sim(faults={"hang": 1.0})
        with pytest.raises(TransientError) as info:
            await chat(client, stalled, {"messages": MESSAGES})
        assert info.value.error_class == "stream_idle"


async def test_wrong_model_is_permanent_with_reason(sim: StartSim, client: InferenceClient) -> None:
    url = await sim(model="sim-model")  # pinned: by default it answers to any name
    with pytest.raises(PermanentError) as info:
        await chat(client, url, {"messages": MESSAGES, "model": "nope"})
    assert info.value.error_class == "http_404"
    assert "nope" in str(info.value)


async def test_a_fastapi_422_reads_as_its_errors_without_the_echoed_body(
    sim: StartSim, client: InferenceClient
) -> None:
    url = await sim(required_fields=("model", "max_tokens"))
    with pytest.raises(PermanentError) as info:
        await chat(client, url, {"messages": [{"role": "user", "content": "a secret prompt"}]})
    assert info.value.error_class == "http_422"
    assert str(info.value) == (
        "HTTP 422: body.model: Field required; body.max_tokens: Field required"
    )


async def test_refused_connection_is_an_outage(client: InferenceClient) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailable) as info:
        await chat(client, url, {"messages": MESSAGES})
    assert info.value.error_class == "connect"
    assert await client.health(url) is False


async def test_outage_window_is_unavailable_then_healthy(
    sim: StartSim, client: InferenceClient
) -> None:
    import asyncio

    url = await sim(outages=[(0.0, 0.5)])
    assert await client.health(url) is False
    with pytest.raises(ServerUnavailable):
        await chat(client, url, {"messages": MESSAGES})
    await asyncio.sleep(0.6)
    assert await client.health(url) is True
    assert (await chat(client, url, {"messages": MESSAGES})).content


# ------------------------------------------------------------ reasoning, tool calls, flags

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
DIGEST = request_digest(MESSAGES)
ALL_FOUR = TRUNCATED | EMPTY_CONTENT | UNCLOSED_THINK | REASONING_ONLY


async def ask(url: str, stream: bool, **extra: Any) -> Completion:
    async with InferenceClient(ClientConfig(stream=stream)) as client:
        return await chat(client, url, {"messages": MESSAGES, **extra})


async def reference(sim: StartSim, **extra: Any) -> Completion:
    """The same request answered with the reasoning in its own field, for comparison."""
    return await ask(await sim(mean_tokens=20, reasoning="field"), False, **extra)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_field_is_read(sim: StartSim, stream: bool, field: str) -> None:
    url = await sim(mean_tokens=20, reasoning="field", reasoning_field=field)
    got = await ask(url, stream)
    assert got.reasoning and got.reasoning.startswith(f"[sim-reasoning:{DIGEST}] ")
    assert answer_matches(MESSAGES, got.content)
    assert got.finish_reason == "stop" and got.flags == 0
    # Stored in the field the server said it in, so that a later turn sends it back there.
    assert got.message == {"role": "assistant", "content": got.content, field: got.reasoning}
    assert got.usage and got.usage["completion_tokens"] == len(got.reasoning.split()) + len(
        got.content.split()
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["think", "think-end"])
async def test_think_tags_are_split_out(sim: StartSim, stream: bool, mode: str) -> None:
    """Closed ``<think>…</think>``, and ``</think>`` alone (``<think>`` was in the prompt)."""
    separate = await reference(sim)
    got = await ask(await sim(mean_tokens=20, reasoning=mode), stream)
    assert got.reasoning == separate.reasoning
    assert got.content == separate.content
    assert got.message == separate.message
    assert got.flags == 0 and not got.unclosed_think
    assert answer_matches(MESSAGES, got.message)


@pytest.mark.parametrize("stream", [False, True])
async def test_unclosed_think_is_reasoning_and_flagged(sim: StartSim, stream: bool) -> None:
    separate = await reference(sim, max_tokens=3)
    got = await ask(await sim(mean_tokens=20, reasoning="think"), stream, max_tokens=3)
    assert got.reasoning == separate.reasoning
    assert got.reasoning and len(got.reasoning.split()) == 3
    assert got.content == ""
    assert got.finish_reason == "length"
    assert got.unclosed_think
    assert got.flags == ALL_FOUR
    assert flag_names(got.flags) == ["truncated", "empty", "unclosed_think", "reasoning_only"]
    assert answer_matches(MESSAGES, got.message)


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_only_answer_is_returned_not_raised(sim: StartSim, stream: bool) -> None:
    url = await sim(mean_tokens=20, reasoning="field", reasoning_field="reasoning")
    got = await ask(url, stream, max_tokens=2)
    assert got.reasoning and len(got.reasoning.split()) == 2
    assert not got.content
    assert got.flags == TRUNCATED | EMPTY_CONTENT | REASONING_ONLY
    assert not got.unclosed_think


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["field", "think", "think-end"])
async def test_truncated_inside_the_answer(sim: StartSim, stream: bool, mode: str) -> None:
    full = await reference(sim)
    assert full.reasoning and full.content
    limit = len(full.reasoning.split()) + 3
    got = await ask(await sim(mean_tokens=20, reasoning=mode), stream, max_tokens=limit)
    assert got.reasoning == full.reasoning
    assert got.content == " ".join(full.content.split()[:3])
    assert got.flags == TRUNCATED
    assert answer_matches(MESSAGES, got.content)


@pytest.mark.parametrize("stream", [False, True])
async def test_think_end_cut_while_thinking_cannot_be_told_apart(
    sim: StartSim, stream: bool
) -> None:
    """Without either tag, the text is content: only the truncation is visible."""
    got = await ask(await sim(mean_tokens=20, reasoning="think-end"), stream, max_tokens=3)
    assert got.reasoning is None
    assert got.content and got.content.startswith("[sim-reasoning:")
    assert got.flags == TRUNCATED


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["none", "field", "think"])
async def test_tool_calls(sim: StartSim, stream: bool, mode: str) -> None:
    url = await sim(mean_tokens=20, reasoning=mode)
    got = await ask(url, stream, tools=TOOLS, tool_choice="required")
    assert got.finish_reason == "tool_calls"
    assert got.content is None
    assert got.flags == 0
    [call] = got.tool_calls or []
    assert call["id"] == f"call_{DIGEST}" and call["type"] == "function"
    assert call["function"]["name"] == "lookup"
    assert orjson.loads(call["function"]["arguments"])["sim"] == DIGEST
    assert (got.reasoning is not None) is (mode != "none")
    assert answer_matches(MESSAGES, got.message)
    # Streamed or not, the stored message is the same, key order included.
    plain = await ask(url, False, tools=TOOLS, tool_choice="required")
    assert orjson.dumps(got.message) == orjson.dumps(plain.message)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_call_cut_by_max_tokens(sim: StartSim, stream: bool) -> None:
    url = await sim(mean_tokens=20)
    got = await ask(url, stream, tools=TOOLS, tool_choice="required", max_tokens=3)
    assert got.finish_reason == "length"
    assert got.flags == TRUNCATED
    [call] = got.tool_calls or []
    assert call["function"]["arguments"].startswith(f'{{"sim": "{DIGEST}"')
    assert answer_matches(MESSAGES, got.message)


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_off_per_request(sim: StartSim, stream: bool) -> None:
    url = await sim(mean_tokens=20, reasoning="think")
    got = await ask(url, stream, chat_template_kwargs={"enable_thinking": False})
    assert got.reasoning is None
    assert answer_matches(MESSAGES, got.content)
    assert got.message == {"role": "assistant", "content": got.content}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["none", "field", "think"])
async def test_empty_answer_is_still_an_error(sim: StartSim, stream: bool, mode: str) -> None:
    url = await sim(reasoning=mode, faults={"empty": 1.0})
    with pytest.raises(TransientError) as info:
        await ask(url, stream)
    assert info.value.error_class == "empty_content"
