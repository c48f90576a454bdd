"""The simulated server's OpenAI Batch API (/v1/files, /v1/batches) and its bill (/sim/bill).

Batches are driven over real sockets on 127.0.0.1; their answers are checked against an
oracle, the online endpoint of a second server with the same seed, never by eye. Waits
poll the batch's status with a generous timeout: nothing here times the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.sim import SimConfig
from orchestrator.sim.batchstore import BatchStore
from orchestrator.sim.runtime import State

REPO = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
DONE = ("completed", "failed", "expired", "cancelled")

StartSim = Callable[..., Awaitable[str]]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def chat_body(i: int, **extra: Any) -> dict[str, Any]:
    words = " ".join(["word"] * (i % 7))
    return {
        "messages": [{"role": "user", "content": f"prompt {i} {words}"}],
        "max_tokens": 12,
        **extra,
    }


def line(custom_id: str, body: Any, url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


async def upload(session: aiohttp.ClientSession, base: str, content: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="input.jsonl")
    async with session.post(f"{base}/v1/files", data=form) as resp:
        assert resp.status == 200, await resp.text()
        made = await resp.json()
    assert made["object"] == "file" and made["bytes"] == len(content)
    assert made["id"].startswith("file-") and made["purpose"] == "batch"
    return str(made["id"])


async def create(
    session: aiohttp.ClientSession, base: str, file_id: str, **extra: Any
) -> tuple[int, dict[str, Any]]:
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **extra}
    async with session.post(f"{base}/v1/batches", json=body) as resp:
        return resp.status, await resp.json()


async def submit(
    session: aiohttp.ClientSession, base: str, content: bytes, **extra: Any
) -> dict[str, Any]:
    status, batch = await create(session, base, await upload(session, base, content), **extra)
    assert status == 200, batch
    return batch


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def wait(
    session: aiohttp.ClientSession,
    base: str,
    batch_id: str,
    until: Callable[[dict[str, Any]], bool] = lambda b: b["status"] in DONE,
    patience: float = 60.0,
) -> dict[str, Any]:
    deadline = time.monotonic() + patience
    while True:
        status, batch = await get(session, f"{base}/v1/batches/{batch_id}")
        assert status == 200, batch
        if until(batch) or time.monotonic() > deadline:
            return batch
        await asyncio.sleep(0.05)


async def lines_of(
    session: aiohttp.ClientSession, base: str, file_id: str | None
) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    async with session.get(f"{base}/v1/files/{file_id}/content") as resp:
        assert resp.status == 200
        text = await resp.text()
    return [json.loads(x) for x in text.splitlines()]


def without_created(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "created"}


async def test_batch_lines_are_the_online_answers(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    """Each line's body is answered as the online endpoint of a fresh server with the
    same seed answers it, in the same order (so the ids agree too); refusals likewise."""
    options = {"seed": 5, "model": ("m1",), "batch_delay": 0.3, "reasoning": "field"}
    bodies: list[dict[str, Any]] = [chat_body(i, model="m1") for i in range(12)]
    bodies[3] = {**bodies[3], "model": "unknown"}  # 404 online
    bodies[5] = {**bodies[5], "n": 0}  # 400 online
    bodies[7] = {**bodies[7], "n": 2, "seed": 9}
    batch_base, online_base = await sim(**options), await sim(**options)
    batch = await submit(
        session, batch_base, jsonl([line(f"c{i}", b) for i, b in enumerate(bodies)])
    )
    assert batch["status"] == "validating" and batch["id"].startswith("batch_")
    batch = await wait(session, batch_base, batch["id"])
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 12, "completed": 10, "failed": 2}
    out = await lines_of(session, batch_base, batch["output_file_id"])
    err = await lines_of(session, batch_base, batch["error_file_id"])
    assert [x["custom_id"] for x in out] != [f"c{i}" for i in range(12) if i not in (3, 5)]
    got = {x["custom_id"]: x for x in out + err}
    for i, body in enumerate(bodies):
        async with session.post(f"{online_base}{CHAT}", json=body) as resp:
            status, online = resp.status, await resp.json()
        answer = got[f"c{i}"]
        assert answer["response"]["status_code"] == status
        assert answer["error"] is None and answer["id"].startswith("batch_req_")
        assert without_created(answer["response"]["body"]) == without_created(online)
    assert {x["custom_id"] for x in err} == {"c3", "c5"}


async def test_completions_endpoint_and_streams_refused(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    base, online = await sim(seed=2, batch_delay=0.2), await sim(seed=2)
    prompts = [{"prompt": f"Once upon a time {i}", "max_tokens": 8} for i in range(4)]
    lines = [line(f"p{i}", p, "/v1/completions") for i, p in enumerate(prompts)]
    lines.append(line("s", {**prompts[0], "stream": True}, "/v1/completions"))
    batch = await submit(session, base, jsonl(lines), endpoint="/v1/completions")
    batch = await wait(session, base, batch["id"])
    out = {x["custom_id"]: x for x in await lines_of(session, base, batch["output_file_id"])}
    (err,) = await lines_of(session, base, batch["error_file_id"])
    assert err["custom_id"] == "s" and err["response"]["status_code"] == 400
    for i, prompt in enumerate(prompts):
        async with session.post(f"{online}/v1/completions", json=prompt) as resp:
            answer = await resp.json()
        assert without_created(out[f"p{i}"]["response"]["body"]) == without_created(answer)


async def test_expired_batch_answers_some_and_expires_the_rest(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    base = await sim(batch_delay=30, batch_window=1.5)
    batch = await submit(session, base, jsonl([line(f"e{i}", chat_body(i)) for i in range(400)]))
    batch = await wait(session, base, batch["id"])
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    out = await lines_of(session, base, batch["output_file_id"])
    err = await lines_of(session, base, batch["error_file_id"])
    assert 0 < len(out) < 400
    assert all(x["response"] is None for x in err)
    assert {x["error"]["code"] for x in err} == {"batch_expired"}
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(f"e{i}" for i in range(400))
    counts = batch["request_counts"]
    assert counts == {"total": 400, "completed": len(out), "failed": len(err)}


async def test_cancelled_batch_keeps_what_it_answered_and_drops_the_rest(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    base = await sim(batch_delay=20)
    batch = await submit(session, base, jsonl([line(f"k{i}", chat_body(i)) for i in range(500)]))
    await wait(session, base, batch["id"], lambda b: b["request_counts"]["completed"] > 0)
    async with session.post(f"{base}/v1/batches/{batch['id']}/cancel") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "cancelling"
    batch = await wait(session, base, batch["id"])
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    out = await lines_of(session, base, batch["output_file_id"])
    assert 0 < len(out) == batch["request_counts"]["completed"] < 500
    assert batch["error_file_id"] is None
    _, bill = await get(session, f"{base}/sim/bill")
    assert bill["batch"]["requests"] == len(out)
    async with session.post(f"{base}/v1/batches/{batch['id']}/cancel") as resp:
        assert resp.status == 400


GOOD = json.dumps(line("g", chat_body(0))).encode()
NO_ID = json.dumps({"method": "POST", "url": CHAT}).encode()
THREE = jsonl([line(f"n{i}", chat_body(i)) for i in range(3)])
FORMAT_FAULTS: dict[str, tuple[bytes, int | None, dict[str, Any]]] = {
    "invalid_json_line": (GOOD + b"\n{not json\n", 2, {}),
    "missing_custom_id": (GOOD + b"\n" + NO_ID, 2, {}),
    "duplicate_custom_id": (GOOD + b"\n" + GOOD, 2, {}),
    "mismatched_url": (jsonl([line("a", chat_body(1), "/v1/completions")]), 1, {}),
    "too_many_requests": (THREE, None, {"batch_max_requests": 2}),
    "file_too_large": (THREE, None, {"batch_max_bytes": 100}),
}


@pytest.mark.parametrize("code", sorted(FORMAT_FAULTS))
async def test_a_file_that_breaks_the_format_fails_the_batch(
    sim: StartSim, session: aiohttp.ClientSession, code: str
) -> None:
    content, number, options = FORMAT_FAULTS[code]
    base = await sim(batch_delay=0.2, price_input=1.0, **options)
    batch = await wait(session, base, (await submit(session, base, content))["id"])
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["errors"]["object"] == "list"
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [(code, number)]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    _, stats = await get(session, f"{base}/sim/stats")
    assert stats["batch_api"]["requests_submitted"] == 0
    assert stats["batch_api"]["requests_answered"] == 0
    _, bill = await get(session, f"{base}/sim/bill")
    assert bill["batch"]["requests"] == 0 and bill["usd"] == 0


async def test_token_limit_counts_live_batches(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    base = await sim(batch_delay=30, batch_token_limit=20)
    body = {"messages": [{"role": "user", "content": " ".join(["w"] * 8)}]}  # 8 tokens
    first = await submit(session, base, jsonl([line("a", body), line("b", body)]))
    first = await wait(session, base, first["id"], lambda b: b["status"] != "validating")
    assert first["status"] == "in_progress"
    second = await wait(
        session, base, (await submit(session, base, jsonl([line("c", body)])))["id"]
    )
    assert second["status"] == "failed"
    assert second["errors"]["data"][0]["code"] == "token_limit_exceeded"
    small = {"messages": [{"role": "user", "content": "one two three"}]}
    third = await submit(session, base, jsonl([line("d", small)]))
    third = await wait(session, base, third["id"], lambda b: b["status"] != "validating")
    assert third["status"] == "in_progress"


@pytest.mark.parametrize("fault", ["missing_output", "truncated_output", "lost_batch"])
async def test_batch_faults_strike_the_first_batch_once(
    sim: StartSim, session: aiohttp.ClientSession, fault: str
) -> None:
    base = await sim(batch_delay=0.2, batch_faults=(fault,))
    content = jsonl([line(f"f{i}", chat_body(i)) for i in range(5)])
    first, second = await submit(session, base, content), await submit(session, base, content)
    second = await wait(session, base, second["id"])
    if fault == "lost_batch":
        deadline = time.monotonic() + 60
        while (await get(session, f"{base}/v1/batches/{first['id']}"))[0] == 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        status, body = await get(session, f"{base}/v1/batches/{first['id']}")
        assert status == 404 and body["error"]["type"] == "invalid_request_error"
        _, listed = await get(session, f"{base}/v1/batches")
        assert [b["id"] for b in listed["data"]] == [second["id"]]
        return
    first = await wait(session, base, first["id"])
    assert first["status"] == second["status"] == "completed"
    async with session.get(f"{base}/v1/files/{first['output_file_id']}/content") as resp:
        status, raw = resp.status, await resp.read()
    if fault == "missing_output":
        assert status == 404
        assert (await get(session, f"{base}/v1/files/{first['output_file_id']}"))[0] == 200
    else:
        assert status == 200 and not raw.endswith(b"\n")
        *whole, cut = raw.split(b"\n")
        assert len(whole) == 4 and all(json.loads(x) for x in whole)
        with pytest.raises(json.JSONDecodeError):
            json.loads(cut)
    assert len(await lines_of(session, base, second["output_file_id"])) == 5


async def test_no_batch_api_answers_404(sim: StartSim, session: aiohttp.ClientSession) -> None:
    base = await sim(batch_api=False)
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", GOOD, filename="x.jsonl")
    async with session.post(f"{base}/v1/files", data=form) as resp:
        assert resp.status == 404
    for path in ("/v1/files/file-x", "/v1/files/file-x/content", "/v1/batches", "/v1/batches/b"):
        async with session.get(f"{base}{path}") as resp:
            assert resp.status == 404
    async with session.post(f"{base}/v1/batches", json={}) as resp:
        assert resp.status == 404
    assert (await get(session, f"{base}/sim/bill"))[0] == 200


async def test_requests_refused_as_openai_refuses_them(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    base = await sim()
    file_id = await upload(session, base, GOOD)
    status, body = await create(session, base, "file-nope")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert (await create(session, base, file_id, endpoint="/v1/embeddings"))[0] == 400
    assert (await create(session, base, file_id, completion_window="1h"))[0] == 400
    many = {f"k{i}": "v" for i in range(17)}
    assert (await create(session, base, file_id, metadata=many))[0] == 400
    assert (await create(session, base, file_id, metadata={"k": 1}))[0] == 400
    status, batch = await create(session, base, file_id, metadata={"k": "v"})
    assert status == 200 and batch["metadata"] == {"k": "v"}
    for path in ("/v1/files/file-nope", "/v1/files/file-nope/content", "/v1/batches/batch_x"):
        status, body = await get(session, f"{base}{path}")
        assert status == 404 and body["error"]["type"] == "invalid_request_error"
    async with session.get(f"{base}/v1/files/{file_id}/content") as resp:
        assert await resp.read() == GOOD
    async with session.delete(f"{base}/v1/files/{file_id}") as resp:
        assert (await resp.json())["deleted"] is True
    assert (await get(session, f"{base}/v1/files/{file_id}"))[0] == 404


async def test_list_pages_newest_first(sim: StartSim, session: aiohttp.ClientSession) -> None:
    base = await sim(batch_delay=0.1)
    file_id = await upload(session, base, GOOD)
    made = [(await create(session, base, file_id))[1]["id"] for _ in range(5)]
    seen: list[str] = []
    after = ""
    while True:
        _, page = await get(session, f"{base}/v1/batches?limit=2{after}")
        ids = [b["id"] for b in page["data"]]
        assert ids and page["first_id"] == ids[0] and page["last_id"] == ids[-1]
        seen += ids
        if not page["has_more"]:
            break
        after = f"&after={page['last_id']}"
    assert seen == made[::-1]


async def test_batch_api_outlives_an_outage(sim: StartSim, session: aiohttp.ClientSession) -> None:
    base = await sim(outages=[(0.0, 600.0)], batch_delay=0.1, rate_limits=())
    async with session.post(f"{base}{CHAT}", json=chat_body(1)) as resp:
        assert resp.status == 503
    batch = await wait(session, base, (await submit(session, base, GOOD))["id"])
    assert batch["status"] == "completed"


async def test_fail_rate_draws_lines_from_their_custom_id(
    sim: StartSim, session: aiohttp.ClientSession
) -> None:
    content = jsonl([line(f"r{i}", chat_body(i)) for i in range(60)])
    failed = []
    for _ in range(2):
        base = await sim(batch_delay=0.1, batch_fail_rate=0.5)
        batch = await wait(session, base, (await submit(session, base, content))["id"])
        err = await lines_of(session, base, batch["error_file_id"])
        assert {x["response"]["status_code"] for x in err} == {500}
        assert {x["response"]["body"]["error"]["type"] for x in err} == {"server_error"}
        failed.append(sorted(x["custom_id"] for x in err))
    assert failed[0] == failed[1] and 10 < len(failed[0]) < 50


def usd(usage: dict[str, Any], prices: tuple[float, float, float], discount: float) -> float:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    price_in, price_cached, price_out = prices
    cost = (
        (usage["prompt_tokens"] - cached) * price_in
        + cached * price_cached
        + usage["completion_tokens"] * price_out
    ) / 1e6
    return cost * (1 - discount)


async def test_bill_and_duplicates(sim: StartSim, session: aiohttp.ClientSession) -> None:
    """Every 200 answer billed from its own usage, batch lines at the discount; a body
    billed twice (online, streamed, or in a batch) counted as a duplicate."""
    prices = (3.0, 0.5, 15.0)
    base = await sim(
        batch_delay=0.1, prefix_cache=10_000, price_input=prices[0],
        price_cached_input=prices[1], price_output=prices[2], batch_discount=0.4,
    )  # fmt: skip
    long = {"messages": [{"role": "user", "content": " ".join(f"w{j}" for j in range(40))}]}
    online_usages = []
    async with session.post(f"{base}{CHAT}", json=long) as resp:
        online_usages.append((await resp.json())["usage"])
    streamed = {**long, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{base}{CHAT}", json=streamed) as resp:
        events = [x for x in (await resp.text()).split("\n\n") if x.startswith("data: {")]
        online_usages.append(json.loads(events[-1][6:])["usage"])
    lines = [line("a", long), line("b", chat_body(2)), line("c", chat_body(2, n=0))]
    batch = await wait(session, base, (await submit(session, base, jsonl(lines)))["id"])
    batch_usages = [
        x["response"]["body"]["usage"]
        for x in await lines_of(session, base, batch["output_file_id"])
    ]
    assert len(batch_usages) == 2
    assert any(u.get("prompt_tokens_details", {}).get("cached_tokens") for u in online_usages)
    _, bill = await get(session, f"{base}/sim/bill")
    assert bill["online"]["requests"] == 2 and bill["batch"]["requests"] == 2
    online_usd = sum(usd(u, prices, 0.0) for u in online_usages)
    batch_usd = sum(usd(u, prices, 0.4) for u in batch_usages)
    assert bill["online"]["usd"] == pytest.approx(online_usd, rel=1e-12)
    assert bill["batch"]["usd"] == pytest.approx(batch_usd, rel=1e-12)
    assert bill["usd"] == pytest.approx(online_usd + batch_usd, rel=1e-12)
    for kind, usages in (("online", online_usages), ("batch", batch_usages)):
        assert bill[kind]["completion_tokens"] == sum(u["completion_tokens"] for u in usages)
        assert bill[kind]["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    _, stats = await get(session, f"{base}/sim/stats")
    assert stats["batch_api"] == {
        "files": 3, "batches": 1, "requests_submitted": 3, "requests_answered": 3,
        "duplicate_requests": 2,
    }  # fmt: skip


async def _run_store(config: SimConfig, content: bytes) -> tuple[str, list[str], list[str]]:
    """A batch taken through its life by the store alone: its status and the custom_ids
    of its output and error files."""
    store = BatchStore(State(config))
    source = store.add_file("in.jsonl", "batch", content)
    batch = store.create(source.id, CHAT, None)
    try:
        await asyncio.wait_for(asyncio.gather(*store.tasks), timeout=60)
    finally:
        await store.close()
    ids = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        text = store.files[file_id].content if file_id else b""
        ids.append([json.loads(x)["custom_id"] for x in text.splitlines()])
    return batch.status, ids[0], ids[1]


_BODIES = st.one_of(
    st.integers(0, 50).map(chat_body),
    st.just({"messages": "not a list"}),
    st.just({**chat_body(3), "stream": True}),
    st.just({**chat_body(4), "n": 0}),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bodies=st.dictionaries(st.text(min_size=1, max_size=8), _BODIES, min_size=1, max_size=40),
    expire=st.booleans(),
    fail_rate=st.sampled_from([0.0, 0.3]),
)
def test_every_line_comes_out_once(
    bodies: dict[str, dict[str, Any]], expire: bool, fail_rate: float
) -> None:
    """Completed or expired, every custom_id is in the output or the error file, once."""
    options = {"batch_delay": 50.0, "batch_window": 0.05} if expire else {"batch_delay": 0.0}
    config = SimConfig(batch_fail_rate=fail_rate, **options)
    content = jsonl([line(k, v) for k, v in bodies.items()])
    status, out, err = asyncio.run(_run_store(config, content))
    assert status == ("expired" if expire else "completed")
    assert sorted(out + err) == sorted(bodies)


def test_sim_server_command_runs_a_batch(tmp_path: Path) -> None:
    """The real ``orchestrator sim-server`` command, its options on the command line."""
    args = ["--port", "0", "--any-model", "--batch-delay", "0.2", "--price-output", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "sim-server", *args],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline().strip()
        assert "listening on" in listening, listening
        base = listening.rsplit(" ", 1)[-1]
        status, bill = asyncio.run(_command_batch(base))
        assert status == "completed"
        assert bill["batch"]["requests"] == 3
        assert bill["usd"] == pytest.approx(bill["batch"]["completion_tokens"] * 2 / 1e6 * 0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _command_batch(base: str) -> tuple[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        content = jsonl([line(f"x{i}", chat_body(i)) for i in range(3)])
        batch = await wait(session, base, (await submit(session, base, content))["id"])
        _, bill = await get(session, f"{base}/sim/bill")
        return batch["status"], bill
