"""JSONL sources: a file (plain, ``.gz`` or ``.zst``), standard input, rows in memory.

Files hold 10^5-10^6 lines and single lines can be tens of megabytes, so a file is read
one binary line at a time and nothing is kept between lines. A BOM on the first line and
CRLF ends are accepted; blank lines are skipped, and counted, so line numbers are the
editor's. gzip is the standard library's; zstd is pyarrow's, loaded for such files only.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from typing import IO, Any

import orjson

from orchestrator.errors import InputError
from orchestrator.formats.readers.base import Part, Rows, Wanted, file_error, stdin_binary

__all__ = ["RecordsSource", "StdinSource", "file_lines"]

_BOM = b"\xef\xbb\xbf"


def file_lines(name: str) -> Rows:
    """The non-blank lines of the JSONL file ``name``, with their numbers."""
    try:
        fh = _open(name)
    except OSError as exc:
        raise file_error(name, exc) from None
    with fh:
        yield from _lines(name, fh)


def _open(name: str) -> IO[bytes]:
    lower = name.lower()
    if lower.endswith(".gz"):
        return gzip.open(name, "rb")
    if lower.endswith(".zst"):
        import pyarrow as pa

        raw = open(name, "rb")  # noqa: SIM115 - closed with the stream
        stream = pa.CompressedInputStream(raw, "zstd")
        return io.BufferedReader(stream, 1 << 20)  # type: ignore[arg-type]
    return open(name, "rb")


def _lines(name: str, fh: IO[bytes]) -> Rows:
    """The lines, numbered. Only the read itself is guarded: an error raised by whoever
    consumes the lines is theirs, not a problem with this file."""
    readline = fh.readline
    lineno = 0
    while True:
        try:
            raw = readline()
        except (OSError, EOFError, ValueError) as exc:
            # A truncated or corrupt .gz / .zst ends here as well as a failing disk.
            raise _read_error(name, exc) from None
        if not raw:
            return
        lineno += 1
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if raw.isspace() or not raw:
            continue
        yield lineno, raw


def _read_error(name: str, exc: BaseException) -> InputError:
    if isinstance(exc, OSError) and exc.errno is not None:
        return file_error(name, exc)
    return InputError(f"cannot read: {exc}", path=name)


class StdinSource:
    """JSONL on standard input (``enqueue -``): lines keyed by number, like a file's."""

    name = "<stdin>"

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        yield Part(self.name, None, "line"), _lines(self.name, stdin_binary())

    def sha256(self) -> str | None:
        return None


class RecordsSource:
    """Dicts in memory (the Python API's rows), each read as the JSONL line it would be:
    the same checks and errors, ``<records>:N`` for the N-th, keyed by N without an id."""

    def __init__(self, rows: Iterable[Any], name: str = "<records>"):
        self.rows = rows
        self.name = name

    def parts(self, wanted: Wanted) -> Iterator[tuple[Part, Rows]]:
        yield Part(self.name, None, "line"), self._encoded()

    def _encoded(self) -> Rows:
        """Rows as JSON lines; a row JSON cannot hold is refused with its position."""
        for n, row in enumerate(self.rows, 1):
            try:
                yield n, orjson.dumps(row)
            except orjson.JSONEncodeError as exc:
                raise InputError(f"not a JSON object: {exc}", path=self.name, line=n) from None

    def sha256(self) -> str | None:
        return None
