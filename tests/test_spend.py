"""What a run costs, exactly: the ledger of what the providers billed (``store.spend``),
the status cost read from it, and ``run --budget``.

Against the simulated server, run by the real command: the ledger's sums are the tokens
the simulator answered (kept or thrown away), the status cost is the provider's bill to
the cent, and a budget stops the run within one claim of it, its items left pending.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import NEEDS_A_PERSON, BudgetSpent
from orchestrator.items.answer import Answer
from orchestrator.items.samples import as_choice
from orchestrator.monitor.dashboard import SqliteSource, make_app
from orchestrator.settings.prices import KEPT, Prices, budget_room, run_prices, status_cost
from orchestrator.store.spend import Bill, bill_of, tally
from tests.helpers import SimProcess, cli, dialogue, kill_worker_after, query, write_jsonl

PRICES = {"price_input": 3.0, "price_cached_input": 0.3, "price_output": 15.0}
OPTIONS = [f"--{k.replace('_', '-')}={v}" for k, v in PRICES.items()]
LEDGER = (
    "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0),"
    " coalesce(sum(cached_tokens), 0), coalesce(sum(completion_tokens), 0) FROM spend"
)


def _enqueue(tmp_path: Path, db: str, rows: list[dict[str, Any]], *extra: str) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    result = cli("enqueue", str(data), "-d", "d", "--db", db, *extra)
    assert result.returncode == 0, result.stderr


def _prompts(n: int, shared: str = "") -> list[dict[str, Any]]:
    """``n`` prompts; with ``shared``, each starts with it (a prefix cache's hits)."""
    return [
        {"id": f"k{i}", "messages": [{"role": "user", "content": f"{shared}question {i} " * 3}]}
        for i in range(n)
    ]


def _status(db: str, *extra: str) -> dict[str, Any]:
    result = cli("status", "--json", "--db", db, *OPTIONS, *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _ledger(db: str) -> tuple[int, int, int, int]:
    return tuple(int(v) for v in query(db, LEDGER)[0])  # type: ignore[return-value]


def _bill(prompt: int, cached: int, completion: int) -> float:
    """What the provider bills for these tokens at ``PRICES``, online."""
    return (
        (prompt - cached) * PRICES["price_input"]
        + cached * PRICES["price_cached_input"]
        + completion * PRICES["price_output"]
    ) / 1e6


def _stored_cached(db: str) -> int:
    return int(query(db, "SELECT coalesce(sum(cached_tokens), 0) FROM outputs")[0][0])


# ------------------------------------------------------------------ the arithmetic

tokens = st.integers(0, 10**6)
bills = st.builds(
    Bill,
    st.sampled_from(["http://a", "http://b"]),
    st.sampled_from(["m1", "m2"]),
    st.booleans(),
    st.integers(0, 1),
    tokens,
    tokens,
    tokens,
)
price = st.none() | st.floats(0, 100, allow_nan=False)


@given(st.lists(st.tuples(st.integers(1, 3), st.sampled_from([KEPT, "truncated"]), bills)))
def test_tally_sums_each_key_once_in_key_order(entries: list[tuple[int, str, Bill]]) -> None:
    rows = tally(entries)
    keys = [(r.dataset_id, r.kind, r.server, r.model, r.batched) for r in rows]
    assert keys == sorted(set(keys))
    for r in rows:
        mine = [
            b
            for d, k, b in entries
            if (d, k, b.server, b.model, b.batched)
            == (r.dataset_id, r.kind, r.server, r.model, r.batched)
        ]
        assert r.requests == sum(b.requests for b in mine)
        assert r.prompt_tokens == sum(b.prompt for b in mine)
        assert r.cached_tokens == sum(b.cached for b in mine)
        assert r.completion_tokens == sum(b.completion for b in mine)


@settings(max_examples=200)
@given(
    st.builds(Prices, price, price, price, price, st.none() | st.floats(0, 1)),
    tokens,
    tokens,
    tokens,
    st.booleans(),
)
def test_a_bill_is_the_providers_formula(
    prices: Prices, prompt: int, cached: int, completion: int, batched: bool
) -> None:
    cached = min(cached, prompt)
    usd = prices.billed(prompt, cached, completion, batched)
    if not prices.by_token:
        assert usd == 0.0
        return
    cached_price = (
        prices.price_cached_input
        if prices.price_cached_input is not None
        else prices.price_input or 0.0
    )
    want = (
        (prompt - cached) * (prices.price_input or 0.0)
        + cached * cached_price
        + completion * (prices.price_output or 0.0)
    ) / 1e6
    discount = 0.5 if prices.batch_discount is None else prices.batch_discount
    if batched:
        want *= 1 - discount
    assert math.isclose(usd, want, rel_tol=1e-9, abs_tol=1e-12)


@given(st.integers(1, 8), st.integers(0, 500), st.integers(0, 500), st.integers(0, 300))
def test_n_choices_bill_the_request_and_its_prompt_once(
    n: int, prompt: int, cached: int, completion: int
) -> None:
    cached = min(cached, prompt)
    usage = {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
    answers = [
        Answer({}, "", None, "stop", as_choice(usage, c, n), 0.1, "http://s", "m", None)
        for c in range(n)
    ]
    found = [bill_of(a) for a in answers]
    assert all(b is not None for b in found)
    assert sum(b.requests for b in found if b) == 1
    assert sum(b.prompt for b in found if b) == prompt
    assert sum(b.cached for b in found if b) == cached
    assert sum(b.completion for b in found if b) == n * completion
    batched = bill_of(Answer({}, "", None, "stop", usage, 0.1, "s", "m", None, batch="b1"))
    assert batched is not None and batched.batched


@given(
    st.floats(0.01, 100),
    st.floats(0, 100),
    st.none() | st.floats(0.0001, 10),
    st.integers(0, 50),
    st.integers(0, 100),
)
def test_a_claim_under_a_budget_never_passes_it(
    limit: float, spent: float, per: float | None, running: int, want: int
) -> None:
    room = budget_room(limit, spent, per, running, want)
    assert 0 <= room <= want
    if per is None:
        assert room == (want if running == 0 and spent < limit else 0)
    else:
        assert spent + (running + room) * per <= limit + 1e-6 or room == 0
        if room < want:  # one more would pass it
            assert spent + (running + room + 1) * per > limit - 1e-6


def test_status_cost_is_the_ledger_priced_by_server() -> None:
    """Each row at its own server's prices, batched at its discount, waste by cause; to
    go is the items left at the dataset's billed cost per item done."""
    rows = [
        {"server": "http://a", "model": "m", "batched": False, "kind": KEPT}
        | {"requests": 10, "prompt_tokens": 1000, "cached_tokens": 400, "completion_tokens": 500},
        {"server": "http://b", "model": "m", "batched": True, "kind": KEPT}
        | {"requests": 5, "prompt_tokens": 500, "cached_tokens": 0, "completion_tokens": 250},
        {"server": "http://a", "model": "m", "batched": False, "kind": "truncated"}
        | {"requests": 2, "prompt_tokens": 200, "cached_tokens": 0, "completion_tokens": 100},
    ]
    counts = {"pending": 15, "running": 0, "done": 15, "failed": 0, "total": 30}
    snap = {
        "totals": {"counts": counts, "overall": {"elapsed_s": 10}},
        "datasets": [{"name": "d", "counts": counts, "billed": rows}],
    }
    own = {"http://user:pw@a/": Prices(None, 2.0, 8.0, 0.5), "http://b": Prices(None, 4.0, 16.0)}
    prices = run_prices(Prices(None, 1.0, 1.0), own)
    cost = status_cost(snap, prices)
    assert cost is not None
    a_kept = (600 * 2.0 + 400 * 0.5 + 500 * 8.0) / 1e6
    b_kept = (500 * 4.0 + 250 * 16.0) / 1e6 * 0.5
    a_lost = (200 * 2.0 + 100 * 8.0) / 1e6
    spent = a_kept + b_kept + a_lost
    assert cost["so_far"] == round(spent, 4)
    assert cost["wasted"] == round(a_lost, 4)
    assert cost["wasted_by_cause"] == {"truncated": round(a_lost, 4)}
    assert cost["to_go"] == round(spent / 15 * 15, 4)
    assert cost["datasets"]["d"]["so_far"] == round(spent, 4)
    assert cost["billed"] == {
        "requests": 17,
        "prompt_tokens": 1700,
        "cached_tokens": 400,
        "completion_tokens": 850,
    }


def test_the_budget_exit_code_is_its_own_and_needs_a_person() -> None:
    codes = [c.exit_code for c in BudgetSpent.__mro__ if hasattr(c, "exit_code")]
    assert BudgetSpent.exit_code == 9 and BudgetSpent.exit_code in NEEDS_A_PERSON
    assert codes[0] == 9


# ------------------------------------------------------------------ against the simulator


def test_ledger_is_what_the_simulator_answered_with_waste(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Truncated answers sampled again (thrown away) are billed as well as those kept:
    the ledger's prompt and completion tokens are the simulator's, and status prices
    them as the provider's bill, to the cent."""
    server = sim_process("--mean-tokens", "24", "--seed", "3")
    _enqueue(tmp_path, db_url, _prompts(40), "--max-tokens", "30", "--on-truncated", "retry")
    result = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done",
        "--max-attempts", "3", "--retry-backoff", "0.01",
    )  # fmt: skip
    assert result.returncode in (0, 6), result.stderr
    stats = server.stats()
    requests, prompt, cached, completion = _ledger(db_url)
    assert requests == stats["completed"]
    assert (prompt, completion) == (stats["prompt_tokens"], stats["generation_tokens"])
    assert cached == 0
    kinds = {k for (k,) in query(db_url, "SELECT DISTINCT kind FROM spend")}
    assert kinds == {KEPT, "truncated"}
    doc = _status(db_url)
    bill = _bill(stats["prompt_tokens"], 0, stats["generation_tokens"])
    assert abs(doc["cost"]["so_far"] - bill) < 0.005  # to the cent
    lost = query(db_url, "SELECT prompt_tokens, completion_tokens FROM spend WHERE kind != 'kept'")
    thrown = sum(_bill(int(p), 0, int(c)) for p, c in lost)
    assert thrown > 0
    assert abs(doc["cost"]["wasted_by_cause"]["truncated"] - thrown) < 0.005
    assert doc["cost"]["datasets"]["d"]["so_far"] == doc["cost"]["so_far"]
    text = cli("status", "--db", db_url, *OPTIONS).stdout
    assert f"${doc['cost']['so_far']:,.2f} so far" in text
    _check_report_and_card(tmp_path, db_url, doc)


def _check_report_and_card(tmp_path: Path, db: str, doc: dict[str, Any]) -> None:
    """The report embeds the status's cost; the dataset card says the tokens billed."""
    out = tmp_path / "report.html"
    result = cli("report", str(out), "--db", db, *OPTIONS)
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    embedded = html.split('<script id="embedded" type="application/json">', 1)[1]
    data = json.loads(embedded.split("</script>", 1)[0])
    assert data["status"]["cost"]["so_far"] == doc["cost"]["so_far"]
    assert data["status"]["cost"]["datasets"] == doc["cost"]["datasets"]
    card = tmp_path / "README.md"
    result = cli("export", str(tmp_path / "out.jsonl"), "--db", db, "--card", str(card))
    assert result.returncode == 0, result.stderr
    kept = query(
        db, "SELECT requests, prompt_tokens, completion_tokens FROM spend WHERE kind = 'kept'"
    )
    requests, prompt, completion = (sum(int(r[i]) for r in kept) for i in range(3))
    text = card.read_text()
    assert (
        f"| billed for answers kept | {requests:,} requests: {prompt:,} prompt tokens "
        f"(0 cached), {completion:,} completion tokens |"
    ) in text


def test_status_cost_is_the_provider_bill_with_cached_tokens(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Prompts that share a long start hit the simulator's prefix cache: the cached
    tokens are billed at the cached price, and status says the provider's bill."""
    server = sim_process("--mean-tokens", "12", "--prefix-cache", "100000", "--seed", "4")
    shared = "You are a careful assistant who answers in one short line. " * 8
    _enqueue(tmp_path, db_url, _prompts(30, shared), "--max-tokens", "64")
    result = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done", "--concurrency", "4"
    )
    assert result.returncode == 0, result.stderr
    stats = server.stats()
    requests, prompt, cached, completion = _ledger(db_url)
    assert requests == stats["completed"] == 30
    assert (prompt, completion) == (stats["prompt_tokens"], stats["generation_tokens"])
    assert cached == _stored_cached(db_url) > 0
    doc = _status(db_url)
    assert doc["cost"]["billed"]["cached_tokens"] == cached
    bill = provider_bill(stats, cached)
    assert round(doc["cost"]["so_far"], 2) == round(bill, 2)
    assert doc["cost"]["to_go"] == 0.0


def provider_bill(stats: dict[str, Any], cached: int) -> float:
    """The provider's bill recomputed from the simulator's counters (and the cached
    tokens it reported), until the simulator says its own (``/sim/bill``)."""
    return _bill(stats["prompt_tokens"], cached, stats["generation_tokens"])


def _sim_bill(url: str) -> dict[str, Any] | None:
    """The simulator's own bill, None where it has no ``/sim/bill`` yet."""
    try:
        with urllib.request.urlopen(url + "/sim/bill", timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _bill_endpoint_answers() -> bool:
    proc = SimProcess()
    try:
        return _sim_bill(proc.start()) is not None
    finally:
        proc.stop()


@pytest.mark.skipif(not _bill_endpoint_answers(), reason="the simulator has no /sim/bill yet")
def test_status_cost_equals_the_simulators_bill(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Once the simulator bills (``GET /sim/bill``), status says its total to the cent,
    waste and cached tokens included."""
    prices = [f"--{k.replace('_', '-')}={v}" for k, v in PRICES.items()]
    server = sim_process(
        "--mean-tokens", "24", "--prefix-cache", "100000", "--seed", "3",
        *prices, "--batch-discount=0.5",
    )  # fmt: skip
    shared = "You are a careful assistant who answers in one short line. " * 8
    rows = _prompts(30, shared)
    _enqueue(tmp_path, db_url, rows, "--max-tokens", "30", "--on-truncated", "retry")
    result = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done",
        "--max-attempts", "3", "--retry-backoff", "0.01",
    )  # fmt: skip
    assert result.returncode in (0, 6), result.stderr
    bill = _sim_bill(server.url)
    assert bill is not None
    requests, prompt, cached, completion = _ledger(db_url)
    assert requests == bill["online"]["requests"] + bill["batch"]["requests"]
    assert prompt == bill["online"]["prompt_tokens"] + bill["batch"]["prompt_tokens"]
    assert cached == bill["online"]["cached_tokens"] + bill["batch"]["cached_tokens"]
    assert completion == bill["online"]["completion_tokens"] + bill["batch"]["completion_tokens"]
    assert round(_status(db_url)["cost"]["so_far"], 2) == round(bill["usd"], 2)


def test_run_stops_within_one_claim_of_its_budget(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """``run --budget``: it stops claiming before the spend would pass the budget, lets
    what is in flight be written, and exits 9 saying what was spent and how to go on;
    the items not claimed stay pending, and a higher budget goes on with them."""
    server = sim_process("--mean-tokens", "200", "--seed", "7")
    _enqueue(tmp_path, db_url, _prompts(120), "--max-tokens", "400")
    concurrency = 4
    budget = 0.05
    prices = ["--price-input=5", "--price-output=25"]
    result = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done",
        "--concurrency", str(concurrency), "--budget", str(budget), *prices,
    )  # fmt: skip
    assert result.returncode == BudgetSpent.exit_code, result.stderr
    assert "budget spent" in result.stderr and "--budget" in result.stderr
    assert f"${budget:,.2f} budget" in result.stderr
    doc = _status(db_url, *prices)
    spent = doc["cost"]["so_far"]
    done = doc["totals"]["counts"]["done"]
    pending = doc["totals"]["counts"]["pending"]
    assert doc["totals"]["counts"]["running"] == 0 and done + pending == 120 and pending > 0
    assert f"{pending:,} items left pending" in result.stderr
    per_item = spent / done
    # Within one claim of the budget: a claim is at most the concurrency's items.
    assert spent <= budget + 2 * concurrency * per_item  # want: concurrency + prefetch
    # And it stopped: one more item at the mean would have passed it.
    assert spent + per_item > budget
    requests, prompt, _, completion = _ledger(db_url)
    stats = server.stats()
    assert (requests, prompt, completion) == (
        stats["completed"],
        stats["prompt_tokens"],
        stats["generation_tokens"],
    )
    again = cli(
        "run", "--server", server.url, "--db", db_url, "--exit-when-done",
        "--concurrency", str(concurrency), "--budget", "100", *prices,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert _status(db_url, *prices)["totals"]["counts"]["done"] == 120


def test_a_budget_needs_a_token_price(tmp_path: Path, db_url: str) -> None:
    _enqueue(tmp_path, db_url, _prompts(2))
    result = cli("run", "--server", "http://127.0.0.1:9", "--db", db_url, "--budget", "5")
    assert result.returncode == 2
    assert "token price" in result.stderr


async def test_dashboard_serves_the_cost_per_dataset(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The dashboard's status JSON carries the same cost block as ``status --json``, and
    its page has a cost column to show it in."""
    db = str(tmp_path / "run.db")
    server = sim_process("--mean-tokens", "16", "--seed", "2")
    _enqueue(tmp_path, db, _prompts(12), "--max-tokens", "40")
    result = cli("run", "--server", server.url, "--db", db, "--exit-when-done")
    assert result.returncode == 0, result.stderr
    expected = _status(db)["cost"]
    source = SqliteSource(db)
    source.check()
    prices = run_prices(Prices(**PRICES))
    runner = web.AppRunner(make_app(source, prices=prices))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "api/status") as resp:
                served = (await resp.json())["cost"]
            async with http.get(url) as resp:
                page = await resp.text()
    finally:
        await runner.cleanup()
        await source.close()
    assert served["so_far"] == expected["so_far"] > 0
    assert served["datasets"] == expected["datasets"]
    assert 'data-field="cost"' in page and 'id="total-cost"' in page


@pytest.mark.parametrize("shape", ["turns", "samples"])
def test_every_request_is_billed_once(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess], shape: str
) -> None:
    """A conversation regenerated turn by turn bills each turn's request as it is kept;
    samples asked with ``n`` bill their request and its prompt once, each choice its own
    completion tokens: the ledger is the simulator's requests and tokens either way."""
    server = sim_process("--mean-tokens", "20", "--seed", "9")
    if shape == "turns":
        rows = [
            {"id": f"c{i}", "messages": dialogue(f"hello {i}", "hi", f"and then {i}", "ok")}
            for i in range(10)
        ]
        _enqueue(tmp_path, db_url, rows, "--regenerate", "all", "--max-tokens", "64")
    else:
        _enqueue(tmp_path, db_url, _prompts(10), "--samples", "4", "--max-tokens", "64")
    result = cli("run", "--server", server.url, "--db", db_url, "--exit-when-done")
    assert result.returncode == 0, result.stderr
    stats = server.stats()
    requests, prompt, _, completion = _ledger(db_url)
    assert requests == stats["chat_requests"] == (20 if shape == "turns" else 10)
    assert (prompt, completion) == (stats["prompt_tokens"], stats["generation_tokens"])
    if shape == "samples":
        stored = query(db_url, "SELECT coalesce(sum(completion_tokens), 0) FROM outputs")
        assert completion == int(stored[0][0])


def test_a_sigkill_neither_loses_nor_doubles_a_bill(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """A worker killed mid-run and a second one that finishes: every answer kept is
    billed once, in the transaction that wrote it; the requests the kill cut are not
    billed (no usage came back to bill from)."""
    server = sim_process("--mean-tokens", "30", "--latency", "0.05", "--seed", "6")
    _enqueue(tmp_path, db_url, _prompts(80), "--max-tokens", "64")
    kill_worker_after(db_url, server.url, 20, "--concurrency", "8")
    result = cli("run", "--server", server.url, "--db", db_url, "--exit-when-done")
    assert result.returncode == 0, result.stderr
    kept = query(
        db_url,
        "SELECT sum(requests), sum(prompt_tokens), sum(completion_tokens) FROM spend"
        " WHERE kind = 'kept'",
    )[0]
    stored = query(
        db_url, "SELECT count(*), sum(prompt_tokens), sum(completion_tokens) FROM outputs"
    )[0]
    assert tuple(int(v) for v in kept) == tuple(int(v) for v in stored)
    assert int(stored[0]) == 80
