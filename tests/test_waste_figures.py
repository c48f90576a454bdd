"""The arithmetic of tokens thrown away and of the cost, over many shapes of input: the
store's tally, the status figures built from its rows, and the run's pooled prices."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import ConfigError
from orchestrator.settings.prices import Prices, run_prices
from orchestrator.store.stats import wasted_figures
from orchestrator.store.waste import CAUSES, MOST_TOKENS, Waste, tally

attempts = st.lists(
    st.tuples(
        st.integers(1, 4),
        st.builds(Waste, st.sampled_from(CAUSES), st.none() | st.integers(-5, 2**40)),
    ),
    max_size=60,
)


@given(attempts)
def test_tally_sums_each_dataset_and_cause_in_key_order(entries: list[tuple[int, Waste]]) -> None:
    rows = tally(entries)
    keys = [(r.dataset_id, r.cause) for r in rows]
    assert keys == sorted(set(keys))  # one row each, in the order writers lock them
    for r in rows:
        mine = [w.tokens for d, w in entries if (d, w.cause) == (r.dataset_id, r.cause)]
        # A count no answer can have (negative, past 32 bits) is no count: unknown.
        counted = [t for t in mine if t is not None and 0 <= t <= MOST_TOKENS]
        assert r.requests == len(mine)
        assert r.unknown == len(mine) - len(counted)
        assert r.tokens == sum(counted)


@given(
    st.dictionaries(
        st.sampled_from(CAUSES),
        st.tuples(st.integers(0, 10**9), st.integers(0, 10**12), st.integers(0, 10**9)),
    ),
    st.integers(0, 10**12),
)
def test_shares_are_of_every_token_generated(
    by_cause: dict[str, tuple[int, int, int]], stored: int
) -> None:
    figures = wasted_figures(by_cause, stored)
    tokens = sum(t for _, t, _ in by_cause.values())
    assert figures["generated_tokens"] == stored + tokens
    assert figures["tokens"] == tokens
    if stored + tokens == 0:
        assert figures["share"] is None
    else:
        assert figures["share"] == round(tokens / (stored + tokens), 4)
        assert 0.0 <= figures["share"] <= 1.0
    assert set(figures["by_cause"]) == set(by_cause)
    assert sum(f["requests"] for f in figures["by_cause"].values()) == figures["requests"]


price = st.none() | st.floats(0, 1000, allow_nan=False)


@settings(max_examples=200)
@given(st.builds(Prices, price, price, price), st.lists(st.builds(Prices, price, price, price)))
def test_pooled_prices(default: Prices, servers: list[Prices]) -> None:
    pooled = run_prices(default, servers)
    each = [s if s.given else default for s in servers] or [default]
    hourly = [p.gpu_hour_cost for p in each if p.gpu_hour_cost is not None]
    assert pooled.gpu_servers == len(hourly)
    assert pooled.gpu_hourly == (sum(hourly) if hourly else None)
    tokened = [p for p in each if p.by_token]
    outs = [p.price_output for p in tokened if p.price_output is not None]
    if outs:
        assert pooled.price_output is not None
        assert math.isclose(pooled.price_output, sum(outs) / len(tokened))
    else:
        assert pooled.price_output is None


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("gpu_hour_cost", -0.5, "gpu_hour_cost: must be at least 0, got -0.5"),
        ("price_input", float("inf"), "price_input: must be a finite number, got inf"),
        ("price_output", "1", "price_output: must be a number, got '1'"),
        ("price_output", True, "price_output: must be a number, got True"),
    ],
)
def test_a_bad_price_is_refused_by_name(field: str, value: object, said: str) -> None:
    with pytest.raises(ConfigError, match=f"^{said}$"):
        Prices(**{field: value})  # type: ignore[arg-type]
