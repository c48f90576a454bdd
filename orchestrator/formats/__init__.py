"""Input and output file formats: readers turn JSONL lines into ready-to-send requests,
the export turns done items into training files.

Names are loaded on first use, so that a command offering the formats' names as choices
(``formats.choices``) starts without the readers' orjson.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import exports

if TYPE_CHECKING:
    from orchestrator.formats.readers import (
        FORMATS,
        INPUT_FORMATS,
        MODES,
        PASSTHROUGH_FORMATS,
        Prepared,
        PreparedItem,
        Record,
        iter_prepared,
        iter_prepared_rows,
        iter_records,
    )

__all__ = [
    "FORMATS",
    "INPUT_FORMATS",
    "MODES",
    "PASSTHROUGH_FORMATS",
    "Prepared",
    "PreparedItem",
    "Record",
    "iter_prepared",
    "iter_prepared_rows",
    "iter_records",
]

__getattr__ = exports(__name__, dict.fromkeys(__all__, "readers"))
