"""Prompts that overflow the server's context, through the real commands and worker
subprocesses against the simulated server (vLLM's refusal, ``--max-model-len``): with
``--on-overflow fit`` each is asked again at once with ``max_tokens`` lowered, flagged,
costing no attempt; a prompt longer than the context alone fails, its numbers said; the
default fails with its own class. The oracle is the arithmetic of the sim's limit: its
prompt tokens are the prompt's words."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from orchestrator.sim import answer_matches
from tests.helpers import SimProcess, cli, query, start_worker, write_jsonl
from tests.test_launch import SIM

LIMIT, MAX_TOKENS = 120, 80


def rows(prefix: str, lengths: list[int]) -> list[dict[str, Any]]:
    """One prompt per length, of that many words (the sim's prompt tokens)."""
    return [
        {
            "id": f"{prefix}{i:04d}",
            "messages": [{"role": "user", "content": " ".join(f"w{i}x{j}" for j in range(n))}],
        }
        for i, n in enumerate(lengths)
    ]


def words(row: dict[str, Any]) -> int:
    return len(row["messages"][0]["content"].split())


def settled(db: str) -> int:
    return query(db, "SELECT count(*) FROM items WHERE state IN ('done', 'failed')")[0][0]


def test_fit_lowers_max_tokens_once_per_item_across_a_sigkill(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--max-model-len", str(LIMIT), "--latency", "0.02")
    # Too long alone first: ten refusals in a row must not trip the breaker.
    lengths = [LIMIT + 5 + i for i in range(10)] + [(i * 7) % (LIMIT + 10) for i in range(150)]
    fit = rows("f", [max(1, n) for n in lengths])
    strict = rows("s", [10, 60, 70, LIMIT + 1])
    common = ("--db", db_url, "--max-tokens", str(MAX_TOKENS))
    data = write_jsonl(tmp_path / "f.jsonl", fit)
    result = cli("enqueue", str(data), "-d", "fit", "--on-overflow", "fit", *common)
    assert result.returncode == 0, result.stderr
    data = write_jsonl(tmp_path / "s.jsonl", strict)
    assert cli("enqueue", str(data), "-d", "strict", *common).returncode == 0

    worker = start_worker(db_url, server.url, "--concurrency", "4")
    deadline = time.monotonic() + 60
    while settled(db_url) < 50 and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.communicate()
    assert 0 < settled(db_url) < len(fit) + len(strict), "the kill must land mid-run"
    result = cli("run", "--server", server.url, "--db", db_url, "--exit-when-done", "--stream")
    assert result.returncode == 6, result.stderr  # finished, with failed items: not halted (5)

    out = tmp_path / "out.jsonl"
    exported = cli("export", str(out), "--db", db_url, "--provenance")
    assert exported.returncode == 0, exported.stderr
    lines = {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}
    items = {k: (s, a, c, e) for k, s, a, c, e in query(
        db_url, "SELECT key, state, attempts, error_class, last_error FROM items"
    )}  # fmt: skip
    # A SIGKILL costs no attempt: a death beside a crash gives it back (store.crashes),
    # so every item's attempts are its own requests' alone.
    reduced = 0
    for row in fit + strict:
        key, prompt = row["id"], words(row)
        state, attempts, error_class, error = items[key]
        if prompt >= LIMIT or (key.startswith("s") and prompt + MAX_TOKENS > LIMIT):
            assert (state, attempts, error_class) == ("failed", 1, "context_overflow"), key
            assert f"the prompt has {prompt} tokens" in error and f"{LIMIT} tokens" in error
            continue
        line = lines[key]
        assert (state, attempts) == ("done", 1), key  # a fit costs no attempt
        assert answer_matches(row["messages"], line["messages"][-1]), key
        if prompt + MAX_TOKENS <= LIMIT:
            assert "max_tokens_reduced" not in line["flags"], key
            continue
        reduced += 1
        assert "max_tokens_reduced" in line["flags"], key
        assert line["usage"]["completion_tokens"] <= LIMIT - prompt, key
        assert line["usage"]["prompt_tokens"] == prompt
    assert reduced > 20
    assert query(db_url, "SELECT count(*) FROM outputs")[0][0] == len(lines)  # none twice
    errors = dict(query(db_url, "SELECT error_class, count(*) FROM attempt_errors GROUP BY 1"))
    assert set(errors) <= {"context_overflow", "lease_lost"}, errors
    failed = sum(1 for s, *_ in items.values() if s == "failed")
    assert errors["context_overflow"] == failed  # one attempt each, never a fit's refusal
    status = json.loads(cli("status", "--json", "--db", db_url).stdout)
    assert status["totals"]["flags"]["max_tokens_reduced"] == reduced
    assert status["totals"]["failed_by_class"] == {"context_overflow": failed}

    kept = cli("export", str(out), "--db", db_url, "--exclude-flag", "max_tokens_reduced")
    assert kept.returncode == 0
    assert len(out.read_bytes().splitlines()) == len(lines) - reduced
    requeued = cli("requeue", "--flag", "max_tokens_reduced", "--db", db_url)
    assert requeued.returncode == 0 and f"requeued {reduced} done items" in requeued.stdout


def test_max_model_len_is_read_from_v1_models(sim_process: Callable[..., SimProcess]) -> None:
    import asyncio

    import aiohttp

    from orchestrator.inference.probes import models

    server = sim_process("--max-model-len", "4096", "--model", "m")

    async def look() -> dict[str, int]:
        async with aiohttp.ClientSession() as session:
            return (await models(session, server.url, 5)).contexts

    assert asyncio.run(look()) == {"m": 4096}


def test_plan_warns_of_prompts_over_the_servers_context(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """``plan --server`` reads ``max_model_len`` from the server's ``/v1/models``."""
    server = sim_process("--max-model-len", "2000")
    short = [
        {"id": f"s{i}", "messages": [{"role": "user", "content": "hi " * 5}]} for i in range(30)
    ]
    long = [
        {"id": f"l{i}", "messages": [{"role": "user", "content": "x" * (4000 if i % 3 else 12000)}]}
        for i in range(30)
    ]  # about 1,000 tokens each, a third of them 3,000: over 2,000 with max_tokens 1,500
    write_jsonl(tmp_path / "short.jsonl", short)
    write_jsonl(tmp_path / "long.jsonl", long)
    run = tmp_path / "run.toml"
    run.write_text(
        '[defaults]\nmodel = "m"\nmax_tokens = 1500\n\n'
        '[[dataset]]\nname = "short"\nfile = "short.jsonl"\n\n'
        '[[dataset]]\nname = "long"\nfile = "long.jsonl"\n'
    )
    db = str(tmp_path / "q.db")
    result = cli("plan", "--config", str(run), "--server", server.url, "--db", db)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "dataset long: about 30 of 30 requests" in warnings[0]
    assert "context of 2,000 tokens" in warnings[0] and "10 of them" in warnings[0]
    doc = json.loads(cli("plan", "--config", str(run), "--max-model-len", "2000", "--json").stdout)
    assert doc["context"] == 2000
    assert {d["name"]: (d["overflows"], d["too_long"]) for d in doc["datasets"]} == {
        "short": (0, 0),
        "long": (30, 10),
    }
    plain = cli("plan", "--config", str(run), "--db", db)
    assert "warning:" not in plain.stdout  # no limit known: nothing to warn of
    # A server the plan launches briefly says its context too.
    launched = cli(
        "plan", "--config", str(run), "--db", db, "--launch", f"{SIM} --max-model-len 2000"
    )
    assert launched.returncode == 0, launched.stderr
    assert "warning: dataset long: about 30 of 30 requests" in launched.stdout


def test_plan_checks_the_enqueued_requests_against_the_context_without_a_run_file(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Without --config, ``plan`` reads the database's requests left: --server and
    --max-model-len warn of those that will not fit, as they do for a run file."""
    long = [
        {"id": f"l{i}", "messages": [{"role": "user", "content": "x" * (4000 if i % 3 else 12000)}]}
        for i in range(30)
    ]
    short = [{"id": f"s{i}", "messages": [{"role": "user", "content": "hi"}]} for i in range(5)]
    db = str(tmp_path / "q.db")
    for name, rows in (("long", long), ("short", short)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        made = cli("enqueue", str(path), "-d", name, "--db", db, "--model", "m",
                   "--max-tokens", "1500")  # fmt: skip
        assert made.returncode == 0, made.stderr
    doc = json.loads(cli("plan", "--db", db, "--max-model-len", "2000", "--json").stdout)
    assert doc["context"] == 2000
    assert {d["name"]: (d["overflows"], d["too_long"]) for d in doc["datasets"]} == {
        "short": (0, 0),
        "long": (30, 10),
    }
    server = sim_process("--max-model-len", "2000")
    result = cli("plan", "--db", db, "--server", server.url)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "dataset long: about 30 of 30 requests" in warnings[0]
    silent = sim_process("--model", "m")  # says no context length
    said = cli("plan", "--db", db, "--server", silent.url)
    assert said.returncode == 0 and "give --max-model-len" in said.stderr
