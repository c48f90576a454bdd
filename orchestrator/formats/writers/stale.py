"""Files an earlier export into a folder left that this one did not write: read from
the folder's earlier card (``writers.card`` writes it), removed after the commit, so the
folder is what its new card says."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import orjson

from orchestrator.formats.writers.lines import errors_path
from orchestrator.formats.writers.specforge import beside


def listed(card: Path) -> list[Path]:
    """The data files an earlier card at ``card`` names in its configs (none when there is
    no card, or it is not one of ours), as paths beside it."""
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return []
    header = text[4 : text.index("\n---\n", 4)]
    found = []
    for line in header.splitlines():
        if line.startswith("    - "):  # a data file's path, as _yaml writes it
            with contextlib.suppress(orjson.JSONDecodeError):
                path = orjson.loads(line[6:])
                if isinstance(path, str):
                    found.append(card.parent / path)
    return found


def drop_unlisted(card: Path, before: list[Path], written: list[Path]) -> list[Path]:
    """Remove the files the earlier card listed (``before``) that this export did not
    write, with their side files and the folders they leave empty: the folder is then
    what its new card says, never one dataset's new files beside another's old ones.
    Only files inside the card's folder are touched. The files removed."""
    root = os.path.abspath(card.parent)
    keep = {os.path.abspath(p) for p in written}
    removed = []
    for path in before:
        full = os.path.abspath(path)
        if full in keep or os.path.commonpath([root, full]) != root or full == root:
            continue
        for stale in (Path(full), *_sides(Path(full))):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
                removed.append(stale)
        folder = os.path.dirname(full)
        while folder != root and os.path.commonpath([root, folder]) == root:
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                break
            folder = os.path.dirname(folder)
    return removed


def _sides(path: Path) -> list[Path]:
    """The files an export writes beside a JSONL file (batch errors, SpecForge's)."""
    if path.suffix != ".jsonl":
        return []

    return [errors_path(path), beside(path, "skipped"), beside(path, "error")]
