"""``run --batch-api``: a provider's Batch API through the real command, against the
simulated provider, which counts on its side every request submitted and billed.

The oracle: the simulator's answers are a function of the request, so a batch run's
export must equal, byte for byte, an online run's of the same prompts; and the provider's
count of requests submitted must equal the number of prompts (never one twice), whatever
happened to the worker in between.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import (
    Heard,
    SimProcess,
    check_export,
    cli,
    dialogue,
    done_count,
    enqueue_prompts,
    query,
    start_worker,
    wait_for,
    write_jsonl,
)

FAST = ("--batch-delay", "0.6")
RUN = ("--exit-when-done", "--batch-api", "--batch-poll", "0.2")


def _batch_stats(server: SimProcess) -> dict[str, int]:
    return server.stats()["batch_api"]


def _online_export(tmp_path: Path, server: SimProcess, n: int) -> bytes:
    """The export of an online run of the same ``n`` prompts."""
    db = tmp_path / "online.db"
    enqueue_prompts(db, tmp_path / "online.jsonl", n)
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "online.out.jsonl"
    check_export(db, out, [f"p{i:06d}" for i in range(n)])
    return out.read_bytes()


def _batch_export(db: Path, tmp_path: Path, n: int) -> bytes:
    out = tmp_path / "batch.out.jsonl"
    check_export(db, out, [f"p{i:06d}" for i in range(n)])
    return out.read_bytes()


def test_a_batch_run_exports_what_an_online_run_does(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process(*FAST)
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 120)
    result = cli("run", "--server", server.url, "--db", str(db), *RUN, "--batch-requests", "50")
    assert result.returncode == 0, result.stderr
    stats = _batch_stats(server)
    assert stats["requests_submitted"] == 120 and stats["duplicate_requests"] == 0
    batches = query(db, "SELECT requests, state FROM batches ORDER BY id")
    assert all(requests <= 50 and state == "closed" for requests, state in batches), batches
    assert sum(requests for requests, _ in batches) == 120
    status = json.loads(cli("status", "--json", "--db", str(db)).stdout)
    assert status["batches"]["by_state"] == {"closed": {"batches": len(batches), "requests": 120}}
    assert status["batches"]["live"] == []
    assert f"closed {len(batches)} (120 requests)" in cli("status", "--db", str(db)).stdout
    shown = json.loads(cli("inspect", "--id", "p000005", "--json", "--db", str(db)).stdout)
    (line,) = shown["batches"]
    assert line["state"] == "closed" and line["settled"] and line["provider_id"]
    wide = cli("inspect", "--id", "p000005", "--db", str(db), env={"COLUMNS": "200"}).stdout
    assert f"in batch {line['provider_id']} (turn 0): completed, answer written" in wide
    assert _batch_export(db, tmp_path, 120) == _online_export(tmp_path, server, 120)


def test_sigkilled_ten_times_it_never_pays_twice(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The worker SIGKILLed ten times, at each step in turn (a batch packed and written
    down, its file uploaded, created, polled, collected) and at random moments: each
    restart adopts the live batches; in the end every prompt was submitted once, none
    lost, and the export is the online run's."""
    n = 400
    server = sim_process("--batch-delay", "1.5")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", n)
    rng = random.Random(20261207)
    extra = (*RUN, "--batch-requests", "40", "--lease-seconds", "2")
    steps = ["worker_started", "batch_created", "batch_collected", "batch_closed", None]
    for kill in range(10):
        worker = start_worker(db, server.url, *extra)
        heard = Heard(worker)
        step = steps[kill % len(steps)]
        with contextlib.suppress(AssertionError):  # the run may end first
            heard.wait_for(step or "worker_started", deadline=60)
        time.sleep(rng.uniform(0.0, 0.3) if step else rng.uniform(0.5, 3.0))
        worker.send_signal(signal.SIGKILL)
        heard.text()
    result = cli("run", "--server", server.url, "--db", str(db), *extra)
    assert result.returncode == 0, result.stderr
    assert done_count(db) == n
    stats = _batch_stats(server)
    assert stats["duplicate_requests"] == 0, stats
    assert stats["requests_answered"] == n, stats
    adopted = query(db, "SELECT count(*) FROM batches WHERE worker IS NOT NULL")[0][0]
    assert adopted >= 10
    assert _batch_export(db, tmp_path, n) == _online_export(tmp_path, server, n)


def test_an_expired_batch_keeps_its_answers_and_asks_the_rest_again(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A provider that answers part of a batch within its window: the answers are kept,
    the rest asked again (attempts given back). Then the provider gets its act together
    (restarted on the same port with a long window) and the run ends: every prompt was
    answered once, across both."""
    slow = sim_process("--batch-delay", "2", "--batch-window", "1.3")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 40)
    worker = start_worker(db, slow.url, *RUN)
    wait_for(lambda: done_count(db) > 0, "answers of an expired batch written")
    wait_for(
        lambda: query(db, "SELECT count(*) FROM batches WHERE status = 'expired'")[0][0] >= 2,
        "two expired batches",
    )
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=120)
    first = _batch_stats(slow)
    slow.stop()
    assert first["duplicate_requests"] == 0, first
    assert 0 < first["requests_answered"] < 40
    assert done_count(db) == first["requests_answered"]
    # Released, not retried: none is past its first attempt, none failed.
    assert query(db, "SELECT max(attempts), count(*) FROM items WHERE state != 'done'")[0][0] <= 1
    good = sim_process(*FAST, port=slow.port)
    result = cli("run", "--server", good.url, "--db", str(db), *RUN)
    assert result.returncode == 0, result.stderr
    assert done_count(db) == 40
    assert first["requests_answered"] + _batch_stats(good)["requests_answered"] == 40


def test_a_cancelled_batch_sends_its_unanswered_lines_back(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A batch cancelled on the provider's side (by a person, say) while the run
    waits: what it answered is kept, the rest asked again."""
    server = sim_process("--batch-delay", "10")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 30)
    worker = start_worker(db, server.url, *RUN)
    provider_id = wait_for(
        lambda: query(db, "SELECT provider_id FROM batches WHERE requests > 1 AND provider_id "
                      "IS NOT NULL"),
        "a batch created",
    )[0][0]  # fmt: skip
    time.sleep(1.0)
    live = json.loads(cli("status", "--json", "--db", str(db)).stdout)["batches"]["live"]
    shown = next(b for b in live if b["provider_id"] == provider_id)
    assert shown["status"] in ("validating", "in_progress") and shown["window_left_s"] > 80000

    req = urllib.request.Request(f"{server.url}/v1/batches/{provider_id}/cancel", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["status"] in ("cancelling", "cancelled")
    worker.communicate(timeout=120)
    assert worker.returncode == 0
    assert done_count(db) == 30
    stats = _batch_stats(server)
    assert stats["requests_answered"] == 30 and stats["duplicate_requests"] == 0, stats


def test_a_request_the_provider_refuses_fails_that_item_alone(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process(*FAST, "--max-model-len", "200")
    db = tmp_path / "q.db"
    rows = [
        {"id": f"p{i:06d}", "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(20)
    ]
    rows[7]["messages"][0]["content"] = "long " * 400
    write_jsonl(tmp_path / "in.jsonl", rows)
    assert cli("enqueue", str(tmp_path / "in.jsonl"), "-d", "d", "--db", str(db),
               "--max-tokens", "16").returncode == 0  # fmt: skip
    result = cli("run", "--server", server.url, "--db", str(db), *RUN)
    assert result.returncode == 6, result.stderr  # finished, one item failed
    failed = query(db, "SELECT key, error_class FROM items WHERE state = 'failed'")
    assert failed == [("p000007", "context_overflow")]
    assert done_count(db) == 19


def test_without_the_batch_api_the_run_says_so_and_takes_nothing(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--no-batch-api")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 5)
    result = cli("run", "--server", server.url, "--db", str(db), *RUN)
    assert result.returncode == 2, result.stderr
    assert "does not offer the Batch API" in result.stderr and "--batch-api" in result.stderr
    assert query(db, "SELECT state, count(*) FROM items GROUP BY state") == [("pending", 5)]


@pytest.mark.parametrize(
    ("fault", "event", "words"),
    [
        ("truncated_output", "batch_file_cut", "unreadable"),
        ("missing_output", "batch_output_unreadable", "problems"),
        ("lost_batch", "batch_abandoned", "no longer at"),
    ],
)
def test_output_files_missing_or_cut_and_a_lost_batch(
    tmp_path: Path,
    sim_process: Callable[..., SimProcess],
    fault: str,
    event: str,
    words: str,
) -> None:
    """A cut output file (read again, then its whole lines kept), a missing one, a lost
    batch: each is named with its batch, and the requests it did not answer are asked
    again. Nothing lost; only what the provider lost is paid again."""
    server = sim_process(*FAST, "--batch-fault", fault)
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 30)
    result = cli(
        "--log-json", "run", "--server", server.url, "--db", str(db), *RUN,
        "--batch-requests", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert done_count(db) == 30
    said = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    named = [e for e in said if e["event"] == event]
    assert len(named) == 1 and named[0]["batch"].startswith("orch-"), named
    assert words in json.dumps(named[0])
    stats = _batch_stats(server)
    struck = query(db, "SELECT requests FROM batches WHERE key = ?", named[0]["batch"])[0][0]
    paid_again = 1 if fault == "truncated_output" else struck
    assert stats["duplicate_requests"] == paid_again, stats
    assert _batch_export(db, tmp_path, 30) == _online_export(tmp_path, server, 30)


def test_servers_file_batch_api_per_server(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process(*FAST)
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 10)
    servers = tmp_path / "servers.txt"
    servers.write_text(f"{server.url} batch_api=maybe\n")
    result = cli("run", "--servers-file", str(servers), "--db", str(db), "--exit-when-done")
    assert result.returncode == 2 and "batch_api='maybe': expected yes or no" in result.stderr
    servers.write_text(f"{server.url} batch_api=yes\n")
    result = cli("run", "--servers-file", str(servers), "--db", str(db), "--exit-when-done",
                 "--batch-poll", "0.2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _batch_stats(server)["requests_submitted"] == 10


async def test_the_report_shows_the_batches(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The dashboard's page (here as ``report``'s static file) shows the batches by
    state, and each live one; none live once the run is over."""
    from tests.browser import Browser

    server = sim_process(*FAST)
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 12)
    result = cli("run", "--server", server.url, "--db", str(db), *RUN)
    assert result.returncode == 0, result.stderr
    made = query(db, "SELECT count(*) FROM batches")[0][0]
    out = tmp_path / "report.html"
    assert cli("report", str(out), "--db", str(db)).returncode == 0
    async with Browser() as browser:
        await browser.open(out.as_uri())
        await browser.wait_for("!document.querySelector('#batches').hidden")
        said = await browser.evaluate("document.querySelector('#batch-states').textContent")
        rows = await browser.evaluate("document.querySelector('#batches tbody').textContent")
        assert browser.errors == []
    assert said == f"closed {made} (12 requests)"
    assert rows == "no live batch"


def test_batches_past_the_providers_token_limit_wait_and_go_again(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The provider refuses a batch whose tokens, with the live batches', pass its limit
    (``token_limit_exceeded``): its requests go back, attempts given back, and go in a
    later batch once the live ones ended; nothing paid twice."""
    server = sim_process("--batch-delay", "1", "--batch-token-limit", "30")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 40)
    result = cli("run", "--server", server.url, "--db", str(db), *RUN, "--batch-requests", "10")
    assert result.returncode == 0, result.stderr
    assert done_count(db) == 40
    refused = query(db, "SELECT count(*) FROM batches WHERE status = 'failed'")[0][0]
    assert refused >= 1
    stats = _batch_stats(server)
    assert stats["requests_answered"] == 40 and stats["duplicate_requests"] == 0, stats
    assert query(db, "SELECT max(attempts) FROM items")[0][0] == 1


def test_a_batch_runs_cost_is_the_providers_bill_and_its_budget_holds(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The cost ``status`` shows of a batch run, at the batch discount, equals the
    provider's bill to the cent, SIGKILLs and all; and ``--budget`` stops a batch run
    within a claim of its budget, exit 9, the rest left pending."""
    prices = ["--price-input=3", "--price-cached-input=0.3", "--price-output=15"]
    server = sim_process(*FAST, "--mean-tokens", "40", *prices, "--batch-discount=0.5")
    db = tmp_path / "q.db"
    enqueue_prompts(db, tmp_path / "in.jsonl", 60)
    worker = start_worker(db, server.url, *RUN, "--batch-requests", "20", "--lease-seconds", "2")
    wait_for(lambda: done_count(db) > 0, "answers written")
    worker.send_signal(signal.SIGKILL)
    worker.communicate()
    result = cli("run", "--server", server.url, "--db", str(db), *RUN, "--lease-seconds", "2")
    assert result.returncode == 0, result.stderr
    with urllib.request.urlopen(server.url + "/sim/bill", timeout=10) as resp:
        bill = json.loads(resp.read())
    assert bill["online"]["requests"] == 0 and bill["batch"]["requests"] == 60
    status = json.loads(
        cli("status", "--json", "--db", str(db), *prices, "--batch-discount=0.5").stdout
    )
    assert round(status["cost"]["so_far"], 2) == round(bill["usd"], 2) > 0
    # A budget: a fresh dataset, a third of what it would cost.
    enqueue_prompts(db, tmp_path / "more.jsonl", 60, dataset="more", prefix="m")
    budget = round(bill["usd"] / 3, 6)
    result = cli(
        "run", "--server", server.url, "--db", str(db), *RUN, "--batch-requests", "5",
        "--dataset", "more", "--budget", str(budget), *prices, "--batch-discount=0.5",
    )  # fmt: skip
    assert result.returncode == 9, result.stderr
    left = query(db, "SELECT count(*) FROM items WHERE state = 'pending' AND key LIKE 'm%'")
    assert 0 < left[0][0] < 60
    status = json.loads(
        cli("status", "--json", "--db", str(db), *prices, "--batch-discount=0.5").stdout
    )
    spent = status["cost"]["datasets"]["more"]["so_far"]
    per_item = spent / (60 - left[0][0])
    assert spent <= budget + 2 * 10 * per_item  # within a claim (a batch server's cap: 10)


def test_conversations_and_samples_go_through_batches_as_online(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Every assistant turn regenerated (each next turn in a later batch) and several
    samples of a prompt asked with ``n``: the export is the online run's."""
    server = sim_process(*FAST)
    rows = [
        {"id": f"c{i:03d}", "messages": dialogue(f"hi {i}", "a", f"and then {i}?", "b")}
        for i in range(8)
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    exports = []
    for name, extra in (("online", ()), ("batch", ("--batch-api", "--batch-poll", "0.2"))):
        db = tmp_path / f"{name}.db"
        for dataset, more in (("talk", ("--regenerate", "all")), ("draws", ("--samples", "3"))):
            result = cli("enqueue", str(tmp_path / "in.jsonl"), "-d", dataset, "--db", str(db),
                         "--max-tokens", "12", *more)  # fmt: skip
            assert result.returncode == 0, result.stderr
        result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done", *extra)
        assert result.returncode == 0, result.stderr
        out = tmp_path / f"{name}.jsonl"
        assert cli("export", str(out), "--db", str(db)).returncode == 0
        exports.append(out.read_bytes())
    assert exports[0] == exports[1]
    batch_db = tmp_path / "batch.db"
    # A second turn is asked only once the first is written: in a later batch.
    turns = query(batch_db, "SELECT e.item_id, max(b.id) > min(b.id) FROM batch_entries e"
                  " JOIN batches b ON b.id = e.batch_id JOIN items i ON i.id = e.item_id"
                  " JOIN datasets d ON d.id = i.dataset_id WHERE d.name = 'talk'"
                  " GROUP BY e.item_id")  # fmt: skip
    assert len(turns) == 8 and all(later for _, later in turns)
    assert len(exports[0].splitlines()) == 8 + 24
