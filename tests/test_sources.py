"""``orchestrator enqueue SOURCE`` for every source format, through the real command:
Parquet shards, folders and globs, CSV/TSV, ``save_to_disk`` folders, compressed JSONL,
standard input, the Hub (a local folder laid out like a Hub repository, through the same
``datasets.load_dataset`` call), columns and templates, and a kill mid-enqueue.

pyarrow writes the Parquet, CSV and Arrow files the tests read; ``datasets`` writes the
``save_to_disk`` folders. Every test that stores runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import gzip
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from tests.helpers import (
    REPO,
    cli,
    cli_loading,
    db_snapshot,
    is_postgres,
    planned,
    query,
    read_terminal,
    write_jsonl,
)

PROBLEMS = [
    {"problem": f"What is {i} + {i}?", "meta": {"level": i % 3, "source": "gen"}, "answer": i}
    for i in range(10)
]


def enqueue(db: str, source: str | Path, *options: str, **kwargs: Any) -> Any:
    return cli("enqueue", str(source), "--db", str(db), *options, **kwargs)


def items(db: str, dataset: str) -> list[tuple[str, dict[str, Any]]]:
    """(key, request) of the dataset's items, in queue order."""
    rows = query(
        db,
        "SELECT i.key, i.request FROM items i JOIN datasets d ON d.id = i.dataset_id"
        " WHERE d.name = ? ORDER BY i.position",
        dataset,
    )
    return [(key, orjson.loads(request)) for key, request in rows]


def user_texts(db: str, dataset: str) -> list[str]:
    return [request["messages"][-1]["content"] for _, request in items(db, dataset)]


def write_shards(folder: Path, rows: list[dict[str, Any]], sizes: list[int]) -> list[Path]:
    """``rows`` as Parquet shards named as the Hub names them, ``sizes`` rows each."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, size in enumerate(sizes):
        path = folder / f"train-{i:05d}-of-{len(sizes):05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[start : start + size]), path)
        paths.append(path)
        start += size
    return paths


TEMPLATE = "Solve the problem below.\\n\\n{problem} (level {meta.level})"


# --- Parquet: shards, keys, re-enqueue, changed rows ---------------------------------------


def test_parquet_folder_and_glob_give_the_same_keys(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_shards(data, PROBLEMS, [6, 4])
    result = enqueue(db_url, data, "-d", "math", "--template", TEMPLATE)
    assert result.returncode == 0, result.stderr
    assert "enqueued 10 items into new dataset 'math'" in result.stdout
    keys = [key for key, _ in items(db_url, "math")]
    assert keys == [f"train-00000-of-00002.parquet:{n}" for n in range(1, 7)] + [
        f"train-00001-of-00002.parquet:{n}" for n in range(1, 5)
    ]
    assert user_texts(db_url, "math")[7] == "Solve the problem below.\n\nWhat is 7 + 7? (level 1)"
    # The same shards by a glob: every key known, nothing added.
    again = enqueue(db_url, f"{data}/train-*.parquet", "-d", "math", "--template", TEMPLATE)
    assert again.returncode == 0, again.stderr
    assert "nothing new: all 10 items" in again.stdout
    # A shard named alone keeps its keys too.
    alone = enqueue(
        db_url, data / "train-00001-of-00002.parquet", "-d", "math", "--template", TEMPLATE
    )
    assert "nothing new: all 4 items" in alone.stdout, alone.stderr


def test_a_changed_parquet_row_is_refused_naming_its_file_and_row(
    db_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_shards(data, PROBLEMS, [6, 4])
    assert enqueue(db_url, data, "-d", "math", "--template", TEMPLATE).returncode == 0
    before = db_snapshot(db_url)
    changed = [dict(row) for row in PROBLEMS]
    changed[8]["problem"] = "Something else entirely"
    write_shards(data, changed, [6, 4])
    result = enqueue(db_url, data, "-d", "math", "--template", TEMPLATE)
    assert result.returncode == 2
    assert (
        f"{data}/train-00001-of-00002.parquet:row 3: key 'train-00001-of-00002.parquet:3' is "
        "already enqueued in dataset 'math' with different content"
    ) in result.stderr
    assert db_snapshot(db_url) == before


def test_a_missing_or_null_column_names_source_row_and_column(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    rows = [dict(row) for row in PROBLEMS]
    rows[7]["problem"] = None
    write_shards(data, rows, [6, 4])
    # A third shard that has no problem column at all.
    pq.write_table(pa.table({"question": ["q"]}), data / "train-00002-of-00002.parquet")
    assert cli("db", "upgrade", "--db", db_url).returncode == 0
    before = db_snapshot(db_url)
    result = enqueue(db_url, data, "-d", "math", "--prompt-column", "problem")
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"{data}/train-00001-of-00002.parquet:row 2: column 'problem' is null" in result.stderr
    assert db_snapshot(db_url) == before
    skipped = enqueue(db_url, data, "-d", "math", "--prompt-column", "problem", "--skip-invalid")
    assert skipped.returncode == 0, skipped.stderr
    assert "enqueued 9 items" in skipped.stdout and "2 invalid lines skipped" in skipped.stdout
    assert (
        f"skipped {data}/train-00002-of-00002.parquet:row 1: column 'problem' is missing "
        "(the row has: question)"
    ) in skipped.stderr


def test_bad_templates_and_option_mixes_are_refused_before_reading(
    db_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_shards(data, PROBLEMS, [10])
    cases = [
        (["--template", "Solve {problem"], "--template: '{' at column 7 is not closed"),
        (["--template", "a } b"], "--template: unmatched '}' at column 3"),
        (["--template", "{}"], "empty field {} at column 1"),
        (
            ["--template", "{problem}", "--prompt-column", "problem"],
            "--prompt-column and --template both build the messages: choose one",
        ),
        (["--system", "be brief"], "--system needs one of --prompt-column"),
        (["--template", "{problem}", "--format", "prompt"], "--format 'prompt' names a JSONL"),
        (["--template", "{problem}", "--passthrough"], "no answer to pass through"),
        (["--template-file", str(tmp_path / "nope.toml")], "nope.toml: no such template file"),
    ]
    for options, message in cases:
        result = enqueue(db_url, data, "-d", "math", *options)
        assert result.returncode == 2, (options, result.stderr)
        assert message in result.stderr, (options, result.stderr)
    assert query(db_url, "SELECT count(*) FROM items")[0][0] == 0


def test_a_template_file_builds_system_and_user_from_columns(db_url: str, tmp_path: Path) -> None:
    rows = [
        {"id": f"r{i}", "question": f"Who wrote {t}?", "context": f"{t} was written {{by}} X."}
        for i, t in enumerate(["A", "B"])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    simple = tmp_path / "qa.toml"
    simple.write_text(
        'system = "Answer from the context only; quote it in {{braces}}."\n'
        'user = """Context:\n{context}\n\nQuestion: {question}"""\n'
    )
    result = enqueue(db_url, tmp_path / "qa.parquet", "-d", "qa", "--template-file", str(simple))
    assert result.returncode == 0, result.stderr
    key, request = items(db_url, "qa")[1]
    assert key == "r1"  # the row's own id column
    assert request == {
        "messages": [
            {"role": "system", "content": "Answer from the context only; quote it in {braces}."},
            {
                "role": "user",
                "content": "Context:\nB was written {by} X.\n\nQuestion: Who wrote B?",
            },
        ]
    }
    listed = tmp_path / "few-shot.toml"
    listed.write_text(
        '[[messages]]\nrole = "user"\ncontent = "2 + 2?"\n'
        '[[messages]]\nrole = "assistant"\ncontent = "4"\n'
        '[[messages]]\nrole = "user"\ncontent = "{question}"\n'
    )
    result = enqueue(
        db_url, tmp_path / "qa.parquet", "-d", "fs", "--template-file", str(listed),
        "--id-column", "question",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    key, request = items(db_url, "fs")[0]
    assert key == "Who wrote A?"
    assert [m["content"] for m in request["messages"]] == ["2 + 2?", "4", "Who wrote A?"]


def test_messages_and_tools_columns(db_url: str, tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    rows = [
        {
            "uid": "a",
            "chat": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old answer"}],
            "tools": orjson.dumps([tool]).decode(),
        },
        {"uid": "b", "chat": [{"from": "human", "value": "yo"}], "tools": ""},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    result = enqueue(
        db_url, tmp_path / "chat.parquet", "-d", "chat", "--messages-column", "chat",
        "--tools-column", "tools", "--id-column", "uid", "--system", "Be brief.\\nVery.",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert items(db_url, "chat") == [
        (
            "a",
            {
                "messages": [
                    {"role": "system", "content": "Be brief.\nVery."},
                    {"role": "user", "content": "hi"},
                ],
                "tools": [tool],
            },
        ),
        (
            "b",
            {
                "messages": [
                    {"role": "system", "content": "Be brief.\nVery."},
                    {"role": "user", "content": "yo"},
                ]
            },
        ),
    ]


# --- CSV, TSV, save_to_disk, compressed JSONL, standard input --------------------------------


def test_csv_and_tsv_cells_are_text(db_url: str, tmp_path: Path) -> None:
    csv = tmp_path / "q.csv"
    csv.write_bytes(
        b'\xef\xbb\xbfid,question,max_tokens\r\n007,"two\nlines, with a comma",5\r\n7,plain,5\r\n'
    )
    result = enqueue(db_url, csv, "-d", "csv", "--prompt-column", "question", "--id-column", "id")
    assert result.returncode == 0, result.stderr
    assert items(db_url, "csv") == [
        ("007", {"messages": [{"role": "user", "content": "two\nlines, with a comma"}]}),
        ("7", {"messages": [{"role": "user", "content": "plain"}]}),
    ]
    tsv = tmp_path / "q.tsv"
    pcsv.write_csv(
        pa.table({"prompt": ["a", "b"], "system": ["", "be brief"]}),
        tsv,
        pcsv.WriteOptions(delimiter="\t"),
    )
    result = enqueue(db_url, tsv, "-d", "tsv")  # read as prompt lines: prompt and system
    assert result.returncode == 0, result.stderr
    assert items(db_url, "tsv") == [
        (f"{tmp_path.name}/q.tsv:1", {"messages": [{"role": "user", "content": "a"}]}),
        (
            f"{tmp_path.name}/q.tsv:2",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "b"},
                ]
            },
        ),
    ]


def test_save_to_disk_folders(db_url: str, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    sharegpt = datasets.Dataset.from_dict(
        {
            "conversations": [
                [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}],
                [{"from": "system", "value": "s"}, {"from": "human", "value": "q2"}],
            ]
        }
    )
    sharegpt.save_to_disk(tmp_path / "one")
    datasets.DatasetDict({"train": sharegpt, "test": sharegpt.select([1])}).save_to_disk(
        tmp_path / "both"
    )
    result = enqueue(db_url, tmp_path / "one", "-d", "one")
    assert result.returncode == 0, result.stderr
    assert items(db_url, "one") == [
        ("data-00000-of-00001.arrow:1", {"messages": [{"role": "user", "content": "hi"}]}),
        (
            "data-00000-of-00001.arrow:2",
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q2"}]},
        ),
    ]
    refused = enqueue(db_url, tmp_path / "both", "-d", "both")
    assert refused.returncode == 2
    assert "a DatasetDict folder with splits train, test: choose one with --split" in refused.stderr
    unknown = enqueue(db_url, tmp_path / "both", "-d", "both", "--split", "dev")
    assert (
        unknown.returncode == 2 and "no split 'dev' (the folder has: train, test)" in unknown.stderr
    )
    result = enqueue(db_url, tmp_path / "both", "-d", "both", "--split", "test")
    assert result.returncode == 0, result.stderr
    assert [key for key, _ in items(db_url, "both")] == ["test/data-00000-of-00001.arrow:1"]


def test_arrow_ipc_files_in_both_formats(db_url: str, tmp_path: Path) -> None:
    """``.arrow`` written by pyarrow as the IPC file format (Feather v2) and as a stream
    (what save_to_disk writes), side by side in one folder."""
    table = pa.Table.from_pylist([{"prompt": f"p{i}", "id": i} for i in range(5)])
    folder = tmp_path / "arrow"
    folder.mkdir()
    with (
        pa.OSFile(str(folder / "a-file.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table.slice(0, 3), max_chunksize=2)
    with (
        pa.OSFile(str(folder / "b-stream.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table.slice(3))
    result = enqueue(db_url, folder, "-d", "arrow")
    assert result.returncode == 0, result.stderr
    assert items(db_url, "arrow") == [
        (str(i), {"messages": [{"role": "user", "content": f"p{i}"}]}) for i in range(5)
    ]
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all")
    bad = enqueue(db_url, tmp_path / "bad.arrow", "-d", "bad")
    assert bad.returncode == 2 and f"{tmp_path}/bad.arrow: not an Arrow IPC file" in bad.stderr


def test_messages_column_for_every_kind_of_dataset(db_url: str, tmp_path: Path) -> None:
    """The column's conversation, read as its line would be: the final answer dropped
    (last), every assistant turn counted (all), the answer stored as done (passthrough)."""
    chat = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    pq.write_table(pa.Table.from_pylist([{"chat": chat}]), tmp_path / "c.parquet")
    source = tmp_path / "c.parquet"
    last = enqueue(db_url, source, "-d", "last", "--messages-column", "chat")
    every = enqueue(db_url, source, "-d", "all", "--messages-column", "chat", "--regenerate", "all")
    stored = enqueue(db_url, source, "-d", "pass", "--messages-column", "chat", "--passthrough")
    for result in (last, every, stored):
        assert result.returncode == 0, result.stderr
    assert items(db_url, "last") == [(f"{tmp_path.name}/c.parquet:1", {"messages": chat[:3]})]
    assert "2 turns to generate" in every.stdout
    assert "stored 1 rows as done" in stored.stdout
    assert query(db_url, "SELECT state FROM items WHERE position = 1 ORDER BY id") == [
        ("pending",),
        ("pending",),
        ("done",),
    ]
    pq.write_table(pa.Table.from_pylist([{"chat": chat[:1]}]), tmp_path / "q.parquet")
    refused = enqueue(
        db_url, tmp_path / "q.parquet", "-d", "pass", "--messages-column", "chat", "--passthrough"
    )
    assert refused.returncode == 2
    assert (
        "q.parquet:row 1: a passthrough row must end with the assistant's answer" in refused.stderr
    )


# --- predicted answer lengths (the longest-first claim's ranking) ----------------------------

# Conversations whose answer turns hold 40, 0 and 120 bytes of text: 10, 0 and 30 tokens
# (orchestrator.items.answer_length.BYTES_PER_TOKEN), as the model would write them again.
_HELD = [
    [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a" * 40}],
    [{"role": "user", "content": "q1"}],
    [
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b" * 40},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "c" * 80},
    ],
]


def predicted(db: str, dataset: str) -> list[tuple[str, int]]:
    """(key, predicted_tokens) of the dataset's items, in queue order."""
    return query(
        db,
        "SELECT i.key, i.predicted_tokens FROM items i JOIN datasets d ON d.id = i.dataset_id"
        " WHERE d.name = ? ORDER BY i.position",
        dataset,
    )


def test_every_source_stores_the_length_of_the_answers_its_rows_hold(
    db_url: str, tmp_path: Path
) -> None:
    """A table's row read as a line, a conversation from --messages-column, an Arrow file
    and a template's assistant part predict the answer as the JSONL line does: the
    trailing answers dropped (last), every answer turn (all)."""
    rows = [{"id": f"r{i}", "messages": chat} for i, chat in enumerate(_HELD)]
    write_jsonl(tmp_path / "lines.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    chats = [{"id": f"r{i}", "chat": chat} for i, chat in enumerate(_HELD)]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    with (
        pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, pa.Table.from_pylist(rows).schema) as writer,
    ):
        writer.write_table(pa.Table.from_pylist(rows))
    last = {"r0": 10, "r1": 0, "r2": 20}
    every = {"r0": 10, "r1": 0, "r2": 30}
    cases = [
        ("jsonl", tmp_path / "lines.jsonl", [], last),
        ("parquet", tmp_path / "rows.parquet", [], last),
        ("arrow", tmp_path / "rows.arrow", [], last),
        ("column", tmp_path / "chats.parquet", ["--messages-column", "chat"], last),
        ("jsonl-all", tmp_path / "lines.jsonl", ["--regenerate", "all"], every),
        ("parquet-all", tmp_path / "rows.parquet", ["--regenerate", "all"], every),
        (
            "column-all",
            tmp_path / "chats.parquet",
            ["--messages-column", "chat", "--regenerate", "all"],
            every,
        ),
    ]
    for name, source, options, want in cases:
        result = enqueue(db_url, source, "-d", name, *options)
        assert result.returncode == 0, (name, result.stderr)
        assert predicted(db_url, name) == list(want.items()), name

    template = tmp_path / "t.toml"
    template.write_text(
        '[[messages]]\nrole = "user"\ncontent = "{problem}"\n'
        '[[messages]]\nrole = "assistant"\ncontent = "{answer}"\n'
    )
    answers = [{"id": "t0", "problem": "p", "answer": "x" * 400}]
    pq.write_table(pa.Table.from_pylist(answers), tmp_path / "answers.parquet")
    source = tmp_path / "answers.parquet"
    built = enqueue(db_url, source, "-d", "tpl", "--template-file", str(template))
    assert built.returncode == 0, built.stderr
    assert predicted(db_url, "tpl") == [("t0", 100)]


def test_plan_counts_a_parquet_run_files_rows_at_their_answers_length(tmp_path: Path) -> None:
    chats = [{"id": f"r{i}", "chat": chat} for i, chat in enumerate(_HELD)]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"id": f"r{i}", "messages": c} for i, c in enumerate(_HELD)]),
        tmp_path / "rows.parquet",
    )
    column, rows = planned(
        tmp_path,
        '[[dataset]]\nname = "column"\nfile = "chats.parquet"\nmessages_column = "chat"\n\n'
        '[[dataset]]\nname = "rows"\nfile = "rows.parquet"\nregenerate = "all"\n',
    )
    # 10 + 20 tokens held; the row without an answer at 0.35 x 1000.
    assert (column["predicted"], column["generated_tokens"]) == (2, 30 + 350)
    # Every turn: 10; 10 + 30 over two turns; the prompt-only row's one turn at 350.
    assert (rows["predicted"], rows["generated_tokens"]) == (3, 40 + 350)


def test_compressed_jsonl_and_standard_input_read_as_the_plain_file(
    db_url: str, tmp_path: Path
) -> None:
    lines = [
        {"id": "a", "messages": [{"role": "user", "content": "hi"}]},
        {"prompt": "no id, keyed by its line"},
    ]
    plain = write_jsonl(tmp_path / "p.jsonl", lines)
    data = plain.read_bytes()
    with gzip.open(tmp_path / "p.jsonl.gz", "wb") as fh:
        fh.write(data)
    with (
        open(tmp_path / "p.jsonl.zst", "wb") as raw,
        pa.CompressedOutputStream(raw, "zstd") as fh,
    ):
        fh.write(data)
    for name in ("p.jsonl", "p.jsonl.gz", "p.jsonl.zst"):
        result = enqueue(db_url, tmp_path / name, "-d", name)
        assert result.returncode == 0, result.stderr
    piped = enqueue(db_url, "-", "-d", "stdin", input=data.decode())
    assert piped.returncode == 0, piped.stderr
    expected = items(db_url, "p.jsonl")
    assert [key for key, _ in expected] == ["a", "2"]
    for name in ("p.jsonl.gz", "p.jsonl.zst", "stdin"):
        assert items(db_url, name) == expected, name
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(data)[:-12])
    result = enqueue(db_url, broken, "-d", "broken")
    assert result.returncode == 2 and f"{broken}: cannot read: " in result.stderr
    assert not items(db_url, "broken")


# --- the Hub ---------------------------------------------------------------------------------


def hub_env(tmp_path: Path) -> dict[str, str]:
    """No network: datasets resolves the name as the local folder it also is."""
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
    }


def hub_repo(tmp_path: Path) -> Path:
    """``org/problems`` laid out as a Hub dataset repository: data/{split}-*.parquet."""
    data = tmp_path / "org" / "problems" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(PROBLEMS[:7]), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(PROBLEMS[7:]), data / "test-00000-of-00001.parquet")
    return tmp_path


def test_hub_dataset_through_load_dataset(db_url: str, tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    root = hub_repo(tmp_path)
    env = hub_env(tmp_path)
    args = ("-d", "hub", "--template", "{problem}")
    refused = enqueue(db_url, "hf://org/problems", *args, cwd=root, env=env)
    assert refused.returncode == 2
    assert "hf://org/problems: choose a split with --split" in refused.stderr
    assert "(the dataset has: train, test)" in refused.stderr
    unknown = enqueue(db_url, "hf://org/problems", *args, "--split", "dev", cwd=root, env=env)
    assert unknown.returncode == 2 and "Bad split: dev" in unknown.stderr
    result = enqueue(db_url, "hf://org/problems", *args, "--split", "test", cwd=root, env=env)
    assert result.returncode == 0, result.stderr
    assert items(db_url, "hub") == [
        (f"test:{n}", {"messages": [{"role": "user", "content": row["problem"]}]})
        for n, row in enumerate(PROBLEMS[7:], 1)
    ]
    again = enqueue(db_url, "hf://org/problems", *args, "--split", "test", cwd=root, env=env)
    assert "nothing new: all 3 items" in again.stdout, again.stderr


def test_hub_source_without_the_extra_says_what_to_install(db_url: str, tmp_path: Path) -> None:
    # A module named datasets that cannot be imported stands for the missing extra.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "datasets.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n"
    )
    env = {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}
    result = enqueue(db_url, "hf://org/problems", "-d", "hub", "--split", "train", env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: hf://org/problems: reading from the Hub needs the datasets library: "
        "pip install 'orchestrator[hf]'"
    )


# --- run files ---------------------------------------------------------------------------------


def test_run_file_reads_parquet_with_a_template_and_the_hub(db_url: str, tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    root = hub_repo(tmp_path)
    write_shards(root / "local", PROBLEMS, [5, 5])
    (root / "t.toml").write_text('user = "Solve: {problem}"\n')
    run = root / "run.toml"
    run.write_text(
        "[defaults]\nmax_tokens = 64\n"
        '[[dataset]]\nname = "local"\nfile = "local/train-*.parquet"\ntemplate_file = "t.toml"\n'
        '[[dataset]]\nname = "hub"\nhf = "org/problems"\nsplit = "train"\n'
        'prompt_column = "problem"\n'
    )
    result = cli("enqueue", "--config", str(run), "--db", db_url, cwd=root, env=hub_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "total: 17 items added to 2 datasets" in result.stdout
    assert user_texts(db_url, "local")[9] == "Solve: What is 9 + 9?"
    assert [key for key, _ in items(db_url, "hub")][:2] == ["train:1", "train:2"]


def test_run_file_column_keys_are_checked_with_the_rest(db_url: str, tmp_path: Path) -> None:
    write_shards(tmp_path / "data", PROBLEMS, [10])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    run = tmp_path / "run.toml"
    run.write_text(
        "[defaults]\nmax_tokens = 64\n"
        '[[dataset]]\nname = "a"\nfile = "data"\ntemplate = "{problem"\n'
        '[[dataset]]\nname = "b"\nfile = "data"\ntemplate = "{x}"\nprompt_column = "x"\n'
        '[[dataset]]\nname = "c"\nfile = "p.jsonl"\nsplit = "train"\n'
        '[[dataset]]\nname = "d"\nfile = "data"\nsystem = "s"\n'
        '[[dataset]]\nname = "e"\nfile = "data"\ntemplate_file = "missing.toml"\n'
        '[[dataset]]\nname = "f"\nfile = "p.jsonl"\nhf = "org/x"\n'
    )
    assert cli("db", "upgrade", "--db", db_url).returncode == 0
    before = db_snapshot(db_url)
    result = cli("enqueue", "--config", str(run), "--db", db_url)
    assert result.returncode == 2
    err = result.stderr
    assert "6 problems:" in err
    assert "dataset[1] \"a\".template: template: '{' at column 1 is not closed" in err
    assert 'dataset[2] "b".template: prompt_column and template both build the messages' in err
    assert 'dataset[3] "c".file: ' in err and "has no splits to choose from" in err
    assert 'dataset[4] "d".system: system needs one of prompt_column' in err
    assert f'dataset[5] "e".template_file: {tmp_path}/missing.toml: no such template file' in err
    assert 'dataset[6] "f".hf: a dataset reads a file or a Hub dataset (hf), not both' in err
    assert db_snapshot(db_url) == before


# --- all or nothing under SIGKILL ----------------------------------------------------------


def _write_large_parquet(path: Path, rows: int) -> None:
    """``rows`` prompt rows in row groups of 10,000, written a group at a time."""
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 10_000):
            ids = [f"k{i:07d}" for i in range(start, start + 10_000)]
            writer.write_table(pa.table({"id": ids, "prompt": [f"Prompt {i}" for i in ids]}))


def _rows_written(leader: int, deadline: float) -> Iterator[int]:
    """The enqueue's progress counter, as it redraws it on its terminal."""
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if not ready:
            continue
        chunk = read_terminal(leader)
        if not chunk:
            return
        seen = (seen + chunk)[-200:]
        counts = re.findall(rb": ([\d,]+)", seen)
        if counts:
            yield int(counts[-1].replace(b",", b""))


def test_sigkill_mid_enqueue_of_a_parquet_file_leaves_all_or_nothing(
    db_url: str, tmp_path: Path
) -> None:
    """Killed once its progress shows rows written (inside the one transaction), the
    enqueue leaves no item and no dataset; run again, it adds the whole file once."""
    # PostgreSQL takes about 2,000 rows/s on the shared test machine, SQLite 50 times that.
    total = 30_000 if is_postgres(db_url) else 100_000
    kill_at = total // 5
    big = tmp_path / "big.parquet"
    _write_large_parquet(big, total)
    assert cli("db", "upgrade", "--db", db_url).returncode == 0
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "enqueue", str(big), "-d", "big", "--db", db_url],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )
    os.close(follower)
    written = 0
    try:
        for written in _rows_written(leader, time.monotonic() + 180):
            if written >= kill_at:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    assert kill_at <= written < total, f"killed at {written:,} rows"
    assert proc.returncode == -signal.SIGKILL
    assert query(db_url, "SELECT count(*) FROM items")[0][0] == 0
    assert query(db_url, "SELECT count(*) FROM datasets")[0][0] == 0
    again = enqueue(db_url, big, "-d", "big")
    assert again.returncode == 0, again.stderr
    assert query(db_url, "SELECT count(*), count(DISTINCT key) FROM items")[0] == (total, total)


# --- what a JSONL enqueue loads ----------------------------------------------------------------


def test_a_jsonl_enqueue_never_imports_pyarrow(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = ["enqueue", str(path), "-d", "d", "--db", str(tmp_path / "q.db")]
    _, heavy = cli_loading(args, ("pyarrow", "datasets", "pandas"))
    assert heavy == []
