"""Pacing under a hosted API's limits: the headers read, the caps checked, the 429s few
against the simulated provider's token buckets, and a server that answers 429 for ever
said loudly."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from orchestrator.errors import ConfigError
from orchestrator.inference.failures import Allowance, RateLimits, parse_duration, rate_limits
from orchestrator.inference.servers_file import parse_servers_file
from orchestrator.items import error_classes as ec
from orchestrator.sim.ratelimit import duration, parse_rate_limit
from tests.helpers import SimProcess, chat, check_export, cli, events, prompts, query, write_jsonl

# ------------------------------------------------------------------------ headers

UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@given(
    st.lists(
        st.tuples(st.sampled_from(list(UNITS)), st.integers(0, 10_000), st.integers(0, 999)),
        min_size=1,
        max_size=4,
    )
)
def test_a_go_duration_reads_as_the_sum_of_its_terms(terms: list[tuple[str, int, int]]) -> None:
    text = "".join(f"{whole}.{frac:03d}{unit}" for unit, whole, frac in terms)
    expected = sum((whole + frac / 1000) * UNITS[unit] for unit, whole, frac in terms)
    assert parse_duration(text) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@given(st.floats(0, 100_000, allow_nan=False))
def test_what_the_simulated_provider_writes_reads_back(seconds: float) -> None:
    # The provider's own formatter ("120ms", "6m0s", "1h2m3.5s"): to the millisecond.
    assert parse_duration(duration(seconds)) == pytest.approx(seconds, abs=1e-3)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("6m0s", 360.0), ("120ms", 0.12), ("20ms", 0.02), ("0.5", 0.5), ("7", 7.0)],
)
def test_openai_formats(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@given(st.text(max_size=12))
def test_an_unreadable_duration_is_none_never_an_error(text: str) -> None:
    value = parse_duration(text)
    assert value is None or value >= 0


@pytest.mark.parametrize("text", ["", "s", "1x", "-1s", "1s-", "nan", "inf", "1 s", "m1"])
def test_bad_durations_are_none(text: str) -> None:
    assert parse_duration(text) is None


@given(
    limit=st.integers(0, 10**9),
    remaining=st.integers(0, 10**9),
    reset=st.floats(0, 10**5, allow_nan=False),
    unit=st.sampled_from(["requests", "tokens"]),
)
def test_headers_of_either_kind_are_read(
    limit: int, remaining: int, reset: float, unit: str
) -> None:
    headers = CIMultiDict(
        {
            f"X-RateLimit-Limit-{unit}": str(limit),
            f"x-ratelimit-remaining-{unit}": str(remaining),
            f"x-ratelimit-reset-{unit}": duration(reset),
        }
    )
    found = rate_limits(headers)
    assert found is not None
    said = getattr(found, unit)
    assert (said.limit, said.remaining) == (limit, remaining)
    assert said.reset == pytest.approx(reset, abs=1e-3)
    other = "tokens" if unit == "requests" else "requests"
    assert getattr(found, other) == Allowance()


def test_no_headers_no_limits_and_garbage_is_left_out() -> None:
    assert rate_limits(CIMultiDict()) is None
    assert rate_limits(CIMultiDict({"x-ratelimit-limit-requests": "many"})) is None
    found = rate_limits(
        CIMultiDict({"x-ratelimit-remaining-tokens": "-3", "x-ratelimit-limit-tokens": "9e3"})
    )
    assert found == RateLimits(tokens=Allowance(limit=9000))


def test_the_simulated_provider_names_its_buckets() -> None:
    spec = parse_rate_limit("rpm=300,burst=25")
    assert (spec.unit, spec.per_minute, spec.burst) == ("requests", 300, 25)
    assert parse_rate_limit("tpm=6000").burst == 6000  # a minute's worth
    for bad in ("rpm=0", "rpm=300,tpm=5", "burst=3", "rpm=x", "rpm=5,burst=-1", "qpm=3"):
        with pytest.raises(ValueError, match="bad rate limit"):
            parse_rate_limit(bad)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_reads_the_headers_of_answers_and_429s(
    sim: Callable[..., Any], stream: bool
) -> None:
    from orchestrator.errors import TransientError
    from orchestrator.inference.client import ClientConfig, InferenceClient

    url = await sim(rate_limits=(parse_rate_limit("rpm=60,burst=2"),), mean_tokens=4)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with InferenceClient(ClientConfig(stream=stream)) as client:
        first = await chat(client, url, body)
        second = await chat(client, url, body)
        with pytest.raises(TransientError) as limited:
            await chat(client, url, body)
    assert first.rate_limits is not None and second.rate_limits is not None
    said = first.rate_limits.requests, second.rate_limits.requests
    assert said[0].limit == said[1].limit == 60
    assert (said[0].remaining, said[1].remaining) == (1, 0)
    assert said[1].reset is not None and 0 < said[1].reset <= 2  # one a second refills two
    assert limited.value.error_class == ec.RATE_LIMITED
    assert limited.value.retry_after is not None and 0 < limited.value.retry_after <= 1
    found = limited.value.rate_limits
    assert isinstance(found, RateLimits) and found.requests.remaining == 0


async def test_a_pacer_with_a_cap_holds_what_the_budget_has_no_room_for() -> None:
    import asyncio

    from orchestrator.inference.pacing import Pacer

    # 120 a minute: 2 a second, at most one second's worth at once.
    pacer = Pacer(rpm=120)
    tickets = [await asyncio.wait_for(pacer.acquire(0), 1) for _ in range(2)]
    assert tickets == [0, 1]
    held = asyncio.ensure_future(pacer.acquire(0))
    await asyncio.sleep(0)
    assert not held.done()  # the bucket is empty: the next one waits for its refill
    assert await asyncio.wait_for(held, 5) == 2


async def test_a_pacer_learns_the_bucket_from_the_headers() -> None:
    import asyncio

    from orchestrator.inference.pacing import Pacer

    pacer = Pacer()
    first = await pacer.acquire(10)
    second = asyncio.ensure_future(pacer.acquire(10))
    await asyncio.sleep(0)
    assert not second.done()  # the first goes alone until it is heard of
    # 60 a minute, 4 left, full again in 1 s: a bucket of 5, one a second.
    pacer.answered(first, RateLimits(Allowance(60, 4, 1.0)), used=12)
    assert await asyncio.wait_for(second, 1) == 1
    assert pacer.requests.rate == 1.0 and pacer.requests.size == pytest.approx(5.0)
    # 4 left, less the reserve of one: the second and two more go at once.
    assert [await asyncio.wait_for(pacer.acquire(10), 1) for _ in range(2)] == [2, 3]
    third = asyncio.ensure_future(pacer.acquire(10))
    await asyncio.sleep(0)
    assert not third.done()
    third.cancel()
    # A 429 pauses the server for its Retry-After.
    assert pacer.limited(2, 30.0, None) == 30.0
    assert pacer._wait(0) > 29


# ------------------------------------------------------------------------ caps


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--rpm", "0"), "'--rpm': must be at least 1, got 0"),
        (("--rpm", "-5"), "'--rpm': must be at least 1, got -5"),
        (("--tpm", "1.5"), "'--tpm': must be an integer"),
        (("--rpm", "lots"), "'--rpm'"),
        (("--rate-limited-warn-after", "0"), "'--rate-limited-warn-after': must be more than 0"),
        (("--rate-limited-warn-after", "nan"), "'--rate-limited-warn-after': must be a finite"),
    ],
)
def test_bad_caps_are_refused_before_anything_runs(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    db = tmp_path / "q.db"
    result = cli("run", "--server", "http://127.0.0.1:9", "--db", str(db), *args)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert not db.exists()


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("rpm=0", "rpm: must be at least 1"),
        ("tpm=abc", "tpm: must be"),
        ("rpm=", "rpm: must be"),
        ("qpm=3", "unknown option 'qpm=3'"),
    ],
)
def test_a_bad_cap_in_the_servers_file_names_its_line(
    tmp_path: Path, option: str, said: str
) -> None:
    servers = tmp_path / "servers.txt"
    servers.write_text(f"# hosted\nhttps://api.example.com concurrency=8 {option}\n")
    with pytest.raises(ConfigError, match=f"{servers}:2: {said}"):
        parse_servers_file(servers)
    db = tmp_path / "q.db"
    result = cli("run", "--servers-file", str(servers), "--db", str(db))
    assert result.returncode == 2 and f"{servers}:2: {said}" in result.stderr
    assert not db.exists()


def test_the_servers_file_takes_caps_per_server(tmp_path: Path) -> None:
    servers = tmp_path / "servers.txt"
    servers.write_text("http://a:1 rpm=500 tpm=90000\nhttp://b:1 concurrency=4\n")
    a, b = parse_servers_file(servers)
    assert (a.rpm, a.tpm, a.concurrency) == (500, 90_000, None)
    assert (b.rpm, b.tpm, b.concurrency) == (None, None, 4)


async def test_the_python_api_refuses_bad_caps(tmp_path: Path) -> None:
    from orchestrator import Queue

    async with Queue(tmp_path / "q.db") as queue:
        for bad in ({"rpm": 0}, {"tpm": True}, {"rpm": 2.5}, {"rate_limited_warn_after": -1}):
            with pytest.raises(ConfigError, match=next(iter(bad))):
                await queue.run(servers=["http://127.0.0.1:9"], **bad)


# ------------------------------------------------------------------------ runs


def _enqueue(tmp_path: Path, db: str, n: int) -> list[str]:
    rows = prompts(n)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    result = cli("enqueue", str(data), "--dataset", "p", "--db", db)
    assert result.returncode == 0, result.stderr
    return [row["id"] for row in rows]


def _run(db: str, url: str, *extra: str) -> None:
    result = cli(
        "run", "--server", url, "--db", db, "--exit-when-done", "--concurrency", "16", *extra
    )
    assert result.returncode == 0, result.stderr


# Bucket of 10 requests refilled at 10 a second: 120 prompts take about 11 s paced.
BUCKET = ("--rate-limit", "rpm=600,burst=10", "--latency", "0.05", "--mean-tokens", "8")


@pytest.mark.parametrize(
    ("sim_args", "run_args"),
    [
        pytest.param((), (), id="headers"),
        pytest.param(("--rate-limit-headers", "false"), ("--rpm", "600"), id="rpm-no-headers"),
        pytest.param(
            ("--rate-limit", "tpm=30000,burst=3000"), (), id="requests-and-tokens-headers"
        ),
    ],
)
def test_a_paced_run_meets_few_429s(
    tmp_path: Path,
    db_url: str,
    sim_process: Callable[..., SimProcess],
    sim_args: tuple[str, ...],
    run_args: tuple[str, ...],
) -> None:
    server = sim_process(*BUCKET, *sim_args)
    keys = _enqueue(tmp_path, db_url, 120)
    _run(db_url, server.url, *run_args)
    stats = server.stats()
    assert stats["completed"] == 120
    # Every request the provider got is an answer or a 429 it counted.
    assert stats["chat_requests"] == stats["completed"] + stats["rate_limited"]
    assert stats["rate_limited"] <= stats["chat_requests"] // 100  # at most 1 %
    if db_url.endswith(".db"):
        check_export(db_url, tmp_path / "out.jsonl", keys)
    assert query(db_url, "SELECT count(*) FROM items WHERE state = 'done'") == [(120,)]


def test_without_pacing_the_same_provider_bounces_many(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    # The reference the test above is measured against: no headers, no cap.
    server = sim_process(*BUCKET, "--rate-limit-headers", "false")
    db = str(tmp_path / "q.db")
    _enqueue(tmp_path, db, 120)
    _run(db, server.url, "--retry-backoff", "0.05")
    stats = server.stats()
    assert stats["completed"] == 120
    assert stats["rate_limited"] > stats["chat_requests"] // 100
    # A 429 spends no attempt, however many an item met.
    assert query(db, "SELECT max(attempts) FROM items") == [(1,)]
    assert query(db, "SELECT count(*) FROM items WHERE state = 'failed'") == [(0,)]


def test_a_server_that_answers_429_for_ever_is_said_loudly(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    from tests.helpers import start_worker

    server = sim_process("--error-rate", "429=1", "--retry-after", "0.2")
    _enqueue(tmp_path, db_url, 20)
    worker = start_worker(
        db_url, server.url, "--rate-limited-warn-after", "1", "--max-attempts", "2",
        env={"ORCHESTRATOR_LOG_REPEAT_SECONDS": "600"},
    )  # fmt: skip
    snap: dict = {}
    for _ in range(600):  # until status says so (each look reads the database once)
        found = cli("status", "--json", "--db", db_url)
        snap = json.loads(found.stdout) if found.returncode == 0 else {}
        if snap.get("rate_limited"):
            break
    (limited,) = snap["rate_limited"]
    assert limited["server"] == server.url
    assert limited["limited_for_s"] >= 1
    text = cli("status", "--db", db_url).stdout
    assert f"RATE LIMITED: {server.url} has answered only HTTP 429 for" in text
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    said = [e for e in events(stderr) if e["event"] == "server_rate_limited"]
    rate_limited = server.stats()["faults"]["429"]
    # One warning, then a summary a minute at most: far fewer than the 429s.
    assert 1 <= len(said) <= 2 < rate_limited
    assert said[0]["server"] == server.url and said[0]["limited_for_s"] >= 1
    assert said[0]["rate_limited"] >= 1
    # Attempts are never spent on it: none failed, each pending one has all its attempts;
    # a claim the stop overtook (the 429s keep claims and releases churning) is released
    # with the rest, never left running.
    states = dict(query(db_url, "SELECT state, count(*) FROM items GROUP BY state"))
    assert states == {"pending": 20}, states
    assert query(db_url, "SELECT max(attempts) FROM items WHERE state = 'pending'") == [(0,)]
    stored = query(
        db_url, "SELECT message FROM attempt_errors WHERE error_class = ?", ec.RATE_LIMITED
    )
    assert any(ec.limited_for(message) is not None for (message,) in stored)
