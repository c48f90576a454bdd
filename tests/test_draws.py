"""Several samples per prompt (``enqueue --samples N``), through the real command: each
sample its own item and its own draw, asked with ``n`` in one request or one request
each, exactly once through a SIGKILL, added later, requeued one at a time, exported a
line each or grouped. Every answer is checked against the oracle: the simulated
server's answer to the prompt, drawn with that sample's seed."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.items.samples import seed_of
from orchestrator.sim import answer_matches
from tests.helpers import (
    SimProcess,
    cli,
    db_snapshot,
    events,
    prompts,
    query,
    start_worker,
    write_jsonl,
)


def _enqueue(db: str, data: Path, *extra: str, dataset: str = "d") -> str:
    result = cli("enqueue", str(data), "-d", dataset, "--db", db, "--max-tokens", "16", *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _run(db: str, server: SimProcess, *extra: str) -> str:
    result = cli(
        "--log-json", "run", "--server", server.url, "--db", db, "--exit-when-done", *extra
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def _export(db: str, out: Path, *extra: str) -> list[dict[str, Any]]:
    result = cli("export", str(out), "--db", db, *extra)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def _check(lines: list[dict[str, Any]], keys: list[str], samples: int, seeds: Any = None) -> None:
    """Each (prompt, sample) once, in order, each answer the draw of its own seed."""
    assert [(line["id"], line["sample"]) for line in lines] == [
        (key, s) for key in keys for s in range(samples)
    ]
    for line in lines:
        *prompt, answer = line["messages"]
        seed = seed_of(line["id"], line["sample"], seeds)
        assert answer_matches(prompt, answer, seed), (line["id"], line["sample"])
    per_prompt: dict[str, set[str]] = {}
    for line in lines:
        per_prompt.setdefault(line["id"], set()).add(line["messages"][-1]["content"])
    assert all(len(answers) == samples for answers in per_prompt.values())  # distinct draws


def test_sigkill_mid_run_then_resume_gives_every_sample_exactly_once(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--latency", "0.05")
    keys = [f"p{i:06d}" for i in range(60)]
    data = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    assert "240 samples, 4 per prompt" in _enqueue(db_url, data, "--samples", "4")
    worker = start_worker(db_url, server.url, "--concurrency", "8", "--lease-seconds", "4")
    deadline = time.monotonic() + 120
    while query(db_url, "SELECT count(*) FROM items WHERE state = 'done'")[0][0] < 40:
        assert worker.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait(30)
    assert query(db_url, "SELECT count(*) FROM items WHERE state = 'done'")[0][0] < 240
    _run(db_url, server, "--concurrency", "8")
    _check(_export(db_url, tmp_path / "out.jsonl"), keys, 4)
    assert query(db_url, "SELECT count(*) FROM outputs") == [(240,)]
    # Samples of one prompt went out together: fewer requests than samples.
    assert server.stats()["chat_requests"] < 200
    status = json.loads(cli("status", "--json", "--db", db_url).stdout)["datasets"][0]
    assert status["samples"] == 4 and status["prompts"] == {"total": 60, "done": 60}
    assert status["counts"]["done"] == 240


def test_every_request_asks_for_all_of_its_prompts_samples(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """No claim or slot cuts a prompt's samples in two: the scouts, the trial and every
    later claim take a prompt with all its samples, and a request of four waits for four
    free slots rather than going out with fewer."""
    server = sim_process("--latency", "0.02")
    keys = [f"p{i:06d}" for i in range(30)]
    _enqueue(db_url, write_jsonl(tmp_path / "in.jsonl", prompts(30)), "--samples", "4")
    _run(db_url, server, "--concurrency", "10")
    _check(_export(db_url, tmp_path / "out.jsonl"), keys, 4)
    assert server.stats()["chat_requests"] == 30


def test_a_server_that_ignores_n_is_asked_a_request_per_sample(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--ignore-n")
    db = str(tmp_path / "q.db")
    keys = [f"p{i:06d}" for i in range(12)]
    _enqueue(db, write_jsonl(tmp_path / "in.jsonl", prompts(12)), "--samples", "3")
    stderr = _run(db, server, "--concurrency", "6")
    ignored = [e for e in events(stderr) if e["event"] == "n_ignored"]
    assert len(ignored) == 1 and ignored[0]["asked"] > ignored[0]["choices"] == 1, ignored
    assert query(db, "SELECT draw_mode FROM datasets") == [("seeds",)]
    _check(_export(db, tmp_path / "out.jsonl"), keys, 3)
    # The answer it did give was kept: one request per sample, none more.
    assert server.stats()["chat_requests"] == 36


def test_sample_requests_seeds_sends_one_request_per_sample_with_the_given_seeds(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    db = str(tmp_path / "q.db")
    keys = [f"p{i:06d}" for i in range(5)]
    data = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    _enqueue(db, data, "--samples", "3", "--seeds", "7,70,700", "--sample-requests", "seeds")
    _run(db, server, "--stream")
    _check(_export(db, tmp_path / "out.jsonl"), keys, 3, seeds=(7, 70, 700))
    assert server.stats()["chat_requests"] == 15


def test_adding_samples_later_adds_only_the_missing_ones(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    keys = [f"p{i:06d}" for i in range(8)]
    data = write_jsonl(tmp_path / "in.jsonl", prompts(8))
    _enqueue(db_url, data, "--samples", "2")
    _run(db_url, server)
    before = query(db_url, "SELECT item_id, created_at, message FROM outputs ORDER BY item_id")
    assert "added 16 samples to the 8 prompts" in _enqueue(db_url, data, "--samples", "4")
    assert "nothing new" in _enqueue(db_url, data, "--samples", "4")
    assert query(db_url, "SELECT count(*) FROM items") == [(32,)]
    _run(db_url, server)
    after = query(db_url, "SELECT item_id, created_at, message FROM outputs ORDER BY item_id")
    assert after[: len(before)] == before  # the first samples were not asked again
    _check(_export(db_url, tmp_path / "out.jsonl"), keys, 4)
    fewer = cli("enqueue", str(data), "-d", "d", "--db", db_url, "--max-tokens", "16",
                "--samples", "2")  # fmt: skip
    assert fewer.returncode != 0 and "cannot have fewer (2)" in fewer.stderr


@pytest.mark.parametrize(
    ("extra", "rows", "message"),
    [
        (("--samples", "3", "--seeds", "1,2,1"), None, "seed 1 is given twice"),
        (("--samples", "2", "--seeds", "1,2,3"), None, "3 seeds for 2 samples"),
        (("--samples", "2", "--param", "seed=5"), None, "a seed in the parameters"),
        (("--samples", "2",), [{"id": "s", "messages": [{"role": "user", "content": "x"}],
                               "seed": 3}], "key 's' sets its own seed"),
    ],
    ids=["repeated", "count", "param", "line"],
)  # fmt: skip
def test_the_same_seed_twice_is_refused_and_nothing_is_written(
    tmp_path: Path, extra: tuple[str, ...], rows: Any, message: str
) -> None:
    db = str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    _enqueue(db, data, dataset="other")
    before = db_snapshot(db)
    data = write_jsonl(tmp_path / "in.jsonl", rows or prompts(3))
    result = cli("enqueue", str(data), "-d", "d", "--db", db, *extra)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert db_snapshot(db) == before


def test_a_run_file_refuses_repeated_seeds(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl", prompts(2))
    run = tmp_path / "run.toml"
    run.write_text(
        '[[dataset]]\nname = "d"\nfile = "in.jsonl"\nmax_tokens = 8\nsamples = 2\nseeds = [4, 4]\n'
    )
    result = cli("enqueue", "--config", str(run), "--db", str(tmp_path / "q.db"))
    assert result.returncode != 0 and "holds 4 twice" in result.stderr, result.stderr


def test_requeue_one_sample_and_on_truncated_act_per_sample(
    db_url: str, tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    keys = [f"p{i:06d}" for i in range(4)]
    _enqueue(db_url, write_jsonl(tmp_path / "in.jsonl", prompts(4)), "--samples", "3")
    _run(db_url, server)
    result = cli("requeue", "--state", "done", "--key", "p000002", "--sample", "1", "--db", db_url)
    assert result.returncode == 0, result.stderr
    assert query(db_url, "SELECT key, sample FROM items WHERE state = 'pending'") == [
        ("p000002", 1)
    ]
    _run(db_url, server)
    _check(_export(db_url, tmp_path / "out.jsonl"), keys, 3)
    shown = cli("inspect", "--dataset", "d", "--id", "p000002", "--json", "--db", db_url)
    records = [json.loads(line) for line in shown.stdout.splitlines()]
    # Samples 0 and 2 went as choices of one request seeded as sample 0; 1 went alone.
    assert [(r["draw"], r["request"]["seed"], r["request"].get("n")) for r in records] == [
        (0, seed_of("p000002", 0), 3),
        (1, seed_of("p000002", 1), None),
        (2, seed_of("p000002", 0), 3),
    ]
    assert len(records[1]["requeues"]) == 1 and not records[0]["requeues"]
    # Every answer is cut at 16 tokens: with --on-truncated fail each sample fails alone.
    data = write_jsonl(tmp_path / "t.jsonl", prompts(2, prefix="t"))
    _enqueue(db_url, data, "--samples", "2", "--on-truncated", "fail", dataset="t")
    result = cli("run", "--server", server.url, "--db", db_url, "--exit-when-done")
    assert result.returncode == 6, result.stderr
    failed = query(
        db_url,
        "SELECT key, sample, error_class FROM items WHERE state = 'failed' ORDER BY key, sample",
    )
    assert failed == [(f"t00000{i}", s, "truncated") for i in range(2) for s in range(2)]


def test_export_groups_a_prompts_samples_in_every_format(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    db = str(tmp_path / "q.db")
    keys = [f"p{i:06d}" for i in range(5)]
    _enqueue(db, write_jsonl(tmp_path / "in.jsonl", prompts(5)), "--samples", "3")
    _run(db, server)
    each = _export(db, tmp_path / "each.jsonl")
    _check(each, keys, 3)
    grouped = _export(db, tmp_path / "g.jsonl", "--group-samples")
    assert [line["id"] for line in grouped] == keys
    for line, sample_lines in zip(grouped, [each[i : i + 3] for i in range(0, 15, 3)], strict=True):
        assert line["messages"] == sample_lines[0]["messages"][:-1]
        assert [a["sample"] for a in line["answers"]] == [0, 1, 2]
        assert [a["message"] for a in line["answers"]] == [s["messages"][-1] for s in sample_lines]
        assert [a["finish_reason"] for a in line["answers"]] == ["length"] * 3
    share = _export(db, tmp_path / "s.jsonl", "--group-samples", "--format", "sharegpt")
    assert [len(line["answers"]) for line in share] == [3] * 5
    assert all(a["message"]["from"] == "gpt" for line in share for a in line["answers"])
    assert all(line["conversations"][-1]["from"] == "human" for line in share)
    batch = _export(db, tmp_path / "b.jsonl", "--group-samples", "--format", "openai-batch")
    for line, sample_lines in zip(batch, [each[i : i + 3] for i in range(0, 15, 3)], strict=True):
        choices = line["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert [c["message"] for c in choices] == [s["messages"][-1] for s in sample_lines]
    flat = _export(db, tmp_path / "f.jsonl", "--format", "openai-batch")
    assert [(line["custom_id"], line["sample"]) for line in flat] == [
        (key, s) for key in keys for s in range(3)
    ]


def test_regenerate_all_gives_each_sample_its_own_conversation(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    from tests.helpers import dialogue

    server = sim_process()
    db = str(tmp_path / "q.db")
    rows = [{"id": f"c{i}", "messages": dialogue(f"q{i}", "a", "more", "b")} for i in range(3)]
    _enqueue(db, write_jsonl(tmp_path / "in.jsonl", rows), "--samples", "2", "--regenerate", "all")
    _run(db, server)
    lines = _export(db, tmp_path / "out.jsonl")
    assert [(line["id"], line["sample"]) for line in lines] == [
        (f"c{i}", s) for i in range(3) for s in range(2)
    ]
    for line in lines:
        seed = seed_of(line["id"], line["sample"])
        first, answer, more, last = line["messages"]
        assert answer_matches([first], answer, seed)
        sent_back = {"role": "assistant", "content": answer["content"]}
        assert answer_matches([first, sent_back, more], last, seed)
    grouped = _export(db, tmp_path / "g.jsonl", "--group-samples")
    assert [len(line["answers"][0]["messages"]) for line in grouped] == [4] * 3


def test_migration_keeps_every_answer_of_an_older_database(tmp_path: Path) -> None:
    """0013 rebuilds items on SQLite: the outputs, turns and requeues that reference its
    rows must all be there after it (a cascade from the old table would delete them)."""
    from alembic import command
    from sqlalchemy import create_engine, event

    from orchestrator.store.migrate import alembic_config

    db = tmp_path / "q.db"
    _enqueue(str(db), write_jsonl(tmp_path / "in.jsonl", prompts(3)))
    with closing(sqlite3.connect(db)) as conn:
        conn.execute(
            "INSERT INTO outputs (item_id, dataset_id, message, latency, attempt, created_at)"
            " SELECT id, dataset_id, '{}', 0, 1, 0 FROM items"
        )
        conn.execute("UPDATE items SET state = 'done'")
        conn.commit()
    engine = create_engine(f"sqlite:///{db}")
    event.listen(engine, "connect", lambda c, _: c.execute("PRAGMA foreign_keys = ON"))
    for target in ("0014", "0015"):
        with engine.begin() as conn:
            (command.downgrade if target == "0014" else command.upgrade)(
                alembic_config(conn), target
            )
        assert query(db, "SELECT count(*) FROM outputs") == [(3,)], target
        assert query(db, "PRAGMA foreign_key_check") == []
    engine.dispose()
    assert query(db, "SELECT sample FROM items") == [(0,), (0,), (0,)]
    assert query(db, "PRAGMA integrity_check") == [("ok",)]


def test_plan_counts_every_sample_and_says_how_they_are_asked(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", prompts(10))
    run = tmp_path / "run.toml"
    run.write_text(
        '[defaults]\nmax_tokens = 100\n[[dataset]]\nname = "a"\nfile = "a.jsonl"\n'
        'samples = 4\n[[dataset]]\nname = "b"\nfile = "a.jsonl"\nsamples = 2\n'
        'sample_requests = "seeds"\n[[dataset]]\nname = "c"\nfile = "a.jsonl"\n'
    )
    result = cli("plan", "--config", str(run), "--json", "--db", str(tmp_path / "q.db"))
    assert result.returncode == 0, result.stderr
    doc = {d["name"]: d for d in json.loads(result.stdout)["datasets"]}
    assert [doc[n]["requests"] for n in "abc"] == [40, 20, 10]
    assert [doc[n]["generated_tokens"] for n in "abc"] == [4 * doc["c"]["generated_tokens"],
                                                          2 * doc["c"]["generated_tokens"],
                                                          doc["c"]["generated_tokens"]]  # fmt: skip
    assert [doc[n]["sample_requests"] for n in "abc"] == ["n", "seeds", None]
    text = cli("plan", "--config", str(run), "--db", str(tmp_path / "q.db")).stdout
    assert "a: 4 samples per prompt" in " ".join(text.split())
    assert "asked with n=4 in one request" in " ".join(text.split())
    assert "b: 2 samples per prompt, each counted as a request, one request per sample" in (
        " ".join(text.split())
    )


def test_several_servers_with_auto_concurrency_one_ignoring_n(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Two servers, caps tuned from their metrics: the one that ignores n turns the
    dataset to a request per sample for both, logged once, and every sample is still
    its own draw, once."""
    honest, ignoring = (
        sim_process("--latency", "0.02"),
        sim_process("--ignore-n", "--latency", "0.02"),
    )
    db = str(tmp_path / "q.db")
    keys = [f"p{i:06d}" for i in range(40)]
    _enqueue(db, write_jsonl(tmp_path / "in.jsonl", prompts(40)), "--samples", "3")
    argv = ("--log-json", "run", "--server", honest.url, "--server", ignoring.url)
    result = cli(*argv, "--db", db, "--exit-when-done", "--concurrency", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    ignored = [e for e in events(result.stderr) if e["event"] == "n_ignored"]
    assert len(ignored) <= 1
    mode = "seeds" if ignored else "n"
    assert query(db, "SELECT draw_mode FROM datasets") == [(mode,)]
    assert all(e["server"] == ignoring.url for e in ignored)
    _check(_export(db, tmp_path / "out.jsonl"), keys, 3)
    requests = honest.stats()["chat_requests"] + ignoring.stats()["chat_requests"]
    assert requests <= 120


def test_specforge_rows_name_their_sample_and_cannot_be_grouped(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    db = str(tmp_path / "q.db")
    _enqueue(db, write_jsonl(tmp_path / "in.jsonl", prompts(2)), "--samples", "2")
    _run(db, server)
    rows = _export(db, tmp_path / "sf.jsonl", "--format", "specforge")
    assert [(r["id"], r["sample"]) for r in rows] == [
        (f"p00000{i}#sample{s}", s) for i in range(2) for s in range(2)
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for extra in (("--format", "specforge"), ("--per-turn",)):
        result = cli("export", str(tmp_path / "g.jsonl"), "--db", db, "--group-samples", *extra)
        assert result.returncode != 0 and "--group-samples" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
