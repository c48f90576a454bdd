"""Run files (``orchestrator.runfile``): the bundled example, refusals, merging, planning."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest

from orchestrator.errors import ConfigError, InputError
from orchestrator.formats import iter_records
from orchestrator.runfile import (
    BYTES_PER_TOKEN,
    COMPLETION_FRACTION,
    ITEM_OVERHEAD_BYTES,
    OUTPUT_OVERHEAD_BYTES,
    DatasetPlan,
    RunConfigError,
    done_stats,
    load_run,
    plan_json,
    plan_run,
    plan_stored,
    render_plan,
)
from orchestrator.store.planning import StoredDataset

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "eagle3"
PER_REQUEST_OVERHEAD = ITEM_OVERHEAD_BYTES + OUTPUT_OVERHEAD_BYTES

SHORT = ("toolcalls", "code", "chat", "math", "multilingual", "longdoc", "writing")


def write_jsonl(path: Path, *rows: Any) -> Path:
    """Objects as JSON lines, strings verbatim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else orjson.dumps(r).decode() for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(folder: Path, text: str, name: str = "run.toml") -> Path:
    """A run file in ``folder``, with a one-prompt data.jsonl beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "data.jsonl").exists():
        write_jsonl(folder / "data.jsonl", {"prompt": "hi"})
    path = folder / name
    path.write_text(text)
    return path


def by_name(plans: list[DatasetPlan]) -> dict[str, DatasetPlan]:
    return {p.name: p for p in plans}


def load_make_data() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the bundled example -----------------------------------------------------------------------


def test_example_parses_into_ten_datasets() -> None:
    plans = load_run(EXAMPLE / "run.toml")
    assert [p.name for p in plans] == [*SHORT, "agentic", "final_chats", "pretokenised"]
    named = by_name(plans)

    for name in SHORT:
        plan = named[name]
        assert plan.concurrency == 150
        assert plan.params["max_tokens"] == 10240
        assert plan.params["model"] == "Qwen/Qwen3-8B"
        assert plan.regenerate == "last"
        assert not plan.passthrough

    agentic = named["agentic"]
    assert agentic.concurrency == 32
    assert agentic.params["max_tokens"] == 16384
    assert agentic.regenerate == "all"
    assert agentic.priority == 1
    assert not agentic.passthrough

    assert named["toolcalls"].on_truncated == "retry"
    assert named["code"].on_truncated == "keep"
    assert named["writing"].format == "openai-batch"
    assert named["chat"].params == {
        "model": "Qwen/Qwen3-8B",
        "max_tokens": 10240,
        "temperature": 0.7,
        "top_p": 0.8,
        "chat_template_kwargs": {"enable_thinking": False},
        "top_k": 20,
        "min_p": 0.0,
    }
    assert named["math"].params["chat_template_kwargs"] == {"enable_thinking": True}

    for name, fmt in (("final_chats", "messages"), ("pretokenised", "tokens")):
        plan = named[name]
        assert plan.passthrough
        assert plan.format == fmt
        assert plan.params == {"model": "Qwen/Qwen3-8B"}
        assert plan.concurrency is None

    for plan in plans:
        assert plan.file.is_absolute()
        assert plan.file.parent == EXAMPLE / "data"


def test_example_rows_are_valid_input() -> None:
    named = by_name(load_run(EXAMPLE / "run.toml"))
    for plan in named.values():
        if plan.format == "tokens":
            continue
        records = list(iter_records(plan.file))
        assert 20 <= len(records) <= 60, plan.name
        assert {r.fmt for r in records} == {plan.format}, plan.name

    for record in iter_records(named["toolcalls"].file):
        tools = record.request["tools"]
        assert tools and all(t["type"] == "function" for t in tools)
        assert record.request["messages"][-1]["role"] == "user"

    for line in named["agentic"].file.read_text().splitlines():
        row = orjson.loads(line)
        assert row["tools"]
        messages = row["messages"]
        calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
        assert len(calls) >= 3
        for i, message in enumerate(messages):
            for call in message.get("tool_calls") or []:
                assert orjson.loads(call["function"]["arguments"]) is not None
                results = [m for m in messages[i + 1 :] if m["role"] == "tool"]
                assert call["id"] in {m["tool_call_id"] for m in results}
        assert messages[-1]["role"] == "assistant"

    for line in named["final_chats"].file.read_text().splitlines():
        assert orjson.loads(line)["messages"][-1]["role"] == "assistant"
    for line in named["pretokenised"].file.read_text().splitlines():
        row = orjson.loads(line)
        assert len(row["input_ids"]) == len(row["loss_mask"]) and 1 in row["loss_mask"]


def test_example_data_is_what_make_data_writes(tmp_path: Path) -> None:
    counts = load_make_data().write_all(tmp_path)
    shipped = sorted(p.name for p in (EXAMPLE / "data").iterdir())
    assert sorted(counts) == shipped
    total = 0
    for name in shipped:
        data = (tmp_path / name).read_bytes()
        assert data == (EXAMPLE / "data" / name).read_bytes(), name
        total += len(data)
    assert total < 1_000_000


def test_example_plan() -> None:
    plans = load_run(EXAMPLE / "run.toml")
    plan = plan_run(plans, tokens_per_second=2000)
    named = {d.name: d for d in plan.datasets}
    assert named["code"].rows == named["code"].requests == 40
    assert named["final_chats"].requests == 0 and named["final_chats"].rows == 30
    # Every assistant turn of the agentic traces is a request (none precede the user turn).
    agentic = by_name(plans)["agentic"].file.read_text().splitlines()
    turns = sum(
        sum(m["role"] == "assistant" for m in orjson.loads(line)["messages"]) for line in agentic
    )
    assert named["agentic"].rows == 24
    assert named["agentic"].requests == turns
    assert plan.requests == sum(d.requests for d in plan.datasets)
    text = render_plan(plan)
    for name in named:
        assert name in text


# --- refusals ------------------------------------------------------------------------------


GOOD_DATASET = '[[dataset]]\nname = "d"\nfile = "data.jsonl"\nmax_tokens = 100\n'

BAD = [
    pytest.param(
        GOOD_DATASET + "max_token = 5\n",
        'dataset[1] "d".max_token',
        'unknown key; did you mean "max_tokens"?',
        id="unknown-dataset-key",
    ),
    pytest.param(
        "[defaults]\ntemprature = 0.5\n" + GOOD_DATASET,
        "defaults.temprature",
        'unknown key; did you mean "temperature"?',
        id="unknown-defaults-key",
    ),
    pytest.param(
        "[[datasets]]\nname = 'x'\n" + GOOD_DATASET,
        "datasets",
        'unknown key; did you mean "dataset"?',
        id="unknown-top-key",
    ),
    pytest.param(
        GOOD_DATASET + "topk = 20\n",
        'dataset[1] "d".topk',
        "did you mean extra_body.top_k?",
        id="extra-body-hint",
    ),
    pytest.param(
        GOOD_DATASET + "seed = 1\n",
        'dataset[1] "d".seed',
        "go in extra_body.seed",
        id="extra-body-field",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "nope.jsonl"\nmax_tokens = 1\n',
        'dataset[1] "d".file',
        "no such file: ",
        id="missing-file",
    ),
    pytest.param(
        GOOD_DATASET.replace("100", '"100"'),
        'dataset[1] "d".max_tokens',
        'must be an integer, got a string ("100")',
        id="wrong-type-int",
    ),
    pytest.param(
        GOOD_DATASET + "passthrough = 'yes'\n",
        'dataset[1] "d".passthrough',
        "must be true or false",
        id="wrong-type-bool",
    ),
    pytest.param(
        GOOD_DATASET + "chat_template_kwargs = 'thinking'\n",
        'dataset[1] "d".chat_template_kwargs',
        "must be a table",
        id="wrong-type-table",
    ),
    pytest.param(
        GOOD_DATASET + "temperature = true\n",
        'dataset[1] "d".temperature',
        "must be a number, got a boolean (true)",
        id="wrong-type-number",
    ),
    pytest.param(
        '[dataset]\nname = "d"\nfile = "data.jsonl"\n',
        "dataset",
        "must be an array of tables ([[dataset]])",
        id="dataset-not-array",
    ),
    pytest.param(
        GOOD_DATASET.replace("100", "0"),
        'dataset[1] "d".max_tokens',
        "must be at least 1, got 0",
        id="max-tokens-zero",
    ),
    pytest.param(
        GOOD_DATASET + "concurrency = 0\n",
        'dataset[1] "d".concurrency',
        "must be at least 1, got 0",
        id="concurrency-zero",
    ),
    pytest.param(
        GOOD_DATASET + "temperature = -0.1\n",
        'dataset[1] "d".temperature',
        "must be at least 0, got -0.1",
        id="temperature-negative",
    ),
    pytest.param(
        GOOD_DATASET + "temperature = nan\n",
        'dataset[1] "d".temperature',
        "must be a finite number",
        id="temperature-nan",
    ),
    pytest.param(
        GOOD_DATASET + "top_p = 0\n",
        'dataset[1] "d".top_p',
        "must be in (0, 1], got 0",
        id="top-p-zero",
    ),
    pytest.param(
        "[defaults]\ntop_p = 1.5\n" + GOOD_DATASET,
        "defaults.top_p",
        "must be in (0, 1], got 1.5",
        id="top-p-above-one",
    ),
    pytest.param(
        GOOD_DATASET + "regenerate = 'every'\n",
        'dataset[1] "d".regenerate',
        'must be one of last | all | each, got "every"',
        id="regenerate-value",
    ),
    pytest.param(
        GOOD_DATASET + "on_truncated = 'retyr'\n",
        'dataset[1] "d".on_truncated',
        'got "retyr"; did you mean "retry"?',
        id="on-truncated-value",
    ),
    pytest.param(
        GOOD_DATASET + "format = 'csv'\n",
        'dataset[1] "d".format',
        'must be one of auto | messages | sharegpt | prompt | openai-batch | tokens, got "csv"',
        id="format-value",
    ),
    pytest.param(
        GOOD_DATASET + GOOD_DATASET,
        'dataset[2] "d".name',
        'duplicate: dataset[1] "d" has the same name',
        id="duplicate-name",
    ),
    pytest.param(
        "[defaults]\nmax_tokens = 10\n",
        "dataset",
        "no datasets",
        id="no-datasets",
    ),
    pytest.param("dataset = []\n", "dataset", "no datasets", id="empty-dataset-list"),
    pytest.param(
        'dataset = ["data.jsonl"]\n',
        "dataset[1]",
        "must be a table ([[dataset]]), got a string",
        id="dataset-entry-not-table",
    ),
    pytest.param(
        "defaults = 3\n" + GOOD_DATASET,
        "defaults",
        "must be a table ([defaults]), got an integer (3)",
        id="defaults-not-table",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\nmax_tokens = \n',
        "",
        "not valid TOML: Invalid value (at line 4, column 14)",
        id="toml-syntax",
    ),
    pytest.param(
        '[[dataset]]\nfile = "data.jsonl"\nmax_tokens = 1\n',
        "dataset[1].name",
        "missing (required)",
        id="missing-name",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nmax_tokens = 5\n',
        'dataset[1] "d".file',
        "missing (required)",
        id="missing-file-key",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\n',
        'dataset[1] "d".max_tokens',
        "missing: a dataset that sends requests needs max_tokens",
        id="missing-max-tokens",
    ),
    pytest.param(
        "[defaults]\nname = 'x'\n" + GOOD_DATASET,
        "defaults.name",
        "belongs to each [[dataset]], not to [defaults]",
        id="name-in-defaults",
    ),
    pytest.param(
        GOOD_DATASET + "[dataset.extra_body]\nmax_tokens = 5\n",
        'dataset[1] "d".extra_body.max_tokens',
        'set it as the key "max_tokens" (outside extra_body)',
        id="extra-body-shadows-key",
    ),
    pytest.param(
        GOOD_DATASET + "[dataset.extra_body]\nwhen = 2024-01-01\n",
        'dataset[1] "d".extra_body.when',
        "a date or time has no JSON form",
        id="extra-body-date",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\npassthrough = true\ntemperature = 0.5\n',
        'dataset[1] "d".temperature',
        "not allowed on a passthrough dataset: its rows are stored as they are and no "
        "request is sent, so sampling fields do not apply",
        id="passthrough-sampling",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\npassthrough = true\n'
        "[dataset.extra_body]\ntop_k = 5\n",
        'dataset[1] "d".extra_body',
        "sampling fields do not apply",
        id="passthrough-extra-body",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\npassthrough = true\nconcurrency = 4\n',
        'dataset[1] "d".concurrency',
        "no request is sent, so concurrency does not apply",
        id="passthrough-concurrency",
    ),
    pytest.param(
        '[[dataset]]\nname = "d"\nfile = "data.jsonl"\npassthrough = true\nformat = "prompt"\n',
        'dataset[1] "d".format',
        '"prompt" rows hold no answer to pass through',
        id="passthrough-prompt-format",
    ),
    pytest.param(
        GOOD_DATASET + 'format = "tokens"\n',
        'dataset[1] "d".format',
        '"tokens" rows are pre-tokenised training rows, not prompts: they need passthrough',
        id="tokens-without-passthrough",
    ),
]


@pytest.mark.parametrize(("text", "where", "reason"), BAD)
def test_bad_input_is_refused(tmp_path: Path, text: str, where: str, reason: str) -> None:
    path = write_config(tmp_path / "cfg", text)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(RunConfigError) as info:
        load_run(path)
    err = info.value
    assert isinstance(err, ConfigError) and err.exit_code == 2
    assert err.path == str(path)
    assert str(err).startswith(f"{path}: ")
    matching = [p for p in err.problems if p.where == where and reason in p.reason]
    assert matching, err.problems
    assert len(err.problems) == 1, err.problems
    assert str(err) == f"{path}: {matching[0]}"
    # Refused as a whole: nothing written beside the config, no plans returned.
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_every_problem_is_reported_together(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "[defaults]\nmax_tokens = 0\n"
        '[[dataset]]\nname = "a"\nfile = "data.jsonl"\ntop_p = 2\n'
        '[[dataset]]\nname = "code"\nfile = "missing.jsonl"\n'
        '[[dataset]]\nname = "c"\nfile = "data.jsonl"\nmax_tokens = -3\nregenerate = "x"\n',
    )
    with pytest.raises(RunConfigError) as info:
        load_run(path)
    wheres = [p.where for p in info.value.problems]
    assert wheres == [
        "defaults.max_tokens",
        'dataset[1] "a".top_p',
        'dataset[2] "code".file',
        'dataset[3] "c".max_tokens',
        'dataset[3] "c".regenerate',
    ]
    message = str(info.value)
    assert message.startswith(f"{path}: 5 problems:\n")
    assert '\n  dataset[3] "c".max_tokens: must be at least 1, got -3' in message


def test_a_folder_without_data_files_is_refused(tmp_path: Path) -> None:
    """A folder is a source of shards; one with none in it is the dataset's problem."""
    path = write_config(
        tmp_path / "cfg", '[[dataset]]\nname = "d"\nfile = "empty"\nmax_tokens = 1\n'
    )
    (tmp_path / "cfg" / "empty").mkdir()
    with pytest.raises(RunConfigError) as info:
        load_run(path)
    [problem] = info.value.problems
    assert problem.where == 'dataset[1] "d".file'
    assert problem.reason.startswith("is a directory with no data files in it (")
    assert problem.reason.endswith(f": {tmp_path / 'cfg' / 'empty'}")


def test_config_file_problems(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="no such file"):
        load_run(tmp_path / "absent.toml")
    with pytest.raises(RunConfigError, match="is a directory"):
        load_run(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'# caf\xe9\n[[dataset]]\nname = "d"\n')
    with pytest.raises(RunConfigError, match=r"not UTF-8 \(byte 0xe9 at offset 5\)"):
        load_run(bad)


# --- paths and merging ---------------------------------------------------------------------


def test_file_paths_are_relative_to_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_jsonl(tmp_path / "shared" / "a.jsonl", {"prompt": "a"})
    write_jsonl(tmp_path / "runs" / "b.jsonl", {"prompt": "b"})
    absolute = write_jsonl(tmp_path / "elsewhere" / "c.jsonl", {"prompt": "c"})
    path = write_config(
        tmp_path / "runs",
        "[defaults]\nmax_tokens = 10\n"
        '[[dataset]]\nname = "a"\nfile = "../shared/a.jsonl"\n'
        '[[dataset]]\nname = "b"\nfile = "b.jsonl"\n'
        f'[[dataset]]\nname = "c"\nfile = "{absolute}"\n',
    )
    monkeypatch.chdir(tmp_path / "elsewhere")
    plans = by_name(load_run(os.path.relpath(path)))
    assert plans["a"].file == tmp_path / "shared" / "a.jsonl"
    assert plans["b"].file == tmp_path / "runs" / "b.jsonl"
    assert plans["c"].file == absolute


def test_defaults_overrides_and_extra_body_merge(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
[defaults]
model = "m"
max_tokens = 1000
temperature = 0.6
top_p = 0.95
concurrency = 150
regenerate = "last"
on_truncated = "keep"
priority = 2
chat_template_kwargs = { enable_thinking = true, thinking_budget = 512 }
[defaults.extra_body]
top_k = 20
min_p = 0.1

[[dataset]]
name = "plain"
file = "data.jsonl"

[[dataset]]
name = "tuned"
file = "data.jsonl"
format = "prompt"
max_tokens = 50
temperature = 0
concurrency = 3
priority = -1
regenerate = "all"
on_truncated = "fail"
chat_template_kwargs = { enable_thinking = false }
[dataset.extra_body]
top_k = 5
repetition_penalty = 1.05
""",
    )
    plans = by_name(load_run(path))
    plain, tuned = plans["plain"], plans["tuned"]
    assert plain.params == {
        "model": "m",
        "max_tokens": 1000,
        "temperature": 0.6,
        "top_p": 0.95,
        "chat_template_kwargs": {"enable_thinking": True, "thinking_budget": 512},
        "top_k": 20,
        "min_p": 0.1,
    }
    assert (plain.format, plain.concurrency, plain.priority) == ("auto", 150, 2)
    assert (plain.regenerate, plain.on_truncated, plain.passthrough) == ("last", "keep", False)
    assert tuned.params == {
        "model": "m",
        "max_tokens": 50,
        "temperature": 0,
        "top_p": 0.95,
        "chat_template_kwargs": {"enable_thinking": False, "thinking_budget": 512},
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.05,
    }
    assert (tuned.format, tuned.concurrency, tuned.priority) == ("prompt", 3, -1)
    assert (tuned.regenerate, tuned.on_truncated) == ("all", "fail")


def test_unset_fields_stay_out_of_params(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[[dataset]]\nname = "d"\nfile = "data.jsonl"\nmax_tokens = 9\n')
    (plan,) = load_run(path)
    assert plan.params == {"max_tokens": 9}
    assert plan.concurrency is None
    assert (plan.format, plan.priority, plan.regenerate, plan.on_truncated) == (
        "auto",
        0,
        "last",
        "keep",
    )


def test_passthrough_takes_only_the_model_from_defaults(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        '[defaults]\nmodel = "m"\nmax_tokens = 10\ntemperature = 0.6\nconcurrency = 5\n'
        'regenerate = "all"\n[defaults.extra_body]\ntop_k = 20\n'
        '[[dataset]]\nname = "p"\nfile = "data.jsonl"\npassthrough = true\npriority = 3\n',
    )
    (plan,) = load_run(path)
    assert plan.passthrough
    assert plan.params == {"model": "m"}
    assert plan.concurrency is None
    assert plan.priority == 3
    assert (plan.regenerate, plan.on_truncated) == ("last", "keep")


# --- planning ------------------------------------------------------------------------------


def request_bytes(path: Path) -> int:
    return sum(len(orjson.dumps(r.request)) for r in iter_records(path))


def small_run(tmp_path: Path) -> list[DatasetPlan]:
    user = {"role": "user", "content": "q"}
    answer = {"role": "assistant", "content": "a"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    write_jsonl(
        tmp_path / "prompts.jsonl",
        {"prompt": "one"},
        "",
        {"prompt": "two", "max_tokens": 100},
        {"messages": [user, answer]},
    )
    write_jsonl(
        tmp_path / "turns.jsonl",
        {"messages": [user, answer, user, answer]},  # 2
        {
            "messages": [
                {"role": "system", "content": "s"},
                user,
                call,
                result,
                call,
                result,
                answer,
            ]
        },
        {"prompt": "alone"},  # 1
        {"messages": [user, answer, user]},  # 2: one turn, then the missing final answer
        {"messages": [user, call, result]},  # 2: the call, then the answer after the tool
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},  # 1
        {"messages": [{"role": "assistant", "content": "hello"}, user, answer]},  # 1
    )
    write_jsonl(
        tmp_path / "final.jsonl",
        {"messages": [user, answer]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    )
    write_jsonl(
        tmp_path / "tokens.jsonl",
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 5], "loss_mask": [0, 1], "id": "t2"},
    )
    path = write_config(
        tmp_path,
        """
[defaults]
max_tokens = 1000
[[dataset]]
name = "prompts"
file = "prompts.jsonl"
[[dataset]]
name = "turns"
file = "turns.jsonl"
max_tokens = 200
regenerate = "all"
[[dataset]]
name = "final"
file = "final.jsonl"
passthrough = true
[[dataset]]
name = "tokens"
file = "tokens.jsonl"
format = "tokens"
passthrough = true
""",
    )
    return load_run(path)


def test_plan_counts_and_assumed_tokens(tmp_path: Path) -> None:
    plans = small_run(tmp_path)
    plan = plan_run(plans, tokens_per_second=10)
    prompts, turns, final, tokens = plan.datasets

    assert (prompts.rows, prompts.requests, prompts.mode) == (3, 3, "last")
    # 0.35 x (1000 + 100): the second row's own max_tokens wins; the third row holds an
    # answer ("a", a token) and counts at its length.
    assert prompts.generated_tokens == prompts.remaining_tokens == 385 + 1
    assert not prompts.measured and prompts.predicted == 1
    assert prompts.tokens_per_request == pytest.approx(386 / 3)
    assert prompts.duration_seconds == pytest.approx(38.6)
    assert prompts.request_bytes == request_bytes(tmp_path / "prompts.jsonl")
    assert prompts.output_bytes == 386 * BYTES_PER_TOKEN * 2
    assert prompts.overhead_bytes == 3 * PER_REQUEST_OVERHEAD
    assert prompts.db_bytes == prompts.request_bytes + 386 * 8 + 3 * PER_REQUEST_OVERHEAD

    assert (turns.rows, turns.requests, turns.mode) == (7, 2 + 3 + 1 + 2 + 2 + 1 + 1, "all")
    # The rows that hold every turn to generate (7 turns in 4 rows) count at the length of
    # their answers, a token each; the other 5 turns are assumed.
    assert turns.predicted == 7
    assert turns.generated_tokens == 4 + round(5 * 200 * COMPLETION_FRACTION)
    assert turns.max_tokens == 200
    # Each turn carries the conversation before it: more bytes than the rows' last requests.
    assert turns.request_bytes > request_bytes(tmp_path / "turns.jsonl")

    for passed, rows in ((final, 2), (tokens, 2)):
        assert passed.mode == "passthrough"
        assert (passed.rows, passed.requests, passed.generated_tokens) == (rows, 0, 0)
        assert passed.duration_seconds == 0
        assert passed.overhead_bytes == rows * PER_REQUEST_OVERHEAD
    lines = (tmp_path / "tokens.jsonl").read_bytes().splitlines()
    assert tokens.request_bytes == sum(len(line) for line in lines)

    assert (plan.rows, plan.requests, plan.done) == (14, 15, 0)
    assert plan.generated_tokens == 386 + 354
    assert plan.duration_seconds == pytest.approx((386 + 354) / 10)
    assert plan.db_bytes == sum(d.db_bytes for d in plan.datasets)


def test_plan_tokens_from_done_stats(tmp_path: Path) -> None:
    plans = small_run(tmp_path)
    stats = {"prompts": (2, 50.0), "turns": (0, 999.0), "unknown": (5, 1.0)}
    plan = plan_run(plans, tokens_per_second=4, done_stats=stats)
    prompts, turns = plan.datasets[:2]
    assert prompts.measured and prompts.done == 2
    # The two rows without an answer of their own at the measured mean, the third at
    # its answer's length (a token); a third of the requests are left.
    assert prompts.generated_tokens == 2 * 50 + 1
    assert prompts.tokens_per_request == pytest.approx(101 / 3)
    assert prompts.remaining_tokens == round(101 / 3)
    assert prompts.duration_seconds == pytest.approx(34 / 4)
    assert prompts.output_bytes == 101 * BYTES_PER_TOKEN * 2
    # No answers done yet: still the assumption.
    assert not turns.measured and turns.generated_tokens == 354
    assert plan.remaining_tokens == 34 + 354
    assert plan.duration_seconds == pytest.approx(388 / 4)

    text = render_plan(plan)
    assert " 34 p " in text and " 30 p " in text
    assert " ".join(text.splitlines()[0].split()) == (
        "dataset format mode rows requests done max_tokens tok/request tokens time left database"
    )
    assert "- m: tokens per request measured" in text
    assert "- a: tokens per request assumed, 0.35 x max_tokens" in text
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert total.split()[1:4] == ["14", "15", "2"]


@pytest.mark.parametrize("rate", [0, -1, math.inf, math.nan])
def test_plan_needs_a_positive_rate(tmp_path: Path, rate: float) -> None:
    with pytest.raises(ConfigError, match="tokens per second"):
        plan_run(small_run(tmp_path), tokens_per_second=rate)


@pytest.mark.parametrize(
    ("name", "rows", "toml", "reason"),
    [
        pytest.param(
            "bad.jsonl",
            [{"prompt": "ok"}, "{nope"],
            "",
            "invalid JSON",
            id="bad-line",
        ),
        pytest.param(
            "mixed.jsonl",
            [{"prompt": "ok"}, {"messages": [{"role": "user", "content": "q"}]}],
            'format = "prompt"',
            'a messages line in a dataset declared format = "prompt"',
            id="format-mismatch",
        ),
        pytest.param(
            "final.jsonl",
            [
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"},
                    ]
                },
                {"messages": [{"role": "user", "content": "q"}]},
            ],
            "passthrough = true",
            "a passthrough row must end with the assistant's answer",
            id="passthrough-without-answer",
        ),
        pytest.param(
            "final.jsonl",
            [
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"},
                    ]
                },
                {"prompt": "q"},
            ],
            "passthrough = true",
            "a prompt line holds no answer to pass through",
            id="passthrough-prompt-line",
        ),
        pytest.param(
            "tokens.jsonl",
            [{"input_ids": [1], "loss_mask": [1]}, {"input_ids": [1, 2], "loss_mask": [1]}],
            'passthrough = true\nformat = "tokens"',
            "loss_mask must be a list as long as input_ids (2)",
            id="tokens-mask-length",
        ),
    ],
)
def test_plan_reports_bad_lines(
    tmp_path: Path, name: str, rows: list[Any], toml: str, reason: str
) -> None:
    write_jsonl(tmp_path / name, *rows)
    max_tokens = "" if "passthrough" in toml else "max_tokens = 10\n"
    path = write_config(tmp_path, f'[[dataset]]\nname = "d"\nfile = "{name}"\n{max_tokens}{toml}\n')
    with pytest.raises(InputError) as info:
        plan_run(load_run(path), tokens_per_second=1)
    assert info.value.path == str(tmp_path / name)
    assert info.value.line == 2
    assert reason in str(info.value)


def test_the_documented_example_is_valid(tmp_path: Path) -> None:
    text = (REPO / "docs" / "CONFIG.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "data").symlink_to(EXAMPLE / "data")
    plans = by_name(load_run(write_config(tmp_path, example)))
    assert list(plans) == ["toolcalls", "chat", "agentic", "final_chats", "pretokenised"]
    assert plans["chat"].params["top_k"] == 40
    assert plans["chat"].params["min_p"] == 0.0
    assert plans["chat"].params["chat_template_kwargs"] == {"enable_thinking": False}
    assert plans["agentic"].params["top_k"] == 20
    assert plans["final_chats"].passthrough and plans["final_chats"].params == {
        "model": "Qwen/Qwen3-8B"
    }


def test_the_documented_table_sources_example_is_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second example: a glob of Parquet shards, a Hub dataset (here a local folder
    laid out as its repository, which load_dataset resolves from the working directory)
    and a save_to_disk folder, with their files made as the example names them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = (REPO / "docs" / "CONFIG.md").read_text()
    example = text.split("```toml\n")[2].split("```", 1)[0]
    (tmp_path / "numina" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"problem": ["1+1?"]}), tmp_path / "numina/data/train-0.parquet")
    (tmp_path / "ORG" / "squad-like" / "data").mkdir(parents=True)
    qa = pa.table({"id": ["q1"], "question": ["who?"], "context": ["me."]})
    pq.write_table(qa, tmp_path / "ORG/squad-like/data/train-00000-of-00001.parquet")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "qa.toml").write_text(
        'system = "Answer from the context."\nuser = "Context: {context}\\n{question}"\n'
    )
    datasets.Dataset.from_dict(
        {"conversations": [[{"from": "human", "value": "hi"}]]}
    ).save_to_disk(tmp_path / "exports" / "sharegpt")
    monkeypatch.chdir(tmp_path)
    plans = by_name(load_run(write_config(tmp_path, example)))
    assert list(plans) == ["math", "qa", "sharegpt"]
    assert plans["math"].columns is not None and plans["math"].columns.template
    assert (plans["qa"].source, plans["qa"].split) == ("hf://ORG/squad-like", "train")
    assert plans["sharegpt"].columns is None
    assert plan_run(list(plans.values()), tokens_per_second=1).rows == 3


def test_plan_reads_rows_as_enqueue_does(tmp_path: Path) -> None:
    # Token rows without loss_mask are fine; a regenerate = "all" row without a user turn
    # is refused as enqueue refuses it.
    write_jsonl(tmp_path / "tokens.jsonl", {"input_ids": [1, 2]}, {"input_ids": [3]})
    write_jsonl(
        tmp_path / "turns.jsonl",
        {"messages": [{"role": "user", "content": "q"}]},
        {"messages": [{"role": "assistant", "content": "a"}]},
    )
    path = write_config(
        tmp_path,
        '[[dataset]]\nname = "t"\nfile = "tokens.jsonl"\nformat = "tokens"\npassthrough = true\n'
        '[[dataset]]\nname = "a"\nfile = "turns.jsonl"\nmax_tokens = 10\nregenerate = "all"\n',
    )
    plans = load_run(path)
    assert plan_run(plans[:1], tokens_per_second=1).datasets[0].rows == 2
    with pytest.raises(InputError, match=r"turns.jsonl:2: no user message"):
        plan_run(plans, tokens_per_second=1)


def stored(name: str, mode: str = "last", **fields: Any) -> StoredDataset:
    values: dict[str, Any] = {
        "name": name,
        "format": "messages",
        "mode": mode,
        "params": {"max_tokens": 100},
        "items": 4,
        "requests": 4,
        "done": 1,
        "running": 1,
        "pending": 2,
        "failed": 0,
        "request_bytes": 1000,
        "answers": 1,
        "completion_tokens": 60,
        "answer_turns": 1,
    }
    values.update(fields)
    return StoredDataset(**values)


def test_plan_stored_and_done_stats() -> None:
    held = [
        stored("measured"),
        stored("assumed", answers=0, completion_tokens=0, answer_turns=0, done=0, pending=3),
        stored("no-limit", params={}, answers=0, completion_tokens=0, answer_turns=0, done=0),
        stored("turns", "all", answers=1, completion_tokens=90, answer_turns=3, requests=7),
        stored("passed", "passthrough", requests=0, done=0, running=0, pending=0, answers=0),
    ]
    # The third figure: new answers per predicted token (1: no item had a prediction).
    assert done_stats(held) == {"measured": (1, 60.0, 1.0), "turns": (1, 30.0, 1.0)}
    plan = plan_stored(held, tokens_per_second=10)
    measured, assumed, no_limit, turns, passed = plan.datasets
    assert (measured.generated_tokens, measured.remaining_tokens) == (240, 180)
    assert assumed.tokens_per_request == 35 and assumed.remaining_tokens == 4 * 35
    assert no_limit.generated_tokens == 0 and no_limit.max_tokens is None
    assert (turns.tokens_per_request, turns.generated_tokens) == (30, 210)
    assert passed.generated_tokens == 0 and passed.overhead_bytes == 4 * PER_REQUEST_OVERHEAD
    assert plan.duration_seconds == pytest.approx(plan.remaining_tokens / 10)
    notes = " ".join(plan.assumptions)
    assert "datasets without max_tokens and without answers yet count no tokens" in notes
    assert "running and pending requests only" in notes
    assert render_plan(plan).splitlines()[0].split()[6:9] == ["running", "pending", "failed"]
    doc = plan_json(plan)
    assert doc["source"] == "database"
    assert doc["datasets"][0]["running"] == 1 and doc["total"]["requests"] == plan.requests
    assert "running" not in plan_json(plan_run([], tokens_per_second=1))["total"]
