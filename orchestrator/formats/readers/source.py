"""Where rows come from: one small protocol over every input format, and the one place a
source (a path, a folder, a glob, ``-``, ``hf://``, an object in memory) is resolved.

A ``Source`` yields ``Part``s (a file, or its one stream), each with its raw rows: JSONL
lines as bytes, table rows as dicts, numbered from 1 within the part. What a row becomes
is the reader's business (``formats.readers``), the same for every source; a source only
says where each row is, so that errors read ``FILE:LINE`` or ``FILE:row N`` and rows
without an id get a key that names their file (``train-00003.parquet:1841``).

The per-format modules (``jsonl``, ``parquet``, ``csv``, ``ipc``, ``huggingface``,
``tables``) are imported when a source of theirs is read: pyarrow and ``datasets`` load
only for the sources that need them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from orchestrator.errors import ConfigError, InputError
from orchestrator.formats.readers import tables
from orchestrator.formats.readers.base import (
    Part,
    Raw,
    Rows,
    Source,
    Wanted,
    file_error,
)
from orchestrator.formats.readers.csv import csv_rows
from orchestrator.formats.readers.huggingface import HubSource, dataset_source
from orchestrator.formats.readers.ipc import arrow_rows, saved_files
from orchestrator.formats.readers.jsonl import RecordsSource, StdinSource, file_lines
from orchestrator.formats.readers.parquet import parquet_rows

__all__ = [
    "DATA_SUFFIXES",
    "Part",
    "Raw",
    "Source",
    "file_error",
    "open_source",
]

# Suffixes of the files a folder or a glob takes, and the reader of each.
DATA_SUFFIXES: dict[str, str] = {
    ".jsonl.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
    ".arrow": "ipc",
    ".csv.gz": "csv",
    ".csv.zst": "csv",
    ".csv": "csv",
    ".tsv.gz": "tsv",
    ".tsv.zst": "tsv",
    ".tsv": "tsv",
}
_LISTED = "*.parquet, *.arrow, *.jsonl, *.csv, *.tsv; the text ones also as .gz, .zst"
_GLOB_CHARS = frozenset("*?[")


def kind_of(name: str) -> str | None:
    """Which reader a file name asks for, by its suffix (None: not a data file's)."""
    lower = name.lower()
    for suffix, kind in DATA_SUFFIXES.items():
        if lower.endswith(suffix):
            return kind
    return None


def open_source(spec: object, *, split: str | None = None, config: str | None = None) -> Source:
    """The source ``spec`` names, resolved now: a missing file, an empty folder, a glob
    that matches nothing or a split that does not exist is an error here, before
    anything is read.

    ``spec``: a path (a JSONL, Parquet, CSV/TSV or Arrow file; a folder of such shards;
    a ``datasets`` ``save_to_disk`` folder; a glob), ``-`` for standard input (JSONL),
    ``hf://ORG/NAME`` (``datasets.load_dataset``, streamed), a ``datasets.Dataset`` /
    ``IterableDataset`` (a ``DatasetDict`` with ``split``), a ``pyarrow.Table`` /
    ``RecordBatch`` / ``RecordBatchReader``, a pandas ``DataFrame``, or any other
    iterable of dicts (rows in any line format). ``split`` picks a split of a
    ``DatasetDict`` (folder or object) or of a Hub dataset; ``config``, a Hub dataset's
    configuration.
    """
    if isinstance(spec, str | os.PathLike):
        return _path_source(os.fsdecode(spec), split, config)
    _no_config(config, "rows in memory")
    table = _table_source(spec, split)
    if table is not None:
        return table
    _no_split(split, "rows in memory")
    if isinstance(spec, bytes | bytearray | dict) or not isinstance(spec, Iterable):
        raise ConfigError(
            f"cannot read {type(spec).__name__} as a source: give a path, rows (an "
            "iterable of dicts) or a table"
        )

    return RecordsSource(spec)


def _path_source(name: str, split: str | None, config: str | None) -> Source:
    if name.startswith("hf://"):
        return HubSource(name.removeprefix("hf://"), split=split, config=config)
    _no_config(config, name)
    if name == "-":
        _no_split(split, "standard input")

        return StdinSource()
    try:
        st = os.stat(name)
    except FileNotFoundError:
        if _GLOB_CHARS.intersection(name):
            _no_split(split, name)
            return _glob_source(name)
        raise file_error(name, FileNotFoundError()) from None
    except OSError as exc:
        raise file_error(name, exc) from None
    if stat.S_ISDIR(st.st_mode):
        return _folder_source(name, split)
    _no_split(split, name)
    kind = kind_of(name) or "jsonl"
    # A JSONL file named directly keeps the keys it always had: id-less lines by number.
    if kind == "jsonl":
        return Files(name, [(name, os.path.basename(name), kind)], keyed=False)
    return Files(name, [(name, direct_name(name), kind)], keyed=True, older=os.path.basename(name))


def direct_name(path: str) -> str:
    """How the rows of a table file named directly are keyed: its folder's name and its
    own (``a/train-00000-of-00001.parquet``), so that the same shard name in two folders
    never meets, and the keys are those a folder one level up gives the same file."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    name = os.path.basename(path)
    return f"{folder}/{name}" if folder else name


def _no_split(split: str | None, what: str) -> None:
    if split is not None:
        raise ConfigError(
            f"{what}: has no splits to choose from (split {split!r} given); a split picks "
            "one of a DatasetDict folder's or a Hub dataset's"
        )


def _no_config(config: str | None, what: str) -> None:
    if config is not None:
        raise ConfigError(
            f"{what}: a configuration ({config!r}) is a Hub dataset's: only hf:// sources take one"
        )


def _glob_source(pattern: str) -> Source:
    """Every data file the glob matches, sorted by name: the order of a dataset's shards."""
    matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matched:
        raise InputError("no file matches", path=pattern)
    root = _fixed_prefix(pattern)
    files = []
    for path in matched:
        kind = kind_of(path)
        if kind is None:
            raise InputError(f"not a data file ({_LISTED}), matched by {pattern}", path=path)
        files.append((path, os.path.relpath(path, root), kind))
    return Files(pattern, files, keyed=True)


def _fixed_prefix(pattern: str) -> str:
    """The directory a glob's names are relative to: its parts before the first wildcard."""
    head: list[str] = []
    for part in pattern.split(os.sep)[:-1]:
        if _GLOB_CHARS.intersection(part):
            break
        head.append(part)
    return os.sep.join(head) or ("/" if pattern.startswith(os.sep) else ".")


def _folder_source(folder: str, split: str | None) -> Source:
    """A ``DatasetDict`` folder (its ``split``), a ``save_to_disk`` folder, or shards."""
    splits = _read_json(folder, "dataset_dict.json")
    if splits is not None:
        names = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise InputError("dataset_dict.json does not list the splits", path=folder)
        if split is None:
            raise ConfigError(
                f"{folder}: a DatasetDict folder with splits {', '.join(names)}: choose one "
                "with --split"
            )
        if split not in names:
            raise ConfigError(f"{folder}: no split {split!r} (the folder has: {', '.join(names)})")

        files = saved_files(os.path.join(folder, split))
        return Files(folder, [(p, os.path.relpath(p, folder), "ipc") for p in files], keyed=True)
    _no_split(split, folder)
    if os.path.exists(os.path.join(folder, "state.json")):
        files = saved_files(folder)
        return Files(folder, [(p, os.path.relpath(p, folder), "ipc") for p in files], keyed=True)
    return Files(folder, _shards(folder), keyed=True)


def _shards(folder: str) -> list[tuple[str, str, str]]:
    """The data files under ``folder`` (hidden and ``_`` names left out), by name."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in names:
            kind = kind_of(name)
            if kind is not None and not name.startswith((".", "_")):
                path = os.path.join(root, name)
                found.append((path, os.path.relpath(path, folder), kind))
    if not found:
        raise InputError(f"is a directory with no data files in it ({_LISTED})", path=folder)
    return sorted(found, key=lambda f: f[1])


def _read_json(folder: str, name: str) -> object:
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read: {exc}", path=path) from None


class Files:
    """Files read in order, each by the reader its suffix names."""

    def __init__(
        self,
        name: str,
        files: list[tuple[str, str, str]],
        *,
        keyed: bool,
        older: str | None = None,
    ):
        self.name = name
        self.files = files
        """(path, name relative to the source, reader) per file."""
        self.keyed = keyed
        """Rows without an id are keyed by file and number (else by number alone)."""
        self.older = older
        """A table file named directly: the name earlier versions keyed its rows by (its
        own name alone), which a dataset they filled keeps (``enqueueing``)."""

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        for path, relative, kind in self.files:
            reader = _READERS[kind]()
            unit = "line" if kind == "jsonl" else "row"
            yield Part(path, relative if self.keyed else None, unit), reader(path, kind, wanted)

    def sha256(self) -> str | None:
        digest = hashlib.sha256()
        for path, _, _ in self.files:
            try:
                with open(path, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        digest.update(chunk)
            except OSError as exc:
                raise file_error(path, exc) from None
        return digest.hexdigest()


def _jsonl_reader() -> Callable[[str, str, Wanted], Rows]:
    return lambda path, kind, wanted: file_lines(path)


def _parquet_reader() -> Callable[[str, str, Wanted], Rows]:
    return lambda path, kind, wanted: parquet_rows(path, wanted)


def _csv_reader() -> Callable[[str, str, Wanted], Rows]:
    return lambda path, kind, wanted: csv_rows(path, "\t" if kind == "tsv" else ",", wanted)


def _ipc_reader() -> Callable[[str, str, Wanted], Rows]:
    return lambda path, kind, wanted: arrow_rows(path, wanted)


_READERS: dict[str, Callable[[], Callable[[str, str, Wanted], Rows]]] = {
    "jsonl": _jsonl_reader,
    "parquet": _parquet_reader,
    "csv": _csv_reader,
    "tsv": _csv_reader,
    "ipc": _ipc_reader,
}


def _table_source(obj: object, split: str | None) -> Any:
    """``obj`` as a table source if it is one (else None): a ``pyarrow`` table, batch or
    reader, a pandas ``DataFrame``, a ``datasets`` dataset (a ``DatasetDict`` with
    ``split``)."""
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        if isinstance(obj, pa.Table):
            return _plain(
                split, tables.TableSource("<Table>", lambda: obj.to_batches(tables.BATCH_ROWS))
            )
        if isinstance(obj, pa.RecordBatch):
            return _plain(split, tables.TableSource("<RecordBatch>", lambda: [obj]))
        if isinstance(obj, pa.RecordBatchReader):
            return _plain(split, tables.TableSource("<RecordBatchReader>", lambda: obj))
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(obj, pandas.DataFrame):
        return _plain(split, tables.TableSource("<DataFrame>", lambda: tables.frame_batches(obj)))
    if "datasets" in sys.modules:
        return dataset_source(obj, split)
    return None


def _plain(split: str | None, source: Any) -> Any:
    if split is not None:
        raise ConfigError(f"{source.name}: has no splits to choose from (split {split!r} given)")
    return source
