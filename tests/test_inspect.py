"""``orchestrator inspect`` through the real command, on SQLite and PostgreSQL: runs against
the simulated server with faults injected, then every view of their items checked against
the stored rows and the simulated server's own record (its fault counters, and the
digest every answer carries of the messages it was asked with), never by eye.

Every test also checks that ``inspect`` changed no byte of the database.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pty
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import orchestrator as orc
from orchestrator.items.conversation import targets
from orchestrator.monitor.inspection import FOLD_CHARS
from orchestrator.sim import answer_matches
from tests import oracle
from tests.helpers import (
    REPO,
    SimProcess,
    cli,
    db_snapshot,
    dialogue,
    is_postgres,
    prompts,
    query,
    start_worker,
    write_jsonl,
)

KEY = "sk-inspect-Zq9KWx7J"
MAX_TOKENS = 24
ANSI = re.compile(r"\x1b\[")
BORDERS = str.maketrans({c: " " for c in "│╭╮╰╯─"})


@pytest.fixture
def servers() -> Iterator[list[SimProcess]]:
    """Two simulated servers wanting the API key: one that fails 30 % of its requests with
    a 500, one that never fails. Both reason in a field of their own."""
    env = {"SIM_API_KEY": KEY}
    common = ("--reasoning", "field", "--mean-tokens", "40")
    started = [
        SimProcess(*common, "--error-rate", "500=0.3", "--seed", "11", env=env),
        SimProcess(*common, "--seed", "12", env=env),
    ]
    for sim in started:
        sim.start()
    yield started
    for sim in started:
        sim.stop()


def unchanged(db: str) -> str:
    """What ``inspect`` must leave as it was: every row (PostgreSQL), or the file's bytes
    and its WAL's (SQLite)."""
    digest = db_snapshot(db)
    wal = Path(f"{db}-wal")
    if not is_postgres(db) and wal.exists():
        digest += hashlib.sha256(wal.read_bytes()).hexdigest()
    return digest


def run(db: str, *urls: str, env: dict[str, str] | None = None) -> None:
    servers = [arg for url in urls for arg in ("--server", url)]
    result = cli(
        "run", *servers, "--db", db, "--exit-when-done", "--retry-backoff", "0.01",
        "--max-attempts", "30", env={"ORCHESTRATOR_API_KEY": KEY, **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def inspect_json(db: str, *args: str) -> list[dict[str, Any]]:
    result = cli("inspect", "--json", "--db", db, *args)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in result.stdout.splitlines()]


def words(text: str) -> str:
    """Text as a panel shows it, borders and wrapping left out."""
    return " ".join(text.translate(BORDERS).split())


def stored_errors(db: str, dataset: str) -> dict[str, list[tuple[Any, ...]]]:
    rows = query(
        db,
        "SELECT i.key, e.attempt, e.error_class, e.message, e.outcome, e.server"
        " FROM attempt_errors AS e JOIN items AS i ON i.id = e.item_id"
        " JOIN datasets AS d ON d.id = i.dataset_id WHERE d.name = ? ORDER BY e.id",
        dataset,
    )
    found: dict[str, list[tuple[Any, ...]]] = {}
    for key, *rest in rows:
        found.setdefault(key, []).append(tuple(rest))
    return found


def enqueue(db: str, folder: Path, dataset: str, rows: list[Any], *extra: str) -> None:
    """``rows`` written to ``<dataset>.jsonl`` in ``folder`` and enqueued into ``dataset``."""
    path = write_jsonl(folder / f"{dataset}.jsonl", rows)
    result = cli("enqueue", str(path), "--dataset", dataset, "--model", "m", "--db", db, *extra)
    assert result.returncode == 0, result.stderr


def answered(db: str, folder: Path, dataset: str, rows: list[Any], url: str, *extra: str) -> None:
    """``rows`` enqueued into ``dataset`` and answered by the server at ``url``."""
    enqueue(db, folder, dataset, rows, *extra)
    run(db, url)


def test_inspect_shows_why_items_were_retried_and_what_truncated_answers_look_like(
    db_url: str, tmp_path: Path, servers: list[SimProcess]
) -> None:
    faulty, sound = servers
    rows = prompts(40, "c")
    enqueue(db_url, tmp_path, "chat", rows, "--max-tokens", str(MAX_TOKENS), "--temperature", "0.5")
    enqueue(db_url, tmp_path, "other", rows[:3])
    run(db_url, faulty.url, sound.url)
    before = unchanged(db_url)

    records = _retried(db_url, faulty, sound)
    every = _as_sent(db_url, rows, (faulty.url, sound.url))
    _truncated(db_url)
    # The Python API gives the same records, typed.
    with orc.open_sync(db_url) as q:
        typed = list(q.inspect(dataset="chat", error_class="http_500"))
    assert all(isinstance(r, orc.ItemRecord) for r in typed)
    assert [orjson.loads(orjson.dumps(dataclasses.asdict(r))) for r in typed] == records
    text = _read_by_a_person(db_url, records[0], faulty.url)
    _refused(db_url)
    # Secrets: the key the servers wanted is nowhere in what inspect prints.
    assert KEY not in text
    assert KEY not in cli("inspect", "--db", db_url, env={"ORCHESTRATOR_API_KEY": KEY}).stdout
    assert KEY.encode() not in b"".join(orjson.dumps(r) for r in every)
    assert unchanged(db_url) == before


def _retried(db: str, faulty: SimProcess, sound: SimProcess) -> list[dict[str, Any]]:
    """--error-class: exactly the items with an http_500 attempt, each with every attempt
    as stored, each 500 credited to the server that gave it, as many as it gave."""
    records = inspect_json(db, "--dataset", "chat", "--error-class", "http_500")
    errors = stored_errors(db, "chat")
    hit = {key for key, attempts in errors.items() if any(e[1] == "http_500" for e in attempts)}
    assert hit and {r["key"] for r in records} == hit
    shown = 0
    for record in records:
        attempts = [
            (e["attempt"], e["error_class"], e["message"], e["outcome"], e["server"])
            for e in record["errors"]
        ]
        assert attempts == errors[record["key"]]
        for e in record["errors"]:
            assert e["server"] == faulty.url and e["message"].startswith("HTTP 500")
            shown += 1
        # A retry keeps the attempt counted, a release gives it back.
        retries = sum(e["outcome"] == "retry" for e in record["errors"])
        assert record["answer"]["attempt"] == retries + 1

    def count(records: list[dict[str, Any]]) -> int:
        return sum(e["error_class"] == "http_500" for r in records for e in r["errors"])

    # The filter shows every 500 of the dataset; the other dataset's items may have met
    # the faulty server too, so the server's own count is matched over both.
    assert count(inspect_json(db, "--dataset", "chat")) == shown > 0
    assert count(inspect_json(db)) == faulty.stats()["faults"]["500"]
    assert sound.stats()["faults"]["500"] == 0
    return records


def _as_sent(db: str, rows: list[dict[str, Any]], urls: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every item in input order, its request as sent (the dataset's parameters as
    enqueued, its own messages), and the answer the server made for that request."""
    every = inspect_json(db, "--dataset", "chat")
    assert [r["key"] for r in every] == [row["id"] for row in rows]
    by_key = {row["id"]: row for row in rows}
    for record in every:
        request = record["request"]
        assert request["messages"] == by_key[record["key"]]["messages"]
        assert {k: v for k, v in request.items() if k != "messages"} == {
            "model": "m",
            "max_tokens": MAX_TOKENS,
            "temperature": 0.5,
        }
        assert answer_matches(request["messages"], record["answer"]["message"])
        assert record["answer"]["server"] in urls
    return every


def _truncated(db: str) -> None:
    """--flag truncated: the answers cut at max_tokens, by their stored finish reason."""
    cut = {
        key
        for key, finish in query(
            db,
            "SELECT i.key, o.finish_reason FROM outputs AS o JOIN items AS i ON i.id = o.item_id"
            " JOIN datasets AS d ON d.id = i.dataset_id WHERE d.name = 'chat'",
        )
        if finish == "length"
    }
    truncated = inspect_json(db, "--flag", "truncated", "--dataset", "chat")
    assert cut and {r["key"] for r in truncated} == cut
    for record in truncated:
        assert record["answer"]["finish_reason"] == "length"
        assert "truncated" in record["answer"]["flags"]
        assert record["answer"]["usage"]["completion_tokens"] == MAX_TOKENS


def _read_by_a_person(db: str, record: dict[str, Any], faulty: str) -> str:
    """--id, piped: no colour; the 500s, their server and the answer there."""
    key = record["key"]
    env = {"ORCHESTRATOR_API_KEY": KEY}
    text = cli("inspect", "--id", key, "--dataset", "chat", "--db", db, env=env)
    assert text.returncode == 0, text.stderr
    assert not ANSI.search(text.stdout)
    flat = words(text.stdout)
    assert f"chat / {key} done" in flat
    assert f"#1 http_500 → retry server {faulty}" in flat
    assert "HTTP 500: simulated internal server error" in flat
    message = record["answer"]["message"]
    assert (message["content"] or message["reasoning_content"]).split()[0] in flat
    return text.stdout


def _refused(db: str) -> None:
    """A key in two datasets, a key nowhere: exit 2, the datasets named, nothing printed.
    No match: said on stderr, exit 0, as requeue and status do for empty selections."""
    both = cli("inspect", "--id", "c000001", "--db", db)
    assert both.returncode == 2 and both.stdout == ""
    assert "item key 'c000001' is in 2 datasets (chat, other)" in both.stderr
    assert "--dataset chat" in both.stderr
    missing = cli("inspect", "--id", "c000039", "--dataset", "other", "--db", db)
    assert missing.returncode == 2 and missing.stdout == ""
    assert "no item has the key 'c000039' in dataset 'other'; it is in chat" in missing.stderr
    nowhere = cli("inspect", "--id", "zz", "--db", db)
    assert nowhere.returncode == 2
    assert "no item has the key 'zz' in any dataset" in nowhere.stderr
    none = cli("inspect", "--state", "failed", "--db", db)
    assert none.returncode == 0 and none.stdout == ""
    assert "no items match: --state failed" in none.stderr


def test_a_sample_is_drawn_again_by_its_seed(
    db_url: str, tmp_path: Path, servers: list[SimProcess]
) -> None:
    faulty, _ = servers
    rows = prompts(30, "s")
    answered(db_url, tmp_path, "s", rows, faulty.url, "--max-tokens", "8")
    before = unchanged(db_url)

    drawn = cli("inspect", "--sample", "5", "--json", "--db", db_url)
    assert drawn.returncode == 0, drawn.stderr
    seed = re.search(r"sampled 5 of 30 matching items \(seed (\d+): --seed \1", drawn.stderr)
    assert seed, drawn.stderr
    keys = [orjson.loads(line)["key"] for line in drawn.stdout.splitlines()]
    again = inspect_json(db_url, "--sample", "5", "--seed", seed.group(1))
    assert [r["key"] for r in again] == keys
    order = [row["id"] for row in rows]
    assert len(set(keys)) == 5 and keys == sorted(keys, key=order.index)
    # Among the matching items only; more than there are is all of them.
    retried = set(stored_errors(db_url, "s"))
    picked = inspect_json(db_url, "--sample", "100", "--error-class", "http_500", "--seed", "3")
    assert {r["key"] for r in picked} == retried
    refused = cli("inspect", "--sample", "2", "--id", "s000001", "--db", db_url)
    assert refused.returncode == 2 and "--id names one item and --sample" in refused.stderr
    assert cli("inspect", "--seed", "4", "--db", db_url).returncode == 2
    assert unchanged(db_url) == before


def test_inspect_shows_every_turn_of_a_regenerated_conversation(
    db_url: str, tmp_path: Path, servers: list[SimProcess]
) -> None:
    faulty, _ = servers
    rows = [
        {"id": f"conv-{i}", "messages": dialogue(f"q{i}", "old a", f"more {i}", "old b", "end")}
        for i in range(6)
    ]
    answered(db_url, tmp_path, "conv", rows, faulty.url, "--regenerate", "all")
    before = unchanged(db_url)

    out = tmp_path / "conv.export.jsonl"
    assert cli("export", str(out), "--db", db_url).returncode == 0
    lines = {line["id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}
    inputs = {row["id"]: row for row in rows}
    verdict = oracle.check_export(
        lines.values(), inputs, modes={"conv": "all"}, sim_reasoning="field"
    )
    assert not verdict.faults and verdict.answers == 6 * 3

    stored = query(
        db_url,
        "SELECT i.key, t.turn, t.message, t.finish_reason FROM item_turns AS t"
        " JOIN items AS i ON i.id = t.item_id ORDER BY i.key, t.turn",
    )
    for record in inspect_json(db_url, "--dataset", "conv"):
        key = record["key"]
        turns = record["generated"]
        assert [(key, t["turn"], t["message"], t["finish_reason"]) for t in turns] == [
            (k, turn, orjson.loads(m), f) for k, turn, m, f in stored if k == key
        ]
        # Each turn is the one the export (checked by the oracle above) put in its place.
        conversation = lines[key]["messages"]
        placed = [conversation[i] for i in targets(inputs[key]["messages"])]
        assert [t["message"] for t in turns] == placed
        assert record["answer"]["message"] == turns[-1]["message"]
        assert record["request"]["messages"] == inputs[key]["messages"]

    key = rows[0]["id"]
    flat = words(cli("inspect", "--id", key, "--db", db_url).stdout)
    assert "turns generated: 3 of 3" in flat
    # The stored conversation as sent, each original answer marked with its turn.
    assert "assistant (the original of turn 1, generated again) old a" in flat
    assert "assistant (the original of turn 2, generated again) old b" in flat
    assert "user end turn 3: the answer to the last message" in flat
    for n, message in enumerate(lines[key]["messages"][i] for i in (1, 3, 5)):
        assert f"turn {n + 1} of 3" in flat
        assert words(message["content"]) in flat
        assert words(message["reasoning_content"])[:60] in flat
    assert unchanged(db_url) == before


def test_a_requeued_item_shows_the_answer_it_set_aside(
    db_url: str, tmp_path: Path, servers: list[SimProcess]
) -> None:
    _, sound = servers
    answered(db_url, tmp_path, "r", prompts(6, "r"), sound.url, "--max-tokens", "4")
    first = {r["key"]: r["answer"] for r in inspect_json(db_url)}
    requeued = cli("requeue", "--flag", "truncated", "--max-tokens", "400", "--db", db_url)
    assert requeued.returncode == 0, requeued.stderr
    run(db_url, sound.url)
    before = unchanged(db_url)

    kept = query(
        db_url,
        "SELECT i.key, s.requeue_id, s.message, s.finish_reason FROM superseded_outputs AS s"
        " JOIN items AS i ON i.id = s.item_id",
    )
    assert kept
    records = {r["key"]: r for r in inspect_json(db_url, "--dataset", "r")}
    for key, requeue_id, message, finish in kept:
        record = records[key]
        assert record["answer"] != first[key]
        assert record["request"]["max_tokens"] == 400
        [requeue] = record["requeues"]
        assert requeue["requeue"] == requeue_id and requeue["state"] == "done"
        set_aside = requeue["answer"]
        assert set_aside == first[key]
        assert set_aside["message"] == orjson.loads(message) and finish == "length"
        assert requeue["request"]["max_tokens"] == 4  # what that answer was asked with
        prompt = record["request"]["messages"]
        assert answer_matches(prompt, set_aside["message"])
        assert answer_matches(prompt, record["answer"]["message"])
    # --flag looks at set-aside answers too: the truncated ones are still found.
    flagged = {r["key"] for r in inspect_json(db_url, "--flag", "truncated")}
    assert flagged == {key for key, *_ in kept}

    key = kept[0][0]
    flat = words(cli("inspect", "--id", key, "--db", db_url).stdout)
    assert f"requeue #{kept[0][1]} at" in flat and "was done" in flat
    assert "set aside, asked with: max_tokens 4 · model m" in flat
    assert "set-aside answer finish length · flags truncated" in flat
    assert unchanged(db_url) == before


def test_a_running_item_shows_who_holds_it(db_url: str, tmp_path: Path) -> None:
    slow = SimProcess("--latency", "600")
    slow.start()
    try:
        enqueue(db_url, tmp_path, "w", prompts(1, "w"))
        worker = start_worker(db_url, slow.url, "--concurrency", "1")
        deadline = time.monotonic() + 120
        held: list[tuple[Any, ...]] = []
        while not held and time.monotonic() < deadline:
            held = query(db_url, "SELECT key, lease_owner FROM items WHERE state = 'running'")
            time.sleep(0.1)
        assert held, "no item was claimed"
        # The worker is frozen while inspect reads: its heartbeats would change the file,
        # and what is checked is that inspect itself writes nothing.
        worker.send_signal(signal.SIGSTOP)
        before = unchanged(db_url)
        [record] = inspect_json(db_url, "--state", "running")
        assert (record["key"], record["lease"]["worker"]) == held[0]
        assert record["lease"]["expires_at"] > time.time()
        assert record["answer"] is None and record["errors"] == []
        flat = words(cli("inspect", "--state", "running", "--db", db_url).stdout)
        assert f"held by {held[0][1]}" in flat
        assert unchanged(db_url) == before
        worker.kill()
        worker.send_signal(signal.SIGCONT)
        worker.communicate()
    finally:
        slow.stop()


def _on_a_terminal(argv: list[str]) -> str:
    """What ``argv`` writes to its standard output when that is a terminal."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        argv, stdout=follower, stderr=subprocess.DEVNULL, cwd=REPO,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"},
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    proc.wait(60)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.sqlite_only
def test_a_terminal_gets_colour_and_folded_texts_escaped_controls(
    db_url: str, tmp_path: Path
) -> None:
    long = SimProcess("--mean-tokens", "1500", "--reasoning", "field")
    long.start()
    try:
        hostile = [{"id": "x", "prompt": "clear \x1b[2J the screen \u202e and [bold]turn[/bold]"}]
        answered(db_url, tmp_path, "x", hostile, long.url, "--max-tokens", "8000")
    finally:
        long.stop()
    before = unchanged(db_url)
    argv = [sys.executable, "-m", "orchestrator", "inspect", "--id", "x", "--db", db_url]
    shown = _on_a_terminal(argv)
    assert ANSI.search(shown)  # colour on a terminal
    assert "\x1b[2J" not in shown and "\u202e" not in shown
    assert "\\x1b[2J" in shown and "\\u202e" in shown
    assert "[bold]turn[/bold]" in shown  # stored text, never read as markup

    [record] = inspect_json(db_url, "--id", "x")
    content = record["answer"]["message"]["content"]
    assert len(content) > 2 * FOLD_CHARS  # well past what is shown whole
    folded = cli("inspect", "--id", "x", "--db", db_url).stdout
    assert "characters folded (--full shows them whole)" in folded
    assert words(content) not in words(folded)
    assert words(content[:200]) in words(folded) and words(content[-100:]) in words(folded)
    whole = cli("inspect", "--id", "x", "--full", "--db", db_url).stdout
    assert "folded" not in whole and words(content) in words(whole)
    assert unchanged(db_url) == before


@pytest.mark.sqlite_only
@pytest.mark.parametrize("mode", [(), ("--json",)], ids=["text", "json"])
def test_a_reader_that_stops_reading_ends_it_quietly(
    db_url: str, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    """``inspect | head``: the read ends when the pipe closes, exit 0, nothing on stderr."""
    rows = [{"id": f"h{i}", "prompt": "many words " * 50} for i in range(400)]
    enqueue(db_url, tmp_path, "h", rows)
    before = unchanged(db_url)
    argv = [sys.executable, "-m", "orchestrator", "inspect", *mode, "--db", db_url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(60) == 0
    assert proc.stderr.read() == b""
    assert unchanged(db_url) == before
