"""Input and output formats: readers turn a source's rows (JSONL, Parquet, CSV, Arrow, the
Hub, tables in memory) into ready-to-send requests, the export turns done items into
training files.

Names are loaded on first use, so that a command offering the formats' names as choices
(``formats.choices``) starts without the readers' orjson, and pyarrow loads only when a
table is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator._util.lazy import exports

if TYPE_CHECKING:
    from orchestrator.formats.readers.columns import Columns
    from orchestrator.formats.readers.rows import (
        FORMATS,
        INPUT_FORMATS,
        MODES,
        PASSTHROUGH_FORMATS,
        Prepared,
        PreparedItem,
        Reading,
        Record,
        iter_prepared,
        iter_prepared_rows,
        iter_records,
    )
    from orchestrator.formats.readers.source import open_source

__all__ = [
    "FORMATS",
    "INPUT_FORMATS",
    "MODES",
    "PASSTHROUGH_FORMATS",
    "Columns",
    "Prepared",
    "PreparedItem",
    "Reading",
    "Record",
    "iter_prepared",
    "iter_prepared_rows",
    "iter_records",
    "open_source",
]

__getattr__ = exports(
    __name__,
    {
        **dict.fromkeys(__all__, "readers.rows"),
        "Columns": "readers.columns",
        "open_source": "readers.source",
    },
)
