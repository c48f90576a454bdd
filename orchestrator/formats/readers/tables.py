"""Arrow record batches to rows, for every table source (Parquet, CSV, Arrow files, the
Hub), and the tables a program holds in memory (``pyarrow``, pandas, ``datasets``).

A table cannot tell a missing key from a null: a struct column holds every field any row
has, and a row without one gets null. So a null is read as absent inside structs (a
message without ``tool_calls``, a tool schema without ``enum``), and at the top level of a
row read whole (as a JSONL line): the rows come out as the JSONL lines they were made
from. A row read by its columns keeps its top-level nulls, so that its error can say
``column 'problem' is null``. Null list elements stay.

pyarrow, pandas and ``datasets`` are never imported here for an object: an object of
theirs means its library is loaded already (``sys.modules``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import count
from typing import TYPE_CHECKING, Any

from orchestrator._util.tables import is_table
from orchestrator.errors import InputError
from orchestrator.formats.readers.base import Part, Rows, Wanted, projection

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["BATCH_ROWS", "TableSource", "batch_rows", "is_table"]

BATCH_ROWS = 4096
"""Rows per record batch read: large enough to make the conversion cheap per row, small
enough to keep memory flat."""


def batch_rows(batches: Iterable[Any], wanted: Wanted, where: str) -> Rows:
    """The rows of ``batches`` (``RecordBatch`` or ``Table``), numbered from 1, with the
    columns ``source.projection`` keeps for ``wanted``, and nulls read as absent.

    An Arrow error while reading is the source's (``where``): a truncated or corrupt file.
    """
    import pyarrow as pa

    n = 0
    it = iter(batches)
    while True:
        try:
            batch = next(it, None)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot read: {exc}", path=where) from None
        if batch is None:
            return
        if isinstance(batch, list):  # rows already (a DataFrame slice Arrow cannot type)
            rows = batch if wanted is not None else [_present(row) for row in batch]
        else:
            if wanted is not None:
                columns = projection(batch.schema.names, wanted)
                if columns is not None:
                    batch = batch.select(columns)
            rows = _rows(batch, keep_nulls=wanted is not None)
        # zip with a counter: the numbered rows without a Python step per row.
        yield from zip(count(n + 1), rows)
        n += len(rows)


def _rows(batch: pa.RecordBatch | pa.Table, *, keep_nulls: bool) -> list[dict[str, Any]]:
    """One batch as dicts, nulls dropped from the columns that hold any (the top-level
    ones kept with ``keep_nulls``)."""
    rows = batch.to_pylist()
    dirty = [
        field for field, column in zip(batch.schema, batch.columns, strict=True) if _nulls(column)
    ]
    if not dirty:
        return rows
    nested = frozenset(field.name for field in dirty if _nested(field.type))
    if keep_nulls:
        if nested:
            for row in rows:
                for name in nested:
                    row[name] = _strip(row[name])
        return rows
    if not nested:
        return [{k: v for k, v in row.items() if v is not None} for row in rows]
    return [
        {k: (_strip(v) if k in nested else v) for k, v in row.items() if v is not None}
        for row in rows
    ]


def _nulls(column: Any) -> bool:
    """Whether a column holds a null at any depth (counted by Arrow, not by Python)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return any(_nulls(chunk) for chunk in column.chunks)
    if column.null_count:
        return True
    if isinstance(column, pa.StructArray):
        return any(_nulls(column.field(i)) for i in range(column.type.num_fields))
    if isinstance(column, pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray):
        return _nulls(column.values)
    if isinstance(column, pa.MapArray):
        return _nulls(column.items)
    return False


def _nested(arrow_type: Any) -> bool:
    """Whether a column holds structs anywhere: only those have nulls for absent keys."""
    import pyarrow.types as t

    if t.is_struct(arrow_type):
        return True
    if t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type):
        return _nested(arrow_type.value_type)
    if t.is_map(arrow_type):
        return _nested(arrow_type.item_type)
    return False


def _present(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if v is not None}


def _strip(value: Any) -> Any:
    if type(value) is dict:
        return {k: _strip(v) for k, v in value.items() if v is not None}
    if type(value) is list:
        return [_strip(v) for v in value]
    return value


class TableSource:
    """A table in memory, read in record batches; rows keyed by position without an id,
    as a list of dicts is (``<records>``), so both give the same items."""

    def __init__(self, name: str, batches: Any):
        self.name = name
        self._batches = batches
        """A callable giving the record batches, called once."""

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        yield Part(self.name, None, "row"), batch_rows(self._batches(), wanted, self.name)

    def sha256(self) -> str | None:
        return None


def frame_batches(frame: Any) -> Iterator[Any]:
    """A DataFrame as Arrow batches, a slice at a time (the frame's index is not a column).

    A slice Arrow cannot type (a column of text and numbers) comes as its rows instead,
    missing values (None, NaN) as None: each row is then judged on its own values."""
    import pyarrow as pa

    for start in range(0, len(frame), BATCH_ROWS):
        chunk = frame.iloc[start : start + BATCH_ROWS]
        try:
            table = pa.Table.from_pandas(chunk, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError):
            yield [_frame_row(row, chunk.columns) for row in chunk.itertuples(index=False)]
            continue
        yield from table.to_batches()


def _frame_row(values: Iterable[Any], names: Iterable[Any]) -> dict[str, Any]:
    row = {}
    for name, value in zip(names, values, strict=True):
        if hasattr(value, "tolist"):  # numpy arrays and scalars
            value = value.tolist()
        if isinstance(value, float) and value != value:  # NaN: pandas' missing value
            value = None
        row[str(name)] = value
    return row
