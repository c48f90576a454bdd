"""``orchestrator enqueue`` through the real CLI: formats, idempotency, bad input."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from tests.helpers import ANSWER, CALL, RESULT, db_snapshot, prompts, query, write_jsonl


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--log-level", "warning", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def snapshot_file(db: Path | str) -> str:
    """The SQLite file's bytes, or on PostgreSQL every row: a refused enqueue leaves both."""
    return db_snapshot(db)


def count_items(db: Path | str) -> int:
    return query(db, "SELECT count(*) FROM items")[0][0]


def test_all_formats_and_keys(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "chat-1", "messages": [{"role": "user", "content": "hi"}]},
            {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "x"}]},
            {"prompt": "write a haiku", "system": "be brief"},
            {
                "custom_id": "batch-7",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "q"}]},
            },
        ],
    )
    code, out, err = invoke("enqueue", str(path), "--dataset", "mix", "--db", str(db))
    assert code == 0, err
    assert "enqueued 4 items" in out
    keys = [r[0] for r in query(db, "SELECT key FROM items ORDER BY position")]
    [(fmt, params)] = query(db, "SELECT input_format, params FROM datasets")
    assert keys == ["chat-1", "2", "3", "batch-7"]
    assert fmt == "mixed" or fmt in {"messages", "sharegpt"}
    assert params == "{}"


def test_enqueue_is_idempotent(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", prompts(50))
    args = ("enqueue", str(path), "--dataset", "d", "--db", str(db), "--max-tokens", "100")
    assert invoke(*args)[0] == 0
    code, out, _ = invoke(*args)
    assert code == 0
    assert "nothing new: all 50 items" in out
    assert count_items(db) == 50
    # Appending lines adds only those.
    write_jsonl(path, prompts(60))
    code, out, _ = invoke(*args)
    assert "enqueued 10 items into existing dataset 'd' (50 already present)" in out
    assert count_items(db) == 60


def test_changed_content_or_params_are_refused(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    assert invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--model", "a")[0] == 0
    before = snapshot_file(db)
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--model", "b")
    assert code == 2
    assert "already exists with other request parameters (model: 'a' -> 'b')" in err
    changed = prompts(3)
    changed[1]["messages"][0]["content"] = "something else"
    write_jsonl(path, changed)
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--model", "a")
    assert code == 2
    assert (
        f"{path}:2: key 'p000001' is already enqueued in dataset 'd' with different content" in err
    )
    assert snapshot_file(db) == before


BAD_LINES = {
    "truncated": (b'{"messages": [{"role": "user", "content": "hi"', "invalid JSON"),
    "wrong_type": (b'{"messages": "hello"}', "messages must be a list"),
    "empty_messages": (b'{"messages": []}', "messages is empty"),
    "missing_messages": (b'{"id": "x"}', "expected one of"),
    "unknown_role": (b'{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot'"),
    "invalid_utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid UTF-8"),
    "duplicate_key": (
        b'{"id": "p000000", "messages": [{"role": "user", "content": "z"}]}',
        "duplicate key 'p000000' (first on line 1)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line_and_writes_nothing(
    db_url: str, tmp_path: Path, case: str
) -> None:
    db = db_url
    good = write_jsonl(tmp_path / "good.jsonl", prompts(5, prefix="g"))
    assert invoke("enqueue", str(good), "-d", "d", "--db", str(db))[0] == 0
    before = snapshot_file(db)
    line, reason = BAD_LINES[case]
    rows: list[object] = [*prompts(3), line, *prompts(2, prefix="q")]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db))
    assert code == 2
    assert f"{bad}:4: " in err and reason in err
    assert out == ""
    assert snapshot_file(db) == before
    # --skip-invalid takes the good lines, lists and counts the bad one.
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db), "--skip-invalid")
    assert code == 0
    assert f"skipped {bad}:4: " in err
    assert "1 invalid lines skipped" in out
    assert count_items(db) == 5 + 5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b""), "no records"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: None, "no such file"),
    ],
)
def test_bad_files(db_url: str, tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    db = db_url
    target = tmp_path / "input.jsonl"
    make(target)
    code, _, err = invoke("enqueue", str(target), "-d", "d", "--db", str(db))
    assert code == 2
    assert message in err and str(target) in err


def test_bom_and_crlf_are_accepted(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = tmp_path / "win.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "a"}]}\r\n{"prompt": "b"}\r\n'
    )
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert count_items(db) == 2


def test_database_file_is_private(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    path = write_jsonl(tmp_path / "in.jsonl", prompts(1))
    invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert db.stat().st_mode & 0o777 == 0o600


def test_a_50_mb_line_is_taken_whole(db_url: str, tmp_path: Path) -> None:
    db = db_url
    big = "word " * (10 * 1024 * 1024)  # 50 MiB of content on one line
    path = write_jsonl(
        tmp_path / "big.jsonl",
        [*prompts(2), {"id": "huge", "messages": [{"role": "user", "content": big}]}],
    )
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert "enqueued 3 items" in out
    [(length,)] = query(db, "SELECT length(request) FROM items WHERE key = 'huge'")
    assert length > 50 * 1024 * 1024


# --- batches ---------------------------------------------------------------------------------
# Enqueue inserts in batches, on SQLite while the next batch is read; with batches of three
# lines, a few lines exercise what a million would: duplicates across batches, a bad line
# while a batch is still being written, a file that overlaps what is stored.


@pytest.fixture(params=["sqlite", "portable"])
def small_batches(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of three lines, through the SQLite writer or the portable one (PostgreSQL's)."""
    module = importlib.import_module("orchestrator.store.loading")
    monkeypatch.setattr(module, "BATCH", 3)
    if request.param == "portable":

        async def portable(conn, database, context):  # type: ignore[no-untyped-def]
            return module._Writer(context, conn)

        monkeypatch.setattr(module, "_writer", portable)


def item_rows(db: Path | str) -> list[tuple[Any, ...]]:
    return query(db, "SELECT key, position, request, digest FROM items ORDER BY id")


@pytest.mark.usefixtures("small_batches")
def test_batches_keep_file_order_and_content(db_url: str, tmp_path: Path) -> None:
    db = db_url
    lines = prompts(10)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert "enqueued 10 items into new dataset 'd'" in out
    rows = item_rows(db)
    assert [(key, position) for key, position, _, _ in rows] == [
        (line["id"], n) for n, line in enumerate(lines, start=1)
    ]
    for (_, _, request, digest), line in zip(rows, lines, strict=True):
        body = {"messages": line["messages"]}
        assert request == orjson.dumps(body).decode()
        assert digest == hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


@pytest.mark.usefixtures("small_batches")
@pytest.mark.parametrize("first", [2, 5])  # same batch as the repeat, or an earlier one
def test_duplicate_key_in_any_batch(db_url: str, tmp_path: Path, first: int) -> None:
    db = db_url
    good = write_jsonl(tmp_path / "good.jsonl", prompts(2, prefix="g"))
    assert invoke("enqueue", str(good), "-d", "d", "--db", str(db))[0] == 0
    before = snapshot_file(db)
    lines = prompts(10)
    lines[5] = {**lines[5], "id": lines[first - 1]["id"]}  # line 6 repeats line `first`
    bad = write_jsonl(tmp_path / "bad.jsonl", lines)
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db))
    assert code == 2
    key = lines[first - 1]["id"]
    assert f"{bad}:6: duplicate key {key!r} (first on line {first})" in err
    assert out == ""
    assert snapshot_file(db) == before
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db), "--skip-invalid")
    assert code == 0, err
    assert f"skipped {bad}:6: duplicate key" in err
    assert "enqueued 9 items into existing dataset 'd' (0 already present, 1 invalid" in out
    assert count_items(db) == 2 + 9
    # The line kept is the first one, at its own position.
    [(position,)] = query(db, "SELECT position FROM items WHERE key = ?", key)
    assert position == 2 + first


@pytest.mark.usefixtures("small_batches")
def test_earlier_duplicate_is_reported_before_a_later_bad_line(db_url: str, tmp_path: Path) -> None:
    db = db_url
    lines: list[object] = [*prompts(8)]
    lines[4] = {**prompts(1)[0]}  # line 5 repeats line 1 (second batch)
    lines[7] = b"{not json"  # line 8, read while the second batch is being written
    bad = write_jsonl(tmp_path / "bad.jsonl", lines)
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db))
    assert code == 2
    assert f"{bad}:5: duplicate key 'p000000' (first on line 1)" in err
    assert out == ""
    assert count_items(db) == 0


@pytest.mark.usefixtures("small_batches")
def test_bad_line_in_a_late_batch_writes_nothing(db_url: str, tmp_path: Path) -> None:
    db = db_url
    good = write_jsonl(tmp_path / "good.jsonl", prompts(4, prefix="g"))
    assert invoke("enqueue", str(good), "-d", "d", "--db", str(db))[0] == 0
    before = snapshot_file(db)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*prompts(13), b'{"messages": []}', *prompts(2)])
    code, _, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db))
    assert code == 2
    assert f"{bad}:14: messages is empty" in err
    assert snapshot_file(db) == before
    assert count_items(db) == 4


@pytest.mark.usefixtures("small_batches")
def test_overlapping_file_adds_only_new_lines(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", prompts(7))
    assert invoke("enqueue", str(path), "-d", "d", "--db", str(db))[0] == 0
    # New lines before, among and after the stored ones, over several batches.
    lines = [*prompts(3, prefix="a"), *prompts(7), *prompts(5, prefix="z")]
    lines.insert(6, prompts(1, prefix="m")[0])
    write_jsonl(path, lines)
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert "enqueued 9 items into existing dataset 'd' (7 already present)" in out
    keys = [key for key, *_ in item_rows(db)]
    assert keys == [line["id"] for line in prompts(7)] + [
        line["id"] for line in lines if not line["id"].startswith("p")
    ]
    code, out, _ = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert "nothing new: all 16 items" in out
    # A changed line late in the file is refused, and nothing else of the file is taken.
    before = snapshot_file(db)
    lines[-1] = {**lines[-1], "messages": [{"role": "user", "content": "changed"}]}
    write_jsonl(path, [*lines, *prompts(2, prefix="n")])
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 2
    assert f"{path}:16: key 'z000004' is already enqueued in dataset 'd' with different" in err
    assert snapshot_file(db) == before


async def test_records_and_prepared_lines_store_the_same(
    backend: str, pg_database: Callable[[], str], tmp_path: Path
) -> None:
    from orchestrator.formats import iter_prepared, iter_records
    from orchestrator.store import DatasetSpec, enqueue, open_database

    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            *prompts(3),
            {"conversations": [{"from": "human", "value": "hello"}], "system": "brief"},
            {"prompt": "a haiku", "max_tokens": 20, "tag": "x"},
            {
                "custom_id": "b-1",
                "body": {"model": "m", "messages": [{"role": "user", "content": "q"}]},
            },
        ],
    )
    stored = []
    for name, lines in (("records", iter_records(path)), ("prepared", iter_prepared(path))):
        db = pg_database() if backend == "postgresql" else str(tmp_path / f"{name}.db")
        database = await open_database(db)
        try:
            report = await enqueue(database, DatasetSpec("d"), lines, path=str(path))
        finally:
            await database.close()
        assert report.added == 6
        assert report.formats == {"messages": 3, "sharegpt": 1, "prompt": 1, "openai-batch": 1}
        stored.append(item_rows(db))
    assert stored[0] == stored[1]


# --- regenerate, pass-through, token rows, --update ------------------------------------------

USER = {"role": "user", "content": "q"}


def rows(db: Path | str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    return query(db, sql, *params)


def claim_all(db: Path | str) -> list[Any]:
    """What a worker would be given: every claimable item, through the real queue."""
    from orchestrator.store import Queue, open_database

    async def go() -> list[Any]:
        database = await open_database(str(db))
        try:
            return await Queue(database).claim("test-worker", 1000, lease_seconds=60)
        finally:
            await database.close()

    return asyncio.run(go())


CONVERSATIONS = [
    {"id": "c1", "messages": [USER, ANSWER, USER, ANSWER]},
    {"id": "c2", "messages": [USER, CALL, RESULT, CALL, RESULT, ANSWER]},
    {"id": "c3", "messages": [USER, ANSWER, USER]},
    {
        "id": "c4",
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
        "system": "s",
    },
    {"id": "c5", "prompt": "q"},
]


def test_regenerate_all_stores_whole_conversations(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--regenerate", "all")
    assert code == 0, err
    assert "enqueued 5 items into new dataset 'd' (0 already present; 9 turns to generate)" in out
    stored = rows(db, "SELECT key, request, state, turn, turns FROM items ORDER BY position")
    assert [(key, state, turn, turns) for key, _, state, turn, turns in stored] == [
        ("c1", "pending", 0, 2),
        ("c2", "pending", 0, 3),
        ("c3", "pending", 0, 2),
        ("c4", "pending", 0, 1),
        ("c5", "pending", 0, 1),
    ]
    messages = [orjson.loads(request)["messages"] for _, request, *_ in stored]
    assert messages[:3] == [line["messages"] for line in CONVERSATIONS[:3]]
    assert messages[3] == [{"role": "system", "content": "s"}, USER, ANSWER]
    assert rows(db, "SELECT regenerate FROM datasets") == [("all",)]
    # Appended lines are read the way the dataset was made, without repeating the option.
    write_jsonl(path, [*CONVERSATIONS, {"id": "c6", "messages": [USER, ANSWER, USER, ANSWER]}])
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert "enqueued 1 items into existing dataset 'd' (5 already present; 2 turns" in out
    assert rows(db, "SELECT turns, request FROM items WHERE key = 'c6'") == [
        (2, orjson.dumps({"messages": [USER, ANSWER, USER, ANSWER]}).decode())
    ]
    # The worker is handed the whole conversation and its turn count.
    leases = {lease.key: lease for lease in claim_all(db)}
    assert leases["c2"].turns == 3 and leases["c2"].turn == 0
    assert leases["c2"].request["messages"] == CONVERSATIONS[1]["messages"]


def test_regenerate_all_bad_line_and_kind_change(db_url: str, tmp_path: Path) -> None:
    db = db_url
    good = write_jsonl(tmp_path / "good.jsonl", CONVERSATIONS)
    assert invoke("enqueue", str(good), "-d", "d", "--db", str(db), "--regenerate", "all")[0] == 0
    before = snapshot_file(db)
    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [*prompts(2), {"messages": [{"role": "system", "content": "s"}, ANSWER]}],
    )
    code, out, err = invoke("enqueue", str(bad), "-d", "d", "--db", str(db))
    assert code == 2 and out == ""
    assert f"{bad}:3: no user message" in err
    code, _, err = invoke("enqueue", str(good), "-d", "d", "--db", str(db), "--regenerate", "last")
    assert code == 2
    assert (
        "dataset 'd' already exists as another kind of dataset (regenerate: 'all' -> 'last')"
        in (err)
    )
    code, _, err = invoke("enqueue", str(good), "-d", "d", "--db", str(db), "--passthrough")
    assert code == 2 and "(passthrough: False -> True)" in err
    assert snapshot_file(db) == before


PASSED = [
    {
        "id": "f1",
        "messages": [USER, ANSWER],
        "usage": {"prompt_tokens": 4, "completion_tokens": 9},
        "tag": "kept",
    },
    {"id": "f2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    {"id": "t1", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    {"input_ids": [9]},
]


def test_passthrough_rows_are_stored_done_and_never_claimed(db_url: str, tmp_path: Path) -> None:
    db = db_url
    pending = write_jsonl(tmp_path / "prompts.jsonl", prompts(2))
    assert invoke("enqueue", str(pending), "-d", "p", "--db", str(db))[0] == 0
    path = write_jsonl(tmp_path / "final.jsonl", PASSED)
    args = ("enqueue", str(path), "-d", "final", "--db", str(db), "--passthrough", "--model", "M")
    code, out, err = invoke(*args)
    assert code == 0, err
    assert "stored 4 rows as done into new pass-through dataset 'final' (0 already present)" in out
    stored = rows(
        db,
        "SELECT i.key, i.request, i.state, i.attempts, i.finished_at IS NOT NULL, i.turns"
        " FROM items i JOIN datasets d ON d.id = i.dataset_id"
        " WHERE d.name = 'final' ORDER BY i.position",
    )
    assert [(k, s, a, f, t) for k, _, s, a, f, t in stored] == [
        ("f1", "done", 0, 1, 1),
        ("f2", "done", 0, 1, 1),
        ("t1", "done", 0, 1, 1),
        ("4", "done", 0, 1, 1),
    ]
    requests = [orjson.loads(request) for _, request, *_ in stored]
    assert requests[0] == PASSED[0]
    assert requests[1] == {"id": "f2", "messages": [USER, ANSWER]}
    assert requests[2:] == PASSED[2:]
    out_rows = rows(
        db,
        "SELECT o.message, o.flags, o.latency, o.attempt, o.model, o.prompt_tokens,"
        " o.completion_tokens, o.params_hash, o.content, o.finish_reason"
        " FROM outputs o JOIN items i ON i.id = o.item_id ORDER BY i.position",
    )
    assert out_rows == [
        ("{}", 0, 0.0, 0, "M", 4, 9, None, None, None),
        *[("{}", 0, 0.0, 0, "M", None, None, None, None, None)] * 3,
    ]
    assert rows(db, "SELECT passthrough, params FROM datasets WHERE name = 'final'") == [
        (1, '{"model":"M"}')
    ]
    # Only the prompts are ever handed to a worker.
    assert sorted(lease.key for lease in claim_all(db)) == ["p000000", "p000001"]
    assert claim_all(db) == []
    # Idempotent, and appending without repeating --passthrough reads the dataset's way.
    code, out, err = invoke("enqueue", str(path), "-d", "final", "--db", str(db), "--model", "M")
    assert code == 0, err
    assert "nothing new: all 4 items" in out
    assert rows(db, "SELECT count(*) FROM outputs") == [(4,)]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"input_ids": [1, -1], "loss_mask": [0, 1]}, "input_ids must hold non-negative integers"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask must be a list as long as input_ids"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "loss_mask is all 0"),
        ({"input_ids": [], "loss_mask": []}, "input_ids must be a non-empty list"),
        ({"messages": [USER]}, "a passthrough row must end with the assistant's answer"),
        ({"prompt": "q"}, "a prompt line holds no answer to pass through"),
    ],
)
def test_bad_passthrough_rows_name_file_and_line(
    db_url: str, tmp_path: Path, line: dict[str, Any], reason: str
) -> None:
    db = db_url
    good = write_jsonl(tmp_path / "good.jsonl", PASSED[2:])
    assert invoke("enqueue", str(good), "-d", "t", "--db", str(db), "--passthrough")[0] == 0
    before = snapshot_file(db)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*PASSED[:3], line, {"input_ids": [5]}])
    code, out, err = invoke("enqueue", str(bad), "-d", "t", "--db", str(db))
    assert code == 2 and out == ""
    assert f"{bad}:4: " in err and reason in err
    assert snapshot_file(db) == before
    code, out, err = invoke("enqueue", str(bad), "-d", "t", "--db", str(db), "--skip-invalid")
    assert code == 0, err
    assert f"skipped {bad}:4: " in err and "1 invalid lines skipped" in out
    # t1 was there already: f1, f2 and line 5 are added.
    assert "enqueued" not in out and "stored 3 rows as done" in out
    done = "sum(CASE WHEN state = 'done' THEN 1 ELSE 0 END)"
    assert rows(db, f"SELECT count(*), {done} FROM items") == [(5, 5)]
    assert rows(db, "SELECT count(*) FROM outputs") == [(5,)]


def test_format_tokens(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "t.jsonl", PASSED[2:])
    code, _, err = invoke("enqueue", str(path), "-d", "t", "--db", str(db), "--format", "tokens")
    assert code == 2 and "can only be passed through" in err
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*PASSED[2:], PASSED[0]])
    args = ("enqueue", str(mixed), "-d", "t", "--db", str(db), "--passthrough")
    code, _, err = invoke(*args, "--format", "tokens")
    assert (
        code == 2 and f'{mixed}:3: a messages line in a dataset declared format = "tokens"' in err
    )
    code, out, err = invoke(*args)  # auto: token rows and conversations mix
    assert code == 0, err
    assert "stored 3 rows as done" in out


def test_declared_format(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, *prompts(1)])
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--format", "prompt")
    assert code == 2 and out == ""
    assert f'{path}:2: a messages line in a dataset declared format = "prompt"' in err


@pytest.mark.parametrize(
    "option",
    [
        ("--max-tokens", "5"),
        ("--temperature", "0.5"),
        ("--param", "top_k=5"),
        ("--concurrency", "3"),
        ("--regenerate", "all"),
        ("--on-truncated", "retry"),
    ],
)
def test_passthrough_refuses_request_options(
    db_url: str, tmp_path: Path, option: tuple[str, str]
) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", PASSED)
    code, _, err = invoke(
        "enqueue", str(path), "-d", "d", "--db", str(db), "--passthrough", *option
    )
    assert code == 2
    assert f"--passthrough stores the rows as done and sends no request: {option[0]}" in err
    # Nor on an existing pass-through dataset, where --passthrough is not repeated.
    assert invoke("enqueue", str(path), "-d", "d", "--db", str(db), "--passthrough")[0] == 0
    before = snapshot_file(db)
    code, _, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db), *option)
    assert code == 2 and "dataset 'd' is pass-through" in err
    assert snapshot_file(db) == before


def test_on_truncated_is_stored_and_may_change(db_url: str, tmp_path: Path) -> None:
    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    args = ("enqueue", str(path), "-d", "d", "--db", str(db))
    assert invoke(*args, "--on-truncated", "retry")[0] == 0
    assert rows(db, "SELECT on_truncated, regenerate FROM datasets") == [("retry", "last")]
    assert invoke(*args)[0] == 0  # not given: kept
    assert rows(db, "SELECT on_truncated FROM datasets") == [("retry",)]
    code, _, err = invoke(*args, "--on-truncated", "fail")  # an operational knob
    assert code == 0, err
    assert rows(db, "SELECT on_truncated FROM datasets") == [("fail",)]


def test_update_changes_parameters_of_the_items_not_done(db_url: str, tmp_path: Path) -> None:
    from orchestrator.store import Output, Queue, open_database
    from orchestrator.store.datasets import params_hash

    db = db_url
    path = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    old = {"model": "m", "temperature": 0.6}
    new = {"model": "m", "temperature": 1.0}
    base = ("enqueue", str(path), "-d", "d", "--db", str(db), "--model", "m")
    assert invoke(*base, "--temperature", "0.6")[0] == 0

    async def finish_one() -> None:
        database = await open_database(str(db))
        try:
            queue = Queue(database)
            [lease] = await queue.claim("w", 1, lease_seconds=60)
            message = {"role": "assistant", "content": "x"}
            output = Output(message, "x", None, "stop", None, 0.1, None, "m", None, 0, old_hash)
            assert await queue.complete([(lease, output)]) == {lease.item_id}
        finally:
            await database.close()

    old_hash = params_hash(old)
    asyncio.run(finish_one())
    items_before = rows(db, "SELECT key, request, digest, state FROM items ORDER BY id")
    before = snapshot_file(db)

    write_jsonl(path, prompts(4))
    code, out, err = invoke(*base, "--temperature", "1.0")
    assert code == 2 and out == ""
    assert "already exists with other request parameters (temperature: 0.6 -> 1.0)" in err
    assert "pass --update" in err
    assert snapshot_file(db) == before

    code, out, err = invoke(*base, "--temperature", "1.0", "--update")
    assert code == 0, err
    assert "enqueued 1 items into existing dataset 'd' (3 already present)" in out
    assert orjson.loads(rows(db, "SELECT params FROM datasets")[0][0]) == new
    sets = {h: orjson.loads(p) for h, p in rows(db, "SELECT hash, params FROM param_sets")}
    assert sets == {old_hash: old, params_hash(new): new}
    # The done item and its output are as they were; the others go out with the new set.
    assert rows(db, "SELECT key, request, digest, state FROM items ORDER BY id")[:3] == items_before
    assert rows(
        db, "SELECT i.key, o.params_hash FROM outputs o JOIN items i ON i.id = o.item_id"
    ) == [("p000000", old_hash)]
    assert sorted(lease.key for lease in claim_all(db)) == ["p000001", "p000002", "p000003"]


@pytest.mark.parametrize(
    ("options", "spec"),
    [
        ({"regenerate": "all"}, {"regenerate": "all"}),
        ({"passthrough": True}, {"passthrough": True}),
    ],
)
async def test_records_and_prepared_items_store_the_same(
    backend: str,
    pg_database: Callable[[], str],
    tmp_path: Path,
    options: dict[str, Any],
    spec: dict[str, Any],
) -> None:
    from orchestrator.errors import ConfigError
    from orchestrator.formats import iter_prepared, iter_records
    from orchestrator.store import DatasetSpec, enqueue, open_database

    lines = [line for line in CONVERSATIONS if "prompt" not in line]
    if options.get("passthrough"):
        lines = [*PASSED, {"id": "c1", "messages": [USER, ANSWER, USER, ANSWER]}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    stored = []
    for name, read in (("records", iter_records), ("prepared", iter_prepared)):
        db = pg_database() if backend == "postgresql" else str(tmp_path / f"{name}.db")
        database = await open_database(db)
        try:
            # Lines read as prompts would lose the turns this dataset keeps: refused.
            with pytest.raises(ConfigError, match="read them with"):
                await enqueue(database, DatasetSpec("d", **spec), read(path), path=str(path))
            report = await enqueue(
                database, DatasetSpec("d", **spec), read(path, **options), path=str(path)
            )
        finally:
            await database.close()
        assert report.added == len(lines)
        stored.append(
            rows(db, "SELECT key, position, request, digest, state, turns FROM items ORDER BY id")
            + rows(db, "SELECT item_id, message, model, prompt_tokens FROM outputs ORDER BY 1")
        )
    assert stored[0] == stored[1]


@pytest.mark.usefixtures("small_batches")
def test_regenerate_all_in_batches(db_url: str, tmp_path: Path) -> None:
    db = db_url
    turns = [{"id": f"t{i}", "messages": [USER, ANSWER] * (i % 3 + 1)} for i in range(8)]
    path = write_jsonl(tmp_path / "in.jsonl", turns[:5])
    args = ("enqueue", str(path), "-d", "d", "--db", str(db), "--regenerate", "all")
    assert invoke(*args)[0] == 0
    # Stored lines among new ones, over several batches; then a repeated key.
    write_jsonl(path, [turns[5], *turns[:5], turns[6], turns[7]])
    code, out, err = invoke(*args)
    assert code == 0, err
    assert "enqueued 3 items into existing dataset 'd' (5 already present; 6 turns" in out
    assert rows(db, "SELECT key, turns, request FROM items ORDER BY position") == [
        (t["id"], len(t["messages"]) // 2, orjson.dumps({"messages": t["messages"]}).decode())
        for t in [*turns[:5], turns[5], turns[6], turns[7]]
    ]
    before = snapshot_file(db)
    extra = {"id": "x", "messages": [USER]}
    write_jsonl(path, [extra, *turns[:4], {**extra, "messages": [USER, ANSWER]}])
    code, out, err = invoke(*args)
    assert code == 2 and out == ""
    assert f"{path}:6: duplicate key 'x' (first on line 1)" in err
    assert snapshot_file(db) == before


def test_postgresql_plans_an_enqueued_dataset_from_its_statistics(
    pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Enqueue leaves the items table analyzed: claims are planned from what it holds,
    not from the guesses made for a table autovacuum has not looked at yet."""
    db = pg_database()
    path = write_jsonl(tmp_path / "p.jsonl", prompts(300))
    code, _, err = invoke("enqueue", str(path), "--dataset", "ds", "--db", db)
    assert code == 0, err
    [(tuples,)] = query(db, "SELECT reltuples FROM pg_class WHERE relname = 'items'")
    assert tuples == 300
    # Nothing new: nothing to analyze again, and nothing fails.
    code, out, err = invoke("enqueue", str(path), "--dataset", "ds", "--db", db)
    assert code == 0 and "all 300 items" in out, err


def test_help_shows_both_thinking_switches_and_a_new_dataset_reads_right(
    tmp_path: Path,
) -> None:
    code, out, _ = invoke("enqueue", "--help")
    flat = "".join(out.split())  # the help wraps inside words
    assert code == 0
    assert '{"enable_thinking":true}\'(Qwen3,DeepSeek)' in flat
    assert '{"thinking":true}\'(Kimi)' in flat
    path = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    code, out, _ = invoke("enqueue", str(path), "-d", "d", "--db", str(tmp_path / "q.db"))
    assert out == "enqueued 3 items into new dataset 'd' (0 already present)\n"
