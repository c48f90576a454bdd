"""``orchestrator enqueue --config`` and ``orchestrator plan`` through the real CLI, on real
SQLite files: the bundled example, refused run files, a bad data line mid-run, --update,
and the plan's numbers from a database and from a run file."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from orchestrator.cli import enqueue as cli_enqueue
from orchestrator.cli import main
from orchestrator.formats.readers import rows as readers
from orchestrator.runfile import load_run
from tests.helpers import prompts, write_jsonl

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "eagle3" / "run.toml"

USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--log-level", "warning", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows(db: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, params).fetchall()


def test_cli_choices_match_the_library() -> None:
    assert cli_enqueue.INPUT_FORMATS is readers.INPUT_FORMATS


# --- enqueue --config ----------------------------------------------------------------------


def test_bundled_example_enqueues_all_ten_datasets(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    code, out, err = invoke("enqueue", "--config", str(EXAMPLE), "--db", str(db))
    assert code == 0, err
    plans = load_run(EXAMPLE)
    lines = out.splitlines()
    assert len(lines) == 11
    for plan, line in zip(plans, lines, strict=False):
        assert f"dataset {plan.name!r}" in line
    assert lines[-1] == (
        "total: 324 items added to 10 datasets (401 requests to generate, 50 rows stored as "
        "done, 0 already present)"
    )

    stored = {
        name: (n, done, turns)
        for name, n, done, turns in rows(
            db,
            "SELECT d.name, count(*), sum(i.state = 'done'), sum(i.turns) FROM items i"
            " JOIN datasets d ON d.id = i.dataset_id GROUP BY d.name",
        )
    }
    assert len(stored) == 10
    for plan in plans:
        n = sum(1 for line in plan.file.read_bytes().splitlines() if line.strip())
        done = n if plan.passthrough else 0
        assert stored[plan.name][:2] == (n, done), plan.name
    # agentic regenerates every assistant turn of its traces: the whole trace is stored.
    traces = [orjson.loads(line) for line in (EXAMPLE.parent / "data/agentic.jsonl").open("rb")]
    turns = sum(sum(m["role"] == "assistant" for m in t["messages"]) for t in traces)
    assert stored["agentic"][2] == turns
    requests = [
        orjson.loads(r) for (r,) in rows(db, "SELECT request FROM items WHERE key LIKE 'agent%'")
    ]
    assert [r["messages"] for r in requests] == [t["messages"] for t in traces]

    settings = {
        row[0]: row[1:]
        for row in rows(
            db,
            "SELECT name, params, concurrency, priority, regenerate, on_truncated, passthrough"
            " FROM datasets",
        )
    }
    for plan in plans:
        params, concurrency, priority, regenerate, on_truncated, passthrough = settings[plan.name]
        assert orjson.loads(params) == plan.params
        assert (concurrency, priority, bool(passthrough)) == (
            plan.concurrency,
            plan.priority,
            plan.passthrough,
        )
        assert (regenerate, on_truncated) == (plan.regenerate, plan.on_truncated)
    assert settings["toolcalls"][4] == "retry"
    assert rows(db, "SELECT count(*) FROM outputs") == [(50,)]

    # Again: nothing new, and the database does not change.
    code, out, err = invoke("enqueue", "--config", str(EXAMPLE), "--db", str(db))
    assert code == 0, err
    assert out.splitlines()[-1].endswith(
        "(0 requests to generate, 0 rows stored as done, 324 already present)"
    )
    assert rows(db, "SELECT count(*) FROM items") == [(324,)]


def small_run(folder: Path, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "a.jsonl", prompts(4, prefix="a"))
    write_jsonl(
        folder / "b.jsonl",
        [
            {"id": "b1", "messages": [USER, ANSWER, USER, ANSWER]},
            {"id": "b2", "messages": [USER, ANSWER, USER, ANSWER, USER, ANSWER]},
        ],
    )
    write_jsonl(folder / "f.jsonl", [{"messages": [USER, ANSWER]}, {"input_ids": [1, 2]}])
    path = folder / "run.toml"
    path.write_text(
        f"""
[defaults]
model = "m"
max_tokens = 100

[[dataset]]
name = "a"
file = "a.jsonl"
format = "messages"
{extra}
[[dataset]]
name = "b"
file = "b.jsonl"
max_tokens = 1000
regenerate = "all"
priority = 2

[[dataset]]
name = "f"
file = "f.jsonl"
passthrough = true
"""
    )
    return path


BAD_CONFIGS = [
    pytest.param("temprature = 0.5\n", 'dataset[1] "a".temprature: unknown key', id="unknown-key"),
    pytest.param('file = "nope.jsonl"\n', "no such file", id="missing-file"),
    pytest.param('max_tokens = "many"\n', "must be an integer", id="wrong-type"),
    pytest.param("top_p = 1.5\n", "must be in (0, 1], got 1.5", id="impossible-value"),
    pytest.param("concurrency = 0\n", "must be at least 1, got 0", id="impossible-concurrency"),
    pytest.param(
        "extra_body = { top_k = nan }\n",
        'dataset[1] "a".extra_body.top_k: must be a finite number, got nan',
        id="nan-in-extra-body",
    ),
    pytest.param(
        "chat_template_kwargs = { budget = -inf }\n",
        "chat_template_kwargs.budget: must be a finite number, got -inf",
        id="infinity-in-chat-template-kwargs",
    ),
]


@pytest.mark.parametrize(("extra", "reason"), BAD_CONFIGS)
def test_a_bad_run_file_enqueues_nothing(tmp_path: Path, extra: str, reason: str) -> None:
    db = tmp_path / "q.db"
    earlier = write_jsonl(tmp_path / "earlier.jsonl", prompts(2))
    assert invoke("enqueue", str(earlier), "-d", "earlier", "--db", str(db))[0] == 0
    before = sha(db)
    # The bad key comes after "file" (TOML: a later key of the same name is an error).
    config = small_run(tmp_path / "run", extra.replace('file = "nope.jsonl"', "priority = 1"))
    if "nope" in extra:
        config.write_text(config.read_text().replace('file = "a.jsonl"', 'file = "nope.jsonl"'))
    config.write_text(config.read_text() + "temperature = 0.5\n")  # a second problem
    code, out, err = invoke("enqueue", "--config", str(config), "--db", str(db))
    assert code == 2
    assert out == ""
    assert f"{config}: 2 problems:" in err
    assert reason in err
    assert 'dataset[3] "f".temperature: not allowed on a passthrough dataset' in err
    assert sha(db) == before
    # No database is created for a refused run file either.
    fresh = tmp_path / "fresh.db"
    assert invoke("enqueue", "--config", str(config), "--db", str(fresh))[0] == 2
    assert not fresh.exists()


def test_config_and_per_dataset_options_do_not_mix(tmp_path: Path) -> None:
    config = small_run(tmp_path)
    db = tmp_path / "q.db"
    code, _, err = invoke(
        "enqueue", "--config", str(config), "--db", str(db), "--model", "x", "-d", "a"
    )
    assert code == 2
    assert "--config takes every dataset setting from the run file: drop --dataset, --model" in err
    code, _, err = invoke("enqueue", "--db", str(db))
    assert code == 2 and "Missing argument 'SOURCE' (or --config RUN.toml)" in err
    assert not db.exists()


def test_bad_data_line_stops_the_run_file_keeping_what_came_before(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    config = small_run(tmp_path)
    bad = write_jsonl(
        tmp_path / "b.jsonl",
        [{"id": "b1", "messages": [USER, ANSWER]}, {"id": "b2", "messages": [ANSWER]}],
    )
    code, out, err = invoke("enqueue", "--config", str(config), "--db", str(db))
    assert code == 2
    assert out.splitlines() == ["enqueued 4 items into new dataset 'a' (0 already present)"]
    assert f"error: {bad}:2: no user message" in err
    assert (
        "stopped at dataset 'b' (2 of 3): nothing of it was enqueued; the datasets before it "
        "stay enqueued ('a')"
    ) in err
    assert rows(db, "SELECT name FROM datasets") == [("a",)]
    assert rows(db, "SELECT count(*) FROM items") == [(4,)]
    # Fixed, the same command finishes the run file.
    small_run(tmp_path)
    code, out, err = invoke("enqueue", "--config", str(config), "--db", str(db))
    assert code == 0, err
    assert "nothing new: all 4 items" in out
    assert out.splitlines()[-1] == (
        "total: 4 items added to 3 datasets (5 requests to generate, 2 rows stored as done, "
        "4 already present)"
    )


def test_changed_parameters_need_update_for_the_whole_run_file(tmp_path: Path) -> None:
    from orchestrator.store.datasets import params_hash

    db = tmp_path / "q.db"
    config = small_run(tmp_path)
    assert invoke("enqueue", "--config", str(config), "--db", str(db))[0] == 0
    before = sha(db)
    text = config.read_text()
    # Two datasets change: both are named, and nothing is written, not even the first.
    config.write_text(text.replace("= 1000", "= 9").replace("max_tokens = 100", "max_tokens = 200"))
    code, out, err = invoke("enqueue", "--config", str(config), "--db", str(db))
    assert code == 2 and out == ""
    assert f"{config}: nothing enqueued, 2 datasets refused:" in err
    assert (
        "dataset 'a' already exists with other request parameters (max_tokens: 100 -> 200)" in err
    )
    assert "dataset 'b' already exists with other request parameters (max_tokens: 1000 -> 9)" in err
    assert "--update" in err
    assert sha(db) == before
    # A changed kind is refused even with --update.
    config.write_text(text.replace('regenerate = "all"', 'regenerate = "last"'))
    code, _, err = invoke("enqueue", "--config", str(config), "--db", str(db), "--update")
    assert code == 2
    assert (
        "dataset 'b' already exists as another kind of dataset (regenerate: 'all' -> 'last')" in err
    )
    assert sha(db) == before

    config.write_text(text.replace("max_tokens = 100", "max_tokens = 200"))
    code, out, err = invoke("enqueue", "--config", str(config), "--db", str(db), "--update")
    assert code == 0, err
    params = dict(rows(db, "SELECT name, params FROM datasets"))
    assert orjson.loads(params["a"]) == {"model": "m", "max_tokens": 200}
    assert orjson.loads(params["f"]) == {"model": "m"}
    hashes = {h for (h,) in rows(db, "SELECT hash FROM param_sets")}
    assert params_hash({"model": "m", "max_tokens": 200}) in hashes
    assert params_hash({"model": "m", "max_tokens": 100}) in hashes


# --- plan --------------------------------------------------------------------------------------


def progress(db: Path) -> None:
    """In dataset a, two answers (30 and 50 tokens), one failure; b's second item is one
    turn in, its answer reporting no tokens."""
    from orchestrator.store import Failure, Output, Queue, open_database

    def output(tokens: int | None) -> Output:
        usage = {"prompt_tokens": 5, "completion_tokens": tokens} if tokens else None
        message = {"role": "assistant", "content": "x"}
        return Output(message, "x", None, "stop", usage, 0.1, None, "m", None)

    async def go() -> None:
        from orchestrator.store.rounds import Round

        database = await open_database(str(db))
        try:
            queue = Queue(database)
            leases = {lease.key: lease for lease in await queue.claim("w", 10, lease_seconds=60)}
            await queue.complete([(leases["a000000"], output(30)), (leases["a000001"], output(50))])
            await queue.fail([(leases["a000002"], Failure("http_400", "no"))])
            await queue.release(
                [(leases[k], Failure("connect", "x"), 0.0) for k in ("a000003", "b1")]
            )
            await queue.write_round(Round(advance=[(leases["b2"], output(None))]))
        finally:
            await database.close()

    asyncio.run(go())


def test_plan_from_the_database(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    config = small_run(tmp_path)
    assert invoke("enqueue", "--config", str(config), "--db", str(db))[0] == 0
    progress(db)

    code, out, err = invoke("plan", "--db", str(db), "--tokens-per-second", "10", "--json")
    assert code == 0, err
    plan = orjson.loads(out)
    assert plan["source"] == "database" and plan["tokens_per_second"] == 10
    a, b, f = plan["datasets"]
    assert (a["name"], a["mode"], a["rows"], a["requests"]) == ("a", "last", 4, 4)
    assert (a["done"], a["running"], a["pending"], a["failed"]) == (2, 0, 1, 1)
    assert a["measured"] and a["tokens_per_request"] == 40
    assert (a["generated_tokens"], a["remaining_tokens"]) == (160, 40)
    # b: 2 + 3 turns; b2 has one generated and is still running for the other two.
    assert (b["name"], b["mode"], b["rows"], b["requests"]) == ("b", "all", 2, 5)
    assert (b["done"], b["running"], b["pending"], b["failed"]) == (1, 2, 2, 0)
    # Its lines hold their answers ("a" each, a token an item): the 4 turns left count at
    # those, not at 0.35 x max_tokens.
    assert not b["measured"] and b["predicted"] == 4
    assert (b["generated_tokens"], b["remaining_tokens"]) == (2, 2)
    assert b["tokens_per_request"] == 0.4
    assert (f["mode"], f["rows"], f["requests"], f["remaining_tokens"]) == ("passthrough", 2, 0, 0)
    total = plan["total"]
    assert total["remaining_tokens"] == 40 + 2
    assert total["duration_seconds"] == 4.2
    assert total["db_bytes"] == sum(d["db_bytes"] for d in plan["datasets"])

    code, out, err = invoke("plan", "--db", str(db), "--tokens-per-second", "10")
    assert code == 0, err
    lines = out.splitlines()
    assert " ".join(lines[0].split()) == (
        "dataset format mode rows requests done running pending failed max_tokens"
        " tok/request tokens time left database"
    )
    row_a = next(line for line in lines if line.startswith("a "))
    assert row_a.split()[:12] == [
        "a",
        "messages",
        "last",
        "4",
        "4",
        "2",
        "0",
        "1",
        "1",
        "100",
        "40",
        "m",
    ]
    total_row = next(line for line in lines if line.startswith("total"))
    assert total_row.split()[1:7] == ["8", "9", "3", "2", "3", "1"]
    assert "42 tokens still to generate, 4s at 10 tok/s" in out


def test_plan_of_a_run_file_counts_answers_done(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    config = small_run(tmp_path)
    # No database yet: the run file alone, at the default rate; no database is created.
    code, out, err = invoke("plan", "--config", str(config), "--db", str(db), "--json")
    assert code == 0, err
    plan = orjson.loads(out)
    assert plan["source"] == "config" and plan["tokens_per_second"] == 850
    assert [d["requests"] for d in plan["datasets"]] == [4, 5, 0]
    assert [d["done"] for d in plan["datasets"]] == [0, 0, 0]
    assert not db.exists()

    assert invoke("enqueue", "--config", str(config), "--db", str(db))[0] == 0
    progress(db)
    code, out, err = invoke("plan", "--config", str(config), "--db", str(db), "--json")
    assert code == 0, err
    a, b, _ = orjson.loads(out)["datasets"]
    assert (a["done"], a["measured"], a["tokens_per_request"]) == (2, True, 40)
    assert (a["generated_tokens"], a["remaining_tokens"]) == (160, 80)
    assert (b["done"], b["measured"]) == (0, False)  # its answer reported no tokens
    code, out, err = invoke("plan", "--config", str(config), "--db", str(db))
    assert code == 0, err
    assert "at 850 tok/s" in out and " 40 m " in out


def test_plan_refusals(tmp_path: Path) -> None:
    db = tmp_path / "none.db"
    code, _, err = invoke("plan", "--db", str(db))
    assert code == 3 and f"no database at {db}" in err  # as for every read (docs/CONFIG.md)
    assert not db.exists()
    config = small_run(tmp_path, "top_p = 2\n")
    code, out, err = invoke("plan", "--config", str(config), "--db", str(db))
    assert code == 2 and out == ""
    assert 'dataset[1] "a".top_p: must be in (0, 1], got 2' in err
    code, _, err = invoke("plan", "--db", str(db), "--tokens-per-second", "0")
    assert code == 2
    empty = tmp_path / "empty.db"
    assert invoke("db", "upgrade", "--db", str(empty))[0] == 0
    code, out, _ = invoke("plan", "--db", str(empty))
    assert code == 0 and "nothing to plan" in out
