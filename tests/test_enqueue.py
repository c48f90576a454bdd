"""``orchestrator enqueue`` through the real CLI: formats, idempotency, bad input."""

from __future__ import annotations

import hashlib
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from tests.helpers import prompts, write_jsonl


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--log-level", "warning", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def snapshot_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def count_items(db: Path) -> int:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM items").fetchone()[0]


def test_all_formats_and_keys(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
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
    with closing(sqlite3.connect(db)) as conn:
        keys = [r[0] for r in conn.execute("SELECT key FROM items ORDER BY position")]
        fmt, params = conn.execute("SELECT input_format, params FROM datasets").fetchone()
    assert keys == ["chat-1", "2", "3", "batch-7"]
    assert fmt == "mixed" or fmt in {"messages", "sharegpt"}
    assert params == "{}"


def test_enqueue_is_idempotent(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
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


def test_changed_content_or_params_are_refused(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
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
def test_bad_line_names_file_and_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    db = tmp_path / "q.db"
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
def test_bad_files(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "q.db"
    target = tmp_path / "input.jsonl"
    make(target)
    code, _, err = invoke("enqueue", str(target), "-d", "d", "--db", str(db))
    assert code == 2
    assert message in err and str(target) in err


def test_bom_and_crlf_are_accepted(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
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


def test_a_50_mb_line_is_taken_whole(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    big = "word " * (10 * 1024 * 1024)  # 50 MiB of content on one line
    path = write_jsonl(
        tmp_path / "big.jsonl",
        [*prompts(2), {"id": "huge", "messages": [{"role": "user", "content": big}]}],
    )
    code, out, err = invoke("enqueue", str(path), "-d", "d", "--db", str(db))
    assert code == 0, err
    assert "enqueued 3 items" in out
    with closing(sqlite3.connect(db)) as conn:
        (length,) = conn.execute("SELECT length(request) FROM items WHERE key = 'huge'").fetchone()
    assert length > 50 * 1024 * 1024
