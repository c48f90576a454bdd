"""Every export option against every format: honoured, or refused before anything is
written (``formats.support`` is the one table), and the folders an export writes.

One database answered by the simulated server: a chat dataset (two samples a prompt,
reasoning apart, token ids and top-2 logprobs, most answers cut by ``max_tokens``, one
prompt refused so that it fails) and a raw completions dataset of the same kind. Each
format is exported through the Python API with each option, and the output (JSONL
lines, or Parquet rows) is checked for what the option adds or takes away.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from orchestrator.errors import ConfigError
from orchestrator.formats import support
from orchestrator.settings.choices import EXPORT_FORMATS, TABLE_FORMATS
from tests.helpers import SimProcess, cli, is_postgres, query, write_jsonl

N = 4


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("options")
    db = tmp / "q.db"
    chat = [{"id": f"c{i}", "prompt": f"question {i}"} for i in range(N)]
    chat.append({"id": "cbad", "prompt": "POISON question"})
    raw = [{"id": f"r{i}", "prompt": f"Count on: {i}, {i + 1},"} for i in range(N)]
    raw.append({"id": "rbad", "prompt": "POISON count"})
    common = ["--db", str(db), "--max-tokens", "40", "--samples", "2", "--logprobs", "2"]
    common += ["--param", "return_token_ids=true"]
    for name, rows, extra in (("chat", chat, []), ("raw", raw, ["--endpoint", "completions"])):
        source = write_jsonl(tmp / f"{name}.jsonl", rows)
        result = cli("enqueue", str(source), "-d", name, *common, *extra)
        assert result.returncode == 0, result.stderr
    sim = SimProcess("--reasoning", "field", "--refuse", "POISON=bad item", "--mean-tokens", "30")
    url = sim.start()
    try:
        result = cli("run", "--server", url, "--db", str(db), "--exit-when-done")
    finally:
        sim.stop()
    assert result.returncode == 6, result.stderr  # finished, the poisoned items failed
    return db


# Each table entry as the API's keyword arguments.
SETTINGS: dict[str, dict[str, Any]] = {
    "reasoning=inline": {"reasoning": "inline"},
    "reasoning=drop": {"reasoning": "drop"},
    "exclude_flags": {"exclude_flags": "truncated"},
    "provenance": {"provenance": True},
    "parsed": {"parsed": True},
    "group_samples": {"group_samples": True},
    "split": {"split": True},
    "include_failed": {"include_failed": "FAILED"},
    "logprobs": {"logprobs": True},
    "token_ids": {"token_ids": True},
    "per_turn": {"per_turn": True},
    "shard_rows": {"split": True, "shard_rows": 3},
    "card": {"card": "CARD"},
    "merge_turns": {"merge_turns": True},
}


def test_every_table_entry_is_tried() -> None:
    assert set(SETTINGS) == set(support.SUPPORT)


def _records(path: Path) -> list[dict[str, Any]]:
    """What a file or folder of the export holds, as dicts (a Parquet row as one)."""
    if path.is_dir():
        data = ("chat.jsonl", "raw.jsonl")
        files = sorted(p for p in path.rglob("*") if p.name.endswith(".parquet") or p.name in data)
        return [r for f in files for r in _records(f)]
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _text(records: list[dict[str, Any]]) -> str:
    return "\n".join(orjson.dumps(r, default=str).decode() for r in records)


Check = Callable[[Path, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]], None]


def _has(needle: str) -> Check:
    def check(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
        assert needle in _text(got), needle

    return check


def _lacks(needle: str) -> Check:
    def check(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
        assert needle not in _text(got) and needle in _text(base), needle

    return check


def _fewer(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    assert len(got) < len(base)


def _grouped(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    assert len(got) == len(base) // 2
    text = _text(got)
    assert '"answers":[' in text or '"index":1' in text


def _files(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    assert out.is_dir() and len(got) == len(base)


def _failed(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    lines = _records(Path(made["include_failed"]))
    failed = "rbad" if _ids(base).startswith("r") else "cbad"
    # Each failed sample's line names its prompt and its sample (SpecForge's ids join
    # with its rows' ``<id>#sample<k>``).
    ids = {line.get("custom_id") or line["id"] for line in lines}
    assert {i.split("#sample")[0] for i in ids} == {failed}
    assert all("sample" in line for line in lines) or len(lines) == 1


def _ids(records: list[dict[str, Any]]) -> str:
    return "".join(str(r.get("custom_id") or r["id"])[0] for r in records)


def _shards(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    assert len(got) == len(base)
    assert all(len(list(folder.iterdir())) > 1 for folder in out.iterdir() if folder.is_dir())


def _single_turns_unchanged(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    # Every answer of this dataset is one turn: nothing to merge, every row as it was.
    assert got == base and got


def _card(out: Path, made: dict[str, Any], got: Any, base: Any) -> None:
    text = Path(made["card"]).read_text()
    assert yaml.safe_load(text.split("---")[1])["configs"]


HONOURED: dict[str, Check] = {
    "reasoning=inline": _has("<think>"),
    "reasoning=drop": _lacks('"reasoning_content":"'),
    "exclude_flags": _fewer,
    "provenance": _has('"params_hash":"'),
    "parsed": _has('"parsed":'),
    "group_samples": _grouped,
    "split": _files,
    "include_failed": _failed,
    "logprobs": _has('"token_logprobs":['),
    "token_ids": _has('"token_ids":['),
    "per_turn": _has("#turn"),
    "shard_rows": _shards,
    "card": _card,
    "merge_turns": _single_turns_unchanged,
}


def _export(db: Path, out: Path, fmt: str, **options: Any) -> Any:
    import orchestrator

    dataset = "raw" if fmt == "completions" else "chat"
    queue = orchestrator.open_sync(str(db))
    try:
        return queue.export(out, datasets=dataset, format=fmt, **options)
    finally:
        queue.close()


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_each_option_is_honoured_or_refused_by_each_format(
    answered: Path, tmp_path: Path, fmt: str, name: str
) -> None:
    suffix = ".parquet" if fmt in TABLE_FORMATS else ".jsonl"
    named = ("FAILED", "CARD")
    made = {k: str(tmp_path / v) if v in named else v for k, v in SETTINGS[name].items()}
    out = tmp_path / ("out" if made.get("split") else f"out{suffix}")
    formats, _ = support.SUPPORT[name]
    if fmt not in formats:
        with pytest.raises(ConfigError) as refused:
            _export(answered, out, fmt, **made)
        option = name.partition("=")[0].replace("_", "-")
        assert f"--{option}" in str(refused.value) and fmt in str(refused.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
        return
    _export(answered, out, fmt, **made)
    base_out = tmp_path / f"base{suffix}"
    _export(answered, base_out, fmt)
    HONOURED[name](out, made, _records(out), _records(base_out))


_TOKEN_COLUMNS = ("token_ids", "tokens", "token_logprobs", "top_token_ids", "top_tokens")


def _jsonl(db: Path, out: Path, *args: str) -> list[dict[str, Any]]:
    result = cli("export", str(out), "--db", str(db), *args)
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def test_parquet_carries_the_token_columns_of_the_jsonl(answered: Path, tmp_path: Path) -> None:
    """``--format parquet --logprobs --token-ids``: each row's token columns hold what the
    JSONL line of the same answer holds (ids as int32, logprobs as float32)."""
    chosen = ["--dataset", "chat", "--logprobs", "--token-ids"]
    lines = _jsonl(answered, tmp_path / "all.jsonl", *chosen)
    out = tmp_path / "all.parquet"
    result = cli("export", str(out), "--db", str(answered), "--format", "parquet", *chosen)
    assert result.returncode == 0, result.stderr
    table = pq.read_table(out)
    assert str(table.schema.field("token_ids").type) == "list<element: int32>"
    assert str(table.schema.field("top_logprobs").type) == "list<element: list<element: float>>"
    rows = table.to_pylist()
    assert len(rows) == len(lines) > 0
    for row, line in zip(rows, lines, strict=True):
        assert (row["id"], row["sample"]) == (line["id"], line["sample"])
        assert line["token_ids"] and line["token_logprobs"]
        for name in (*_TOKEN_COLUMNS, "top_logprobs"):
            assert row[name] == line.get(name), name


def test_completions_group_samples(answered: Path, tmp_path: Path) -> None:
    """``--format completions --group-samples``: a line per prompt, its samples' completions
    in ``answers``, each as its own line had it."""
    each = _jsonl(answered, tmp_path / "each.jsonl", "--dataset", "raw", "--format", "completions")
    grouped = _jsonl(
        answered, tmp_path / "g.jsonl", "--dataset", "raw", "--format", "completions",
        "--group-samples", "--logprobs",
    )  # fmt: skip
    assert [line["id"] for line in grouped] == [f"r{i}" for i in range(N)]
    for line, pair in zip(grouped, [each[i : i + 2] for i in range(0, 2 * N, 2)], strict=True):
        assert line["prompt"] == pair[0]["prompt"] and line["dataset"] == "raw"
        assert [a["sample"] for a in line["answers"]] == [0, 1]
        assert [a["completion"] for a in line["answers"]] == [s["completion"] for s in pair]
        assert all(a["token_logprobs"] for a in line["answers"])


# ---------------------------------------------------------------------- folders


def _two_datasets(tmp_path: Path) -> Path:
    """Datasets ``a`` and ``b``, three done items each, answered in plain SQL."""
    import sqlite3

    db = tmp_path / "two.db"
    for name in ("a", "b"):
        rows = [{"id": f"{name}{i}", "prompt": f"question {i}"} for i in range(3)]
        source = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        result = cli("enqueue", str(source), "-d", name, "--db", str(db))
        assert result.returncode == 0, result.stderr
    with sqlite3.connect(db) as conn:
        message = '{"role":"assistant","content":"an answer"}'
        conn.execute(
            "INSERT INTO outputs (item_id, dataset_id, finish_reason, message, latency, attempt,"
            " created_at, flags) SELECT id, dataset_id, 'stop', ?, 0.5, 1, 1.8e9, 0 FROM items",
            (message,),
        )
        conn.execute("UPDATE items SET state = 'done', attempts = 1")
    return db


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("fmt", ["parquet", "messages"])
def test_a_folder_export_of_fewer_datasets_leaves_only_what_its_card_lists(
    tmp_path: Path, fmt: str
) -> None:
    """``export OUT --split`` of a and b, then of a alone: b's files, named by the earlier
    card, go with it, and the folder holds what the new card lists (and nothing else of
    the earlier export's)."""
    db = _two_datasets(tmp_path)
    out = tmp_path / "out"
    args = ["export", str(out), "--db", str(db), "--format", fmt, "--split"]
    args += [] if fmt == "parquet" else ["--card", str(out / "README.md")]
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # not the export's: left alone
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert any(name.startswith("b") for name in _files_under(out))
    again = cli(*args, "--dataset", "a")
    assert again.returncode == 0, again.stderr
    header = yaml.safe_load((out / "README.md").read_text().split("---")[1])
    listed = sorted(p for c in header["configs"] for f in c["data_files"] for p in f["path"])
    assert [c["config_name"] for c in header["configs"]] == ["a"]
    assert _files_under(out) == sorted([*listed, "README.md", "notes.txt"])
    assert not (out / "b").exists()


def test_split_makes_the_folders_parents_and_a_folder_target_suggests_split(
    tmp_path: Path,
) -> None:
    db = _two_datasets(tmp_path)
    out = tmp_path / "out" / "final" / "sg"
    result = cli("export", str(out), "--db", str(db), "--format", "specforge", "--split")
    assert result.returncode == 0, result.stderr
    assert (out / "a.jsonl").exists() and (out / "b.jsonl").exists()
    refused = cli("export", str(out), "--db", str(db), "--format", "specforge")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "is a directory" in refused.stderr and "--split" in refused.stderr


# ---------------------------------------------------------------------- one snapshot

_REASONED = '{"role":"assistant","content":"an answer","reasoning_content":"because"}'


def _commit(db: str, sql: str, *params: Any) -> None:
    if is_postgres(db):
        query(db, sql, *params)  # asyncpg commits each statement
        return
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(sql, params)


def _answer(db: str, keys: list[str]) -> None:
    """Answers (with reasoning) for ``keys`` committed, as a worker commits them."""
    for key in keys:
        _commit(
            db,
            "INSERT INTO outputs (item_id, dataset_id, finish_reason, message, latency,"
            " attempt, created_at, flags) SELECT id, dataset_id, 'stop', ?, 0.5, 1, 1.8e9, 0"
            " FROM items WHERE key = ?",
            _REASONED,
            key,
        )
        _commit(db, "UPDATE items SET state = 'done', attempts = 1 WHERE key = ?", key)


def test_the_card_describes_the_rows_it_was_written_with(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker commits answers while the export runs, after its rows were read and
    before its card's figures are: rows, counts and figures all come from one snapshot."""
    import orchestrator
    from orchestrator.formats.writers import card

    keys = [f"k{i}" for i in range(10)]
    rows = [{"id": key, "prompt": f"question {key}"} for key in keys]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    assert cli("enqueue", str(source), "-d", "d", "--db", db_url).returncode == 0
    _answer(db_url, keys[:4])
    figures = card.card_figures

    def meanwhile(rows: Any, dataset_id: int, **how: Any) -> Any:
        _answer(db_url, keys[4:])  # committed between the rows' read and the figures'
        return figures(rows, dataset_id, **how)

    monkeypatch.setattr(card, "card_figures", meanwhile)
    out = tmp_path / "out"
    queue = orchestrator.open_sync(db_url)
    try:
        report = queue.export(out, format="parquet", split=True)
    finally:
        queue.close()
    assert report.lines == 4 and query(db_url, "SELECT count(*) FROM outputs") == [(10,)]
    text = (out / "README.md").read_text()
    assert "| d | 4 | 10 | 4 | 0 | 0 | 1 |" in text
    assert "| done | 4 |" in text and "| pending or running | 6 |" in text
    assert "| answers with reasoning | 100.0% (4 of 4) |" in text
