"""``orchestrator dataset set`` and ``dataset delete`` (and the Python API's same calls)
through the real command, on SQLite and PostgreSQL: a setting changes alone, a deletion
says what it takes, refuses what it must, and its undo puts every row back as it was."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
from click.testing import CliRunner

import orchestrator
from orchestrator.cli import main
from tests.helpers import db_snapshot, is_postgres, prompts, query, write_jsonl


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--log-level", "warning", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def execute(db: str, *statements: str) -> None:
    """Write statements on either backend, committed."""
    if not is_postgres(db):
        with closing(sqlite3.connect(db)) as conn:
            for sql in statements:
                conn.execute(sql)
            conn.commit()
        return

    async def run() -> None:
        import asyncpg

        conn = await asyncpg.connect(db)
        try:
            for sql in statements:
                await conn.execute(sql)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


def params(db: str, name: str = "d") -> dict[str, Any]:
    return orjson.loads(query(db, "SELECT params FROM datasets WHERE name = ?", name)[0][0])


def enqueued(db: str, tmp_path: Path, name: str = "d", n: int = 4) -> Path:
    path = write_jsonl(tmp_path / f"{name}.jsonl", prompts(n, prefix=name))
    code, _, err = invoke(
        "enqueue", str(path), "-d", name, "--db", db,
        "--model", "m", "--max-tokens", "2048", "--temperature", "0.6",
    )  # fmt: skip
    assert code == 0, err
    return path


def test_an_update_changes_the_setting_named_and_keeps_the_others(
    db_url: str, tmp_path: Path
) -> None:
    db = db_url
    path = enqueued(db, tmp_path)
    # The same file again without its parameters: they stay, nothing is refused.
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", db)
    assert code == 0, err
    assert "nothing new: all 4 items" in out
    code, out, err = invoke(
        "enqueue", str(path), "-d", "d", "--db", db, "--update", "--max-tokens", "4096"
    )
    assert code == 0, err
    assert "dataset 'd': max_tokens 2048 → 4096 on 4 pending items" in out
    assert "nothing new" not in out
    assert params(db) == {"model": "m", "max_tokens": 4096, "temperature": 0.6}
    # Without --update the refusal names the one command that changes it alone.
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", db, "--max-tokens", "8192")
    assert code == 2 and "`orchestrator dataset set d --max-tokens 8192`" in err
    code, out, err = invoke("dataset", "set", "d", "--db", db, "--max-tokens", "8192")
    assert code == 0, err
    assert "dataset 'd': max_tokens 4096 → 8192 on 4 pending items" in out
    assert params(db) == {"model": "m", "max_tokens": 8192, "temperature": 0.6}


def test_dataset_set_changes_knobs_and_unsets_and_refuses_what_does_nothing(
    db_url: str, tmp_path: Path
) -> None:
    db = db_url
    enqueued(db, tmp_path)
    execute(db, "UPDATE items SET state = 'done', finished_at = 1 WHERE key = 'd000000'")
    code, out, err = invoke(
        "dataset", "set", "d", "--db", db, "--unset", "temperature", "--concurrency", "3"
    )
    assert code == 0, err
    assert "temperature 0.6 → unset, concurrency unset → 3 on 3 pending items" in out
    assert params(db) == {"model": "m", "max_tokens": 2048}
    before = db_snapshot(db)
    for args, said in (
        ((), "name a setting"),
        (("--unset", "top_p"), "does not set top_p"),
        (("--temperature", "-1"), "-1"),
    ):
        code, _, err = invoke("dataset", "set", "d", "--db", db, *args)
        assert code == 2 and said in err, err
    code, _, err = invoke("dataset", "set", "nope", "--db", db, "--max-tokens", "5")
    assert code == 2 and "no such dataset: nope" in err
    assert db_snapshot(db) == before


def test_the_api_changes_one_setting_and_its_update_merges(db_url: str, tmp_path: Path) -> None:
    db = db_url
    enqueued(db, tmp_path)
    with orchestrator.open_sync(db) as q:
        report = q.set_dataset("d", max_tokens=4096)
        assert [str(c) for c in report.changed] == ["max_tokens 2048 → 4096"]
        assert report.pending == 4
        again = q.enqueue(prompts(4, prefix="d"), dataset="d", top_p=0.9, update=True)
        assert [str(c) for c in again.changed] == ["top_p unset → 0.9"]
    assert params(db) == {"model": "m", "max_tokens": 4096, "temperature": 0.6, "top_p": 0.9}


MOVED = (
    "datasets", "items", "outputs", "item_turns", "attempt_errors", "requeued_items",
    "superseded_outputs", "superseded_turns", "wasted_tokens",
)  # fmt: skip


def rows(db: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the tables a dataset lives in, as stored."""
    return {t: query(db, f"SELECT * FROM {t} ORDER BY 1, 2") for t in MOVED}


def answered(db: str, name: str) -> None:
    """The dataset's first item done with an answer, an attempt error and wasted tokens."""
    ds = f"(SELECT id FROM datasets WHERE name = '{name}')"
    first = f"(SELECT min(id) FROM items WHERE dataset_id = {ds})"
    execute(
        db,
        f"UPDATE items SET state = 'done', finished_at = 1.25 WHERE id = {first}",
        "INSERT INTO outputs (item_id, dataset_id, message, latency, attempt, created_at,"
        f' completion_tokens) SELECT {first}, {ds}, \'{{"content": "hi"}}\', 0.5, 1, 2.5, 7',
        "INSERT INTO item_turns (item_id, turn, message, latency, created_at)"
        f" SELECT {first}, 0, '{{}}', 0.5, 2.5",
        "INSERT INTO attempt_errors (item_id, dataset_id, attempt, error_class, outcome,"
        f" created_at) SELECT {first}, {ds}, 1, 'timeout', 'retry', 1.5",
        "INSERT INTO wasted_tokens (dataset_id, cause, requests, tokens, unknown, updated_at)"
        f" SELECT {ds}, 'retry', 1, 10, 0, 1.5",
    )


def test_delete_says_what_goes_refuses_answers_and_running_and_undo_restores_it(
    db_url: str, tmp_path: Path
) -> None:
    db = db_url
    enqueued(db, tmp_path, "keep")
    enqueued(db, tmp_path, "d")
    answered(db, "d")
    before = rows(db)
    snapshot = db_snapshot(db)
    code, out, err = invoke("dataset", "delete", "d", "--db", db, "--dry-run")
    assert code == 0, err
    assert "would delete dataset 'd' (dry run, nothing changed): 4 items (1 done, 3 pending)" in out
    assert "1 answers" in out and "--with-outputs" in out
    code, _, err = invoke("dataset", "delete", "d", "--db", db)
    assert code == 2 and "holds 1 answers" in err and "--with-outputs" in err
    assert db_snapshot(db) == snapshot
    execute(
        db,
        "UPDATE items SET state = 'running', lease_token = 't', lease_owner = 'w',"
        " lease_expires_at = 9e9 WHERE key = 'd000001'",
    )
    code, _, err = invoke("dataset", "delete", "d", "--db", db, "--with-outputs")
    assert code == 2 and "1 items running" in err and "orchestrator pause d" in err
    execute(
        db,
        "UPDATE items SET state = 'pending', lease_token = NULL, lease_owner = NULL,"
        " lease_expires_at = NULL WHERE key = 'd000001'",
    )
    code, out, err = invoke("dataset", "delete", "d", "--db", db, "--with-outputs")
    assert code == 0, err
    assert "deleted dataset 'd'" in out and "--undo" in out
    left = rows(db)
    assert [r[1] for r in left["datasets"]] == ["keep"]
    assert {r[1] for r in left["items"]} == {before["datasets"][0][0]}
    assert not left["outputs"] and not left["attempt_errors"] and not left["wasted_tokens"]
    code, out, _ = invoke("status", "--db", db, "--json")
    assert [d["name"] for d in orjson.loads(out)["datasets"]] == ["keep"]
    code, out, err = invoke("dataset", "delete", "d", "--undo", "--db", db)
    assert code == 0, err
    assert "brought back dataset 'd'" in out
    assert rows(db) == before
    code, _, err = invoke("dataset", "delete", "d", "--undo", "--db", db)
    assert code == 2 and "nothing to bring back" in err


def test_undo_after_a_new_dataset_took_the_ids_and_purge_ends_it(
    db_url: str, tmp_path: Path
) -> None:
    db = db_url
    enqueued(db, tmp_path, "d")
    before = rows(db)
    assert invoke("dataset", "delete", "d", "--db", db)[0] == 0
    enqueued(db, tmp_path, "other")
    code, _, err = invoke("dataset", "delete", "d", "--undo", "--db", db)
    assert code == 0, err
    back = query(db, "SELECT key, request, digest, state FROM items ORDER BY position, key")
    assert len(back) == 8
    keys = {r[0] for r in back}
    assert {r[2] for r in before["items"]} <= keys
    # A name taken since is refused; a purged deletion cannot come back.
    assert invoke("dataset", "delete", "other", "--db", db)[0] == 0
    enqueued(db, tmp_path, "other")
    code, _, err = invoke("dataset", "delete", "other", "--undo", "--db", db)
    assert code == 2 and "was made since the deletion" in err
    code, out, err = invoke("dataset", "purge", "other", "--db", db)
    assert code == 0 and "purged 1 deletion" in out, err
    code, _, err = invoke("dataset", "delete", "other", "--undo", "--db", db)
    assert code == 2 and "nothing to bring back" in err
    assert not query(db, "SELECT * FROM deleted_items")


def test_the_api_deletes_and_brings_back(db_url: str, tmp_path: Path) -> None:
    db = db_url
    enqueued(db, tmp_path, "d")
    answered(db, "d")
    before = rows(db)
    with orchestrator.open_sync(db) as q:
        plan = q.delete_dataset("d", dry_run=True)
        assert plan.deletion_id is None and plan.states == {"done": 1, "pending": 3}
        try:
            q.delete_dataset("d")
        except orchestrator.ConfigError as exc:
            assert "with_outputs=True" in str(exc)
        else:
            raise AssertionError("a dataset with answers was deleted without with_outputs")
        done = q.delete_dataset("d", with_outputs=True)
        assert done.deletion_id is not None and done.answers == 1
        assert q.status().datasets == {}
        q.undo_delete("d")
    assert rows(db) == before
