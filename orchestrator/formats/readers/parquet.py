"""Parquet files, read a record batch at a time (``ParquetFile.iter_batches``): memory
stays at a row group's compressed pages and one batch, whatever the file's size.

When the rows are read by their columns (``--prompt-column``, a template), only those
columns are read from the file: a wide dataset costs what its prompt columns cost.
"""

from __future__ import annotations

from orchestrator.errors import InputError
from orchestrator.formats.readers.base import Rows, Wanted, file_error, projection
from orchestrator.formats.readers.tables import BATCH_ROWS, batch_rows

__all__ = ["parquet_rows"]


def parquet_rows(path: str, wanted: Wanted) -> Rows:
    """The rows of the Parquet file at ``path``, numbered from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except OSError as exc:
        if exc.errno is not None:
            raise file_error(path, exc) from None
        raise InputError(f"not a Parquet file: {exc}", path=path) from None
    except pa.ArrowException as exc:
        raise InputError(f"not a Parquet file: {exc}", path=path) from None
    with parquet:
        columns = projection(parquet.schema_arrow.names, wanted)
        # One thread: the rows are consumed by one, and the store's thread needs the other core.
        batches = parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns, use_threads=False)
        yield from batch_rows(batches, wanted, path)
