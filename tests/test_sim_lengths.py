"""The simulated server's answer lengths by dataset (``--length-model``) and its trace.

Strategies are compared on the lengths the server draws, so a prompt must get the same
length from every server process, whoever sends it, and each dataset its own
distribution.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from orchestrator.sim import request_digest
from orchestrator.sim.config import SimConfig
from orchestrator.sim.length_model import LengthModel, Lognormal
from orchestrator.sim.offline import Request, schedule
from tests.helpers import REPO, SimProcess

MODEL = {
    "default": {"mean": 20, "sigma": 0},
    "datasets": {"long": {"mean": 400, "sigma": 0.5}, "short": {"mean": 30, "sigma": 0.5}},
}


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}"}]


async def _lengths(url: str, dataset: str | None, n: int, **body: Any) -> list[int]:
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            payload: dict[str, Any] = {"messages": _messages(i), **body}
            if dataset is not None:
                payload["metadata"] = {"dataset": dataset}
            async with session.post(url + "/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200, await resp.text()
                out.append((await resp.json())["usage"]["completion_tokens"])
    return out


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(MODEL))
    return path


async def test_each_prompt_gets_the_same_length_from_every_server(
    model_file: Path, sim_process: Callable[..., SimProcess]
) -> None:
    first = sim_process("--length-model", str(model_file))
    second = sim_process("--length-model", str(model_file))
    lengths = await _lengths(first.url, "long", 300)
    assert await _lengths(second.url, "long", 300) == lengths
    # The length is the one the model draws from the request's digest, and no other.
    drawn = LengthModel({"long": Lognormal(400, 0.5)})
    assert lengths == [drawn.tokens("long", request_digest(_messages(i))) for i in range(300)]
    # Lognormal about the file's mean: spread out, none the same for all.
    assert 0.8 * 400 < sum(lengths) / len(lengths) < 1.2 * 400
    assert max(lengths) > 2.5 * min(lengths)
    # Another seed draws other lengths for the same prompts.
    third = sim_process("--length-model", str(model_file), "--seed", "7")
    assert await _lengths(third.url, "long", 300) != lengths


async def test_the_dataset_picks_the_distribution_and_max_tokens_still_cuts(
    model_file: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--length-model", str(model_file), "--mean-tokens", "5")
    long = await _lengths(server.url, "long", 100)
    short = await _lengths(server.url, "short", 100)
    assert sum(long) > 5 * sum(short)
    # No dataset, or one the file does not list: the default distribution (sigma 0).
    assert set(await _lengths(server.url, None, 20)) == {20}
    assert set(await _lengths(server.url, "unlisted", 20)) == {20}
    assert max(await _lengths(server.url, "long", 100, max_tokens=50)) == 50


async def test_without_a_default_unlisted_datasets_keep_the_mean_tokens_lengths(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"datasets": {"long": {"mean": 400}}}))
    plain = sim_process("--mean-tokens", "10")
    modelled = sim_process("--mean-tokens", "10", "--length-model", str(path))
    assert await _lengths(modelled.url, "other", 50) == await _lengths(plain.url, "other", 50)
    assert set(await _lengths(modelled.url, "long", 5)) == {400}


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{", "invalid JSON"),
        ('{"datasets": {"a": {"sigma": 1}}}', 'datasets.a: expected {"mean"'),
        ('{"datasets": {"a": {"mean": 0}}}', "datasets.a: mean must be"),
        ('{"datasets": {"a": {"mean": 5, "sigma": "x"}}}', "datasets.a.sigma must be a number"),
        ('{"lengths": {}}', 'expected an object with "default"'),
    ],
)
def test_a_bad_length_model_file_stops_the_server_naming_it(
    tmp_path: Path, content: str, said: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    for argv in (
        [sys.executable, "-m", "orchestrator.sim.server", "--length-model", str(path)],
        [sys.executable, "-m", "orchestrator", "sim-server", "--length-model", str(path)],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 2, done.stderr
        assert str(path) in done.stderr and said in done.stderr, done.stderr


def test_a_missing_length_model_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    argv = [sys.executable, "-m", "orchestrator", "sim-server", "--length-model", str(missing)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2 and f"{missing}: cannot read" in done.stderr, done.stderr


async def test_the_trace_counts_every_step_on_the_offline_models_clock(
    tmp_path: Path, model_file: Path, sim_process: Callable[..., SimProcess]
) -> None:
    trace = tmp_path / "trace.jsonl"
    options = {"kv_tokens": 5000, "step_time": 0.001, "step_per_request": 0.0001}
    server = sim_process(
        "--length-model", str(model_file), "--trace", str(trace), "--kv-tokens", "5000",
        "--step-time", "0.001", "--step-per-request", "0.0001", "--time-scale", "0.5",
    )  # fmt: skip
    # One request at a time: the server's steps are exactly the offline model's.
    lengths = await _lengths(server.url, "short", 5)
    server.stop()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(s["batch"] for s in steps) == sum(lengths)
    assert sum(s["finished"] for s in steps) == 5
    assert all(s["batch"] == 1 for s in steps)
    # The first request ran alone from t=0: its answer came at the offline model's time.
    first = next(s["t"] for s in steps if s["finished"])
    alone = schedule(SimConfig(**options), [Request(3, lengths[0], lengths[0])])
    assert math.isclose(first, alone.makespan, abs_tol=1e-3)
    # Later ones waited for their request: idle time is on the clock, scaled back.
    busy = schedule(SimConfig(**options), [Request(3, n, n) for n in lengths], in_flight=1)
    assert steps[-1]["t"] > busy.makespan
