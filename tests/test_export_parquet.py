"""``export --format parquet``, ``--split`` shards, the dataset card and ``to_dataset``.

A run against the simulated server on each backend: a dataset of plain prompts (some
cut by ``max_tokens``, one refused by the server so that it fails), a dataset offering
tools, the server reasoning in a separate field. Everything goes through the real
command; what it writes is read back with pyarrow, pandas and ``datasets``, each row
checked against the JSONL export of the same database (one way to make a row) and each
answer against the simulator's oracle. The card's figures are recomputed from the
database's rows.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.sim import answer_matches
from tests import test_export_formats as formats
from tests.helpers import REPO, SimProcess, cli, query, write_jsonl

PROMPTS = 23
TOOLS = 9
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


def _hf_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def run_db(db_url: str, tmp_path: Path) -> str:
    """Two datasets answered by the simulator, on the backend of ``db_url``."""
    plain = [
        {"id": f"q{i:03d}", "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(PROMPTS)
    ]
    plain[5]["messages"][0]["content"] = "POISON question"
    tools = [
        {"id": f"t{i:03d}", "prompt": f"look up {i}", "system": "Call tools.", "tools": [TOOL]}
        for i in range(TOOLS)
    ]
    for name, rows, extra in (
        ("plain", plain, ["--max-tokens", "80"]),
        ("tools", tools, []),
    ):
        source = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        result = cli("enqueue", str(source), "-d", name, "--db", db_url, *extra)
        assert result.returncode == 0, result.stderr
    sim = SimProcess("--reasoning", "field", "--refuse", "POISON=bad item", "--mean-tokens", "40")
    url = sim.start()
    try:
        result = cli("run", "--server", url, "--db", db_url, "--exit-when-done")
    finally:
        sim.stop()
    assert result.returncode == 6, result.stderr  # 6: finished with an item failed, as planned
    return db_url


def _jsonl(db: str, out: Path, *args: str) -> list[dict[str, Any]]:
    result = cli("export", str(out), "--db", db, *args)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


_MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id")


def _as_table_row(line: dict[str, Any]) -> dict[str, Any]:
    """A JSONL messages line as the Parquet export types it (module doc of the writer)."""
    row = {
        "id": line["id"],
        "dataset": line["dataset"],
        "messages": [
            {k: m.get(k) for k in _MESSAGE_KEYS}
            | {
                "tool_calls": [
                    {"id": c.get("id"), "type": c.get("type"), "function": c.get("function")}
                    for c in m["tool_calls"]
                ]
                if m.get("tool_calls") is not None
                else None
            }
            for m in line["messages"]
        ],
        "tools": json.dumps(line["tools"], separators=(",", ":")) if "tools" in line else None,
        "finish_reason": line["finish_reason"],
        "usage": {
            k: line["usage"].get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
        if line["usage"] is not None
        else None,
        "flags": line["flags"],
    }
    for key in ("model", "params_hash", "server", "created_at", "started_at"):
        if key in line:
            row[key] = line[key]
    if "params" in line:
        row["params"] = line["params"]
    return row


def _oracle(rows: list[dict[str, Any]]) -> None:
    """Every answer is the simulator's answer to its own prompt."""
    for row in rows:
        *prompt, answer = row["messages"]
        assert answer["role"] == "assistant"
        sent = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        assert answer_matches(sent, {k: v for k, v in answer.items() if v is not None}), row["id"]


def test_parquet_rows_are_the_jsonl_rows(run_db: str, tmp_path: Path) -> None:
    lines = _jsonl(run_db, tmp_path / "all.jsonl", "--provenance")
    out = tmp_path / "all.parquet"
    result = cli("export", str(out), "--db", run_db, "--format", "parquet", "--provenance")
    assert result.returncode == 0, result.stderr
    assert f"exported {PROMPTS - 1 + TOOLS} items to {out}" in result.stdout
    table = pq.read_table(out)
    rows = table.to_pylist()
    expected = []
    for line in lines:
        row = _as_table_row(line)
        row["params"] = json.dumps(line["params"], separators=(",", ":"))
        expected.append(row)
    # params: the stored JSON text; compared as values.
    for row in rows:
        row["params"] = json.dumps(json.loads(row["params"]), separators=(",", ":"))
    assert rows == expected
    assert [r["id"] for r in rows] == [f"q{i:03d}" for i in range(PROMPTS) if i != 5] + [
        f"t{i:03d}" for i in range(TOOLS)
    ]
    _oracle(rows)
    assert any(r["messages"][-1]["reasoning_content"] for r in rows)
    assert any(r["messages"][-1]["tool_calls"] for r in rows)
    assert any("truncated" in r["flags"] for r in rows)
    # pandas reads the same rows.
    frame = pd.read_parquet(out)
    assert list(frame["id"]) == [r["id"] for r in rows]
    assert list(frame.columns) == table.column_names


def test_options_apply_to_parquet(run_db: str, tmp_path: Path) -> None:
    """--dataset, --exclude-flag, --reasoning and --include-failed, as for JSONL."""
    args = ["--dataset", "plain", "--exclude-flag", "truncated", "--reasoning", "inline"]
    lines = _jsonl(run_db, tmp_path / "some.jsonl", *args, "--provenance")
    out, failed = tmp_path / "some.parquet", tmp_path / "failed.jsonl"
    result = cli(
        "export", str(out), "--db", run_db, "--format", "parquet", *args,
        "--include-failed", str(failed),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out).to_pylist()
    assert rows == [
        {k: v for k, v in _as_table_row(line).items() if k in rows[0]} for line in lines
    ]
    assert rows and all(r["dataset"] == "plain" and "truncated" not in r["flags"] for r in rows)
    assert all(r["messages"][-1]["content"].startswith("<think>") for r in rows)
    assert "left out" in result.stdout
    errors = [orjson.loads(line) for line in failed.read_bytes().splitlines()]
    assert [(e["id"], e["dataset"]) for e in errors] == [("q005", "plain")]


def _percentile(values: list[int], q: int) -> int | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _card(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """The card's YAML header and each dataset's figure table."""
    text = path.read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    tables: dict[str, dict[str, str]] = {}
    name = None
    for line in body.splitlines():
        if line.startswith("## "):
            name = line[3:]
            tables[name] = {}
        elif name and line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 2 and cells[0] != "figure":
                tables[name][cells[0]] = cells[1]
    return yaml.safe_load(header), tables


def _expected_figures(db: str, name: str, mask: int) -> dict[str, str]:
    """The card's figures of dataset ``name``, recomputed from the database's rows."""
    (dataset_id,) = query(db, "SELECT id FROM datasets WHERE name = ?", name)[0]
    states = dict(
        query(
            db, "SELECT state, count(*) FROM items WHERE dataset_id = ? GROUP BY state", dataset_id
        )
    )
    outputs = query(
        db,
        "SELECT prompt_tokens, completion_tokens, flags, message, created_at FROM outputs"
        " WHERE dataset_id = ?",
        dataset_id,
    )
    kept = [o for o in outputs if not o[2] & mask]
    reasoned = sum(1 for o in kept if json.loads(o[3]).get("reasoning_content"))
    total = sum(states.values())

    def pair(index: int) -> str:
        values = [o[index] for o in kept if o[index] is not None]
        return f"{_percentile(values, 50)} / {_percentile(values, 90)}"

    return {
        "rows in this export": f"{len(kept):,}",
        "left out for quality flags": f"{len(outputs) - len(kept):,}",
        "items": f"{total:,}",
        "done": f"{states.get('done', 0):,}",
        "failed": f"{states.get('failed', 0):,}",
        "pending or running": f"{states.get('pending', 0) + states.get('running', 0):,}",
        "answers with reasoning": f"{reasoned / len(kept):.1%} ({reasoned:,} of {len(kept):,})",
        "prompt tokens p50 / p90": pair(0),
        "completion tokens p50 / p90": pair(1),
        "first answer": _when(min(o[4] for o in outputs)),
        "last answer": _when(max(o[4] for o in outputs)),
        "billed for answers kept": _billed(db, dataset_id, "="),
        "billed for answers thrown away": _billed(db, dataset_id, "!="),
    }


def _billed(db: str, dataset_id: int, kept: str) -> str:
    """The card's line of the tokens billed (the ``spend`` ledger), kept or not."""
    sql = (
        "SELECT coalesce(sum(requests), 0), coalesce(sum(prompt_tokens), 0),"
        " coalesce(sum(cached_tokens), 0), coalesce(sum(completion_tokens), 0) FROM spend"
        f" WHERE dataset_id = ? AND kind {kept} 'kept'"
    )
    r, p, c, t = (int(v) for v in query(db, sql, dataset_id)[0])
    return f"{r:,} requests: {p:,} prompt tokens ({c:,} cached), {t:,} completion tokens"


def _models_line(db: str, name: str, mask: int) -> str:
    """The card's line of the model and parameters the exported answers were made with."""
    found = query(
        db,
        "SELECT o.model, p.params, o.flags FROM outputs AS o JOIN datasets AS d"
        " ON d.id = o.dataset_id LEFT JOIN param_sets AS p ON p.hash = o.params_hash"
        " WHERE d.name = ?",
        name,
    )
    kept = {(m, p) for m, p, flags in found if not flags & mask}
    ((model, params),) = kept  # one model, one set of parameters in this run
    n = sum(1 for m, p, flags in found if not flags & mask)
    return f"- `{model}` with `{params}`: {n:,} answers"


def test_split_shards_and_card(
    run_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    _hf_offline(monkeypatch, tmp_path)
    out = tmp_path / "export"
    args = ["--format", "parquet", "--split", "--shard-rows", "7", "--exclude-flag", "truncated"]
    result = cli("export", str(out), "--db", run_db, *args)
    assert result.returncode == 0, result.stderr
    lines = _jsonl(run_db, tmp_path / "all.jsonl", "--exclude-flag", "truncated", "--provenance")
    by_dataset = {
        name: [ln for ln in lines if ln["dataset"] == name] for name in ("plain", "tools")
    }
    header, tables = _card(out / "README.md")
    configs = {c["config_name"]: c for c in header["configs"]}
    assert set(configs) == {"plain", "tools"}
    for name, expected in by_dataset.items():
        shards = math.ceil(len(expected) / 7)
        names = sorted(p.name for p in (out / name).iterdir())
        assert names == [f"train-{i:05d}-of-{shards:05d}.parquet" for i in range(shards)]
        sizes = [pq.ParquetFile(out / name / n).metadata.num_rows for n in names]
        assert max(sizes) <= 7 and sum(sizes) == len(expected)
        # The card's configs name exactly these files, and they load.
        (files,) = configs[name]["data_files"]
        assert files["split"] == "train"
        assert files["path"] == [f"{name}/{n}" for n in names]
        assert all((out / p).is_file() for p in files["path"])
        from_card = datasets.load_dataset(str(out), name, split="train")
        by_files = datasets.load_dataset(
            "parquet", data_files=[str(out / p) for p in files["path"]], split="train"
        )
        rows = [_as_table_row(ln) for ln in expected]
        for got in (from_card.to_list(), by_files.to_list(), pd.read_parquet(out / name)):
            listed = got if isinstance(got, list) else got.to_dict("records")
            assert [r["id"] for r in listed] == [r["id"] for r in rows]
        assert [{k: r[k] for k in rows[0] if k in r} for r in from_card.to_list()] == [
            {k: v for k, v in r.items() if k in from_card.column_names} for r in rows
        ]
        _oracle(from_card.to_list())
        assert tables[name] == _expected_figures(run_db, name, 1)  # truncated's bit
        assert _models_line(run_db, name, 1) in (out / "README.md").read_text()
    assert "| plain | " in (out / "README.md").read_text()


def test_to_dataset(run_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import orchestrator

    _hf_offline(monkeypatch, tmp_path)
    lines = _jsonl(run_db, tmp_path / "tools.jsonl", "--dataset", "tools", "--provenance")
    with orchestrator.open_sync(run_db) as q:
        dataset = q.to_dataset(datasets="tools")
    rows = [_as_table_row(ln) for ln in lines]
    assert [{k: r[k] for k in dataset.column_names} for r in rows] == dataset.to_list()
    assert len(dataset) == TOOLS


def test_to_dataset_without_the_extra(tmp_path: Path) -> None:
    """Without ``datasets`` installed, one line saying what to install."""
    db = tmp_path / "q.db"
    cli(
        "enqueue",
        str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])),
        "-d",
        "d",
        "--db",
        str(db),
    )
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "import orchestrator\n"
        "from orchestrator.errors import ConfigError\n"
        f"q = orchestrator.open_sync({str(db)!r})\n"
        "try:\n    q.to_dataset()\nexcept ConfigError as e:\n    print(e)\n"
        "finally:\n    q.close()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip() == (
        "to_dataset needs the datasets library: pip install 'orchestrator[hf]'"
    ), result.stderr


# ---------------------------------------------------------------------- files, kills, mistakes


def _done_db(tmp_path: Path, n: int) -> Path:
    """``n`` done items of one dataset, answered in plain SQL (no server needed)."""
    db = tmp_path / "done.db"
    rows = [{"id": f"k{i:05d}", "prompt": f"question {i}"} for i in range(n)]
    result = cli(
        "enqueue", str(write_jsonl(tmp_path / "in.jsonl", rows)), "-d", "d", "--db", str(db)
    )
    assert result.returncode == 0, result.stderr
    import sqlite3

    with sqlite3.connect(db) as conn:
        ids = [r[0] for r in conn.execute("SELECT id, dataset_id FROM items ORDER BY id")]
        (dataset_id,) = conn.execute("SELECT id FROM datasets").fetchone()
        message = orjson.dumps({"role": "assistant", "content": "an answer " * 20}).decode()
        usage = '{"prompt_tokens":3,"completion_tokens":40,"total_tokens":43}'
        conn.executemany(
            "INSERT INTO outputs (item_id, dataset_id, finish_reason, prompt_tokens,"
            " completion_tokens, message, usage, latency, attempt, created_at, flags)"
            " VALUES (?, ?, 'stop', 3, 40, ?, ?, 0.5, 1, ?, 0)",
            [(i, dataset_id, message, usage, 1_800_000_000.0 + i) for i in ids],
        )
        conn.execute("UPDATE items SET state = 'done', attempts = 1")
    return db


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_reexport_replaces_every_shard(tmp_path: Path) -> None:
    db = _done_db(tmp_path, 40)
    out = tmp_path / "out"
    for rows, shards in ((5, 8), (15, 3)):
        result = cli(
            "export", str(out), "--db", str(db), "--format", "parquet", "--split",
            "--shard-rows", str(rows),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        names = sorted(p.name for p in (out / "d").iterdir())
        assert names == [f"train-{i:05d}-of-{shards:05d}.parquet" for i in range(shards)]
    header, _ = _card(out / "README.md")
    assert header["configs"][0]["data_files"][0]["path"] == [f"d/{n}" for n in names]
    # The same rows give the same files, card included.
    before = _tree(out)
    again = cli(
        "export", str(out), "--db", str(db), "--format", "parquet", "--split", "--shard-rows", "15"
    )
    assert again.returncode == 0, again.stderr
    assert _tree(out) == before


def test_card_beside_a_jsonl_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--card FILE`` with any format: its one config names the file, and it loads."""
    import datasets

    _hf_offline(monkeypatch, tmp_path)
    db = _done_db(tmp_path, 12)
    folder = tmp_path / "pub"
    folder.mkdir()
    result = cli(
        "export", str(folder / "all.jsonl"), "--db", str(db), "--card", str(folder / "README.md")
    )
    assert result.returncode == 0, result.stderr
    header, tables = _card(folder / "README.md")
    assert header["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": ["all.jsonl"]}]}
    ]
    loaded = datasets.load_dataset(str(folder), split="train")
    assert loaded["id"] == [f"k{i:05d}" for i in range(12)]
    assert tables["d"] == _expected_figures(str(db), "d", 0)


# Stops the export after its first row group is in a temporary file: killed there, the
# process has written part of the export and renamed nothing.
_STOPPED_EXPORT = """
import os, sys, time
import pyarrow.parquet as pq
from orchestrator.cli import main
write = pq.ParquetWriter.write_table
def stop(self, *a, **k):
    write(self, *a, **k)
    open(os.environ["READY"], "w").close()
    time.sleep(600)
pq.ParquetWriter.write_table = stop
main(sys.argv[1:])
"""


def test_sigkill_leaves_the_previous_export(tmp_path: Path) -> None:
    db = _done_db(tmp_path, 60)
    out = tmp_path / "out"
    args = ["export", str(out), "--db", str(db), "--format", "parquet", "--split"]
    first = cli(*args, "--shard-rows", "25")
    assert first.returncode == 0, first.stderr
    before = _tree(out)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_EXPORT, *args, "--shard-rows", "10"],
        cwd=REPO,
        env={**os.environ, "READY": str(ready)},
        stderr=subprocess.PIPE,
    )
    try:
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert any(p.name.endswith(".tmp") for p in (out / "d").iterdir())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Only the previous export at the target; its partial successor is a hidden file,
    # which the next export to the same place removes.
    visible = {k: v for k, v in _tree(out).items() if not Path(k).name.startswith(".")}
    assert visible == before
    again = cli(*args, "--shard-rows", "10")
    assert again.returncode == 0, again.stderr
    assert not [p for p in (out / "d").iterdir() if p.name.startswith(".")]
    assert len(list((out / "d").iterdir())) == 6


def _refused(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert all(n in line for n in needles), line
    return line


def test_mistakes_are_refused_with_nothing_written(tmp_path: Path, mounted: Any) -> None:
    db = _done_db(tmp_path, 3)
    parquet = ["--db", str(db), "--format", "parquet"]
    _refused(
        cli("export", str(tmp_path / "o"), *parquet, "--split", "--shard-rows", "0"), "--shard-rows"
    )
    _refused(
        cli("export", str(tmp_path / "o.parquet"), *parquet, "--split"),
        "o.parquet", "give a folder name",
    )  # fmt: skip
    _refused(cli("export", "-", *parquet, "--split"), "stream", "--split needs a directory")
    _refused(
        cli("export", str(tmp_path / "one.parquet"), *parquet, "--shard-rows", "5"),
        "shard_rows", "--split",
    )  # fmt: skip
    (tmp_path / "afile").write_text("")
    _refused(cli("export", str(tmp_path / "afile" / "o.parquet"), *parquet), "not a directory")
    ro = mounted("-t", "tmpfs", "-o", "ro,size=1m")
    _refused(cli("export", str(ro / "o.parquet"), *parquet), str(ro / "o.parquet"), "read-only")
    _refused(cli("export", str(ro / "o"), *parquet, "--split"), str(ro / "o"), "read-only")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.parquet").exists()
    assert not (tmp_path / "one.parquet").exists()
    assert not list(ro.iterdir())


def test_token_rows_are_refused_by_name(tmp_path: Path) -> None:
    """A pre-tokenised row has no messages: the Parquet export says which and writes nothing."""
    db = tmp_path / "t.db"
    rows = [{"id": "tok1", "input_ids": [1, 2, 3]}]
    source = write_jsonl(tmp_path / "tok.jsonl", rows)
    result = cli(
        "enqueue", str(source), "-d", "toks", "--db", str(db), "--passthrough", "--format", "tokens"
    )
    if result.returncode != 0:
        pytest.fail(result.stderr)
    out = tmp_path / "t.parquet"
    line = _refused(cli("export", str(out), "--db", str(db), "--format", "parquet"), "'tok1'")
    assert "pre-tokenised" in line and "--format messages" in line
    assert not out.exists()


# ---------------------------------------------------------------------- every kind of row


@pytest.fixture(scope="module")
def kinds_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_export_formats' database: every kind of row export meets."""
    tmp = tmp_path_factory.mktemp("kinds")
    db = tmp / "kinds.db"
    formats._enqueue(tmp, db, "chat", formats.CHAT_LINES)
    formats._enqueue(tmp, db, "web/qa", [{"id": "w0", "prompt": "What is a URL?"}])
    asyncio.run(formats._answer(db))
    formats._insert_new_kinds(db)
    return db


def test_every_kind_of_row_as_in_jsonl(kinds_db: Path, tmp_path: Path) -> None:
    """Multi-turn, agentic, truncated and empty answers (test_export_formats' database):
    each Parquet row is its JSONL line typed, under every reasoning mode, with provenance;
    pre-tokenised rows are refused by name."""
    db = kinds_db
    chosen = ["--dataset", "chat", "--dataset", "multi", "--dataset", "web/qa"]
    for reasoning in ("separate", "inline", "drop"):
        options = [*chosen, "--reasoning", reasoning]
        lines = _jsonl(str(db), tmp_path / f"{reasoning}.jsonl", *options, "--provenance")
        for provenance in ([], ["--provenance"]):
            out = tmp_path / f"{reasoning}{len(provenance)}.parquet"
            result = cli(
                "export", str(out), "--db", str(db), "--format", "parquet", *options, *provenance
            )
            assert result.returncode == 0, result.stderr
            rows = pq.read_table(out).to_pylist()
            expected = [_as_table_row(line) for line in lines]
            for row, want in zip(rows, expected, strict=True):
                if provenance:
                    assert json.loads(row.pop("params") or "null") == want.pop("params")
                assert row == {k: v for k, v in want.items() if k in row}
            assert {r["dataset"] for r in rows} == {"chat", "multi", "web/qa"}
    line = _refused(
        cli("export", str(tmp_path / "p.parquet"), "--db", str(db), "--format", "parquet")
    )
    assert "'pass'" in line and "pre-tokenised" in line


# What stored JSON can hold: orjson wrote it, and its integers are 64-bit (signed or not).
_SCALARS = st.one_of(
    st.none(),
    st.text(max_size=5),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=2),
    st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2),
)


@given(
    content=_VALUES,
    arguments=_VALUES,
    role=_VALUES,
    count=_VALUES,
)
@settings(max_examples=60, deadline=None)
def test_values_of_other_types_are_conformed(
    content: Any, arguments: Any, role: Any, count: Any
) -> None:
    """Whatever the stored JSON holds, a row is written: text as it is, other values as
    their JSON text, counts that are not whole numbers as null."""
    from orchestrator.formats.writers.parquet import _Encoder, schema
    from orchestrator.store.outputs import DatasetRef

    encoder = _Encoder(DatasetRef(1, "d", "last", False), schema(False))
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": role, "content": content, "tool_calls": [call]}
    record = {"id": "k", "dataset": "d", "messages": [message], "usage": {"prompt_tokens": count}}
    encoder.add(record, "k", 0)
    (row,) = encoder.table().to_pylist()

    def text(value: Any) -> Any:
        return value if value is None or isinstance(value, str) else orjson.dumps(value).decode()

    (got,) = row["messages"]
    assert got["content"] == text(content) and got["role"] == text(role)
    assert got["tool_calls"][0]["function"]["arguments"] == text(arguments)
    whole = isinstance(count, int) or (isinstance(count, float) and count.is_integer())
    expected = int(count) if whole and not isinstance(count, bool) else None
    if expected is not None and not -(2**63) <= expected < 2**63:
        expected = None
    assert row["usage"]["prompt_tokens"] == expected
    assert row["flags"] == []


def test_per_turn_rows_as_in_jsonl(kinds_db: Path, tmp_path: Path) -> None:
    """``--per-turn`` with Parquet: the rows of the JSONL per-turn export, with their
    ``source_id``, ``source_row_index`` and ``assistant_turn_index`` columns."""
    options = ["--dataset", "multi", "--dataset", "chat", "--per-turn"]
    lines = _jsonl(str(kinds_db), tmp_path / "turns.jsonl", *options, "--provenance")
    out = tmp_path / "turns.parquet"
    result = cli("export", str(out), "--db", str(kinds_db), "--format", "parquet", *options)
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == len(lines) > len({line["source_id"] for line in lines})
    for row, line in zip(rows, lines, strict=True):
        want = _as_table_row(line)
        want |= {k: line[k] for k in ("source_id", "source_row_index", "assistant_turn_index")}
        assert row == {k: v for k, v in want.items() if k in row}
