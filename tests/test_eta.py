"""The ETA forecast: the claim order replayed over each dataset's own answer times."""

from __future__ import annotations

import pytest

from orchestrator.monitor.eta import Work, forecast


def measured(dataset_id: int, pending: int, seconds: float, **kw: object) -> Work:
    kw.setdefault("sample", 100)
    kw.setdefault("tokens", seconds * 100)
    return Work(dataset_id, pending=pending, running=0, seconds=seconds, **kw)  # type: ignore[arg-type]


def test_one_dataset_runs_at_the_concurrency_in_use() -> None:
    # 100 items of 2 s each, 10 in flight: 20 s.
    result = forecast([measured(1, 100, 2.0, in_flight=10.0)])
    assert result.slots == 10.0
    assert result.datasets == {1: pytest.approx(20.0)}
    assert result.total == pytest.approx(20.0)


def test_live_workers_in_flight_count_only_when_the_window_saw_nothing() -> None:
    result = forecast([measured(1, 100, 2.0, in_flight=4.0)], live_in_flight=10)
    assert result.slots == 4.0 and result.total == pytest.approx(50.0)
    result = forecast([measured(1, 100, 2.0, in_flight=0.0)], live_in_flight=10)
    assert result.slots == 10.0 and result.total == pytest.approx(20.0)


def test_datasets_follow_priority_and_hand_their_slots_on() -> None:
    # "a" (priority 1): 50 x 1 s at 10 slots ends at 5 s; then "b": 30 x 4 s = 120
    # request-seconds at 10 slots, 12 s more. A linear extrapolation of "a"'s pace
    # (10 items/s) would say 8 s for everything.
    result = forecast(
        [
            measured(1, 50, 1.0, priority=1, in_flight=10.0),
            measured(2, 30, 4.0),
        ]
    )
    assert result.datasets[1] == pytest.approx(5.0)
    assert result.datasets[2] == pytest.approx(17.0)
    assert result.total == pytest.approx(17.0)


def test_a_capped_dataset_runs_beside_the_others() -> None:
    # 10 slots: "a" capped at 4 (40 x 1 s) and "b" taking the other 6 (30 x 1 s).
    # "b" ends at 5 s; "a" stays at its cap and ends at 10 s.
    result = forecast(
        [measured(1, 40, 1.0, cap=4, in_flight=4.0), measured(2, 30, 1.0, in_flight=6.0)]
    )
    assert result.datasets[2] == pytest.approx(5.0)
    assert result.datasets[1] == pytest.approx(10.0)


def test_the_last_items_take_one_answer_time_not_a_share_of_the_slots() -> None:
    result = forecast([measured(1, 5, 3.0, in_flight=64.0)])
    assert result.total == pytest.approx(3.0)


def test_items_in_flight_count_half() -> None:
    work = Work(1, pending=10, running=10, seconds=1.0, tokens=10.0, sample=5, in_flight=5.0)
    assert forecast([work]).total == pytest.approx(3.0)  # (10 + 5) x 1 s / 5 slots


def test_a_dataset_without_answers_borrows_a_time_scaled_to_its_max_tokens() -> None:
    # Measured: 100 tokens in 1.0 s and 400 tokens in 2.5 s, i.e. 0.5 s + 5 ms/token,
    # with answers filling half of max_tokens. "c" (max_tokens 2000) should then answer
    # 1000 tokens in 5.5 s: 10 items on 10 slots, after the others.
    work = [
        measured(1, 0, 1.0, tokens=100.0, max_tokens=200, in_flight=5.0),
        measured(2, 0, 2.5, tokens=400.0, max_tokens=800, in_flight=5.0),
        Work(3, pending=10, running=0, max_tokens=2000),
    ]
    result = forecast(work)
    assert result.datasets[1] == 0.0 and result.datasets[2] == 0.0
    assert result.datasets[3] == pytest.approx(5.5)


def test_paused_datasets_are_left_out_of_the_total() -> None:
    result = forecast([measured(1, 10, 1.0, in_flight=5.0), measured(2, 99, 9.0, paused=True)])
    assert result.datasets == {1: pytest.approx(2.0), 2: None}
    assert result.total == pytest.approx(2.0)


def test_no_forecast_without_answers_or_without_anyone_working() -> None:
    assert forecast([Work(1, pending=10, running=0)]).total is None
    assert forecast([measured(1, 10, 1.0)]).total is None  # no slots in use
    assert forecast([measured(1, 0, 1.0)]).total == 0.0
