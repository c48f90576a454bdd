"""Writing training-ready JSONL from committed outputs.

The file is written beside its destination under a temporary name, flushed to disk and
renamed over the destination at the end: a crash mid-export leaves the previous file
intact, and a reader never sees half a file. Order and bytes depend only on the
committed rows, so exporting twice gives identical files.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from orchestrator.errors import ConfigError
from orchestrator.store import Database, DoneItem, check_datasets, iter_done

# Request fields worth carrying into a training example next to the conversation.
_CARRIED = ("tools",)


def messages_line(item: DoneItem) -> dict[str, Any]:
    """``{id, dataset, messages, finish_reason, usage}``: the input turns, then the answer."""
    line: dict[str, Any] = {
        "id": item.key,
        "dataset": item.dataset,
        "messages": [*item.request.get("messages", []), item.message],
        "finish_reason": item.finish_reason,
        "usage": item.usage,
    }
    for name in _CARRIED:
        if name in item.request:
            line[name] = item.request[name]
    return line


async def export_jsonl(
    database: Database,
    out: str | os.PathLike[str],
    *,
    dataset_names: Sequence[str] = (),
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write one line per done item; returns how many."""
    await check_datasets(database, dataset_names)
    target = Path(out)
    if target.is_dir():
        raise ConfigError(f"{target}: is a directory; give a file name")
    if not target.parent.exists():
        raise ConfigError(f"{target}: directory {target.parent} does not exist")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with open(tmp, "wb") as fh:
            async for item in iter_done(database, dataset_names or None):
                fh.write(orjson.dumps(messages_line(item)))
                fh.write(b"\n")
                count += 1
                if progress and count % 10_000 == 0:
                    progress(count)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if progress:
        progress(count)
    return count
