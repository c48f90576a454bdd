"""The simulated inference server, exercised over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from orchestrator.sim import (
    SimConfig,
    answer_matches,
    parse_fault,
    parse_outage,
    parse_refusal,
    request_digest,
    serve,
    write_sample,
)
from tests.helpers import cli

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Explain black holes in three sentences."},
]

StartSim = Callable[..., Awaitable[str]]


@pytest.fixture
def start_sim(sim: StartSim) -> StartSim:
    """Servers on free ports (the shared ``sim`` fixture), stopped after the test."""
    return sim


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture(autouse=True)
def no_error_logs(caplog: pytest.LogCaptureFixture) -> Any:
    """Faults and vanished clients must not make the server log errors or tracebacks."""
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


async def chat(
    session: aiohttp.ClientSession, base: str, messages: list[Any] = MESSAGES, **extra: Any
) -> tuple[int, dict[str, Any]]:
    async with session.post(
        f"{base}/v1/chat/completions", json={"messages": messages, **extra}
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def stream_events(
    session: aiohttp.ClientSession, base: str, **extra: Any
) -> tuple[str, list[str]]:
    body = {"messages": MESSAGES, "stream": True, **extra}
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
        content_type = resp.headers["Content-Type"]
    assert raw.endswith("\n\n")
    events = [block for block in raw.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events)
    return content_type, [event.removeprefix("data: ") for event in events]


async def stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/sim/stats") as resp:
        assert resp.status == 200
        return await resp.json()


async def wait_for_stats(
    session: aiohttp.ClientSession, base: str, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    # Polled until a deadline far past what an idle machine needs, so that a loaded one
    # passes too; a check that never holds still fails.
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        current = await stats(session, base)
        if check(current):
            return current
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"stats never matched: {current}")
        await asyncio.sleep(0.02)


async def test_answer_shape_and_provenance(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(mean_tokens=20)
    status, body = await chat(session, base, model="sim-model")
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == "sim-model"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    content = choice["message"]["content"]
    words = content.split()
    assert words[0] == f"[sim:{request_digest(MESSAGES)}]"
    assert 10 <= len(words) <= 30
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": len(words),
        "total_tokens": 9 + len(words),
    }
    assert answer_matches(MESSAGES, content)
    reordered = [{"content": m["content"], "role": m["role"]} for m in MESSAGES]
    assert answer_matches(reordered, content)
    assert not answer_matches([{"role": "user", "content": "something else"}], content)
    assert not answer_matches(MESSAGES, None)
    assert not answer_matches(MESSAGES, "")


def test_request_digest_format():
    digest = request_digest(MESSAGES)
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert digest != request_digest(MESSAGES[1:])


async def test_answers_are_deterministic(start_sim: StartSim, session: aiohttp.ClientSession):
    first, again, other_seed = (
        await start_sim(seed=7),
        await start_sim(seed=7),
        await start_sim(seed=8),
    )
    _, a = await chat(session, first)
    _, b = await chat(session, first)
    _, c = await chat(session, again)
    _, d = await chat(session, other_seed)
    content = a["choices"][0]["message"]["content"]
    assert b["choices"][0]["message"]["content"] == content
    assert c["choices"][0]["message"]["content"] == content
    other = d["choices"][0]["message"]["content"]
    assert other != content
    assert answer_matches(MESSAGES, other)
    assert len(other.split()) == len(content.split())

    lengths = set()
    for i in range(30):
        _, body = await chat(session, first, [{"role": "user", "content": f"prompt {i}"}])
        lengths.add(body["usage"]["completion_tokens"])
    assert len(lengths) > 5
    assert all(32 <= n <= 96 for n in lengths)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_cuts_the_answer(
    start_sim: StartSim, session: aiohttp.ClientSession, key: str
):
    base = await start_sim()
    _, full = await chat(session, base)
    full_words = full["choices"][0]["message"]["content"].split()

    _, cut = await chat(session, base, **{key: 5})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].split() == full_words[:5]
    assert cut["usage"]["completion_tokens"] == 5

    _, roomy = await chat(session, base, **{key: len(full_words) + 10})
    assert roomy["choices"][0]["finish_reason"] == "stop"
    assert roomy["usage"]["completion_tokens"] == len(full_words)


async def test_streaming_matches_non_streaming(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(mean_tokens=30)
    _, plain = await chat(session, base)
    content_type, events = await stream_events(
        session, base, stream_options={"include_usage": True}
    )
    assert content_type.startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == plain["usage"]
    finish_chunk = chunks[-2]
    assert finish_chunk["choices"][0]["finish_reason"] == "stop"
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]]
    assert len([d for d in deltas if d]) > 3
    assert "".join(deltas) == plain["choices"][0]["message"]["content"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])

    _, events = await stream_events(session, base, max_tokens=6)
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all(c["choices"] for c in chunks), "usage chunk sent without include_usage"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text.split()) == 6
    assert answer_matches(MESSAGES, text)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b"{}",
        b'{"messages": []}',
        b'{"messages": "hello"}',
        b'{"messages": ["hello"]}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "7"}',
    ],
)
async def test_bad_bodies_get_400(start_sim: StartSim, session: aiohttp.ClientSession, raw: bytes):
    base = await start_sim()
    async with session.post(
        f"{base}/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["object"] == "error"
    assert body["type"] == "BadRequestError"
    assert body["code"] == 400
    assert body["message"]
    current = await stats(session, base)
    assert current["invalid"] == 1
    assert current["completed"] == 0


async def test_wrong_model_gets_404(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(model="served")
    status, body = await chat(session, base, model="other")
    assert status == 404
    assert body["object"] == "error"
    assert body["code"] == 404
    assert body["message"] == "The model `other` does not exist."
    status, body = await chat(session, base, model="served")
    assert status == 200
    assert body["model"] == "served"


async def test_refused_text_gets_the_same_400(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(refusals={"[bad]": "Invalid image URL"})
    for n in (1, 2):
        status, body = await chat(session, base, [{"role": "user", "content": f"{n} [bad]"}])
        assert (status, body["message"], body["code"]) == (400, "Invalid image URL", 400)
    status, _ = await chat(session, base, [{"role": "user", "content": "fine"}])
    assert status == 200
    assert (await stats(session, base))["invalid"] == 2


async def test_a_missing_required_field_gets_fastapis_422_echoing_the_body(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(required_fields=("model",))
    status, body = await chat(session, base, temperature=0.5)
    assert status == 422
    assert body == {
        "detail": [
            {
                "type": "missing",
                "loc": ["body", "model"],
                "msg": "Field required",
                "input": {"messages": MESSAGES, "temperature": 0.5},
            }
        ]
    }
    status, _ = await chat(session, base, model="m")
    assert status == 200


async def test_health_and_models(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(model="m-1")
    for path in ("/health", "/health_generate"):
        async with session.get(base + path) as resp:
            assert resp.status == 200
    async with session.get(f"{base}/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m-1"]


@pytest.mark.parametrize(
    ("kind", "status", "error_type"),
    [
        ("500", 500, "InternalServerError"),
        ("503", 503, "ServiceUnavailableError"),
        ("429", 429, "RateLimitError"),
        ("400", 400, "BadRequestError"),
    ],
)
async def test_status_faults(
    start_sim: StartSim, session: aiohttp.ClientSession, kind: str, status: int, error_type: str
):
    base = await start_sim(faults={kind: 1.0}, retry_after=2.5)
    for stream in (False, True):
        async with session.post(
            f"{base}/v1/chat/completions", json={"messages": MESSAGES, "stream": stream}
        ) as resp:
            assert resp.status == status
            body = await resp.json()
            retry_after = resp.headers.get("Retry-After")
        assert body["object"] == "error"
        assert body["type"] == error_type
        assert retry_after == ("2.5" if kind == "429" else None)
    current = await stats(session, base)
    assert current["faults"][kind] == 2
    assert current["completed"] == 0


async def test_reset_fault_drops_the_connection(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(faults={"reset": 1.0})
    with pytest.raises(
        (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)
    ):
        await chat(session, base)
    current = await stats(session, base)
    assert current["faults"]["reset"] == 1
    assert current["completed"] == 0


async def test_hang_fault_never_answers(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(faults={"hang": 1.0})
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        async with session.post(
            f"{base}/v1/chat/completions", json={"messages": MESSAGES}, timeout=timeout
        ) as resp:
            await resp.read()
    current = await wait_for_stats(session, base, lambda s: s["aborted"] == 1)
    assert current["running"] == 0
    assert current["faults"]["hang"] == 1


async def test_hanging_request_does_not_block_shutdown(session: aiohttp.ClientSession):
    runner, port = await serve(SimConfig(faults={"hang": 1.0}), "127.0.0.1", 0)
    pending = asyncio.create_task(
        session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": MESSAGES})
    )
    await asyncio.sleep(0.1)
    await asyncio.wait_for(runner.cleanup(), timeout=3)
    with pytest.raises(aiohttp.ClientError):
        resp = await pending
        await resp.read()


async def test_malformed_fault(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(faults={"malformed": 1.0})
    async with session.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        raw = await resp.read()
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)

    async with session.post(
        f"{base}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    ) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert "[DONE]" not in text
    assert '"finish_reason":"stop"' not in text
    assert '"content":"[sim:' in text
    current = await stats(session, base)
    assert current["faults"]["malformed"] == 2
    assert current["completed"] == 0


async def test_fault_rates_mix_and_retries_can_succeed(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(faults={"500": 0.3, "429": 0.2}, seed=3)
    statuses = [(await chat(session, base))[0] for _ in range(300)]
    assert set(statuses) == {200, 429, 500}
    assert 50 <= statuses.count(500) <= 130
    assert 30 <= statuses.count(429) <= 100
    current = await stats(session, base)
    assert current["faults"]["500"] == statuses.count(500)
    assert current["faults"]["429"] == statuses.count(429)
    assert current["completed"] == statuses.count(200)
    assert current["chat_requests"] == 300

    # The draws come from one seeded stream: a second server with the same seed repeats them.
    twin = await start_sim(faults={"500": 0.3, "429": 0.2}, seed=3)
    assert [(await chat(session, twin))[0] for _ in range(50)] == statuses[:50]


async def test_outage_window(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(outages=[(0.0, 0.5)])
    async with session.get(f"{base}/health") as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["object"] == "error"
    assert body["message"] == "server unavailable (simulated outage)"
    status, _ = await chat(session, base)
    assert status == 503
    await asyncio.sleep(0.6)
    async with session.get(f"{base}/health") as resp:
        assert resp.status == 200
    status, _ = await chat(session, base)
    assert status == 200
    current = await stats(session, base)
    assert current["outage_rejected"] == 2
    assert current["completed"] == 1


def metric_value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} missing from /metrics"
    return float(match.group(1))


async def test_metrics(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(model="m")
    generated = 0
    for i in range(3):
        _, body = await chat(session, base, [{"role": "user", "content": f"q {i}"}])
        generated += body["usage"]["completion_tokens"]
    async with session.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    label = '{model_name="m"}'
    for gauge in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
    ):
        assert f"# TYPE sglang:{gauge} gauge" in text
        metric_value(text, f"sglang:{gauge}{label}")
    for counter in ("prompt_tokens", "generation_tokens", "num_requests", "num_aborted_requests"):
        assert f"# TYPE sglang:{counter} counter" in text
    assert metric_value(text, f"sglang:num_requests_total{label}") == 3
    assert metric_value(text, f"sglang:prompt_tokens_total{label}") == 6
    assert metric_value(text, f"sglang:generation_tokens_total{label}") == generated
    assert metric_value(text, f"sglang:num_aborted_requests_total{label}") == 0
    assert metric_value(text, f"sglang:gen_throughput{label}") > 0
    assert "# TYPE sglang:e2e_request_latency_seconds histogram" in text
    hist = "sglang:e2e_request_latency_seconds"
    assert metric_value(text, f'{hist}_bucket{{model_name="m",le="+Inf"}}') == 3
    assert metric_value(text, f"{hist}_count{label}") == 3
    assert metric_value(text, f"{hist}_sum{label}") >= 0


async def test_client_leaving_mid_stream_counts_as_aborted(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(per_token=0.02, mean_tokens=100)
    async with session.post(
        f"{base}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()
        running = await stats(session, base)
        assert running["running"] == 1
        resp.close()
    current = await wait_for_stats(session, base, lambda s: s["aborted"] == 1)
    assert current["running"] == 0
    assert current["completed"] == 0
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    assert metric_value(text, 'sglang:num_aborted_requests_total{model_name="sim-model"}') == 1


async def test_client_leaving_during_latency_counts_as_aborted(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(latency=5.0)
    # The client leaves only once the server holds its request: a fixed client timeout
    # could expire, on a loaded machine, before the request ever reached the handler.
    request = asyncio.ensure_future(
        session.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES})
    )
    await wait_for_stats(session, base, lambda s: s["running"] == 1)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    current = await wait_for_stats(session, base, lambda s: s["aborted"] == 1)
    assert current["running"] == 0
    assert current["chat_requests"] == 1


async def test_latency_is_applied(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(latency=0.1, per_token=0.005, mean_tokens=20)
    loop = asyncio.get_running_loop()
    begun = loop.time()
    _, body = await chat(session, base)
    elapsed = loop.time() - begun
    assert elapsed >= 0.1 + 0.005 * body["usage"]["completion_tokens"] - 0.01


def test_parse_specs():
    assert parse_fault("500=0.05") == ("500", 0.05)
    assert parse_fault("reset=1") == ("reset", 1.0)
    assert parse_fault("malformed=0") == ("malformed", 0.0)
    for bad in ("500", "boom=0.1", "500=x", "500=1.5", "=0.1", "429=-0.1"):
        with pytest.raises(ValueError, match="fault spec"):
            parse_fault(bad)
    assert parse_outage("30:10") == (30.0, 10.0)
    assert parse_outage("0.5:0.25") == (0.5, 0.25)
    for bad in ("30", "a:b", "-1:5", "5:0", "5:-2"):
        with pytest.raises(ValueError, match="outage spec"):
            parse_outage(bad)
    assert parse_refusal("[bad]=Invalid image URL") == ("[bad]", "Invalid image URL")
    for bad in ("[bad]", "=msg", "x= "):
        with pytest.raises(ValueError, match="refusal spec"):
            parse_refusal(bad)


@pytest.mark.parametrize(
    "options",
    [
        {"faults": {"teapot": 0.1}},
        {"faults": {"500": 1.2}},
        {"faults": {"500": 0.6, "reset": 0.6}},
        {"mean_tokens": 0},
        {"latency": -1.0},
        {"outages": [(1.0, 0.0)]},
    ],
)
def test_config_validation(options: dict[str, Any]):
    with pytest.raises(ValueError):
        SimConfig(**options)


async def _sim_command(*args: str) -> asyncio.subprocess.Process:
    """``python -m orchestrator.sim.server`` with ``args``, stdout and stderr piped."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator.sim.server",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def test_run_forever_announces_port_and_stops_on_sigterm():
    proc = await _sim_command(
        "--host", "127.0.0.1", "--port", "0", "--model", "cli-model", "--fault", "500=0"
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=10)).decode()
        match = re.fullmatch(r"sim-server listening on http://127\.0\.0\.1:(\d+)\n", line)
        assert match, line
        base = f"http://127.0.0.1:{match.group(1)}"
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{base}/health") as resp:
                assert resp.status == 200
            status, body = await chat(client, base, model="cli-model")
            assert status == 200
            assert answer_matches(MESSAGES, body["choices"][0]["message"]["content"])
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    assert stdout == b""
    assert stderr == b""


async def test_cli_rejects_bad_fault_spec():
    proc = await _sim_command("--fault", "boom=1")
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=10)
    assert proc.returncode == 2
    assert b"unknown kind 'boom'" in stderr
    assert stdout == b""


def test_write_sample(tmp_path: Path):
    path = tmp_path / "sample.jsonl"
    assert write_sample(path, n=500, seed=1) == 500
    lines = path.read_bytes().splitlines()
    assert len(lines) == 500
    records = [json.loads(line) for line in lines]
    ids = [r["id"] for r in records]
    assert len(set(ids)) == 500
    assert ids[0] == "sample-000001"
    shapes = {tuple(m["role"] for m in r["messages"]) for r in records}
    assert shapes == {("user",), ("system", "user"), ("user", "assistant", "user")}
    for record in records:
        assert all(isinstance(m["content"], str) and m["content"] for m in record["messages"])
    assert len({r["messages"][-1]["content"] for r in records}) > 200

    again = tmp_path / "again.jsonl"
    write_sample(again, n=500, seed=1)
    assert again.read_bytes() == path.read_bytes()
    other = tmp_path / "other.jsonl"
    write_sample(other, n=500, seed=2)
    assert other.read_bytes() != path.read_bytes()
    assert write_sample(tmp_path / "empty.jsonl", n=0) == 0
    assert (tmp_path / "empty.jsonl").read_bytes() == b""


# ------------------------------------------------------------ reasoning, tool calls, truncation

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "fetch", "parameters": {"type": "object"}}},
]
DIGEST = request_digest(MESSAGES)


def message_of(body: dict[str, Any]) -> dict[str, Any]:
    [choice] = body["choices"]
    return choice["message"]


def assembled(events: list[str]) -> dict[str, Any]:
    """A stream put back together as a client would: text per delta field, tool calls,
    finish_reason and usage; also checks the shape every stream must have."""
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    texts: dict[str, str] = {}
    calls: dict[int, dict[str, Any]] = {}
    order: list[str] = []
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert all(f is None for f in finish[:-1]) and finish[-1] is not None
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key, value in choice["delta"].items():
                if key == "role":
                    assert value == "assistant"
                    continue
                if key == "tool_calls":
                    for part in value:
                        if part["index"] not in calls:
                            assert part["id"].startswith("call_") and part["type"] == "function"
                            assert part["function"]["name"] and part["function"]["arguments"] == ""
                            calls[part["index"]] = {**part, "function": dict(part["function"])}
                        else:
                            assert set(part) == {"index", "function"}
                            assert set(part["function"]) == {"arguments"}
                            calls[part["index"]]["function"]["arguments"] += part["function"][
                                "arguments"
                            ]
                elif value:
                    texts[key] = texts.get(key, "") + value
                if value and (not order or order[-1] != key):
                    order.append(key)
    usage = chunks[-1].get("usage")
    return {
        "texts": texts,
        "order": order,
        "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls.values()],
        "finish_reason": finish[-1],
        "usage": usage,
    }


async def both(
    session: aiohttp.ClientSession, base: str, **extra: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plain answer and the streamed one (with usage) to the same request."""
    status, plain = await chat(session, base, **extra)
    assert status == 200, plain
    _, events = await stream_events(session, base, stream_options={"include_usage": True}, **extra)
    return plain, assembled(events)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_in_a_field(
    start_sim: StartSim, session: aiohttp.ClientSession, field: str
):
    plain_base = await start_sim(mean_tokens=20)
    base = await start_sim(mean_tokens=20, reasoning="field", reasoning_field=field)
    _, without = await chat(session, plain_base)
    plain, streamed = await both(session, base)
    message = message_of(plain)
    other = ({"reasoning_content", "reasoning"} - {field}).pop()
    assert other not in message
    reasoning = message[field]
    assert reasoning.split()[0] == f"[sim-reasoning:{DIGEST}]"
    assert 10 <= len(reasoning.split()) <= 30
    # Thinking comes before the answer and does not change it.
    assert message["content"] == message_of(without)["content"]
    assert plain["choices"][0]["finish_reason"] == "stop"
    tokens = len(reasoning.split()) + len(message["content"].split())
    assert plain["usage"]["completion_tokens"] == tokens
    assert answer_matches(MESSAGES, message)
    assert not answer_matches(MESSAGES[1:], message)

    assert streamed["texts"] == {field: reasoning, "content": message["content"]}
    assert streamed["order"] == [field, "content"]
    assert streamed["usage"] == plain["usage"]
    assert streamed["finish_reason"] == "stop"


@pytest.mark.parametrize("mode", ["think", "think-end"])
async def test_reasoning_left_in_the_content(
    start_sim: StartSim, session: aiohttp.ClientSession, mode: str
):
    field_base = await start_sim(mean_tokens=20, reasoning="field")
    base = await start_sim(mean_tokens=20, reasoning=mode)
    _, separate = await chat(session, field_base)
    plain, streamed = await both(session, base)
    reasoning = message_of(separate)["reasoning_content"]
    answer = message_of(separate)["content"]
    message = message_of(plain)
    assert set(message) == {"role", "content"}
    opening = "<think>\n" if mode == "think" else ""
    assert message["content"] == f"{opening}{reasoning}\n</think>\n\n{answer}"
    assert plain["usage"] == separate["usage"]
    assert answer_matches(MESSAGES, message["content"])
    assert answer_matches(MESSAGES, message)
    assert streamed["texts"] == {"content": message["content"]}
    assert streamed["usage"] == plain["usage"]


@pytest.mark.parametrize("mode", ["field", "think", "think-end"])
@pytest.mark.parametrize(
    ("kwargs", "thinks"),
    [
        ({"enable_thinking": False}, False),
        ({"thinking": False}, False),
        ({"enable_thinking": True}, True),
        ({}, True),
    ],
)
async def test_thinking_can_be_turned_off_per_request(
    start_sim: StartSim,
    session: aiohttp.ClientSession,
    mode: str,
    kwargs: dict[str, Any],
    thinks: bool,
):
    plain_base = await start_sim(mean_tokens=20)
    base = await start_sim(mean_tokens=20, reasoning=mode)
    _, without = await chat(session, plain_base)
    plain, streamed = await both(session, base, chat_template_kwargs=kwargs)
    message = message_of(plain)
    if thinks:
        assert plain["usage"]["completion_tokens"] > without["usage"]["completion_tokens"]
        return
    assert message["content"] == message_of(without)["content"]
    assert message.get("reasoning_content") is None
    assert plain["usage"] == without["usage"]
    assert streamed["texts"] == {"content": message["content"]}


@pytest.mark.parametrize("mode", ["field", "think", "think-end"])
@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_truncation_inside_the_reasoning(
    start_sim: StartSim, session: aiohttp.ClientSession, mode: str, key: str
):
    base = await start_sim(reasoning=mode)
    _, full = await chat(session, await start_sim(reasoning="field"))
    reasoning_words = message_of(full)["reasoning_content"].split()
    plain, streamed = await both(session, base, **{key: 3})
    assert plain["choices"][0]["finish_reason"] == streamed["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 3
    assert streamed["usage"] == plain["usage"]
    message = message_of(plain)
    cut = " ".join(reasoning_words[:3])
    if mode == "field":
        assert message == {"role": "assistant", "content": None, "reasoning_content": cut}
        assert streamed["texts"] == {"reasoning_content": cut}
        assert answer_matches(MESSAGES, message)
    else:
        # No </think>, and no answer: the model ran out of tokens while thinking.
        expected = "<think>\n" + cut if mode == "think" else cut
        assert message == {"role": "assistant", "content": expected}
        assert streamed["texts"] == {"content": expected}


@pytest.mark.parametrize("mode", ["field", "think"])
async def test_truncation_inside_the_answer(
    start_sim: StartSim, session: aiohttp.ClientSession, mode: str
):
    _, full = await chat(session, await start_sim(reasoning="field"))
    reasoning = message_of(full)["reasoning_content"]
    answer_words = message_of(full)["content"].split()
    limit = len(reasoning.split()) + 2
    plain, streamed = await both(session, await start_sim(reasoning=mode), max_tokens=limit)
    assert plain["choices"][0]["finish_reason"] == streamed["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == limit
    cut = " ".join(answer_words[:2])
    message = message_of(plain)
    if mode == "field":
        assert message["reasoning_content"] == reasoning
        assert message["content"] == cut
    else:
        assert message["content"] == f"<think>\n{reasoning}\n</think>\n\n{cut}"
    assert answer_matches(MESSAGES, message)

    # A limit at exactly the end of the thinking leaves it closed, with no answer.
    plain, streamed = await both(session, await start_sim(reasoning="think"), max_tokens=limit - 2)
    assert message_of(plain)["content"] == f"<think>\n{reasoning}\n</think>\n\n"
    assert plain["choices"][0]["finish_reason"] == "length"
    assert streamed["texts"] == {"content": message_of(plain)["content"]}


def arguments_of(message: dict[str, Any]) -> dict[str, Any]:
    [call] = message["tool_calls"]
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("mode", ["none", "field", "think"])
async def test_tool_call_when_required(
    start_sim: StartSim, session: aiohttp.ClientSession, mode: str
):
    base = await start_sim(mean_tokens=20, reasoning=mode, tool_call_rate=0.0)
    plain, streamed = await both(session, base, tools=TOOLS, tool_choice="required")
    assert plain["choices"][0]["finish_reason"] == streamed["finish_reason"] == "tool_calls"
    message = message_of(plain)
    [call] = message["tool_calls"]
    assert call["id"] == f"call_{DIGEST}"
    assert call["type"] == "function"
    assert call["function"]["name"] == "search"
    arguments = arguments_of(message)
    assert arguments["sim"] == DIGEST
    if mode == "think":
        assert message["content"].startswith("<think>\n[sim-reasoning:")
        assert message["content"].endswith("</think>\n\n")
    else:
        assert message["content"] is None
    assert (message.get("reasoning_content") is not None) is (mode == "field")
    answer_tokens = 1 + len(arguments["text"].split())
    reasoning_tokens = plain["usage"]["completion_tokens"] - answer_tokens
    assert (reasoning_tokens > 0) is (mode != "none")
    assert answer_matches(MESSAGES, message)
    assert not answer_matches(MESSAGES[1:], message)
    assert not answer_matches(MESSAGES, message["content"])

    assert streamed["tool_calls"] == message["tool_calls"]
    assert streamed["usage"] == plain["usage"]
    assert streamed["order"][-1] == "tool_calls"
    assert streamed["texts"].get("content") == (message["content"] if mode == "think" else None)


async def test_tool_arguments_are_streamed_in_pieces(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(mean_tokens=40)
    _, events = await stream_events(session, base, tools=TOOLS, tool_choice="required")
    parts = [
        json.loads(e)["choices"][0]["delta"].get("tool_calls") for e in events[:-1] if "{" in e
    ]
    parts = [p[0] for p in parts if p]
    assert "id" in parts[0] and parts[0]["function"]["name"] == "search"
    pieces = [p["function"]["arguments"] for p in parts[1:]]
    assert len(pieces) > 3 and all(pieces)
    assert json.loads("".join(pieces))["sim"] == DIGEST


async def test_tool_choice_forms(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(tool_call_rate=1.0)
    _, body = await chat(session, base, tools=TOOLS)
    assert message_of(body)["tool_calls"][0]["function"]["name"] == "search"
    named = {"type": "function", "function": {"name": "fetch"}}
    _, body = await chat(session, base, tools=TOOLS, tool_choice=named)
    assert message_of(body)["tool_calls"][0]["function"]["name"] == "fetch"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": []}, {}):
        _, body = await chat(session, base, **extra)
        assert "tool_calls" not in message_of(body)
        assert answer_matches(MESSAGES, message_of(body)["content"])
        assert body["choices"][0]["finish_reason"] == "stop"

    never = await start_sim(tool_call_rate=0.0)
    _, body = await chat(session, never, tools=TOOLS, tool_choice="auto")
    assert "tool_calls" not in message_of(body)


async def test_tool_call_rate_is_a_deterministic_share(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base, twin = await start_sim(mean_tokens=8), await start_sim(mean_tokens=8)
    prompts = [[{"role": "user", "content": f"task {i}"}] for i in range(60)]

    async def calls(url: str) -> list[bool]:
        answers = []
        for prompt in prompts:
            _, body = await chat(session, url, prompt, tools=TOOLS)
            message = message_of(body)
            answers.append("tool_calls" in message)
            assert answer_matches(prompt, message)
            reason = body["choices"][0]["finish_reason"]
            assert reason == ("tool_calls" if answers[-1] else "stop")
        return answers

    first = await calls(base)
    assert 15 <= sum(first) <= 45
    assert await calls(twin) == first
    assert await calls(base) == first


async def test_tool_call_cut_by_max_tokens(start_sim: StartSim, session: aiohttp.ClientSession):
    base = await start_sim(mean_tokens=20)
    _, full = await chat(session, base, tools=TOOLS, tool_choice="required")
    full_words = arguments_of(message_of(full))["text"].split()
    plain, streamed = await both(session, base, tools=TOOLS, tool_choice="required", max_tokens=4)
    assert plain["choices"][0]["finish_reason"] == "length"
    message = message_of(plain)
    arguments = message["tool_calls"][0]["function"]["arguments"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)
    assert arguments.startswith(f'{{"sim": "{DIGEST}"')
    # Four tokens: the digest and three words of the text.
    assert arguments.split('"text": "')[1].split() == full_words[:3]
    assert answer_matches(MESSAGES, message)
    assert not answer_matches(MESSAGES[1:], message)
    assert streamed["tool_calls"] == message["tool_calls"]
    assert plain["usage"]["completion_tokens"] == 4


def test_answer_matches_forms():
    other = request_digest(MESSAGES[1:])
    content = f"[sim:{DIGEST}] alpha beta"
    reasoning = f"[sim-reasoning:{DIGEST}] gamma"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}

    def with_args(arguments: str) -> dict[str, Any]:
        return {**call, "function": {"name": "f", "arguments": arguments}}

    assert answer_matches(MESSAGES, f"<think>\n{reasoning}\n</think>\n\n{content}")
    assert not answer_matches(MESSAGES, f"<think>\n[sim-reasoning:{other}]\n</think>\n{content}")
    assert not answer_matches(MESSAGES, f"<think>\n{reasoning}")
    assert answer_matches(MESSAGES, {"content": content, "reasoning": reasoning})
    assert answer_matches(MESSAGES, {"content": None, "reasoning_content": reasoning})
    assert answer_matches(MESSAGES, {"content": "", "reasoning_content": reasoning})
    assert not answer_matches(MESSAGES, {"content": content, "reasoning_content": "nope"})
    assert not answer_matches(MESSAGES, {"content": None})
    assert not answer_matches(MESSAGES, {"content": "  "})
    assert not answer_matches(MESSAGES, ["not", "a", "message"])
    good = with_args(orjson.dumps({"sim": DIGEST, "text": "x"}).decode())
    assert answer_matches(MESSAGES, {"content": None, "tool_calls": [good]})
    bad = with_args(orjson.dumps({"sim": other}).decode())
    assert not answer_matches(MESSAGES, {"content": None, "tool_calls": [good, bad]})
    assert not answer_matches(MESSAGES, {"content": None, "tool_calls": [with_args("[1]")]})
    assert not answer_matches(MESSAGES, {"content": None, "tool_calls": [with_args('{"si')]})
    assert not answer_matches(MESSAGES, {"content": None, "tool_calls": [{"id": "c"}]})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": {"name": "f"}}, "'tools' must be a list"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be an object"),
        ({"tools": [{"function": {"name": 3}}]}, "tools[0] must be an object"),
        ({"tool_choice": "required"}, "'tools' must be set"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be one of"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in 'tools'",
        ),
        ({"chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object"),
    ],
)
async def test_bad_tools_get_400(
    start_sim: StartSim, session: aiohttp.ClientSession, extra: dict[str, Any], message: str
):
    base = await start_sim()
    status, body = await chat(session, base, **extra)
    assert status == 400
    assert message in body["message"]


@pytest.mark.parametrize(
    "options",
    [{"reasoning": "yes"}, {"reasoning_field": "thoughts"}, {"tool_call_rate": 1.5}],
)
def test_reasoning_and_tool_config_validation(options: dict[str, Any]):
    with pytest.raises(ValueError):
        SimConfig(**options)


async def test_empty_fault_has_no_reasoning_either(
    start_sim: StartSim, session: aiohttp.ClientSession
):
    base = await start_sim(reasoning="field", faults={"empty": 1.0})
    plain, streamed = await both(session, base, tools=TOOLS, tool_choice="required")
    message = message_of(plain)
    assert not message["content"] and not message.get("reasoning_content")
    assert "tool_calls" not in message
    assert streamed["texts"] == {} and streamed["tool_calls"] == []


async def read_listening_line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    match = re.fullmatch(r"sim-server listening on (http://127\.0\.0\.1:\d+)\n", line)
    assert match, line
    return match.group(1)


@pytest.mark.parametrize(
    "command",
    [["-m", "orchestrator.sim.server"], ["-m", "orchestrator", "sim-server"]],
    ids=["module", "cli"],
)
async def test_command_lines_take_reasoning_and_tool_flags(command: list[str]):
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATOR_LOG_LEVEL": "warning"}
    flags = ["--reasoning", "field", "--reasoning-field", "reasoning", "--tool-call-rate", "1"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        "--port",
        "0",
        *flags,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        base = await read_listening_line(proc)
        async with aiohttp.ClientSession() as client:
            _, body = await chat(client, base, tools=TOOLS)
        message = message_of(body)
        assert message["reasoning"].startswith(f"[sim-reasoning:{DIGEST}]")
        assert "reasoning_content" not in message
        assert arguments_of(message)["sim"] == DIGEST
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), timeout=10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0


def test_cli_choices_match_the_server():
    from orchestrator.cli.sim import sim_server
    from orchestrator.sim import REASONING_FIELDS, REASONING_MODES

    params = {p.name: p for p in sim_server.params}
    assert tuple(params["reasoning"].type.choices) == REASONING_MODES
    assert tuple(params["reasoning_field"].type.choices) == REASONING_FIELDS
    assert params["reasoning"].default == SimConfig().reasoning
    assert params["reasoning_field"].default == SimConfig().reasoning_field
    assert params["tool_call_rate"].default == SimConfig().tool_call_rate
    for name in (
        "kv_tokens",
        "max_running",
        "step_time",
        "step_per_request",
        "prefill_per_token",
        "time_scale",
    ):
        assert params[name].default == getattr(SimConfig(), name), name


@pytest.mark.parametrize("max_tokens", [400, 10])
async def test_json_answers_stream_as_they_answer_whole(
    start_sim: StartSim, session: aiohttp.ClientSession, max_tokens: int
) -> None:
    """Asked for JSON: the kind each prompt gets is ``json_answer_kind`` of its digest,
    streamed content equals the whole answer's, and an answer cut by max_tokens never
    parses."""
    from orchestrator.sim import json_answer_kind, request_digest

    base = await start_sim(json_invalid_rate=0.3, json_mismatch_rate=0.3)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}
    kinds = set()
    for i in range(40):
        messages = [{"role": "user", "content": f"json {i}"}]
        extra = {"max_tokens": max_tokens, "response_format": fmt}
        _, body = await chat(session, base, messages, **extra)
        content = body["choices"][0]["message"]["content"]
        async with session.post(
            f"{base}/v1/chat/completions", json={"messages": messages, "stream": True, **extra}
        ) as resp:
            raw = (await resp.read()).decode()
        chunks = [
            json.loads(e.removeprefix("data: "))
            for e in raw.split("\n\n")
            if e.startswith("data: {")
        ]
        streamed = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert streamed == content
        kind = json_answer_kind(request_digest(messages), 0, 0.3, 0.3)
        kinds.add(kind)
        try:
            value = json.loads(content)
        except ValueError:
            assert kind == "invalid_json" or max_tokens == 10
            continue
        assert kind != "invalid_json" and max_tokens == 400
        assert value["sim"] == request_digest(messages)
        assert ("text" in value) == (kind == "valid") and ("words" in value) != (kind == "valid")
    assert kinds == {"valid", "invalid_json", "schema_mismatch"}


def _sim_server(*args: str) -> tuple[subprocess.Popen[str], str]:
    """``orchestrator sim-server`` as a user starts it, on a free port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "sim-server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.fullmatch(r"sim-server listening on (http://127\.0\.0\.1:\d+)\n", line)
    assert match, line
    return proc, match.group(1)


def _ask(base: str, model: str | None) -> tuple[int, dict[str, Any]]:
    body = {"messages": MESSAGES, **({"model": model} if model is not None else {})}
    request = urllib.request.Request(
        base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _listed(base: str) -> list[str]:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def test_sim_server_answers_only_the_models_it_lists_as_vllm_does(tmp_path: Path) -> None:
    """What /v1/models lists is what is answered: another name gets vLLM's 404, so that
    ``doctor --model X`` and a run agree with the server; ``--model`` (repeated) serves
    those names, ``--any-model`` any name."""
    db = tmp_path / "q.db"
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    made = cli("enqueue", str(src), "-d", "d", "--model", "Qwen/Qwen3-8B", "--db", str(db))
    assert made.returncode == 0, made.stderr
    started = [_sim_server(), _sim_server("--model", "Qwen/Qwen3-8B", "--model", "qwen")]
    started.append(_sim_server("--any-model"))
    (_, plain), (_, named), (_, anything) = started
    try:
        assert _listed(plain) == ["sim-model"]
        assert _ask(plain, None)[0] == 200 and _ask(plain, "sim-model")[0] == 200
        status, body = _ask(plain, "Qwen/Qwen3-8B")
        assert (status, body["message"]) == (404, "The model `Qwen/Qwen3-8B` does not exist.")
        assert body["type"] == "NotFoundError"
        refused = cli("doctor", "--server", plain, "--db", str(db))
        assert refused.returncode != 0 and "does not serve Qwen/Qwen3-8B" in refused.stdout

        assert _listed(named) == ["Qwen/Qwen3-8B", "qwen"]
        for model in ("Qwen/Qwen3-8B", "qwen"):
            status, body = _ask(named, model)
            assert status == 200 and body["model"] == model
        assert _ask(named, "sim-model")[0] == 404
        served = cli("doctor", "--server", named, "--db", str(db))
        assert served.returncode == 0, served.stdout + served.stderr

        assert _listed(anything) == ["sim-model"] and _ask(anything, "Qwen/Qwen3-8B")[0] == 200
    finally:
        for proc, _ in started:
            proc.kill()
            proc.wait()
