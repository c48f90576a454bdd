"""Arrow IPC files: a ``datasets`` ``save_to_disk`` folder's shards (the stream format)
and ``.arrow`` / Feather files (the file format), memory-mapped and read batch by batch.

A ``save_to_disk`` folder lists its shards, in order, in ``state.json``; a
``DatasetDict`` folder holds one such folder per split (``source`` picks it).
"""

from __future__ import annotations

import json
import os

from orchestrator.errors import InputError
from orchestrator.formats.readers.base import Rows, Wanted, file_error
from orchestrator.formats.readers.tables import batch_rows

__all__ = ["arrow_rows", "saved_files"]

_FILE_MAGIC = b"ARROW1"


def arrow_rows(path: str, wanted: Wanted) -> Rows:
    """The rows of the Arrow IPC file at ``path`` (stream or file format), from 1."""
    import pyarrow as pa

    try:
        source = pa.memory_map(path)
    except OSError as exc:
        raise file_error(path, exc) from None
    with source:
        try:
            if source.read(len(_FILE_MAGIC)) == _FILE_MAGIC:
                source.seek(0)
                file = pa.ipc.open_file(source)
                batches = (file.get_batch(i) for i in range(file.num_record_batches))
            else:
                source.seek(0)
                batches = pa.ipc.open_stream(source)
        except pa.ArrowException as exc:
            raise InputError(f"not an Arrow IPC file: {exc}", path=path) from None
        yield from batch_rows(batches, wanted, path)


def saved_files(folder: str) -> list[str]:
    """The shards of a ``save_to_disk`` folder, in its order (``state.json``)."""
    state_path = os.path.join(folder, "state.json")
    try:
        with open(state_path, "rb") as fh:
            state = json.load(fh)
    except FileNotFoundError:
        raise InputError("not a save_to_disk folder (no state.json)", path=folder) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read: {exc}", path=state_path) from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files:
        raise InputError("lists no data files (_data_files)", path=state_path)
    paths = []
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise InputError(f"a data file entry is not a file name: {entry!r}", path=state_path)
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise InputError(f"lists {name}, which is not there", path=state_path)
        paths.append(path)
    return paths
