"""The simulated server's continuous-batching model: queue, KV cache, retractions, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from orchestrator.inference import server_metrics
from orchestrator.sim import SimConfig, answer_matches
from orchestrator.sim.server import main as sim_main
from tests.conftest import StartSim


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {i}"}]


async def _ask(session: aiohttp.ClientSession, url: str, i: int, **body: Any) -> dict[str, Any]:
    payload = {"messages": _messages(i), **body}
    async with session.post(url + "/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/sim/stats") as resp:
        return await resp.json()


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/metrics") as resp:
        return server_metrics.view(server_metrics.parse(await resp.text()))


async def _run_all(url: str, n: int, **body: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """Send ``n`` requests at once; sample /metrics and /sim/stats until they are answered,
    each answer made for its own prompt."""
    snapshots: list[Any] = []
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(_ask(session, url, i, **body)) for i in range(n)]
        while not all(t.done() for t in tasks):
            snapshots.append((await _metrics(session, url), await _json(session, url)))
            await asyncio.sleep(0.01)
        answers = [t.result() for t in tasks]
    for i, doc in enumerate(answers):
        assert answer_matches(_messages(i), doc["choices"][0]["message"]["content"])
    return answers, snapshots


async def _final(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """/sim/stats and /metrics once every request is answered."""
    async with aiohttp.ClientSession() as session:
        return await _json(session, url), await _metrics(session, url)


async def test_requests_queue_when_the_cache_is_full(sim: StartSim) -> None:
    # Answers of 20-60 tokens; 400 tokens of cache hold only a handful at once.
    url = await sim(mean_tokens=40, kv_tokens=400, step_time=0.0005, step_per_request=0.0)
    answers, snapshots = await _run_all(url, 40, max_tokens=60)
    stats, final = await _final(url)
    batch = stats["batch"]
    assert batch["peak_queued"] > 0
    assert 0 < batch["peak_running"] < 40
    assert batch["peak_token_usage"] <= 1.0
    assert stats["completed"] == 40
    # Every snapshot agrees with itself and with the model's bounds.
    assert any(m["queued"] > 0 for m, _ in snapshots)
    for m, s in snapshots:
        assert 0.0 <= m["kv_cache_usage"] <= 1.0
        assert m["running"] + m["queued"] <= 40
        b = s["batch"]
        assert b["kv_used"] <= b["kv_tokens"]
        assert b["running"] + b["queued"] <= s["running"]
        assert b["token_usage"] == pytest.approx(b["kv_used"] / 400)
    # Drained: nothing running or queued, the cache empty, every token counted.
    assert final["running"] == 0 and final["queued"] == 0 and final["kv_cache_usage"] == 0
    generated = sum(doc["usage"]["completion_tokens"] for doc in answers)
    assert final["generation_tokens_total"] == generated


async def test_overflow_retracts_the_newest_and_counts_it(sim: StartSim) -> None:
    # The admission estimate grows bolder each step; long answers then outgrow the cache.
    url = await sim(mean_tokens=400, kv_tokens=3000, step_time=0.0001, step_per_request=0.0)
    await _run_all(url, 30, max_tokens=600)
    stats, final = await _final(url)
    batch = stats["batch"]
    assert batch["retracted"] > 0
    assert final["preemptions_total"] == batch["retracted"]
    assert batch["peak_token_usage"] <= 1.0
    # A retracted request still gives its whole answer, once.
    assert stats["completed"] == 30
    assert final["kv_cache_usage"] == 0


async def test_max_running_caps_the_batch(sim: StartSim) -> None:
    url = await sim(mean_tokens=20, max_running=4, step_time=0.0005)
    _, snapshots = await _run_all(url, 20, stream=False)
    stats, _ = await _final(url)
    assert stats["batch"]["peak_running"] == 4
    assert stats["batch"]["peak_queued"] > 0
    assert all(m["running"] <= 4 for m, _ in snapshots)
    assert stats["batch"]["retracted"] == 0  # no cache limit, nothing to retract


async def test_streamed_answers_equal_plain_ones_when_batching(sim: StartSim) -> None:
    url = await sim(mean_tokens=20, kv_tokens=500, step_time=0.0005)
    payload = {"messages": _messages(1), "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=payload) as resp,
    ):
        text = (await resp.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    async with aiohttp.ClientSession() as session:
        plain = await _ask(session, url, 1)
    content = plain["choices"][0]["message"]["content"]
    assert content.split()[0] in text


async def test_a_request_larger_than_the_cache_is_refused(sim: StartSim) -> None:
    url = await sim(mean_tokens=400, kv_tokens=100)
    payload = {"messages": _messages(1)}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=payload) as resp,
    ):
        assert resp.status == 400
        assert "KV cache" in (await resp.json())["message"]


def test_batching_is_off_by_default_and_options_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not SimConfig().batching
    assert SimConfig(kv_tokens=1000).batching and SimConfig(max_running=8).batching
    for bad in (["--time-scale", "0"], ["--kv-tokens", "-1"], ["--step-time", "-1"]):
        with pytest.raises(SystemExit) as exc:
            sim_main(bad)
        assert exc.value.code == 2
    assert "time_scale" in capsys.readouterr().err


def _model(**config: Any) -> Any:
    from orchestrator.sim.batching import BatchModel

    return BatchModel(SimConfig(**config))


def _seq(prompt: int, target: int, limit: int | None = None) -> Any:
    from orchestrator.sim.batching import Seq

    return Seq(prompt, target, limit or target)


def test_fifo_admits_what_fits_now_and_reserves_nothing() -> None:
    # Ten requests of 100 prompt tokens that will each grow to 1,100: SGLang's admission
    # reserves room for part of every max_tokens, vLLM's takes what fits the cache now.
    reserve = _model(kv_tokens=2000)
    fifo = _model(kv_tokens=2000, admission="fifo")
    for model in (reserve, fifo):
        for _ in range(10):
            model.add(_seq(100, 1000))
        model.step()
    assert len(reserve.running) == 2
    assert len(fifo.running) == 10
    assert fifo.kv_used == 10 * 101


def test_fifo_stops_at_the_batch_cap_and_keeps_arrival_order() -> None:
    model = _model(kv_tokens=100_000, max_running=4, admission="fifo")
    seqs = [_seq(10, 5) for _ in range(10)]
    for seq in seqs:
        model.add(seq)
    model.step()
    assert model.running == seqs[:4]
    assert list(model.queue) == seqs[4:]


def test_fifo_preempts_the_newest_to_the_head_of_the_queue() -> None:
    # Four requests admitted at once fill the cache as they grow: the newest is preempted
    # (its cache freed, to be computed again) and waits at the head of the queue, before
    # a request that came after it; every answer still ends whole, the cache never over.
    model = _model(kv_tokens=100, admission="fifo")
    seqs = [_seq(10, 40) for _ in range(4)]
    for seq in seqs:
        model.add(seq)
    model.step()
    assert model.running == seqs
    later = _seq(60, 1)  # too large to fit beside them
    model.add(later)
    while not model.retracted:
        model.step()
    assert model.retracted == 1
    assert model.running == seqs[:3]
    assert list(model.queue) == [seqs[3], later]
    assert model.kv_used + len(model.running) <= 100
    while model.busy:
        model.step()
        assert model.kv_used <= 100
    assert all(seq.generated == seq.target for seq in [*seqs, later])


def test_admission_and_metric_names_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--admission", "lifo"], ["--metric-names", "tgi"]):
        with pytest.raises(SystemExit) as exc:
            sim_main(bad)
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="admission"):
        SimConfig(admission="lifo")
    with pytest.raises(ValueError, match="metric_names"):
        SimConfig(metric_names="tgi")


async def test_vllm_names_on_metrics(sim: StartSim) -> None:
    url = await sim(
        mean_tokens=400,
        kv_tokens=2000,
        max_running=8,
        admission="fifo",
        metric_names="vllm",
        step_time=0.0001,
        step_per_request=0.0,
    )
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    assert "sglang:" not in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"vllm:{name}{{" in text
    await _run_all(url, 30, max_tokens=600)
    stats, final = await _final(url)
    assert final["kind"] == "vllm"
    assert stats["batch"]["peak_running"] == 8
    assert stats["batch"]["retracted"] > 0
    assert final["preemptions_total"] == stats["batch"]["retracted"]
    assert stats["completed"] == 30


def test_sglang_retraction_frees_room_for_twenty_steps_to_the_back_of_the_queue() -> None:
    # Retracted: the fewest generated tokens first (the longest prompt among equals),
    # until those that stay have room for 20 more steps; they wait behind the queue.
    model = _model(kv_tokens=860, retraction="sglang")
    old = [_seq(100, 500, 600) for _ in range(3)]
    for seq in old:
        seq.generated = 150
    short, long = _seq(50, 500, 600), _seq(80, 500, 600)
    waiting = _seq(900, 1)
    model.running = [*old, short, long]
    for seq in model.running:
        seq.place = "running"
    model.kv_used = sum(seq.kv for seq in model.running)  # 750 + 130 = 880, over 860
    model.queue.append(waiting)
    waiting.place = "queued"
    assert model._retract() == 2  # one makes room for a step; 20 need another gone
    assert model.running == old
    assert list(model.queue) == [waiting, long, short]
    assert model.kv_used + 3 * 20 <= 860
    assert model.ratio == pytest.approx((450 + 60) / (1800 + 1))
