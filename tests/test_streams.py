"""Streams and waits, through the real command against ``tests.hostile_server``: streams
that end without ``[DONE]``, events of any size, and what a server's ``Retry-After`` may
make a worker wait (docs/RELIABILITY.md, "Streams and waits")."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.helpers import Hostile, cli, events, prompts, query, start_worker, write_jsonl
from tests.test_hostile import wait_for


def enqueue(db: str, n: int, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    result = cli("enqueue", str(src), "--dataset", "d", "--max-tokens", "16", "--db", db)
    assert result.returncode == 0, result.stderr


def run(db: str, server: Hostile, *extra: str) -> tuple[int, str]:
    result = cli(
        "--log-json", "--log-level", "info", "run", "--server", server.url, "--exit-when-done",
        "--db", db, *extra,
        timeout=240,
    )  # fmt: skip
    return result.returncode, result.stderr


def exported(db: str, out: Path) -> list[dict[str, Any]]:
    result = cli("export", str(out), "--db", db)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


# ------------------------------------------------------------ a finish_reason, no [DONE]


@pytest.mark.parametrize("end", ["usage", "close", "break"])
def test_a_stream_that_ends_after_its_finish_reason_is_an_answer(
    db_url: str, tmp_path: Path, hostile: Callable[..., Hostile], end: str
) -> None:
    """The finish reason came, then no ``[DONE]``: the body ended after the usage chunk,
    right after the finish reason, or the connection broke there. Each answer is whole:
    stored once, with the usage when the server sent it."""
    server = hostile("--stream-end", end, "--stream-bytes", "300")
    enqueue(db_url, 6, tmp_path)
    code, stderr = run(db_url, server, "--stream", "--max-attempts", "1")
    assert code == 0, stderr[-2000:]
    assert query(db_url, "SELECT state, attempts FROM items") == [("done", 1)] * 6
    lines = exported(db_url, tmp_path / "out.jsonl")
    assert [line["messages"][-1]["content"] for line in lines] == ["y" * 300] * 6
    assert {line["finish_reason"] for line in lines} == {"stop"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1} if end == "usage" else None
    assert [line.get("usage") for line in lines] == [usage] * 6
    assert not any(e.get("error_class") for e in events(stderr))


# ------------------------------------------------------------ events of any size


@pytest.mark.parametrize("size", [200 * 2**10, 600 * 2**10, 3 * 2**20 // 2])
def test_one_event_of_any_size_within_the_cap_is_read(
    db_url: str, tmp_path: Path, hostile: Callable[..., Hostile], size: int
) -> None:
    """The answer's content in one ``data:`` event: read whole up to --max-response-mb."""
    server = hostile("--stream-bytes", str(size), "--piece-bytes", str(size))
    enqueue(db_url, 2, tmp_path)
    code, stderr = run(db_url, server, "--stream", "--max-response-mb", "2", "--max-attempts", "1")
    assert code == 0, stderr[-2000:]
    assert "Traceback" not in stderr and "item_crashed" not in stderr
    lines = exported(db_url, tmp_path / "out.jsonl")
    assert [len(line["messages"][-1]["content"]) for line in lines] == [size] * 2


def test_one_event_over_the_cap_is_too_large_without_a_traceback(
    db_url: str, tmp_path: Path, hostile: Callable[..., Hostile]
) -> None:
    size = 3 * 2**20
    server = hostile("--stream-bytes", str(size), "--piece-bytes", str(size))
    enqueue(db_url, 2, tmp_path)
    code, stderr = run(db_url, server, "--stream", "--max-response-mb", "1")
    assert code == 6, stderr[-2000:]
    assert "Traceback" not in stderr and "item_crashed" not in stderr
    rows = query(db_url, "SELECT state, error_class, attempts FROM items")
    assert rows == [("failed", "response_too_large", 1)] * 2, rows
    assert query(db_url, "SELECT count(*) FROM outputs") == [(0,)]


# ------------------------------------------------------------ Retry-After


@pytest.mark.parametrize(
    "header",
    [
        "Retry-After=1e308",
        "Retry-After=inf",
        "Retry-After=Fri, 31 Dec 9999 23:59:59 GMT",
        "retry-after-ms=1e308",
    ],
)
def test_a_huge_retry_after_waits_the_backoff_cap_and_says_so(
    db_url: str, tmp_path: Path, hostile: Callable[..., Hostile], header: str
) -> None:
    """However far off the server says, the item is back within 5 minutes, its attempt
    given back, and the log says the server's value was capped."""
    server = hostile("--rate-limit", header)
    enqueue(db_url, 1, tmp_path)
    worker = start_worker(db_url, server.url, "--exit-when-done")
    released = (
        "SELECT not_before FROM items"
        " WHERE state = 'pending' AND attempts = 0 AND error_class = 'rate_limited'"
    )
    wait_for(lambda: bool(query(db_url, released)), timeout=120)
    seen = time.time()
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    ((not_before,),) = query(db_url, released)
    assert not_before is not None and 200 < not_before - seen <= 300, not_before - seen
    (capped,) = [e for e in events(stderr) if e["event"] == "retry_after_capped"]
    assert capped["server"] == server.url and capped["wait_s"] == 300
    assert capped["retry_after_s"] == "inf" or capped["retry_after_s"] > 300
    json.dumps(capped, allow_nan=False)  # a log line any JSON reader takes


@pytest.mark.parametrize(
    ("header", "attempts"),
    [
        ("retry-after-ms=1500", 1),  # released for 1.5 s, the attempt given back
        ("Retry-After=-5", 1),  # a time gone by: now, the attempt given back
        # Unreadable: released after a backoff; a 429 never spends an attempt either way.
        ("Retry-After=nan", 1),
        ("retry-after-ms=nan", 1),
        ("Retry-After=soon", 1),
    ],
)
def test_a_retry_after_is_honoured_or_else_ignored(
    db_url: str, tmp_path: Path, hostile: Callable[..., Hostile], header: str, attempts: int
) -> None:
    server = hostile("--rate-limit", header)
    enqueue(db_url, 2, tmp_path)
    code, stderr = run(db_url, server, "--max-attempts", "2", "--retry-backoff", "0.5")
    assert code == 0, stderr[-2000:]
    assert query(db_url, "SELECT state, attempts FROM items") == [("done", attempts)] * 2
    assert "retry_after_capped" not in stderr


# ------------------------------------------------------------ the tuner's looks at /metrics


@pytest.mark.parametrize(
    "trouble", [["--metrics-fail", "2"], ["--metrics-delay", "8"]], ids=["failed", "slow"]
)
def test_a_failed_or_slow_look_at_metrics_holds_the_cap_until_they_come(
    tmp_path: Path, hostile: Callable[..., Hostile], trouble: list[str]
) -> None:
    """Two looks answered 503, or one that takes 8 s (past the 5 s a look is waited for
    in a tick): the cap holds until the metrics come, and the first change is the one
    they call for (a queue of 6 on 2 slots: down to 4), not a ramp in the dark. The
    server reports that queue whatever is in flight: figures counted from the requests
    it holds would hang on how fast a loaded machine sends the next one."""
    server = hostile(
        "--metrics-slots", "2", "--metrics-waiting", "6", "--answer-delay", "0.25", *trouble
    )
    db = str(tmp_path / "q.db")
    enqueue(db, 500, tmp_path)
    code, stderr = run(db, server, "--concurrency", "auto")
    assert code == 0, stderr[-2000:]
    seen = events(stderr)
    assert not [e for e in seen if e["event"].startswith("server_metrics_")], seen
    changes = [e for e in seen if e["event"] == "concurrency_changed"]
    assert changes and (changes[0]["old"], changes[0]["reason"]) == (8, "queue"), seen
    assert changes[0]["new"] == 4


def test_a_server_without_metrics_is_tuned_without_them_after_three_looks(
    tmp_path: Path, hostile: Callable[..., Hostile]
) -> None:
    # No /metrics: 404. Three looks a second apart, then the tuner's first sample of its
    # own: the run must still be busy at cap 8 well after that (1,000 answers of 0.1 s at
    # 8 at once take 12.5 s; 400 took 5 s, and a loaded machine ended the run first).
    server = hostile("--answer-delay", "0.1")
    db = str(tmp_path / "q.db")
    enqueue(db, 1000, tmp_path)
    code, stderr = run(db, server, "--concurrency", "auto")
    assert code == 0, stderr[-2000:]
    seen = events(stderr)
    (unavailable,) = [e for e in seen if e["event"] == "server_metrics_unavailable"]
    assert unavailable["looks"] == 3 and "HTTP 404" in unavailable["reason"], unavailable
    assert server.stats()["GET /metrics"] >= 3
    changes = [e for e in seen if e["event"] == "concurrency_changed"]
    assert changes and changes[0]["reason"] == "ramp"  # on its own tokens per second
