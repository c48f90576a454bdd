"""``export --format specforge`` and ``--per-turn``, held to SpecForge's own rules.

The rules are SpecForge's scripts themselves, read from sgl-project/SpecForge at commit
a6b6b0230009d15ec2a97a57384e6f53f0f96946 and copied unchanged into
``tests/fixtures/specforge/`` (MIT): ``validate_regenerated_data.py`` judges every line
and says why it refuses a skipped one, and ``expand_reasoning_conversations.py`` expands
the whole-conversation file into the per-turn rows ours must equal. Both need only the
standard library, so they run here as SpecForge's users run them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import orchestrator as orc
from orchestrator.formats.writers import specforge, turns
from tests import oracle, specforge_parser
from tests.conftest import StartSim
from tests.helpers import REPO, SimProcess, cli, export_caught, write_jsonl
from tests.test_llamacpp import CONVERSATIONS as LLAMA_CONVERSATIONS
from tests.test_llamacpp import MODEL as LLAMA_MODEL
from tests.test_llamacpp import llama  # noqa: F401 (the session's llama-server)
from tests.test_training_data import config, run_worker, tool_trace

SPECFORGE = REPO / "tests" / "fixtures" / "specforge"
SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"
sys.path.insert(0, str(SPECFORGE))
import expand_reasoning_conversations as sf_expand  # noqa: E402
import validate_regenerated_data as sf_validate  # noqa: E402

REFUSED = "PLEASE REFUSE"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for raw in path.read_bytes().splitlines()]


def validator_says(row: dict[str, Any]) -> str | None:
    """SpecForge's validator's verdict on one row as our export would have written it."""
    row = {k: v for k, v in row.items() if k != "error"}
    row["status"] = "success"
    try:
        sf_validate.validate_row(row, expect_non_reasoning=False, strict_think_markers=True)
    except ValueError as exc:
        return str(exc)
    return None


def _tools(row: dict[str, Any]) -> bool:
    return specforge.uses_tools(row.get("conversations"))


def run_script(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SPECFORGE / script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


# ----------------------------------------------------------------------- the run


def _chat(i: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "answer briefly"}]
    for t in range(3):
        messages += [
            {"role": "user", "content": f"chat {i} question {t}"},
            {"role": "assistant", "content": f"original answer {t}"},
        ]
    return {"id": f"chat-{i:03d}", "messages": messages}


def _final_rows() -> list[dict[str, Any]]:
    """Finished conversations, one per rule of SpecForge's validator they keep or break."""
    u, a = "user", "assistant"

    def row(i: int, *messages: tuple[str, Any]) -> dict[str, Any]:
        return {
            "id": f"final-{i:03d}",
            "messages": [{"role": r, "content": c} for r, c in messages],
        }

    tool = row(4, (u, "weather?"), (a, "calling"), ("tool", "sunny"), (a, "It is sunny."))
    tool["messages"][1]["tool_calls"] = [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    ]
    tool["messages"][2]["tool_call_id"] = "c1"
    return [
        row(0, (u, "hello"), (a, "Hello there.")),
        row(1, (u, "think?"), (a, "<think>hm</think> yes")),
        row(2, (u, "one"), (a, "two"), ("system", "be terse"), (u, "three"), (a, "four")),
        row(3, ("developer", "sys"), (u, "hi"), (a, "   ")),
        tool,
        row(5, (u, "first"), (a, "second"), (u, "third"), (a, "fourth")),
    ]


MODES = {"chat": "all", "tools": "all", "prompts": "last", "final": "passthrough"}


async def _run(db_url: str, tmp_path: Path, sim: StartSim) -> dict[str, dict[str, Any]]:
    """A run with every shape the export meets: conversations regenerated turn by turn
    with reasoning, tool traces, prompts some of which the server refuses, finished
    conversations that break SpecForge's rules one by one, and pre-tokenised rows."""
    tools = [tool_trace(i, "open_box" if i % 2 else "weigh_box") for i in range(12)]
    for row in tools:
        row["id"] = f"tools-{row['id']}"
    prompts = [
        {"id": f"prompts-{i:03d}", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(["add 2 and 2", REFUSED, "name a river", REFUSED, "a haiku"])
    ]
    sets = {
        "chat": ([_chat(i) for i in range(6)], ["--regenerate", "all"]),
        "tools": (tools, ["--regenerate", "all"]),
        "prompts": (prompts, []),
        "final": (_final_rows(), ["--passthrough"]),
    }
    inputs: dict[str, dict[str, Any]] = {}
    for name, (rows, how) in sets.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        done = cli("enqueue", str(path), "-d", name, *how, "--db", db_url)
        assert done.returncode == 0, done.stderr
        inputs.update({row["id"]: row for row in rows})
    tokens = [{"id": f"t{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for i in range(2)]
    path = write_jsonl(tmp_path / "tokens.jsonl", tokens)
    done = cli("enqueue", str(path), "-d", "tokens", "--passthrough", "--db", db_url)
    assert done.returncode == 0, done.stderr
    url = await sim(reasoning="field", tool_call_rate=0.5, refusals={REFUSED: "refused"})
    from orchestrator.store import open_database

    database = await open_database(db_url)
    try:
        await run_worker(database, config(url, max_attempts=1))
    finally:
        await database.close()
    return inputs


def _export(db_url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = cli("export", str(out), "--format", "specforge", *args, "--db", db_url)
    assert result.returncode == 0, result.stderr
    return result


async def test_specforge_export_meets_specforge_rules(
    db_url: str, tmp_path: Path, sim: StartSim
) -> None:
    inputs = await _run(db_url, tmp_path, sim)
    out = tmp_path / "train.jsonl"
    result = _export(db_url, out)
    lines = read_jsonl(out)
    skipped = read_jsonl(tmp_path / "train_skipped.jsonl")
    errors = read_jsonl(tmp_path / "train_error.jsonl")

    # SpecForge's validator, as its users run it, takes every line of OUT without tool
    # turns; SpecForge's parser hands the chat template every message of those with them.
    plain = write_jsonl(tmp_path / "plain.jsonl", [x for x in lines if not _tools(x)])
    checked = run_script("validate_regenerated_data.py", "--data-path", str(plain),
                         "--strict-think-markers", cwd=tmp_path)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert "validation passed" in checked.stdout
    called = [line for line in lines if _tools(line)]
    assert len(called) >= 6
    for line in called:
        loaded = specforge_parser.offline_row(line)
        assert not specforge_parser.losses(line, loaded), line["id"]
    assert all(line["status"] == "success" for line in lines)
    for line in lines:
        for message in line["conversations"]:
            if message["role"] == "assistant":
                assert isinstance(message["reasoning_content"], str | None)

    # Each skipped row names the reason SpecForge gives for it: its validator's, or for
    # a row with tool turns what its parser would do to it.
    for row in skipped:
        assert row["status"] == "skipped"
        if _tools(row):
            assert row["error"] == specforge.problem(row)[1], row["id"]
        else:
            assert validator_says(row) == row["error"], row["id"]
    reasons = Counter(specforge.problem({**row, "status": "success"})[0] for row in skipped)
    assert {"no_conversation", "think_marker", "unsupported_role", "empty_content"} <= set(reasons)
    assert reasons["no_conversation"] == 2  # the pre-tokenised rows
    summary = specforge.summary(dict(reasons), [tmp_path / "train_skipped.jsonl"])
    assert summary is not None and result.stderr.rstrip().endswith(summary)
    by_id = {row["id"].split("/", 1)[-1]: row for row in skipped}
    assert by_id["final-001"]["error"] == "assistant message 1 contains a thinking marker"
    assert by_id["final-002"]["error"] == "message 2 has unsupported role 'system'"
    assert "final-004" not in by_id  # a tool call, its result and the answer

    # Failed items, as SpecForge's script writes its errors.
    assert sorted(e["id"] for e in errors) == ["prompts/prompts-001", "prompts/prompts-003"]
    assert all(e["status"] == "error" and "refused" in e["error"] for e in errors)

    # Nothing lost, nothing twice: every item is in exactly one of the three files.
    ids = [row["id"] for row in [*lines, *skipped, *errors]]
    status = orjson.loads(cli("status", "--json", "--db", db_url).stdout)
    assert len(ids) == len(set(ids)) == status["totals"]["counts"]["total"]

    # The answers are the simulated server's to what was asked (the oracle), in the
    # written rows and in those skipped, which are real answers too.
    answered = [row for row in [*lines, *skipped] if "conversations" in row]
    verdict = oracle.check_export(
        answered, inputs, modes=MODES, fmt="specforge", sim_reasoning="field"
    )
    assert not verdict.faults, verdict.faults
    assert verdict.answers > 6 * 3


async def test_per_turn_rows_are_specforge_expansions(
    db_url: str, tmp_path: Path, sim: StartSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _run(db_url, tmp_path, sim)
    full, rows = tmp_path / "full.jsonl", tmp_path / "turns.jsonl"
    _export(db_url, full)
    result = _export(db_url, rows, "--per-turn")
    ours = {row["id"]: row for row in read_jsonl(rows)}
    assert len(ours) == len(read_jsonl(rows))
    # The same rows skipped, and the same items failed, as without --per-turn.
    assert (tmp_path / "turns_skipped.jsonl").read_bytes() == (
        tmp_path / "full_skipped.jsonl"
    ).read_bytes()
    assert len(read_jsonl(tmp_path / "turns_error.jsonl")) == 2
    assert f"turns of {len(read_jsonl(full))} items" in result.stdout

    expanded = tmp_path / "sf_turns.jsonl"
    ran = run_script("expand_reasoning_conversations.py", "--input-file-path", str(full),
                     "--output-file-path", str(expanded), cwd=tmp_path)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    theirs = read_jsonl(expanded)
    assert "multi-turn input rows: 0" not in ran.stdout
    source = read_jsonl(full)
    for event in theirs:
        mine = ours[event["id"]]
        # Ours keeps the row's tools (a tool-using turn needs its schemas); the rest is
        # SpecForge's row exactly.
        assert {k: v for k, v in mine.items() if k != "tools"} == event
        assert mine.get("tools") == source[event["source_row_index"]].get("tools")
    # Rows SpecForge's expansion leaves out are those without reasoning (the finished
    # conversations, stored as they were read) and those with tool turns, which its
    # checks refuse; those are expanded all the same, turn for turn as it would.
    left_out = read_jsonl(tmp_path / "sf_turns_skipped.jsonl")
    called = [row for row in left_out if _tools(row)]
    assert called and all("reasoning_content" in row["error"] for row in left_out
                          if not _tools(row))  # fmt: skip
    extra = {k for k in ours if k not in {e["id"] for e in theirs}}
    assert {ours[k]["source_id"] for k in extra} == {row["id"] for row in left_out}
    assert all(k.startswith(("final/final-", "tools/")) for k in extra)
    monkeypatch.setattr(sf_expand, "validate_conversation", lambda messages: None)
    for row in called:
        index = next(i for i, x in enumerate(source) if x["id"] == row["id"])
        for event in sf_expand.expand_row(source[index], index):
            mine = ours[event["id"]]
            assert {k: v for k, v in mine.items() if k != "tools"} == event

    # The Python API writes the same bytes and reports what the command says.
    async with orc.open(db_url) as q:
        report = await q.export(tmp_path / "api.jsonl", format="specforge", per_turn=True)
        listed = [row async for row in q.results(format="specforge", per_turn=True)]
    assert (tmp_path / "api.jsonl").read_bytes() == rows.read_bytes()
    assert listed == read_jsonl(rows)
    assert report.summary is not None and report.summary.replace("api", "turns") in result.stderr
    assert (report.lines, report.items) == (len(ours), len(source))
    assert sum(report.skipped.values()) == len(read_jsonl(tmp_path / "turns_skipped.jsonl"))


async def test_per_turn_rows_in_other_formats(db_url: str, tmp_path: Path, sim: StartSim) -> None:
    """Every conversation format expands the same way: each row is its whole line's
    conversation cut after turn k, earlier turns without reasoning."""
    await _run(db_url, tmp_path, sim)
    for fmt, key, role, assistant in (
        ("messages", "messages", "role", "assistant"),
        ("sharegpt", "conversations", "from", "gpt"),
    ):
        whole, split = tmp_path / f"{fmt}.jsonl", tmp_path / f"{fmt}-turns.jsonl"
        for out, more in ((whole, ()), (split, ("--per-turn",))):
            done = cli("export", str(out), "--format", fmt, *more, "--db", db_url)
            assert done.returncode == 0, done.stderr
        lines = read_jsonl(whole)
        seen: Counter[int] = Counter()
        for row in read_jsonl(split):
            if "source_row_index" not in row:  # a pre-tokenised row: as it was
                assert key not in row and row in lines
                continue
            source = lines[row["source_row_index"]]
            assert row["source_id"] == source["id"]
            assert row["id"] == f"{source['id']}#turn{row['assistant_turn_index']}"
            cut = row[key]
            places = [i for i, m in enumerate(source[key]) if m[role] == assistant]
            end = places[row["assistant_turn_index"]]
            assert cut[-1] == source[key][end]
            for mine, whole_message in zip(cut[:-1], source[key][:end], strict=True):
                if whole_message[role] == assistant:
                    whole_message = {
                        k: v for k, v in whole_message.items() if k != "reasoning_content"
                    }
                assert mine == whole_message
            final = end == places[-1]
            if fmt == "messages":
                assert row["finish_reason"] == (source["finish_reason"] if final else None)
            seen[row["source_row_index"]] += 1
        # Regenerated-all and finished conversations: a row per assistant turn after the
        # first user message; others: the final answer alone.
        for index, source in enumerate(lines):
            if key not in source:
                continue
            name = oracle.dataset_of(source["id"].split("/", 1)[-1], MODES)
            n = sum(1 for m in source[key] if m[role] == assistant)
            assert seen[index] == (n if MODES[name] != "last" else 1), source["id"]


def test_a_killed_specforge_export_leaves_no_file(tmp_path: Path) -> None:
    db = tmp_path / "big.db"
    rows = [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "" if i % 10 == 0 else "y" * 2000},
            ],
        }
        for i in range(20_000)
    ]
    data = write_jsonl(tmp_path / "done.jsonl", rows)
    stored = cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", str(db))
    assert stored.returncode == 0, stored.stderr
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "export", str(out), "--format", "specforge",
         "--db", str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    export_caught(proc, out, 60)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    names = ("out.jsonl", "out_skipped.jsonl", "out_error.jsonl")
    assert not any((tmp_path / name).exists() for name in names)
    # The next export completes, and clears what the dead one left.
    done = cli("export", str(out), "--format", "specforge", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(out)) == 18_000
    assert len(read_jsonl(tmp_path / "out_skipped.jsonl")) == 2_000
    assert read_jsonl(tmp_path / "out_error.jsonl") == []
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _trace(i: int, arguments: str, *, answered_twice: bool = False) -> dict[str, Any]:
    """A finished tool-calling conversation: a call, its result, the answer."""
    call = {"id": f"c{i}", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"weather in town {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    if answered_twice:  # an answer after an answer: SpecForge's parser cuts it off
        messages.append({"role": "assistant", "content": "Anything else?"})
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    return {"id": f"trace-{i}", "messages": messages, "tools": tools}


async def test_rows_specforge_cannot_take_are_named_last(tmp_path: Path) -> None:
    """Tool-calling rows SpecForge takes are written; one whose call is cut off (its
    parser would train ``{}`` for the arguments) or whose turns it would cut short is set
    aside, and the export ends saying how many, why, where, and which formats carry them."""
    db = tmp_path / "q.db"
    rows = [_trace(0, '{"city": "Paris"}'), _trace(1, '{"city": "Par'), _trace(2, "{}"),
            _trace(3, "{}", answered_twice=True)]  # fmt: skip
    data = write_jsonl(tmp_path / "done.jsonl", rows)
    assert cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", str(db)).returncode == 0
    out = tmp_path / "train.jsonl"
    result = cli("export", str(out), "--format", "specforge", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert [line["id"] for line in read_jsonl(out)] == ["trace-0", "trace-2"]
    skipped = {row["id"]: row for row in read_jsonl(tmp_path / "train_skipped.jsonl")}
    assert sorted(skipped) == ["trace-1", "trace-3"]
    assert "arguments are not JSON" in skipped["trace-1"]["error"]
    assert skipped["trace-1"]["conversations"][1]["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Par'
    )
    assert "cuts the conversation" in skipped["trace-3"]["error"]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: skipped 2 rows SpecForge cannot take"), result.stderr
    assert "1 tool-call arguments that are not JSON" in last and "1 turns out of order" in last
    assert str(tmp_path / "train_skipped.jsonl") in last
    assert "`--format messages` (OpenAI messages with tool_calls)" in last
    # The report says it too, and the messages format carries the two whole.
    async with orc.open(str(db)) as q:
        report = await q.export(tmp_path / "api.jsonl", format="specforge")
    assert report.skipped == {"tool_arguments": 1, "role_order": 1}
    assert report.summary is not None and "--format messages" in report.summary
    whole = tmp_path / "whole.jsonl"
    assert cli("export", str(whole), "--db", str(db)).returncode == 0
    carried = {line["id"]: line["messages"] for line in read_jsonl(whole)}
    assert carried["trace-1"] == rows[1]["messages"] and carried["trace-3"] == rows[3]["messages"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("-", "--format", "specforge"), "writes its skipped rows beside OUT"),
        (("o.jsonl", "--format", "specforge", "--reasoning", "inline"), "<think> markers"),
        (("o.jsonl", "--format", "openai-batch", "--per-turn"), "it splits conversations"),
    ],
)
def test_what_the_specforge_shapes_refuse(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    db = tmp_path / "q.db"
    data = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])  # fmt: skip
    assert cli("enqueue", str(data), "-d", "d", "--passthrough", "--db", str(db)).returncode == 0
    result = cli("export", *args, "--db", str(db), cwd=tmp_path)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "q.db"]


# ------------------------------------------------- the rules, over many row shapes

_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", None])
_TEXT = st.sampled_from(["hi", "", "  ", "<think>x", "a </THINK> b", "plain words", None, 3])
_REASONING = st.sampled_from([None, "why", "", "<think>deep", 7])


@st.composite
def _rows(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[Any] = []
    for _ in range(draw(st.integers(0, 7))):
        if draw(st.integers(0, 30)) == 0:
            messages.append("not a message")
            continue
        message: dict[str, Any] = {"role": draw(_ROLES), "content": draw(_TEXT)}
        if message["role"] == "assistant":
            message["reasoning_content"] = draw(_REASONING)
        messages.append(message)
    row: dict[str, Any] = {"id": draw(st.sampled_from(["r1", "", " ", None])), "status": "success"}
    if draw(st.integers(0, 10)):
        row["conversations"] = messages
    return row


@st.composite
def _valid_rows(draw: st.DrawFn) -> dict[str, Any]:
    """Rows SpecForge's expansion takes: alternating turns, each answer with reasoning."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": "sys"})
    for t in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": f"u{t}"})
        answer = {"role": "assistant", "content": f"a{t}", "reasoning_content": f"r{t}"}
        messages.append(answer)
    row: dict[str, Any] = {"id": f"row{draw(st.integers(0, 99))}", "conversations": messages}
    if draw(st.booleans()):
        row["tools"] = [{"type": "function", "function": {"name": "f"}}]
    row["status"] = "success"
    return row


@settings(max_examples=400, deadline=None)
@given(_rows())
def test_problem_is_the_validators_verdict(row: dict[str, Any]) -> None:
    """A row without tool turns: the validator's verdict, word for word."""
    found = specforge.problem(row)
    if found:
        assert found[0] in specforge.REASONS
    if not _tools(row):
        assert (found[1] if found else None) == validator_says(row)


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
_GOOD_CALLS = [
    _CALL,
    {**_CALL, "id": "c2", "function": {"name": "g", "arguments": "{}"}},
    {"id": "c3", "function": {"name": "h", "arguments": {"b": [1]}}},
]
_CALLS = st.sampled_from(
    [
        *_GOOD_CALLS,
        {**_CALL, "function": {"name": "f", "arguments": '{"a": '}},  # cut off
        {**_CALL, "function": {"arguments": "{}"}},
        "not a call",
    ]
)


def _call_rounds(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Assistant turns that call tools, each followed by its results."""
    messages: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(0, 2))):
        messages.append(
            {
                "role": "assistant",
                "content": draw(st.sampled_from([None, "", "calling"])),
                "reasoning_content": draw(st.sampled_from([None, "why"])),
                "tool_calls": draw(st.lists(_CALLS, min_size=1, max_size=2)),
            }
        )
        for _ in range(draw(st.integers(1, 2))):
            content = draw(st.sampled_from(["result", "", None]))
            messages.append({"role": "tool", "tool_call_id": "c1", "content": content})
    return messages


@st.composite
def _tool_rows(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """Tool-calling conversations, some then broken (a turn dropped, a role or a content
    changed, something not a message put in), and whether it is still whole: every call
    well formed, nothing broken."""
    messages: list[Any] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": "sys"})
    for t in range(draw(st.integers(1, 3))):
        messages += [{"role": "user", "content": f"u{t}"}, *_call_rounds(draw)]
        reasoning = draw(st.sampled_from([None, "why"]))
        messages.append({"role": "assistant", "content": f"a{t}", "reasoning_content": reasoning})
    whole = all(call in _GOOD_CALLS for m in messages for call in m.get("tool_calls") or [])
    for _ in range(draw(st.integers(0, 2))):
        whole = False
        i = draw(st.integers(0, len(messages) - 1))
        kind = draw(st.sampled_from(["drop", "role", "content", "object"]))
        if kind == "drop" and len(messages) > 1:
            del messages[i]
        elif kind == "role" and isinstance(messages[i], dict):
            role = draw(st.sampled_from(["system", "user", "assistant", "tool", None]))
            messages[i] = {**messages[i], "role": role}
        elif kind == "content" and isinstance(messages[i], dict):
            content = draw(st.sampled_from(["", None, ["a part"], "<think>x"]))
            messages[i] = {**messages[i], "content": content}
        elif kind == "object":
            messages.insert(i, "not a message")
    tools = draw(st.sampled_from([[], [{"type": "function", "function": {"name": "f"}}]]))
    row = {"id": "r1", "conversations": messages, "tools": tools, "status": "success"}
    return row, whole


#: Reasons that are SpecForge's parser's own doing: a turn dropped, a conversation cut, a
#: call or a content rendered other than written.
_PARSER_LOSSES = {"not_object", "role_order", "tool_call", "tool_arguments", "content_type"}


@settings(max_examples=400, deadline=None)
@given(_tool_rows())
def test_problem_is_what_specforges_parser_does(drawn: tuple[dict[str, Any], bool]) -> None:
    """A row with tool turns is taken whole, and refused for a loss only if SpecForge's
    parser would hand the chat template its messages other than written."""
    row, whole = drawn
    if not _tools(row):
        return
    found = specforge.problem(row)
    lost = specforge_parser.losses(row, specforge_parser.offline_row(row))
    if whole:
        assert found is None and not lost, (found, lost)
    if found is None:
        assert not lost, lost
    elif found[0] in _PARSER_LOSSES:
        assert lost, found


@settings(max_examples=200, deadline=None)
@given(_valid_rows(), st.integers(0, 1000))
def test_expansion_is_specforges(row: dict[str, Any], index: int) -> None:
    ours = list(turns.expand(row, "specforge", index, every_turn=True))
    # Ours keeps the row's tools on each of its rows; SpecForge's drops them.
    assert all(event.pop("tools", None) == row.get("tools") for event in ours)
    assert ours == sf_expand.expand_row(row, index)


@given(st.lists(st.text(st.characters(blacklist_characters="<"), min_size=1), min_size=1))
def test_inline_reasoning_leaves_earlier_turns(reasonings: list[str]) -> None:
    """With ``--reasoning inline`` an earlier turn loses its <think> block, nothing else
    (a reasoning that itself holds ``\n</think>\n\n`` cannot be told from its end)."""
    from orchestrator.formats.writers.lines import apply_reasoning

    messages: list[dict[str, Any]] = []
    for t, thought in enumerate(reasonings):
        answer = {"role": "assistant", "content": f"answer {t}", "reasoning_content": thought}
        messages += [{"role": "user", "content": f"q{t}"}, apply_reasoning(answer, "inline")]
    rows = list(turns.expand({"id": "x", "messages": messages}, "messages", 0,
                             every_turn=True, reasoning="inline"))  # fmt: skip
    last = rows[-1]["messages"]
    assert last[-1] == messages[-1]
    earlier = [m["content"] for m in last[:-1] if m["role"] == "assistant"]
    assert earlier == [f"answer {t}" for t in range(len(reasonings) - 1)]


def test_the_vendored_scripts_name_their_commit() -> None:
    assert specforge.SPECFORGE_COMMIT == SPECFORGE_COMMIT
    for script in SPECFORGE.glob("*.py"):
        assert SPECFORGE_COMMIT in script.read_text().splitlines()[1], script


def test_the_bundled_eagle3_run_for_specforge(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """The example run, answered by a reasoning server and exported one file per dataset:
    each file's rows without tool calls pass SpecForge's validator, those with them reach
    its parser whole, and nothing is lost between the files."""
    db = tmp_path / "run.db"
    enqueued = cli("enqueue", "--config", str(REPO / "examples/eagle3/run.toml"), "--db", str(db))
    assert enqueued.returncode == 0, enqueued.stderr
    server = sim_process("--mean-tokens", "24", "--reasoning", "field", "--model", "Qwen/Qwen3-8B")
    ran = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done", timeout=240)
    assert ran.returncode == 0, ran.stderr
    out = tmp_path / "eagle"
    done = cli("export", str(out), "--split", "--format", "specforge", "--db", str(db))
    assert done.returncode == 0, done.stderr
    written = skipped = failed = called = 0
    for path in sorted(out.glob("*.jsonl")):
        if path.stem.endswith(("_skipped", "_error")):
            continue
        rows = read_jsonl(path)
        plain = [row for row in rows if not _tools(row)]
        if plain:
            checked = run_script("validate_regenerated_data.py", "--data-path",
                                 str(write_jsonl(tmp_path / path.name, plain)),
                                 "--strict-think-markers", cwd=tmp_path)  # fmt: skip
            assert checked.returncode == 0 and "validation passed" in checked.stdout, path
        for row in rows:
            if _tools(row):
                called += 1
                lost = specforge_parser.losses(row, specforge_parser.offline_row(row))
                assert not lost, (row["id"], lost)
        refused = read_jsonl(path.with_name(f"{path.stem}_skipped.jsonl"))
        assert all(specforge.problem(row)[1] == row["error"] for row in refused), path
        assert all(validator_says(row) == row["error"] for row in refused if not _tools(row))
        if path.stem == "pretokenised":
            assert (len(rows), len(refused)) == (0, 20)
        written, skipped = written + len(rows), skipped + len(refused)
        failed += len(read_jsonl(path.with_name(f"{path.stem}_error.jsonl")))
    status = orjson.loads(cli("status", "--json", "--db", str(db)).stdout)
    assert written + skipped + failed == status["totals"]["counts"]["total"] == 324
    # Only the pre-tokenised set is set aside; the tool-call answers are written.
    assert f"skipped {skipped:,} rows" in done.stderr and skipped == 20 and called > 10


@pytest.mark.llamacpp
def test_a_llamacpp_run_for_specforge(llama: str, tmp_path: Path) -> None:  # noqa: F811
    """Turns regenerated by a real llama-server: the SpecForge file passes its validator,
    what is skipped carries the validator's reason, and the per-turn rows are one per
    generated turn, each ending with that turn as the whole conversation has it."""
    db = tmp_path / "q.db"
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(LLAMA_CONVERSATIONS)]
    data = write_jsonl(tmp_path / "multi.jsonl", rows)
    enqueued = cli("enqueue", str(data), "-d", "multi", "--regenerate", "all",
                   "--max-tokens", "8", "--model", LLAMA_MODEL, "--db", str(db))  # fmt: skip
    assert enqueued.returncode == 0, enqueued.stderr
    ran = cli("run", "--server", llama, "--db", str(db), "--exit-when-done")
    assert ran.returncode == 0, ran.stderr
    out, per_turn = tmp_path / "train.jsonl", tmp_path / "turns.jsonl"
    for target, more in ((out, ()), (per_turn, ("--per-turn",))):
        done = cli("export", str(target), "--format", "specforge", *more, "--db", str(db))
        assert done.returncode == 0, done.stderr
    lines, skipped = read_jsonl(out), read_jsonl(tmp_path / "train_skipped.jsonl")
    assert len(lines) + len(skipped) == 3
    assert all(validator_says(row) == row["error"] for row in skipped)
    if lines:
        checked = run_script("validate_regenerated_data.py", "--data-path", str(out),
                             "--strict-think-markers", cwd=tmp_path)  # fmt: skip
        assert checked.returncode == 0 and "validation passed" in checked.stdout
    expected = []
    for index, line in enumerate(lines):
        places = [i for i, m in enumerate(line["conversations"]) if m["role"] == "assistant"]
        for k, place in enumerate(places):
            expected.append((f"{line['id']}#turn{k}", index, line["conversations"][place]))
    got = [(r["id"], r["source_row_index"], r["conversations"][-1]) for r in read_jsonl(per_turn)]
    assert got == expected
