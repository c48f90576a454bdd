"""Whether an object is a table a program holds in memory (``pyarrow``, pandas,
``datasets``), asked without importing any of them: a library that was never imported
cannot have made the object."""

from __future__ import annotations

import sys


def is_dataset(obj: object) -> bool:
    """Whether ``obj`` is a ``datasets`` object (a split, or a dict of splits)."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return False
    kinds = (datasets.Dataset, datasets.IterableDataset)
    return isinstance(obj, (*kinds, datasets.DatasetDict, datasets.IterableDatasetDict))


def is_table(obj: object) -> bool:
    """Whether ``obj`` is one of the tables the readers take besides paths and rows."""
    pa = sys.modules.get("pyarrow")
    if pa is not None and isinstance(obj, pa.Table | pa.RecordBatch | pa.RecordBatchReader):
        return True
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(obj, pandas.DataFrame):
        return True
    return is_dataset(obj)
