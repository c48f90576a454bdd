"""CSV and TSV files (plain, ``.gz`` or ``.zst``), read a block at a time
(``pyarrow.csv.open_csv``).

Every cell is text: a CSV has no types, and guessing them would turn an id ``007`` into
the number 7 (two rows' keys could then meet). The first line names the columns; a quoted
value may span lines (multi-line prompts); an empty cell is the empty string.
"""

from __future__ import annotations

from collections import Counter

from orchestrator.errors import InputError
from orchestrator.formats.readers.base import Rows, Wanted, file_error, projection
from orchestrator.formats.readers.tables import batch_rows

__all__ = ["csv_rows"]

_BLOCK = 1 << 20
"""Bytes per block parsed: a block must hold a whole row, so it grows for larger ones."""


def csv_rows(path: str, delimiter: str, wanted: Wanted) -> Rows:
    """The rows of the CSV (or TSV, ``delimiter`` a tab) file at ``path``, from 1."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    parse = pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    names = _header(path, parse)
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        raise InputError(f"the header names column {repeated[0]!r} twice", path=path)
    include = projection(names, wanted) or names
    convert = pcsv.ConvertOptions(
        column_types=dict.fromkeys(names, pa.string()),
        strings_can_be_null=False,
        include_columns=include,
    )
    reader = _open(path, parse, convert)
    with reader:
        yield from batch_rows(reader, wanted, path)


def _header(path: str, parse: object) -> list[str]:
    """The column names, from a reader opened for them alone."""
    reader = _open(path, parse)
    with reader:
        return list(reader.schema.names)


def _open(path: str, parse: object, convert: object = None) -> object:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        return pcsv.open_csv(
            path,
            read_options=pcsv.ReadOptions(block_size=_BLOCK, use_threads=False),
            parse_options=parse,
            convert_options=convert,
        )
    except OSError as exc:
        if exc.errno is not None:
            raise file_error(path, exc) from None
        raise InputError(f"cannot read: {exc}", path=path) from None
    except pa.ArrowInvalid as exc:
        if "Empty CSV file" in str(exc):
            raise InputError("no records in file", path=path) from None
        raise InputError(f"not a valid CSV file: {exc}", path=path) from None
