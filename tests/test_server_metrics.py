"""The servers' own view in ``status``: scraped from /metrics, SGLang, vLLM and llama.cpp names."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from orchestrator.inference.server_metrics import parse, scrape, view
from tests.helpers import SimProcess, cli, prompts, write_jsonl

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.42
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
"""


def test_vllm_names_are_read() -> None:
    found = view(parse(VLLM.format(tokens=1000.0)))
    assert found["kind"] == "vllm"
    assert (found["running"], found["queued"], found["kv_cache_usage"]) == (12.0, 3.0, 0.42)
    assert found["generation_tokens_total"] == 1000.0 and found["gen_throughput"] is None


def test_preemptions_under_either_vllm_name() -> None:
    for name in ("vllm:num_preemptions_total", "vllm:num_preemptions"):
        text = f'# TYPE {name} gauge\n{name}{{engine="0"}} 7.0\n'
        assert view(parse(text))["preemptions_total"] == 7.0, name


async def test_vllm_throughput_comes_from_the_counter() -> None:
    served = 0

    async def metrics(_request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        return web.Response(text=VLLM.format(tokens=1000.0 + 500.0 * served))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    started = time.monotonic()
    try:
        found = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/v1", interval=0.5)
    finally:
        took = time.monotonic() - started
        await runner.cleanup()
    assert found["error"] is None and served == 2
    # 500 tokens between two scrapes at least half a second apart, and at most as far
    # apart as the whole call took (on a busy machine, well over a second).
    assert 500 / took <= found["gen_throughput"] <= 1000


def test_status_shows_the_servers_view(tmp_path: Path, sim_process: Any) -> None:
    db = tmp_path / "q.db"
    path = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    assert cli("enqueue", str(path), "-d", "ds", "--db", str(db)).returncode == 0
    server: SimProcess = sim_process("--latency", "0")
    down = "http://127.0.0.1:9"  # discard port: nothing listens
    result = cli("status", "--json", "--db", str(db), "--server", server.url, "--server", down)
    assert result.returncode == 0, result.stderr
    sim, gone = json.loads(result.stdout)["servers"]
    assert sim["kind"] == "sglang" and sim["error"] is None
    assert sim["running"] == 0 and sim["queued"] == 0 and sim["gen_throughput"] is not None
    assert gone["error"] and gone["kind"] is None
    text = cli("status", "--db", str(db), "--server", server.url, "--server", down).stdout
    assert "servers (their own /metrics):" in text
    assert f"{server.url}  (sglang)  running 0, queued 0" in text
    assert f"{down}  unreachable" in text


# As llama.cpp's llama-server --metrics writes it (tools/server/server-task.cpp).
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 69
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 16
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1200
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 10729.6
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 8
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 7.5
"""


def test_llamacpp_names_are_read() -> None:
    found = view(parse(LLAMACPP))
    assert found["kind"] == "llamacpp"
    assert (found["running"], found["queued"]) == (8.0, 5.0)
    assert (found["generation_tokens_total"], found["prompt_tokens_total"]) == (1200.0, 69.0)
    # One sequence's decode speed is not the server's throughput: that comes from the
    # counter between two scrapes. No KV-cache gauge in this llama.cpp.
    assert found["gen_throughput"] is None and found["kv_cache_usage"] is None
