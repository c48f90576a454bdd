"""Input and output file formats: readers turn JSONL lines into ready-to-send requests."""

from orchestrator.formats.readers import FORMATS, Record, iter_records

__all__ = ["FORMATS", "Record", "iter_records"]
