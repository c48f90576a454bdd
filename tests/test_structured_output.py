"""Structured output, checked: through the real commands, worker subprocesses and the
simulated server, whose JSON answers (valid, broken, of another shape) are a function of
the prompt, so the oracle here knows each answer's flag before the run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.items.quality import INVALID_JSON, SCHEMA_MISMATCH
from orchestrator.items.structured import check, response_format_for
from orchestrator.sim import answer_matches, json_answer_kind, request_digest
from tests.conftest import StartSim
from tests.helpers import (
    SimProcess,
    cli,
    db_snapshot,
    export_lines,
    kill_worker_after,
    prompts,
    query,
    write_jsonl,
)

SCHEMA = {
    "type": "object",
    "properties": {"sim": {"type": "string"}, "text": {"type": "string"}},
    "required": ["sim", "text"],
    "additionalProperties": False,
}
INVALID, MISMATCH = 0.2, 0.25
FLAG_OF = {"valid": [], "invalid_json": ["invalid_json"], "schema_mismatch": ["schema_mismatch"]}


def kind_of(messages: list[dict[str, Any]]) -> str:
    """What the simulated server answers these messages with (its seed is 0)."""
    return json_answer_kind(request_digest(messages), 0, INVALID, MISMATCH)


def export(db: str, out: Path, *extra: str) -> list[dict[str, Any]]:
    return export_lines(db, out, "--parsed", "--provenance", *extra)


def test_each_answer_is_flagged_once_across_a_sigkill(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A schema dataset and a json_object one, reasoning in the content: the worker is
    killed mid-run and the run resumed; every answer carries the flag the oracle
    expects, exactly once, and ``parsed`` is the JSON value of the valid ones."""
    server = sim_process(
        "--latency", "0.02", "--reasoning", "think",
        "--json-invalid-rate", str(INVALID), "--json-mismatch-rate", str(MISMATCH),
    )  # fmt: skip
    schema = tmp_path / "answer.schema.json"
    schema.write_bytes(orjson.dumps(SCHEMA))
    rows = prompts(160, prefix="s")
    data = write_jsonl(tmp_path / "s.jsonl", rows)
    common = ("--db", db_url, "--max-tokens", "400")
    result = cli("enqueue", str(data), "-d", "schema", "--json-schema", str(schema), *common)
    assert result.returncode == 0, result.stderr
    objects = write_jsonl(tmp_path / "o.jsonl", prompts(40, prefix="o"))
    fmt = ("--param", 'response_format={"type": "json_object"}')
    assert cli("enqueue", str(objects), "-d", "objects", *fmt, *common).returncode == 0

    killed_at = kill_worker_after(db_url, server.url, 40, "--concurrency", "4")
    assert 0 < killed_at < 200, "the kill must land mid-run"
    # Resumed streaming: a streamed JSON answer is checked as a whole one is.
    result = cli("run", "--server", server.url, "--db", db_url, "--exit-when-done", "--stream")
    assert result.returncode == 0, result.stderr

    lines = export(db_url, tmp_path / "out.jsonl")
    assert len(lines) == 200
    expected = {"invalid_json": 0, "schema_mismatch": 0}
    for line in lines:
        *prompt, answer = line["messages"]
        assert answer_matches(prompt, answer), line["id"]
        assert answer["reasoning_content"], "the reasoning is split off before the check"
        kind = kind_of(prompt)
        if line["dataset"] == "objects" and kind == "schema_mismatch":
            kind = "valid"  # another shape is still a JSON object: no schema to miss
        assert line["flags"] == FLAG_OF[kind], (line["id"], kind, answer["content"])
        if kind == "valid":
            assert line["parsed"] == orjson.loads(answer["content"])
            assert line["parsed"]["sim"] == request_digest(prompt)
        else:
            assert line["parsed"] is None
            expected[kind] += 1
    assert expected["invalid_json"] and expected["schema_mismatch"]
    assert query(db_url, "SELECT count(*) FROM outputs")[0][0] == 200  # none twice
    status = json.loads(cli("status", "--json", "--db", db_url).stdout)
    flags = status["totals"]["flags"]
    assert {k: flags[k] for k in expected} == expected
    by_name = {d["name"]: d for d in status["datasets"]}
    invalid = sum(1 for line in lines if line["dataset"] == "schema" and line["flags"])
    assert by_name["schema"]["structured"] == {
        "invalid": invalid,
        "invalid_share": round(invalid / 160, 4),
    }
    text = cli("status", "--db", db_url).stdout
    assert "structured output" in text and f"invalid {invalid / 160:.1%}" in text

    kept = export(db_url, tmp_path / "kept.jsonl", "--exclude-flag", "invalid_json,schema_mismatch")
    assert len(kept) == 200 - sum(expected.values())
    requeued = cli("requeue", "--flag", "schema_mismatch", "--db", db_url)
    assert requeued.returncode == 0, requeued.stderr
    assert f"requeued {expected['schema_mismatch']} done items" in requeued.stdout


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_on_invalid_retries_or_fails_and_counts_the_attempts(
    policy: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The simulated answer is the same on every attempt: ``retry`` spends the item's
    attempts and fails it with the answer's class, ``fail`` fails it on the first."""
    db = str(tmp_path / "q.db")
    server = sim_process("--json-invalid-rate", str(INVALID), "--json-mismatch-rate", str(MISMATCH))
    schema = tmp_path / "s.json"
    schema.write_bytes(orjson.dumps(SCHEMA))
    rows = prompts(60)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    result = cli(
        "enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "400",
        "--json-schema", str(schema), "--on-invalid", policy,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = ("--exit-when-done", "--max-attempts", "3", "--retry-backoff", "0.01")
    result = cli("run", "--server", server.url, "--db", db, *run)
    assert result.returncode == 6, result.stderr  # finished, with failed items
    attempts = 3 if policy == "retry" else 1
    items = query(db, "SELECT key, state, attempts, error_class FROM items")
    for key, state, tries, error_class in items:
        kind = kind_of(next(r["messages"] for r in rows if r["id"] == key))
        if kind == "valid":
            assert (state, tries) == ("done", 1), key
        else:
            assert (state, tries, error_class) == ("failed", attempts, kind), key
    errors = dict(query(db, "SELECT error_class, count(*) FROM attempt_errors GROUP BY 1"))
    bad = {k: sum(1 for *_, c in items if c == k) for k in ("invalid_json", "schema_mismatch")}
    assert errors == {k: n * attempts for k, n in bad.items() if n}


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"{not json", "not JSON"),
        (b'{"type": 5}', "not a valid JSON schema at type"),
        (b"[1, 2]", "must be an object"),
    ],
)
def test_a_bad_schema_file_stops_enqueue_naming_it(
    db_url: str, tmp_path: Path, content: bytes, said: str
) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    assert cli("enqueue", str(data), "-d", "first", "--db", db_url).returncode == 0
    before = db_snapshot(db_url)
    schema = tmp_path / "bad.json"
    schema.write_bytes(content)
    result = cli("enqueue", str(data), "-d", "d", "--db", db_url, "--json-schema", str(schema))
    assert result.returncode == 2, result.stderr
    assert f"--json-schema {schema}" in result.stderr and said in result.stderr
    assert db_snapshot(db_url) == before  # nothing written


def test_a_missing_schema_file_is_named(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    db = tmp_path / "q.db"
    missing = tmp_path / "nope.json"
    result = cli("enqueue", str(data), "-d", "d", "--db", str(db), "--json-schema", str(missing))
    assert result.returncode == 2
    assert f"--json-schema {missing}: cannot read it" in result.stderr
    assert not db.exists()


# ------------------------------------------------------------------ the check itself

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@given(value=values, pad=st.sampled_from(["", " ", "\n", "\n\n "]))
def test_any_json_value_parses_back_to_itself(value: Any, pad: str) -> None:
    text = pad + json.dumps(value) + pad
    checked = check(text, {"type": "json_schema", "json_schema": {"schema": {}}})
    assert checked.flags == 0 and checked.parsed == value
    as_object = check(text, {"type": "json_object"})
    assert as_object.flags == (0 if isinstance(value, dict) else SCHEMA_MISMATCH)


@given(value=values, cut=st.integers(1, 50))
def test_a_cut_answer_is_invalid_json(value: Any, cut: int) -> None:
    text = json.dumps({"v": value})
    checked = check(text[: max(1, len(text) - cut)], {"type": "json_object"})
    assert checked.flags == INVALID_JSON and checked.parsed is None


def test_a_mismatch_says_where() -> None:
    fmt = response_format_for(SCHEMA, source="t")
    checked = check('{"sim": "x", "text": 3}', fmt)
    assert checked.flags == SCHEMA_MISMATCH
    assert "at text" in checked.reason and "is not of type 'string'" in checked.reason
    assert check('```json\n{"sim": "x", "text": "y"}\n```', fmt).flags == INVALID_JSON


async def test_the_api_checks_a_schema_and_fits_overflows(tmp_path: Path, sim: StartSim) -> None:
    """``Queue.enqueue(json_schema=..., on_invalid=..., on_overflow=...)`` and
    ``results(parsed=True)`` are the command's options."""
    import orchestrator as orc
    from orchestrator.errors import ConfigError

    url = await sim(json_invalid_rate=INVALID, json_mismatch_rate=MISMATCH, max_model_len=120)
    rows = prompts(30)
    async with orc.open(str(tmp_path / "q.db")) as q:
        with pytest.raises(ConfigError, match="not a valid JSON schema"):
            await q.enqueue(rows, dataset="bad", model="m", json_schema={"type": 5})
        await q.enqueue(
            rows, dataset="d", model="m", max_tokens=400, json_schema=SCHEMA,
            on_invalid="fail", on_overflow="fit",
        )  # fmt: skip
        outcome = await q.run(servers=[url], concurrency=4)
        lines = [row async for row in q.results(parsed=True, provenance=True)]
    assert outcome.stats.failed == sum(1 for r in rows if kind_of(r["messages"]) != "valid")
    by_kind = {r["id"]: kind_of(r["messages"]) for r in rows}
    assert [line["id"] for line in lines] == [k for k, v in by_kind.items() if v == "valid"]
    for line in lines:
        assert line["flags"] == ["max_tokens_reduced"]  # 400 over a context of 120: fitted
        assert line["parsed"]["sim"] == request_digest(line["messages"][:-1])
