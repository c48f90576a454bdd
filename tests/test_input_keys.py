"""Item keys of rows read whole: ``--id-column`` without a column that builds the
messages, and the keys of table files named one at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import cli, query, write_jsonl


def _ultrachat(n: int) -> list[dict[str, Any]]:
    """Rows shaped as HuggingFaceH4/ultrachat_200k's: prompt, prompt_id, messages."""
    rows = []
    for i in range(n):
        prompt = f"Tell me about river {i}."
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": f"{i:04x}" * 16,
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": f"River {i} is long."},
                    {"role": "user", "content": "And its source?"},
                    {"role": "assistant", "content": f"A spring on hill {i}."},
                ],
            }
        )
    return rows


def _write(tmp_path: Path, rows: list[dict[str, Any]], kind: str) -> Path:
    if kind == "jsonl":
        return write_jsonl(tmp_path / "ultrachat.jsonl", rows)
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("passthrough", [False, True], ids=["prompts", "passthrough"])
def test_id_column_keys_rows_read_whole(tmp_path: Path, kind: str, passthrough: bool) -> None:
    """``--id-column prompt_id`` on an ultrachat file: every row is read as its line
    (the conversation, its trailing answer dropped, or kept whole to pass through), keyed
    by its prompt_id; enqueuing it again adds nothing."""
    rows = _ultrachat(5)
    source = _write(tmp_path, rows, kind)
    db = str(tmp_path / "q.db")
    args = ["enqueue", str(source), "-d", "u", "--db", db, "--id-column", "prompt_id"]
    args += ["--passthrough"] if passthrough else []
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stderr
    stored = query(db, "SELECT key, request FROM items ORDER BY position")
    assert [key for key, _ in stored] == [row["prompt_id"] for row in rows]
    for (_, request), row in zip(stored, rows, strict=True):
        messages = orjson.loads(request)["messages"]
        assert messages == (row["messages"] if passthrough else row["messages"][:3])
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert query(db, "SELECT count(*) FROM items") == [(5,)]
    if passthrough:
        out = tmp_path / "out.jsonl"
        result = cli("export", str(out), "--db", db, "--format", "sharegpt")
        assert result.returncode == 0, result.stderr
        lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
        assert [line["id"] for line in lines] == [row["prompt_id"] for row in rows]


def test_id_column_missing_from_a_row_read_whole_names_it(tmp_path: Path) -> None:
    rows = _ultrachat(3)
    del rows[1]["prompt_id"]
    source = write_jsonl(tmp_path / "u.jsonl", rows)
    db = str(tmp_path / "q.db")
    result = cli("enqueue", str(source), "-d", "u", "--db", db, "--id-column", "prompt_id")
    assert result.returncode == 2, result.stderr
    assert f"{source}:2" in result.stderr and "'prompt_id' is missing" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------- shard names


def _shards(tmp_path: Path) -> tuple[Path, Path]:
    """``data/a/train-00000-of-00001.parquet`` and the same name under ``data/b``."""
    paths = []
    for folder in ("a", "b"):
        (tmp_path / "data" / folder).mkdir(parents=True)
        path = tmp_path / "data" / folder / "train-00000-of-00001.parquet"
        rows = [{"prompt": f"{folder} question {i}"} for i in range(3)]
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths[0], paths[1]


def _enqueue(db: str, source: Path, *, cwd: Path) -> str:
    result = cli("enqueue", str(source), "-d", "d", "--db", db, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_shards_of_one_name_in_two_folders_both_go_in(tmp_path: Path) -> None:
    """Two shards named alike, each named directly, into one dataset: each row once, keyed
    by folder and name; each enqueue repeated (from another directory too) adds nothing,
    and the folder above them, enqueued, gives the same keys."""
    a, b = _shards(tmp_path)
    db = str(tmp_path / "q.db")
    _enqueue(db, a.relative_to(tmp_path), cwd=tmp_path)
    _enqueue(db, b.relative_to(tmp_path), cwd=tmp_path)
    keys = [k for (k,) in query(db, "SELECT key FROM items ORDER BY position")]
    assert keys == [f"{f}/train-00000-of-00001.parquet:{i}" for f in "ab" for i in (1, 2, 3)]
    for source, cwd in ((a, tmp_path), (b.relative_to(tmp_path / "data"), tmp_path / "data")):
        assert _enqueue(db, source, cwd=cwd).startswith("nothing new: all 3 items")
    _enqueue(db, tmp_path / "data", cwd=tmp_path)
    assert query(db, "SELECT count(*) FROM items") == [(6,)]


def test_a_dataset_keyed_by_shard_name_alone_keeps_its_keys(tmp_path: Path) -> None:
    """A dataset an earlier version filled from a shard named directly (keys
    ``train-00000-of-00001.parquet:N``): the same shard again adds nothing, and a shard
    of the same name from another folder goes in beside it."""
    a, b = _shards(tmp_path)
    db = str(tmp_path / "q.db")
    _enqueue(db, a, cwd=tmp_path)
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(db)) as conn, conn:  # the keys an earlier version gave
        conn.execute("UPDATE items SET key = substr(key, 3)")
    _enqueue(db, a, cwd=tmp_path)
    old = [f"train-00000-of-00001.parquet:{i}" for i in (1, 2, 3)]
    assert [k for (k,) in query(db, "SELECT key FROM items ORDER BY position")] == old
    _enqueue(db, b, cwd=tmp_path)
    keys = [k for (k,) in query(db, "SELECT key FROM items ORDER BY position")]
    assert keys == [*old, *(f"b/train-00000-of-00001.parquet:{i}" for i in (1, 2, 3))]
