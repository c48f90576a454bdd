"""The offline scheduler: the simulated server's batching model stepped in simulated time.

The makespan benchmark measures runs against it, so its arithmetic is checked on cases
small enough to work out by hand.
"""

from __future__ import annotations

import pytest

from orchestrator.sim.config import SimConfig
from orchestrator.sim.offline import Request, longest_first, schedule, tail_share

# One second a step whatever the batch, no prefill: a step is one token of each request.
SLOTS = {"step_time": 1.0, "step_per_request": 0.0, "prefill_per_token": 0.0}


def jobs(*tokens: int) -> list[Request]:
    return [Request(prompt=1, tokens=n, limit=n) for n in tokens]


def test_one_slot_runs_the_requests_back_to_back_in_order() -> None:
    result = schedule(SimConfig(max_running=1, **SLOTS), jobs(3, 1, 2))
    assert result.makespan == 6
    assert result.finished == [3, 4, 6]  # in the order given
    assert result.generated == 6
    assert [batch for _, batch, _ in result.steps] == [1] * 6


def test_longest_first_ends_sooner_than_first_come_first_served() -> None:
    config = SimConfig(max_running=2, **SLOTS)
    given = jobs(1, 1, 1, 1, 4)
    # In the order given, the long one starts once four short ones have run: 2 + 4.
    assert schedule(config, given).makespan == 6
    # Longest first: it runs beside the four short ones, one after another.
    ordered = longest_first(given)
    assert [r.tokens for r in ordered] == [4, 1, 1, 1, 1]
    assert schedule(config, ordered).makespan == 4


def test_a_client_in_flight_count_bounds_the_batch() -> None:
    result = schedule(SimConfig(max_running=10, **SLOTS), jobs(5, 5, 5, 5), in_flight=2)
    assert max(batch for _, batch, _ in result.steps) == 2
    assert all(queued == 0 for _, _, queued in result.steps)
    assert result.makespan == 10


def test_steps_slow_down_as_the_batch_grows_and_prefill_costs_time() -> None:
    config = SimConfig(max_running=4, step_time=0.5, step_per_request=0.25, prefill_per_token=0.1)
    result = schedule(config, [Request(prompt=10, tokens=2, limit=2)] * 2)
    # Step 1 admits both (20 prompt tokens): 0.5 + 2 * 0.25 + 2.0; step 2: 0.5 + 0.5.
    assert result.makespan == pytest.approx(4.0)
    assert result.peak_rate == pytest.approx(2 / 1.0)


def test_the_cache_limits_the_batch_as_the_live_server_does() -> None:
    # 100 tokens of cache; a prompt of 20 whose max_tokens is 20 is expected to need
    # 20 + 0.7 * 20 = 34 at first: two fit beside each other (68), a third does not (102).
    config = SimConfig(kv_tokens=100, **SLOTS)
    result = schedule(config, [Request(prompt=20, tokens=10, limit=20)] * 3)
    assert max(batch for _, batch, _ in result.steps) == 2
    assert result.makespan == 20


def test_tail_share() -> None:
    finished = [float(t) for t in range(1, 101)]
    # 99 % are done at t=99, the last at 100: one second of a 100-second run.
    assert tail_share(finished, 100.0) == pytest.approx(0.01)
    assert tail_share([*[1.0] * 99, 50.0], 50.0) == pytest.approx(49 / 50)
    assert tail_share([], 0.0) == 0.0
