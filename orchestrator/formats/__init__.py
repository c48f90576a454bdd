"""Input and output file formats: readers turn JSONL lines into ready-to-send requests."""

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
