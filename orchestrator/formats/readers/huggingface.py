"""Hugging Face datasets: ``hf://ORG/NAME`` through ``datasets.load_dataset(...,
streaming=True)``, and ``Dataset`` / ``IterableDataset`` objects a program holds.

Both are read as Arrow tables (``with_format("arrow")``), so a Hub dataset streams shard
by shard without a download of the whole, and nothing is decoded (images stay bytes).
The ``datasets`` library is an extra (``pip install 'orchestrator[hf]'``); without it an
``hf://`` source is refused with what to install. ``load_dataset`` resolves a name that is
a local folder before asking the Hub, so a folder laid out like a Hub repository reads
through the same call.

A Hub dataset's rows have no file name the stream reveals: without an id they are keyed
by split (and configuration) and number, ``train:1841``, stable for the same revision.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from orchestrator._util.tables import is_dataset
from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.readers.base import Part, Rows, Wanted, projection
from orchestrator.formats.readers.tables import BATCH_ROWS, TableSource, batch_rows

__all__ = ["INSTALL", "HubSource", "dataset_source", "is_dataset", "load"]

INSTALL = "pip install 'orchestrator[hf]'"


class HubSource:
    """A Hub dataset's split, streamed."""

    def __init__(self, dataset: str, *, split: str | None, config: str | None):
        if not dataset.strip("/"):
            raise ConfigError("hf://: name a dataset, e.g. hf://ORG/NAME")
        self.dataset = dataset
        self.config = config
        self.name = f"hf://{dataset}"
        _need_datasets(self.name)
        if split is None:
            raise ConfigError(f"{self.name}: choose a split with --split" + _splits(self))
        self.split = split
        scope = f"{config}/{split}" if config else split
        self.part = Part(f"{self.name}[{scope}]", scope, "row")
        # Loaded now: an unknown dataset, split or configuration is refused before any
        # transaction starts (streaming reads no data yet).
        self.loaded = load(dataset, split=split, config=config)

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        dataset = self.loaded
        columns = _present(dataset, wanted)
        if columns is not None:
            dataset = dataset.select_columns(columns)
        tables = dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)
        yield self.part, batch_rows(_guarded(tables, self.part.path), wanted, self.part.path)

    def sha256(self) -> str | None:
        return None


def load(dataset: str, *, split: str, config: str | None) -> Any:
    """``datasets.load_dataset(dataset, config, split=split, streaming=True)``, its errors
    as ours: the one call every ``hf://`` source goes through."""
    import datasets

    try:
        return datasets.load_dataset(dataset, config, split=split, streaming=True)
    except ValueError as exc:
        # An unknown split or configuration: datasets names the ones there are.
        raise ConfigError(f"hf://{dataset}: {exc}") from None
    except (OSError, FileNotFoundError) as exc:
        raise InputError(f"cannot load: {exc}", path=f"hf://{dataset}") from None
    except Exception as exc:  # datasets raises its own kinds (DatasetNotFoundError, ...)
        raise InputError(
            f"cannot load: {type(exc).__name__}: {exc}", path=f"hf://{dataset}"
        ) from None


def _need_datasets(name: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{name}: reading from the Hub needs the datasets library: {INSTALL}"
        ) from None


def _splits(source: HubSource) -> str:
    """`` (the dataset has: train, test)`` when that can be found out, else nothing."""
    import datasets

    try:
        names = datasets.get_dataset_split_names(source.dataset, source.config)
    except Exception:
        return ""
    return f" (the dataset has: {', '.join(names)})" if names else ""


def _present(dataset: Any, wanted: Wanted) -> list[str] | None:
    """The wanted columns the dataset has (None: all of them, or unknown)."""
    names = getattr(dataset, "column_names", None)
    return projection(list(names), wanted) if names else None


def _guarded(tables: Iterator[Any], where: str) -> Iterator[Any]:
    """The stream's tables; a failure while streaming (a shard gone, the network) is the
    source's error, named."""
    while True:
        try:
            table = next(tables, None)
        except Exception as exc:  # datasets and fsspec raise many kinds
            raise InputError(f"cannot read: {type(exc).__name__}: {exc}", path=where) from None
        if table is None:
            return
        yield table


def dataset_source(obj: object, split: str | None) -> TableSource | None:
    """A ``datasets`` object as a table source (None when ``obj`` is not one)."""
    datasets = sys.modules["datasets"]
    if isinstance(obj, datasets.DatasetDict | datasets.IterableDatasetDict):
        names = list(obj)
        if split is None:
            raise ConfigError(
                f"a {type(obj).__name__} holds splits {', '.join(names)}: choose one with "
                "split= (or pass ds[split])"
            )
        if split not in obj:
            raise ConfigError(
                f"no split {split!r} (the {type(obj).__name__} has: {', '.join(names)})"
            )
        obj = obj[split]
    elif split is not None and isinstance(obj, datasets.Dataset | datasets.IterableDataset):
        raise ConfigError(f"a {type(obj).__name__} is one split already (split {split!r} given)")
    if isinstance(obj, datasets.Dataset | datasets.IterableDataset):
        name = f"<{type(obj).__name__}>"
        arrow = obj.with_format("arrow")
        return TableSource(name, lambda: _guarded(arrow.iter(batch_size=BATCH_ROWS), name))
    return None
