"""``--token-ids`` and ``export --format tokens``: every row's ``input_ids`` are, id for
id, the prompt the server evaluated and the ids it generated. The simulated server's
ids are a function of what it received (``orchestrator.sim.logprobs``: a prompt word's
id is its own, an answer token's follows from the request's digest), so the oracle
recomputes every row from the exported conversation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import orchestrator
from orchestrator.formats.writers.tokens import merged
from orchestrator.items.conversation import targets
from orchestrator.items.token_ids import TokenIds
from orchestrator.sim import logprobs as sim_tokens
from orchestrator.sim import request_digest
from orchestrator.sim.prefix import prompt_words
from tests import helpers
from tests.helpers import SimProcess, cli, dialogue, query, write_jsonl
from tests.test_training_data import tool_trace


def rows(n: int) -> list[dict[str, Any]]:
    """Chats, multi-turn dialogues and tool-calling traces, in turn."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"id": f"c{i:03d}", "messages": dialogue(f"Name river {i}.")})
        elif i % 3 == 1:
            turns = dialogue(f"Count to {i}.", "one two", "Go on.", "three", "More.")
            out.append({"id": f"d{i:03d}", "messages": turns})
        else:
            out.append({**tool_trace(i, "open_box"), "id": f"t{i:03d}"})
    return out


def enqueue_turns(db: Path, source: list[dict[str, Any]], max_tokens: int) -> None:
    """``source`` as one dataset regenerated whole, with the server's token ids asked."""
    data = write_jsonl(db.parent / "in.jsonl", source)
    made = cli(
        "enqueue", str(data), "-d", "mixed", "--db", str(db), "--regenerate", "all",
        "--token-ids", "--max-tokens", str(max_tokens),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr


def export(db: Path, fmt: str, *extra: str) -> tuple[list[dict[str, Any]], str]:
    out = db.parent / f"out-{fmt}.jsonl"
    result = cli("export", str(out), "--db", str(db), "--format", fmt, *extra)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()], result.stderr


def expected(context: list[dict[str, Any]], answer_tokens: int) -> list[int]:
    """What the simulated server saw and generated for a turn asked with ``context``."""
    digest = request_digest(context)
    generated = [sim_tokens.token(digest, i)[0] for i in range(answer_tokens)]
    return sim_tokens.prompt_ids(prompt_words(context)) + generated


def check_rows(db: Path, source: list[dict[str, Any]], prompt_from: str) -> int:
    """Every token row against the oracle, from the exported conversations; the rows."""
    conversations = {line["id"]: line for line in export(db, "messages", "--provenance")[0]}
    token_rows, said = export(db, "tokens", "--provenance")
    assert "left out" not in said, said
    by_id = {row["id"]: row for row in token_rows}
    assert len(by_id) == len(token_rows)  # no row twice
    seen = 0
    for original in source:
        messages = conversations[original["id"]]["messages"]
        answered = [p for p in targets(messages) if p < len(messages)]
        for k, position in enumerate(answered):
            row = by_id[f"{original['id']}#turn{k}"]
            n = sum(row["loss_mask"])
            assert row["input_ids"] == expected(messages[:position], n), row["id"]
            prompt = len(sim_tokens.prompt_ids(prompt_words(messages[:position])))
            assert row["loss_mask"] == [0] * prompt + [1] * n
            assert row["prompt_ids_from"] == prompt_from and row["dataset"] == "mixed"
            seen += 1
    assert seen == len(token_rows)
    return seen


@pytest.mark.parametrize("prompt_from", ["response", "tokenize"])
def test_token_rows_are_what_the_server_saw_and_generated_after_a_kill(
    sim_process: Callable[..., SimProcess], tmp_path: Path, prompt_from: str
) -> None:
    """Chats, dialogues and tool-calling traces, the worker SIGKILLed mid-run: each
    generated turn is one row, its ids exactly the server's, prompt ids from the answer
    or, where the answer carries none, from the server's ``/tokenize``."""
    server = sim_process("--prompt-ids", prompt_from, "--reasoning", "field", "--latency", "0.02")
    db = tmp_path / "q.db"
    source = rows(90)
    enqueue_turns(db, source, 24)
    worker = helpers.start_worker(db, server.url, "--concurrency", "8")
    helpers.kill_worker_once(
        worker, lambda: query(db, "SELECT count(*) FROM item_turns")[0][0] >= 40
    )
    assert query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0] < len(source)
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    assert check_rows(db, source, prompt_from) > len(source)


def test_turns_without_prompt_ids_are_left_out_and_counted(
    sim_process: Callable[..., SimProcess], tmp_path: Path
) -> None:
    """A server that says no prompt ids and serves no ``/tokenize``: no row is written
    with half its ids; the export says how many turns were left out and why."""
    server = sim_process("--prompt-ids", "none")
    db = tmp_path / "q.db"
    source = [{"id": f"c{i}", "messages": dialogue(f"Name stone {i}.")} for i in range(5)]
    data = write_jsonl(tmp_path / "in.jsonl", source)
    made = cli("enqueue", str(data), "-d", "plain", "--db", str(db), "--token-ids")
    assert made.returncode == 0, made.stderr
    result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    token_rows, said = export(db, "tokens")
    assert token_rows == []
    assert "5 generated turns left out of the token rows: 5 no prompt ids" in said, said
    # Enqueued without --token-ids, the reason says what to do.
    data = write_jsonl(tmp_path / "more.jsonl", [{"id": "x", "messages": dialogue("Hi.")}])
    assert cli("enqueue", str(data), "-d", "other", "--db", str(db)).returncode == 0
    assert cli("run", "--server", server.url, "--db", str(db), "--exit-when-done").returncode == 0
    _, said = export(db, "tokens")
    assert "enqueue the dataset with --token-ids" in said, said


@st.composite
def chains(draw: st.DrawFn) -> list[TokenIds]:
    """A conversation's turns whose prompts each begin with the turn before it."""
    ids = st.lists(st.integers(0, 2**31 - 1), max_size=6)
    before: list[int] = []
    turns = []
    for _ in range(draw(st.integers(1, 5))):
        prompt = before + draw(ids)
        generated = draw(ids)
        turns.append(TokenIds(tuple(prompt), tuple(generated), "response"))
        before = prompt + generated
    return turns


@given(chains(), st.data())
def test_merged_turns_mask_every_generated_span_and_refuse_a_broken_chain(
    turns: list[TokenIds], data: st.DataObject
) -> None:
    found = merged(turns)
    assert found is not None
    input_ids, mask = found
    assert input_ids == turns[-1].input_ids() and len(mask) == len(input_ids)
    # The ids under the mask are each turn's generated ids, in order, and nothing else.
    assert [i for i, m in zip(input_ids, mask, strict=True) if m] == [
        i for t in turns for i in t.generated or ()
    ]
    # A later prompt that does not begin with what came before: no merged row.
    later = [t for t in turns[1:] if t.prompt]
    if later:
        broken = data.draw(st.sampled_from(later))
        at = turns.index(broken)
        changed = TokenIds((broken.prompt[0] ^ 1, *broken.prompt[1:]), broken.generated)
        if turns[at - 1].input_ids():
            assert merged([*turns[:at], changed, *turns[at + 1 :]]) is None


def test_merge_turns_keeps_a_row_per_turn_where_the_ids_do_not_chain(
    sim_process: Callable[..., SimProcess], tmp_path: Path
) -> None:
    """The simulated server tokenizes an earlier answer's words otherwise than it
    generated them (as a template may): no conversation chains, each stays a row per
    turn, and the export says how many."""
    server = sim_process()
    db = tmp_path / "q.db"
    source = [r for r in rows(12) if r["id"].startswith("d")]
    enqueue_turns(db, source, 8)
    assert cli("run", "--server", server.url, "--db", str(db), "--exit-when-done").returncode == 0
    per_turn, _ = export(db, "tokens")
    kept, said = export(db, "tokens", "--merge-turns")
    assert kept == per_turn and len(kept) == 3 * len(source)
    assert f"{len(source)} conversations stay a row per turn" in said, said
    # The Python API gives the same rows, and says the same of them.
    queue = orchestrator.open_sync(str(db))
    try:
        assert list(queue.results(format="tokens")) == per_turn
        report = queue.export(db.parent / "api.jsonl", format="tokens", merge_turns=True)
    finally:
        queue.close()
    assert (report.lines, report.unmerged) == (len(per_turn), len(source))
    assert report.summary is not None and "stay a row per turn" in report.summary


def test_ids_the_server_spells_otherwise_than_the_text_are_flagged(
    sim_process: Callable[..., SimProcess], tmp_path: Path
) -> None:
    """A server that sometimes says another answer's ids (``bad_ids``): exactly the turns
    whose ids are not the oracle's are flagged ``token_mismatch``, by the server's own
    ``/detokenize``; ``--exclude-flag token_mismatch`` leaves exactly those out."""
    server = sim_process("--fault", "bad_ids=0.3", "--reasoning", "field")
    db = tmp_path / "q.db"
    source = [{"id": f"c{i:02d}", "messages": dialogue(f"Name stone {i}.")} for i in range(40)]
    data = write_jsonl(tmp_path / "in.jsonl", source)
    made = cli("enqueue", str(data), "-d", "flags", "--db", str(db), "--token-ids")
    assert made.returncode == 0, made.stderr
    assert cli("run", "--server", server.url, "--db", str(db), "--exit-when-done").returncode == 0
    conversations = {line["id"]: line["messages"] for line in export(db, "messages")[0]}
    token_rows, _ = export(db, "tokens", "--provenance")
    wrong = set()
    for row in token_rows:
        context = conversations[row["id"]][:-1]
        right = row["input_ids"] == expected(context, sum(row["loss_mask"]))
        assert ("token_mismatch" in row["flags"]) == (not right), row["id"]
        wrong |= set() if right else {row["id"]}
    assert 0 < len(wrong) < len(source)
    kept, _ = export(db, "tokens", "--exclude-flag", "token_mismatch")
    assert {row["id"] for row in kept} == {row["id"] for row in token_rows} - wrong
