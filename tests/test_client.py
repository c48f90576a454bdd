"""The inference client against the simulated server: answers, and every error class."""

from __future__ import annotations

import socket

import pytest

from orchestrator.client import ClientConfig, InferenceClient, base_url
from orchestrator.errors import PermanentError, ServerUnavailable, TransientError
from orchestrator.sim import answer_matches
from tests.conftest import StartSim

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
        got = await client.chat(url, {"messages": MESSAGES, "max_tokens": 5})
    assert answer_matches(MESSAGES, got.content)
    assert got.finish_reason == "length"
    assert got.usage and got.usage["completion_tokens"] == 5
    assert got.message == {"role": "assistant", "content": got.content}
    assert got.model == "sim-model" and got.server == url and got.latency > 0


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
        await client.chat(url, {"messages": MESSAGES})
    assert type(info.value) is error
    assert info.value.error_class == error_class
    if fault == "429":
        assert info.value.retry_after == 7


async def test_stream_faults(sim: StartSim) -> None:
    async with InferenceClient(ClientConfig(stream=True, stream_idle_timeout=1)) as client:
        cut = await sim(faults={"malformed": 1.0})
        with pytest.raises(TransientError) as info:
            await client.chat(cut, {"messages": MESSAGES})
        assert info.value.error_class == "stream_cut"
        stalled = await sim(faults={"hang": 1.0})
        with pytest.raises(TransientError) as info:
            await client.chat(stalled, {"messages": MESSAGES})
        assert info.value.error_class == "stream_idle"


async def test_wrong_model_is_permanent_with_reason(sim: StartSim, client: InferenceClient) -> None:
    url = await sim()
    with pytest.raises(PermanentError) as info:
        await client.chat(url, {"messages": MESSAGES, "model": "nope"})
    assert info.value.error_class == "http_404"
    assert "nope" in str(info.value)


async def test_refused_connection_is_an_outage(client: InferenceClient) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailable) as info:
        await client.chat(url, {"messages": MESSAGES})
    assert info.value.error_class == "connect"
    assert await client.health(url) is False


async def test_outage_window_is_unavailable_then_healthy(
    sim: StartSim, client: InferenceClient
) -> None:
    import asyncio

    url = await sim(outages=[(0.0, 0.5)])
    assert await client.health(url) is False
    with pytest.raises(ServerUnavailable):
        await client.chat(url, {"messages": MESSAGES})
    await asyncio.sleep(0.6)
    assert await client.health(url) is True
    assert (await client.chat(url, {"messages": MESSAGES})).content
