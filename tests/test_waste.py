"""Tokens generated and thrown away, counted per dataset and cause, through the real
commands: worker subprocesses killed and stopped, a requeue, truncated answers sampled
again, bad bodies, a lease stolen. The simulated server counts what it generated for the
answers it finished (``generation_tokens``); every one of them is either stored or counted
thrown away, so the two sides must add up."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from tests.helpers import (
    SimProcess,
    cli,
    is_postgres,
    prompts,
    query,
    start_worker,
    write_jsonl,
)

STORED = "SELECT coalesce(sum(completion_tokens), 0) FROM outputs"


def wait_for(condition: Callable[[], Any], what: str, deadline: float = 120.0) -> Any:
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline:.0f} s waiting for {what}")


def enqueue(tmp_path: Path, db: str, n: int, *extra: str, dataset: str = "d") -> None:
    data = write_jsonl(tmp_path / f"{dataset}.jsonl", prompts(n, prefix=f"{dataset}-"))
    result = cli("enqueue", str(data), "-d", dataset, "--db", db, *extra)
    assert result.returncode == 0, result.stderr


def run_to_end(db: str, url: str, *extra: str) -> None:
    result = cli("run", "--server", url, "--db", db, "--exit-when-done", *extra)
    assert result.returncode in (0, 6), result.stderr  # 6: items failed for good


def wasted(db: str) -> dict[str, tuple[int, int, int]]:
    """(requests, tokens, unknown) by cause, as the table holds them."""
    rows = query(db, "SELECT cause, requests, tokens, unknown FROM wasted_tokens")
    return {cause: (int(r), int(t), int(u)) for cause, r, t, u in rows if r}


def stored(db: str) -> int:
    return int(query(db, STORED)[0][0])


def status(db: str, *extra: str) -> dict[str, Any]:
    result = cli("status", "--json", "--db", db, *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def check_shown(db: str, causes: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """status --json and its text say what the table holds, as shares of all generated."""
    doc = status(db)
    total = doc["totals"]["wasted"]
    tokens = sum(t for _, t, _ in causes.values())
    assert total["tokens"] == tokens
    assert total["requests"] == sum(r for r, _, _ in causes.values())
    assert total["generated_tokens"] == stored(db) + tokens
    for cause, (r, t, u) in causes.items():
        shown = total["by_cause"][cause]
        assert (shown["requests"], shown["tokens"], shown["unknown"]) == (r, t, u)
        if total["generated_tokens"]:
            assert shown["share"] == round(t / total["generated_tokens"], 4)
    assert doc["datasets"][0]["wasted"]["by_cause"] == total["by_cause"]
    text = cli("status", "--db", db).stdout
    if causes:
        assert f"tokens thrown away: {tokens:,} of {total['generated_tokens']:,}" in text
    return doc


def steal(db: str, expires: float) -> int:
    """Every running item's lease taken over by a holder elsewhere, as a worker on
    another host whose claim won would; how many."""
    sql = (
        "UPDATE items SET lease_token = 'taken-over', lease_owner = 'elsewhere:1:1',"
        " lease_expires_at = ? WHERE state = 'running' RETURNING id"
    )
    if is_postgres(db):
        return len(query(db, sql, expires))
    with closing(sqlite3.connect(db, timeout=30)) as conn, conn:
        return len(conn.execute(sql, (expires,)).fetchall())


def sim_stats(server: SimProcess) -> dict[str, Any]:
    return server.stats()


def test_truncated_answers_sampled_again_are_counted(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """``--on-truncated retry``: a truncated answer is the same every time (the server's
    answer is a function of the conversation), so it is sampled until its attempts are
    spent; each of those answers is thrown away with its tokens."""
    server = sim_process("--mean-tokens", "24", "--seed", "3")
    enqueue(tmp_path, db_url, 60, "--max-tokens", "24", "--on-truncated", "retry")
    run_to_end(db_url, server.url, "--max-attempts", "3", "--retry-backoff", "0.01")
    attempts = query(db_url, "SELECT count(*) FROM attempt_errors WHERE error_class = 'truncated'")
    causes = wasted(db_url)
    assert set(causes) == {"truncated"}
    requests, tokens, unknown = causes["truncated"]
    assert requests == attempts[0][0] > 0 and unknown == 0
    assert tokens == 24 * requests  # each cut at max_tokens
    assert sim_stats(server)["generation_tokens"] == stored(db_url) + tokens
    check_shown(db_url, causes)


def test_bad_bodies_retried_are_counted(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Malformed bodies say no usage: each is a request thrown away of unknown tokens,
    as many as the server sent; what the server finished is what is stored."""
    server = sim_process("--mean-tokens", "20", "--error-rate", "malformed=0.3", "--seed", "5")
    enqueue(tmp_path, db_url, 80, "--max-tokens", "200")
    run_to_end(db_url, server.url, "--retry-backoff", "0.01", "--max-attempts", "20")
    stats = sim_stats(server)
    causes = wasted(db_url)
    bad = stats["faults"]["malformed"]
    assert bad > 0
    assert causes == {"bad_response": (bad, 0, bad)}
    assert stats["generation_tokens"] == stored(db_url)
    doc = check_shown(db_url, causes)
    assert doc["totals"]["wasted"]["unknown"] == bad


def test_answers_set_aside_by_requeue_are_counted_and_an_undo_takes_them_back(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--mean-tokens", "30")
    enqueue(tmp_path, db_url, 50, "--max-tokens", "500")
    run_to_end(db_url, server.url)
    first = stored(db_url)
    assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
    assert wasted(db_url) == {"requeued": (50, first, 0)}
    assert cli("requeue", "--undo", "--db", db_url).returncode == 0
    assert wasted(db_url) == {}
    assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
    run_to_end(db_url, server.url)
    causes = wasted(db_url)
    assert causes == {"requeued": (50, first, 0)}
    assert sim_stats(server)["generation_tokens"] == stored(db_url) + first
    check_shown(db_url, causes)


def test_a_sigkilled_workers_requests_are_counted_of_unknown_tokens(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """The items a killed worker held are found by the next worker (its pid is dead):
    each counts as a request thrown away, tokens unknown; the server finished none of
    them, and every answer it finished is stored."""
    server = sim_process("--mean-tokens", "10", "--latency", "4")
    enqueue(tmp_path, db_url, 30, "--max-tokens", "100")
    worker = start_worker(db_url, server.url, "--concurrency", "6")
    wait_for(lambda: sim_stats(server)["running"] == 6, "six requests in flight")
    worker.send_signal(signal.SIGKILL)
    worker.wait(30)
    held = query(db_url, "SELECT count(*) FROM items WHERE state = 'running'")[0][0]
    assert held >= 6
    run_to_end(db_url, server.url, "--concurrency", "30")
    assert wasted(db_url) == {"killed": (held, 0, held)}
    wait_for(lambda: sim_stats(server)["running"] == 0, "the killed requests to end")
    stats = sim_stats(server)
    assert stats["aborted"] == 6
    assert stats["generation_tokens"] == stored(db_url)
    doc = check_shown(db_url, wasted(db_url))
    assert "of unknown tokens" in cli("status", "--db", db_url).stdout
    assert doc["totals"]["wasted"]["share"] == 0.0


def test_requests_cut_by_a_sigterm_are_counted(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """SIGTERM with no grace: the requests in flight are cancelled, each counted thrown
    away (the server said nothing of their tokens before the end); items claimed but not
    started are released at no cost."""
    server = sim_process("--mean-tokens", "10", "--latency", "3")
    enqueue(tmp_path, db_url, 30, "--max-tokens", "100")
    worker = start_worker(db_url, server.url, "--concurrency", "5", "--grace", "0")
    wait_for(lambda: sim_stats(server)["running"] == 5, "five requests in flight")
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    assert wasted(db_url) == {"stopped": (5, 0, 5)}
    wait_for(lambda: sim_stats(server)["running"] == 0, "the cut requests to end")
    assert sim_stats(server)["aborted"] == 5
    run_to_end(db_url, server.url, "--concurrency", "30")
    assert sim_stats(server)["generation_tokens"] == stored(db_url)
    check_shown(db_url, wasted(db_url))


def test_answers_of_a_stolen_lease_are_fenced_out_and_counted(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Leases taken over while their requests run: the answers that come back are fenced
    out (never written), each counted with the tokens its usage said; the items are done
    later by the next holder, and the server's count is stored plus fenced."""
    server = sim_process("--mean-tokens", "40", "--latency", "2")
    enqueue(tmp_path, db_url, 8, "--max-tokens", "400")
    worker = start_worker(
        db_url, server.url, "--concurrency", "4", "--lease-seconds", "60", "--exit-when-done"
    )
    wait_for(lambda: sim_stats(server)["running"] == 4, "four requests in flight")
    # Another holder takes the leases over; they expire soon, for the worker to reap.
    stolen = steal(db_url, time.time() + 3)
    assert stolen >= 4
    assert worker.wait(120) == 0, worker.stderr.read() if worker.stderr else ""
    causes = wasted(db_url)
    assert set(causes) == {"fenced"}
    requests, tokens, unknown = causes["fenced"]
    assert requests == stolen and unknown == 0 and tokens > 0
    assert sim_stats(server)["generation_tokens"] == stored(db_url) + tokens
    assert query(db_url, "SELECT count(*) FROM items WHERE state = 'done'") == [(8,)]
    check_shown(db_url, causes)
