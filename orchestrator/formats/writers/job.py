"""An export's files: targets checked, each written to a temporary file renamed at the
end (a crash leaves the previous file whole), and the job that carries one export
across its datasets."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from orchestrator._util import atomicfile
from orchestrator.errors import ConfigError
from orchestrator.formats.options import ExportOptions, ExportReport, Progress, fast_rows
from orchestrator.formats.writers import sample_groups as draws
from orchestrator.formats.writers import specforge
from orchestrator.formats.writers.lines import (
    LineIndex,
    LineWriter,
    batch_error_line,
    errors_path,
    failed_line,
    line_id,
)
from orchestrator.formats.writers.stale import drop_unlisted, listed
from orchestrator.formats.writers.tokens import TokenWriter
from orchestrator.settings.choices import (  # noqa: F401
    EXPORT_FORMATS,
    REASONING_MODES,
    TABLE_FORMATS,
)
from orchestrator.store.outputs import (
    DatasetRef,
    FailedRow,
)

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------- files


_BUFFER = 1 << 20


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_stems(names: Sequence[str]) -> dict[str, str]:
    """A file name (without ``.jsonl``) per dataset, safe on any filesystem, never shared.

    Names made of letters, digits, ``.``, ``_`` and ``-`` stay as they are; any other
    name is cleaned and gets a short hash of itself, so two names never meet in one file
    (also not on a case-insensitive filesystem).
    """

    def tagged(name: str, stem: str) -> str:
        return f"{stem or 'dataset'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"

    stems = {}
    for name in names:
        stem = _UNSAFE.sub("_", name).lstrip(".")
        stems[name] = stem if stem == name and stem else tagged(name, stem)
    folded: dict[str, list[str]] = {}
    for name, stem in stems.items():
        folded.setdefault(stem.casefold(), []).append(name)
    for clash in folded.values():
        if len(clash) > 1:
            for name in clash:
                stems[name] = tagged(name, stems[name])
    return stems


# ``export -``: the lines go to standard output, written as they come (nothing to rename).
STDOUT = Path("-")


def _check_target(target: Path, *, output: bool = False) -> None:
    """A file the export will write; ``output``: the export's own file (not --split)."""
    if target == STDOUT or atomicfile.is_stream(target):
        return
    if target.is_dir():
        hint = ", or --split to write a file per dataset into it" if output else ""
        raise ConfigError(f"{target}: is a directory; give a file name{hint}")
    if not target.parent.exists():
        raise ConfigError(f"{target}: directory {target.parent} does not exist")
    if not target.parent.is_dir():
        raise ConfigError(f"{target}: {target.parent} is a file, not a directory")


def _card_path(target: Path, options: ExportOptions, stream: bool) -> Path | None:
    """Where the dataset card goes: ``card``, or README.md in a table format's folder."""
    if options.card is None:
        split_table = options.split and options.format in TABLE_FORMATS
        return target / "README.md" if split_table else None
    if stream:
        raise ConfigError(
            f"{options.card}: a dataset card names the export's files; the export goes "
            f"to a stream ({target}), which has none"
        )
    return Path(options.card)


def _check_table_target(target: Path, options: ExportOptions) -> None:
    """A table format's target: a folder with ``split``, a file without."""
    if options.split and target.suffix in (".parquet", ".pq"):
        raise ConfigError(
            f"{target}: --split writes a folder of shards per dataset; give a folder "
            "name, not a .parquet file (or leave out --split for one file)"
        )


# What writing an export file can meet, and what to do about it.
_WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full: free space there, or export to another disk",
    errno.EDQUOT: "the disk quota is used up: free space there, or export to another disk",
    errno.EFBIG: "the file would pass the file size limit (ulimit -f): raise it, or export "
    "less at a time (--dataset, --split)",
    errno.EROFS: "the file system is read-only: export to a writable directory",
    errno.EACCES: "permission denied: export to a directory you can write",
    errno.EPERM: "permission denied: export to a directory you can write",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENOENT: "its directory does not exist",
    errno.EBADF: "it names a file descriptor that is not open",
}


def make_folder(target: Path) -> None:
    """``target`` made a folder (and its parents, as ``mkdir -p``) if it is not one, or
    one line saying why it cannot be."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(target, exc) from None


def _write_error(target: Path, exc: OSError) -> ConfigError:
    """One line for a file that could not be written: the path, the cause, what to do."""
    reason = _WRITE_ERRORS.get(exc.errno or 0, f"cannot write it: {exc.strerror or exc}")
    return ConfigError(f"{target}: {reason}")


class _Staged:
    """Files written under temporary names, renamed over their targets together at the end
    (streams are written in place).

    While any temporary file exists, SIGTERM does what SIGINT does (from the main thread:
    ``KeyboardInterrupt``, or the event loop's cancellation), so that a stop by a service
    manager or ``timeout`` unwinds and removes them too. Those of a process killed outright
    are removed by the next write to the same target (``atomicfile.remove_stale``).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []
        self._sigterm: tuple[Any] | None = None

    @contextlib.contextmanager
    def open(self, target: Path) -> Iterator[IO[bytes]]:
        if target == STDOUT:
            yield sys.stdout.buffer
            sys.stdout.buffer.flush()
            return
        try:
            stream = atomicfile.open_stream(target)
        except OSError as exc:
            raise _write_error(target, exc) from None
        if stream is not None:
            # A FIFO, a device, ``>(cmd)``, /dev/stdout: written in place, as it comes.
            with self._file_errors(target), open(stream, "wb", buffering=_BUFFER) as fh:
                yield fh
                fh.flush()
            return
        self._interrupt_on_sigterm()
        try:
            # Mode kept (or the umask's for a new file), symlinks written through.
            fd, tmp = atomicfile.open_temp(target)
        except OSError as exc:
            raise _write_error(target, exc) from None
        self._pending.append((tmp, target))
        with self._file_errors(target), open(fd, "wb", buffering=_BUFFER) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())

    @staticmethod
    @contextlib.contextmanager
    def _file_errors(target: Path) -> Iterator[None]:
        """The file's own faults as one line; a database read error (or a reader that
        went away: EPIPE) stays what it is."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _WRITE_ERRORS:
                raise
            raise _write_error(target, exc) from None

    def retarget(self, target: Path, final: Path) -> None:
        """Rename into ``final`` rather than ``target`` at commit: a name that is known
        only once the file is written (a shard's ``-of-N``)."""
        self._pending = [(tmp, final if t == target else t) for tmp, t in self._pending]

    def commit(self) -> None:
        try:
            while self._pending:
                tmp, target = self._pending[0]
                try:
                    atomicfile.replace(tmp, target)
                except OSError as exc:
                    raise _write_error(target, exc) from None
                self._pending.pop(0)
        finally:
            self.discard()  # what was not renamed (an error, a signal) goes

    def discard(self) -> None:
        for tmp, _ in self._pending:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._pending.clear()
        if self._sigterm is not None:
            previous = self._sigterm[0]
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._sigterm = None

    def _interrupt_on_sigterm(self) -> None:
        if self._sigterm is not None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIGINT ignored (a background job): interrupt anyway
            handler = signal.default_int_handler
        self._sigterm = (signal.signal(signal.SIGTERM, handler),)


class _Counter:
    """Lines written so far, reported every 10,000 to a progress callback."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.count = 0

    def add(self, n: int) -> None:
        before, self.count = self.count, self.count + n
        if self.progress and before // 10_000 != self.count // 10_000:
            self.progress(self.count)

    def done(self) -> int:
        if self.progress:
            self.progress(self.count)
        return self.count


class ExportJob:
    """One export: which files get which datasets, the line shapes, the tally.

    Either read adapter drives it the same way, so both write the same bytes. Used as a
    context manager: every file is renamed into place on success, none on failure.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        options: ExportOptions,
        datasets: list[DatasetRef],
        progress: Progress | None,
    ):
        self.options = options
        self.counter = _Counter(progress)
        self.staged = _Staged()
        self._lines: list[LineWriter] = []
        self._failed = 0
        target = Path(out)
        # Where each dataset's done items go, and where its failed items go (if anywhere).
        self.outputs: list[tuple[Path, list[DatasetRef]]] = []
        self.failures: list[tuple[Path, list[DatasetRef]]] = []
        batch = options.format == "openai-batch"
        sides = options.format == "specforge"  # its skipped and error files beside OUT
        stream = target == STDOUT or atomicfile.is_stream(target)
        if stream and (options.split or sides or (batch and options.include_failed is None)):
            raise ConfigError(
                f"{target}: a stream (standard output, a pipe, a device), written as one: "
                "--split needs a directory, --format openai-batch needs "
                "--include-failed FILE for the failed items, and --format specforge "
                "writes its skipped rows beside OUT"
            )
        table = options.format in TABLE_FORMATS
        if options.split:
            if target.exists() and not target.is_dir():
                raise ConfigError(
                    f"{target}: not a directory (--split writes one file per dataset)"
                )
            stems = file_stems([d.name for d in datasets])
            # A table format's dataset is a folder of shards (formats.writers.parquet).
            suffix = "" if table else ".jsonl"
            self.outputs = [(target / f"{stems[d.name]}{suffix}", [d]) for d in datasets]
            if batch and options.include_failed is None:
                self.failures = [(target / f"{stems[d.name]}.errors.jsonl", [d]) for d in datasets]
        else:
            self.outputs = [(target, datasets)]
            if batch and options.include_failed is None:
                self.failures = [(errors_path(target), datasets)]
        if sides and options.include_failed is None:
            self.failures = [(specforge.beside(p, "error"), group) for p, group in self.outputs]
        if options.include_failed is not None:
            self.failures = [(Path(options.include_failed), datasets)]
        self.card = _card_path(target, options, stream)
        # Each output's file of rows SpecForge cannot take.
        self.skips = {p: specforge.beside(p, "skipped") for p, _ in self.outputs if sides}
        self._skip: Callable[[bytes], object] | None = None
        self._index = LineIndex()
        paths = [p for p, _ in [*self.outputs, *self.failures]] + list(self.skips.values())
        paths += [self.card] if self.card is not None else []
        seen = {os.path.abspath(p) for p in paths}
        if len(seen) != len(paths):
            raise ConfigError("two export files would share a name; choose other paths")
        if table:
            _check_table_target(target, options)
        if options.split:
            make_folder(target)
        outputs = {p for p, _ in self.outputs}
        for path in paths:  # (a table's dataset folder: its writer checks it)
            if not (table and options.split and path in outputs):
                _check_target(path, output=path in outputs and not options.split)
        # Run once every file is in place: a table writer's removal of older shards, and
        # of the files of a folder's earlier card that this export does not write.
        self.after_commit: list[Callable[[], None]] = []
        self._drop_unlisted(self.card if options.split else None)
        # Rows written per dataset id, for the card.
        self.written: dict[int, int] = {}
        # The files each output became, where a writer names them as it goes (a table
        # format's folder of shards); else each output is its one file.
        self.output_files: dict[Path, list[Path]] = {}
        # Datasets whose lines share a file with another dataset's.
        self._shared = {d.id for _, group in self.outputs if len(group) > 1 for d in group}
        self._shared_failures = {
            d.id for _, group in self.failures if len(group) > 1 for d in group
        }
        self._mixed: list[tuple[Path, int, int]] = []

    def _drop_unlisted(self, card: Path | None) -> None:
        """After the commit, the files of the folder's earlier card that this export did
        not write go (``writers.stale.drop_unlisted``)."""
        if card is None:
            return

        before = listed(card)

        def drop() -> None:
            written = [f for p, _ in self.outputs for f in self.files_of(p)]
            drop_unlisted(card, before, written)

        if before:
            self.after_commit.append(drop)

    def excluded_by_dataset(self) -> dict[int, int]:
        """Done items left out for their flags so far, by dataset id."""
        return {lines.dataset.id: lines.excluded for lines in self._lines}

    def restart_index(self) -> None:
        """Row indexes (``per_turn``'s ``source_row_index``) count from 0 in a new output,
        as ``output`` does for a file of lines."""
        self._index = LineIndex()

    def files_of(self, target: Path) -> list[Path]:
        """The files the output ``target`` became."""
        return self.output_files.get(target, [target])

    def fast(self, dataset: DatasetRef) -> bool:
        return fast_rows(self.options, dataset)

    def token_lines(self, dataset: DatasetRef) -> TokenWriter:
        """The writer of a dataset's rows in ``--format tokens``."""
        options = self.options
        lines = TokenWriter(dataset, options.provenance, options.exclude_flags, options.merge_turns)
        self._lines.append(lines)
        return lines

    def _tokens(self) -> list[TokenWriter]:
        return [w for w in self._lines if isinstance(w, TokenWriter)]

    def lines(self, dataset: DatasetRef) -> LineWriter:
        shared = dataset.id in self._shared
        lines = LineWriter(dataset, self.options, shared=shared, index=self._index, skip=self._skip)
        self._lines.append(lines)
        return lines

    @contextlib.contextmanager
    def output(self, target: Path) -> Iterator[IO[bytes]]:
        """A file of done items (and its skipped file, if it has one), noted in ``mixed``
        if it mixes token rows with others."""
        before, shapes = self.counter.count, len(self._lines)
        self._index = LineIndex()
        skips = self.skips.get(target)
        with (
            self.staged.open(target) as fh,
            self.staged.open(skips) if skips else contextlib.nullcontext() as skip,
        ):
            self._skip = skip.write if skip is not None else None
            yield fh
        self._skip = None
        tokens = sum(lines.tokens for lines in self._lines[shapes:])
        others = self.counter.count - before - tokens
        if tokens and others:
            self._mixed.append((target, tokens, others))

    def write_failed(
        self, write: Callable[[bytes], object], dataset: DatasetRef, rows: Sequence[FailedRow]
    ) -> None:
        fmt, several = self.options.format, dataset.samples > 1
        shared = dataset.id in self._shared_failures
        for row in rows:
            if fmt == "openai-batch":
                line = batch_error_line(dataset.name, row, shared=shared, sampled=several)
            else:
                line = failed_line(dataset.name, row)
                if fmt == "specforge":
                    line["id"] = line_id(dataset.name, row[0]) if shared else row[0]
            if several:  # each failed sample named as its done rows are (ids that join)
                line = draws.sampled(line, row[6], fmt)
            if fmt == "specforge":
                line = specforge.error_line(line)
            write(orjson.dumps(line))
            write(b"\n")
        self._failed += len(rows)

    def __enter__(self) -> ExportJob:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.staged.commit()
            for step in self.after_commit:
                step()
        else:
            self.staged.discard()

    def report(self) -> ExportReport:
        return ExportReport(
            lines=self.counter.done(),
            excluded=sum(lines.excluded for lines in self._lines),
            failed=self._failed,
            files=[f for p, _ in self.outputs for f in self.files_of(p)],
            failed_files=[p for p, _ in self.failures],
            mixed=list(self._mixed),
            card=self.card,
            skipped=_merged(lines.skipped for lines in self._lines),
            skipped_files=list(self.skips.values()),
            left_out=_merged(w.left_out for w in self._tokens()),
            unmerged=sum(w.unmerged for w in self._tokens()),
            items=self.counter.count - sum(lines.extra for lines in self._lines),
        )


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in counts:
        for name, n in part.items():
            total[name] = total.get(name, 0) + n
    return total
