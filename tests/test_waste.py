"""Tokens generated and thrown away, counted per dataset and cause, through the real
commands: worker subprocesses killed and stopped, a requeue, truncated answers sampled
again, bad bodies, a lease stolen. The simulated server counts what it generated for the
answers it finished (``generation_tokens``); every one of them is either stored or counted
thrown away, so the two sides must add up."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from orchestrator.errors import RunStopped
from orchestrator.store import Database
from tests.helpers import (
    SimProcess,
    cli,
    is_postgres,
    prompts,
    query,
    start_worker,
    wait_for,
    write_jsonl,
)

STORED = "SELECT coalesce(sum(completion_tokens), 0) FROM outputs"


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
    server = sim_process("--mean-tokens", "10", "--latency", "2")
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


def truncating_run(tmp_path: Path, db: str, server: SimProcess) -> dict[str, tuple[int, int, int]]:
    """A short run whose truncated answers are sampled again until their attempts end."""
    enqueue(tmp_path, db, 40, "--max-tokens", "24", "--on-truncated", "retry")
    run_to_end(db, server.url, "--max-attempts", "2", "--retry-backoff", "0.01")
    causes = wasted(db)
    assert causes["truncated"][0] > 0
    return causes


async def test_metrics_dashboard_and_report_show_the_queues_waste(
    tmp_path: Path, db_url: str, database: Database, sim_process: Callable[..., SimProcess]
) -> None:
    """/metrics counts the queue's tokens thrown away by dataset and cause, the report's
    page shows the share the status document says."""
    from orchestrator.inference.client import ClientConfig, InferenceClient
    from orchestrator.worker import Worker, WorkerConfig
    from orchestrator.worker.metrics import WorkerMetrics
    from tests.test_dashboard import report_rows
    from tests.test_metrics import samples, value

    server = sim_process("--mean-tokens", "24", "--seed", "3")
    causes = truncating_run(tmp_path, db_url, server)
    metrics = WorkerMetrics()
    config = WorkerConfig(servers=(server.url,), exit_when_done=True, poll_interval=0.05)
    async with InferenceClient(ClientConfig(request_timeout=5)) as client:
        worker = Worker(database, client, config, metrics=metrics)
        with contextlib.suppress(RunStopped):
            await worker.run()  # nothing left: loads the catalog and ends (items failed)
    metrics.set_wasted(await worker._wasted())
    found = samples(metrics.exposition().decode())
    requests, tokens, unknown = causes["truncated"]
    labels = {"dataset": "d", "cause": "truncated"}
    assert value(found, "orchestrator_wasted_tokens_total", **labels) == tokens
    assert value(found, "orchestrator_wasted_requests_total", **labels) == requests
    assert value(found, "orchestrator_wasted_unknown_requests_total", **labels) == unknown
    share = status(db_url)["datasets"][0]["wasted"]["share"]
    rows = await report_rows(tmp_path / "report.html", db_url)
    assert rows["d"]["wasted"] == f"{100 * share:.1f}%"


def test_status_and_plan_priced_against_the_documents_figures(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """The cost recomputed from the status document's own figures: by the server-hour
    (two servers of a servers file, one at its own price) and by the token."""
    server = sim_process("--mean-tokens", "24", "--seed", "3")
    truncating_run(tmp_path, db_url, server)
    servers = tmp_path / "servers.txt"
    servers.write_text("http://gpu-1:30000  gpu_hour_cost=3.5\nhttp://gpu-2:30000\n")
    doc = status(db_url, "--servers-file", str(servers), "--gpu-hour-cost", "2")
    totals, cost = doc["totals"], doc["cost"]
    hours = totals["overall"]["elapsed_s"] / 3600
    assert cost["gpu_hourly"] == 5.5 and cost["gpu_servers"] == 2
    assert cost["so_far"] == round(5.5 * hours, 4)
    assert cost["wasted"] == round(5.5 * hours * totals["wasted"]["share"], 4)
    assert cost["to_go"] == 0.0  # every item is done or failed

    doc = status(db_url, "--price-input", "0.5", "--price-output", "2")
    (entry,) = doc["datasets"]
    w, prompt = entry["wasted"], entry["prompt_tokens"]["total"]
    mean_prompt = prompt / entry["overall"]["done"]
    thrown = (w["requests"] * mean_prompt * 0.5 + w["tokens"] * 2) / 1e6
    kept = (prompt * 0.5 + entry["completion_tokens"]["total"] * 2) / 1e6
    assert doc["cost"]["wasted"] == round(thrown, 4)
    assert doc["cost"]["so_far"] == round(kept + thrown, 4)
    text = cli("status", "--db", db_url, "--price-input", "0.5", "--price-output", "2").stdout
    assert f"cost: ${doc['cost']['so_far']:,.2f} so far" in text

    plan = cli("plan", "--db", db_url, "--gpu-hour-cost", "4", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["cost"]["to_go"] == round(4 * planned["total"]["duration_seconds"] / 3600, 4)


def test_bad_prices_are_refused_by_name(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    enqueue(tmp_path, db_url, 3, "--max-tokens", "10")
    for args, said in [
        (("--gpu-hour-cost", "-1"), "--gpu-hour-cost': must be at least 0, got -1"),
        (("--price-input", "nan"), "--price-input': must be a finite number, got nan"),
        (("--price-output", "cheap"), "--price-output': must be a number, got cheap"),
    ]:
        for command in ("status", "plan"):
            result = cli(command, "--db", db_url, *args)
            assert result.returncode == 2 and said in result.stderr, (command, result.stderr)
    servers = tmp_path / "servers.txt"
    servers.write_text("http://gpu-1:30000\nhttp://gpu-2:30000  price_output=-3\n")
    result = cli("status", "--db", db_url, "--servers-file", str(servers))
    assert result.returncode == 2
    assert f"{servers}:2: price_output: must be at least 0, got -3" in result.stderr
    run = tmp_path / "run.toml"
    data = write_jsonl(tmp_path / "p.jsonl", prompts(3))
    run.write_text(
        f'[prices]\ngpu_hour_cost = "2"\n\n[[dataset]]\nname = "x"\nfile = "{data}"\n'
        "max_tokens = 10\n"
    )
    result = cli("plan", "--config", str(run), "--db", db_url)
    assert result.returncode == 2
    assert 'prices.gpu_hour_cost: must be a number, got a string ("2")' in result.stderr


def test_a_stop_counts_what_the_cut_streams_said(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Streams asked for usage in every chunk (``run --stream-usage``): a request cut
    by a stop counts the tokens its chunks had said, at most what the server had sent it
    before the client left."""
    server = sim_process("--mean-tokens", "400", "--per-token", "0.02")
    enqueue(tmp_path, db_url, 12, "--max-tokens", "4000")
    streaming = ("--stream", "--stream-usage")
    worker = start_worker(db_url, server.url, "--concurrency", "4", "--grace", "0", *streaming)
    wait_for(lambda: sim_stats(server)["running"] == 4, "four requests in flight")
    time.sleep(1.5)  # well into their streams, far from their ends
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    wait_for(lambda: sim_stats(server)["running"] == 0, "the cut streams to end")
    stats = sim_stats(server)
    (requests, tokens, unknown), *_ = wasted(db_url).values()
    assert set(wasted(db_url)) == {"stopped"}
    assert (requests, unknown) == (4, 0) == (stats["aborted"], 0)
    assert 0 < tokens <= stats["aborted_tokens"]
    run_to_end(db_url, server.url, "--concurrency", "12", *streaming)
    assert sim_stats(server)["generation_tokens"] == stored(db_url)
    check_shown(db_url, wasted(db_url))
