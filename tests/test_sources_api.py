"""``q.enqueue`` with the tables a program holds: ``datasets`` objects, ``pyarrow`` tables
and readers, pandas frames. Each gives the items the same rows give as a list of dicts
(keys by position when the rows have no id), and a bad row names the object and the row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import orchestrator as orc
from orchestrator.errors import ConfigError, InputError
from tests.helpers import query

ROWS = [
    {"question": "What is 1 + 1?", "meta": {"level": 1}},
    {"question": "What is 2 + 2?", "meta": {"level": 2}},
    {"question": "Name a prime.", "meta": {"level": 1}},
]
CHAT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
    {"id": "b", "messages": [{"role": "user", "content": "yo", "name": "u"}]},
    {"id": "c", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 7},
]
SQL = (
    "SELECT i.key, i.request, i.digest FROM items i JOIN datasets d ON d.id = i.dataset_id"
    " WHERE d.name = ? ORDER BY i.position"
)


def _tables() -> dict[str, Any]:
    """The same rows as every kind of table object the API takes."""
    datasets = pytest.importorskip("datasets")
    pandas = pytest.importorskip("pandas")
    table = pa.Table.from_pylist(ROWS)
    return {
        "dataset": datasets.Dataset.from_list(ROWS),
        "iterable": datasets.Dataset.from_list(ROWS).to_iterable_dataset(),
        "table": table,
        "reader": pa.RecordBatchReader.from_batches(
            table.schema, table.to_batches(max_chunksize=2)
        ),
        "frame": pandas.DataFrame(ROWS),
    }


async def test_every_table_object_gives_the_items_of_its_rows(db_url: str) -> None:
    template = "{question} (level {meta.level})"
    async with orc.open(db_url) as q:
        base = await q.enqueue(ROWS, dataset="list", template=template)
        assert base.added == 3
        for name, table in _tables().items():
            report = await q.enqueue(table, dataset=name, template=template)
            assert (report.added, report.formats) == (3, {"template": 3}), name
    expected = query(db_url, SQL, "list")
    assert [key for key, _, _ in expected] == ["1", "2", "3"]
    assert '"What is 2 + 2? (level 2)"' in expected[1][1]
    for name in _tables():
        assert query(db_url, SQL, name) == expected, name


async def test_a_dataset_of_chat_rows_reads_as_its_jsonl_lines(db_url: str) -> None:
    datasets = pytest.importorskip("datasets")
    # Columnar: rows without max_tokens get null, messages without name get null fields.
    columns = ("id", "conversations", "messages", "max_tokens")
    chat = datasets.Dataset.from_dict({name: [row.get(name) for row in CHAT] for name in columns})
    assert chat[2]["messages"] == [{"role": "user", "content": "hey", "name": None}]
    async with orc.open(db_url) as q:
        await q.enqueue(CHAT, dataset="list")
        await q.enqueue(chat, dataset="hf")
        again = await q.enqueue(chat, dataset="hf")
    assert (again.added, again.already_present) == (0, 3)
    assert query(db_url, SQL, "hf") == query(db_url, SQL, "list")


async def test_a_dataset_dict_needs_its_split(db_url: str) -> None:
    datasets = pytest.importorskip("datasets")
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    async with orc.open(db_url) as q:
        with pytest.raises(ConfigError, match="holds splits train, test: choose one with split="):
            await q.enqueue(both, dataset="d", prompt_column="question")
        with pytest.raises(
            ConfigError, match=r"no split 'dev' \(the DatasetDict has: train, test\)"
        ):
            await q.enqueue(both, dataset="d", prompt_column="question", split="dev")
        report = await q.enqueue(both, dataset="d", prompt_column="question", split="test")
    assert report.added == 1


async def test_a_bad_row_names_the_object_and_the_row(db_url: str) -> None:
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame([{"q": "fine"}, {"q": None}, {"q": 3}])
    async with orc.open(db_url) as q:
        with pytest.raises(InputError) as info:
            await q.enqueue(frame, dataset="d", prompt_column="q")
        assert str(info.value) == "<DataFrame>:row 2: column 'q' is null"
        assert (info.value.path, info.value.row) == ("<DataFrame>", 2)
        report = await q.enqueue(frame, dataset="d", prompt_column="q", skip_invalid=True)
    assert report.added == 1
    assert [str(e) for e in report.invalid] == [
        "<DataFrame>:row 2: column 'q' is null",
        "<DataFrame>:row 3: column 'q' must be text, got int",
    ]


async def test_a_parquet_path_and_its_table_differ_only_in_their_keys(
    db_url: str, tmp_path: Path
) -> None:
    """A file's id-less rows are keyed by file and row; a table in memory's by position."""
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "rows.parquet")
    async with orc.open(db_url) as q:
        await q.enqueue(tmp_path / "rows.parquet", dataset="file", prompt_column="question")
        await q.enqueue(table, dataset="table", prompt_column="question")
    from_file, from_table = query(db_url, SQL, "file"), query(db_url, SQL, "table")
    # A file named directly is keyed by its folder and its name (shards of one name in
    # two folders cannot collide).
    named = f"{tmp_path.name}/rows.parquet"
    assert [row[0] for row in from_file] == [f"{named}:1", f"{named}:2", f"{named}:3"]
    assert [row[1:] for row in from_file] == [row[1:] for row in from_table]


async def test_objects_that_are_no_source_are_refused(db_url: str) -> None:
    async with orc.open(db_url) as q:
        with pytest.raises(
            ConfigError, match="records: must be a path, a table or an iterable of dicts, got 42"
        ):
            await q.enqueue(42, dataset="d")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="has no splits to choose from"):
            await q.enqueue(pa.Table.from_pylist(ROWS), dataset="d", split="train")
