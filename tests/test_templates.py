"""Properties of the template language and of reading rows across source formats.

The template language is column lookups and literal text, nothing else; the same rows
written as JSONL, Parquet and CSV read into the same queue items.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.formats import iter_prepared
from orchestrator.formats.readers.columns import Columns
from orchestrator.formats.readers.template import TemplateError, ValueProblem, escape, parse

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
NAME = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="{}."), min_size=1, max_size=12
)
VALUE = st.one_of(TEXT, st.integers(-(10**12), 10**12), st.floats(allow_nan=False))


@given(TEXT)
def test_literal_text_round_trips_through_escape(text: str) -> None:
    template = parse(escape(text))
    assert template.render({}) == text
    assert template.columns == frozenset()


@given(TEXT, NAME, VALUE, TEXT)
def test_any_column_name_is_looked_up_as_written(
    before: str, name: str, value: Any, after: str
) -> None:
    template = parse(escape(before) + "{" + name + "}" + escape(after))
    assert template.columns == {name}
    assert template.render({name: value}) == before + str(value) + after


@given(st.lists(NAME, min_size=1, max_size=5), TEXT)
def test_dots_reach_into_nested_structs(path: list[str], value: str) -> None:
    row: Any = value
    for name in reversed(path):
        row = {name: row}
    template = parse("{" + ".".join(path) + "}")
    assert template.render(row) == value
    if len(path) > 1:
        # One level short of the value: a struct, which a hole does not take.
        with pytest.raises(ValueProblem, match="must be text or a number, got a struct"):
            parse("{" + ".".join(path[:-1]) + "}").render(row)


@given(st.lists(NAME, min_size=1, max_size=4))
def test_a_missing_field_names_the_whole_path(path: list[str]) -> None:
    with pytest.raises(ValueProblem) as info:
        parse("{" + ".".join(path) + "}").render({})
    assert info.value.column == ".".join(path)
    assert str(info.value).startswith(f"column {'.'.join(path)!r} is missing")


def _reference(text: str, row: dict[str, Any]) -> str:
    """The language by another route: a regex over braces, lookups by key only."""
    out = []
    for token in re.findall(r"\{\{|\}\}|\{[^{}]*\}|[^{}]+", text):
        if token in ("{{", "}}"):
            out.append(token[0])
        elif token.startswith("{"):
            value: Any = row
            for name in token[1:-1].split("."):
                value = value[name]
            out.append(str(value))
        else:
            out.append(token)
    return "".join(out)


PIECE = st.one_of(
    TEXT.map(escape),
    NAME.map(lambda name: "{" + name + "}"),
    st.sampled_from(["{x.__class__}", "{x!r}", "{x:>10}", "{0}", "{x[0]}", "{x()}"]),
)


@given(st.lists(PIECE, max_size=6), st.dictionaries(NAME, TEXT, max_size=5))
def test_nothing_but_lookups_is_evaluated(pieces: list[str], extra: dict[str, str]) -> None:
    """Format specs, conversions, attributes, indexes and calls are field names like any
    other: a row that has a column of that name fills it, a row that lacks one is an
    error, and the text is what plain lookups give."""
    text = "".join(pieces)
    template = parse(text)
    row: dict[str, Any] = {name: f"<{name}>" for name in template.columns} | extra
    row.update({name: f"<{name}>" for name in template.columns})
    if "x" in row and "{x.__class__}" in text:
        row["x"] = {"__class__": "not a class"}
    try:
        rendered = template.render(row)
    except ValueProblem:
        # Only a struct path can fail here: x is text where x.__class__ needs a struct.
        assert "{x.__class__}" in text
        return
    assert rendered == _reference(text, row)


@given(TEXT, TEXT, st.sampled_from(["{", "}", "{a{b}", "{}", "{a..b}", "{.a}"]))
def test_unbalanced_or_empty_fields_are_refused(before: str, after: str, bad: str) -> None:
    with pytest.raises(TemplateError):
        parse(escape(before) + bad + escape(after))


# --- the same rows in three formats -----------------------------------------------------------

CELL = st.text(
    st.characters(blacklist_categories=("Cs", "Cc")) | st.sampled_from(["\n", "\t", '"', ","]),
    max_size=20,
)
ROW = st.fixed_dictionaries(
    {"prompt": CELL.filter(lambda s: s.strip()), "system": CELL, "topic": CELL}
)


def _write_all(folder: Path, rows: list[dict[str, str]]) -> dict[str, Path]:
    jsonl = folder / "rows.jsonl"
    jsonl.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "rows.parquet")
    pcsv.write_csv(table, folder / "rows.csv")
    return {"jsonl": jsonl, "parquet": folder / "rows.parquet", "csv": folder / "rows.csv"}


def _queue(path: Path, columns: Columns | None) -> list[tuple[str, str, str, str]]:
    """What the store would write for ``path``: (key, format, digest, body) per row."""
    return [(p.key, p.fmt, p.digest, p.body) for p in iter_prepared(path, columns=columns)]


@settings(max_examples=40, deadline=None)
@given(st.lists(ROW, min_size=1, max_size=6))
def test_the_same_rows_as_jsonl_parquet_and_csv_give_the_same_queue(
    rows: list[dict[str, str]],
) -> None:
    rows = [{"id": f"r{i}", **row} for i, row in enumerate(rows)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = _write_all(Path(tmp), rows)
        for columns in (None, Columns(template="{topic}: {prompt}", system="s")):
            if columns is not None and not all(
                f"{r['topic']}: {r['prompt']}".strip() for r in rows
            ):
                continue
            queues = {name: _queue(path, columns) for name, path in paths.items()}
            assert queues["parquet"] == queues["jsonl"], columns
            assert queues["csv"] == queues["jsonl"], columns
            assert [key for key, *_ in queues["jsonl"]] == [row["id"] for row in rows]


def test_rows_without_ids_are_keyed_by_their_file_in_tables_and_by_line_in_jsonl(
    tmp_path: Path,
) -> None:
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    paths = _write_all(tmp_path, rows)
    keys = {name: [key for key, *_ in _queue(path, None)] for name, path in paths.items()}
    assert keys == {
        "jsonl": ["1", "2"],
        "parquet": [f"{tmp_path.name}/rows.parquet:1", f"{tmp_path.name}/rows.parquet:2"],
        "csv": [f"{tmp_path.name}/rows.csv:1", f"{tmp_path.name}/rows.csv:2"],
    }
