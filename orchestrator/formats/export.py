"""Writing training-ready JSONL from committed outputs.

Every file is written beside its destination under a temporary name, flushed to disk and
renamed over the destination once all of an export's files are complete: a crash
mid-export leaves the previous files intact, and a reader never sees half a file. A stream
(standard output, a FIFO, ``>(cmd)``, ``/dev/stdout``: ``atomicfile.open_stream``) has
nothing to rename and is written in place, as the lines come. Order
and bytes depend only on the committed rows, so exporting twice gives identical files.

The stored message and usage are orjson's own encoding of what was received (the store
writes every JSON column with ``orjson.dumps``), so they go into the line as they are
(``orjson.Fragment``): the bytes are those a parse and a re-encode would give, at a
fraction of the cost. The default shape (:func:`write_lines`) parses only the request,
to splice its messages in; the other shapes (:class:`ExportOptions`) parse what they
change.

Four line formats (docs/INPUTS-AND-EXPORTS.md): ``messages`` (the default), ``sharegpt``
(``from``/``value`` turns, as SpecForge and other EAGLE-3 trainers read them),
``openai-batch`` (the OpenAI Batch API / ``vllm run-batch`` output line, failed items in
an error file beside it) and ``specforge`` (SpecForge's training data, rows it
cannot take and failed items in files beside it: ``writers.specforge``). Any
conversation format can be written a row per generated turn (``writers.turns``).
The table formats (``parquet``) encode the ``messages`` rows in ``formats.writers``,
and so does the dataset card (``writers.card``); every row of every format is made
by ``LineWriter.line`` (or, for the plain lines, ``plain_record``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError
from orchestrator.formats.options import ExportOptions, ExportReport, Progress, fast_rows
from orchestrator.formats.writers.job import ExportJob
from orchestrator.formats.writers.lines import LineIndex, LineWriter, write_lines
from orchestrator.formats.writers.tokens import TokenWriter
from orchestrator.settings.choices import (  # noqa: F401
    EXPORT_FORMATS,
    REASONING_MODES,
    TABLE_FORMATS,
)
from orchestrator.store import access
from orchestrator.store.outputs import (
    dataset_refs,
    done_rows,
    failed_rows,
    full_batches,
    token_batches,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from orchestrator.store.access import Batches
    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

# ---------------------------------------------------------------------- writing


MIXED_TOKEN_ROWS = (
    "SpecForge skips pre-tokenised rows in a conversation file without a word, and "
    "trainers that read messages or conversations cannot use them: export those "
    "datasets apart (--split, or --dataset NAME)"
)


def warn_mixed(report: ExportReport, fmt: str) -> None:
    """One structlog warning per file that mixes pre-tokenised rows with conversations.

    structlog is imported only here, when there is something to say: a plain export
    does not load it.
    """
    if not report.mixed:
        return
    import structlog

    log = structlog.get_logger("orchestrator.export")
    for path, tokens, others in report.mixed:
        log.warning(
            "export_mixed_token_rows",
            file=str(path),
            format=fmt,
            token_rows=tokens,
            other_lines=others,
            hint=MIXED_TOKEN_ROWS,
        )


def export_rows(
    rows: Rows,
    out: str | os.PathLike[str],
    *,
    dataset_names: Sequence[str] = (),
    progress: Progress | None = None,
    options: ExportOptions | None = None,
    warn: bool = True,
) -> ExportReport:
    """Write the export from one read transaction, through either adapter.

    ``warn``: log :func:`warn_mixed`'s events (the CLI does it itself, once its logging
    is set up).
    """
    job = ExportJob(out, options or ExportOptions(), dataset_refs(rows, dataset_names), progress)
    with job:
        if job.options.format in TABLE_FORMATS:
            from orchestrator.formats.writers.parquet import write_tables  # lazy: pyarrow

            write_tables(job, rows)
        else:
            _write_jsonl(job, rows)
        for target, group in job.failures:
            with job.staged.open(target) as fh:
                for dataset in group:
                    job.write_failed(fh.write, dataset, failed_rows(rows, dataset.id))
        if job.card is not None:
            from orchestrator.formats.writers.card import write_card  # lazy: start-up

            write_card(job, rows)
    report = job.report()
    if warn:
        warn_mixed(report, job.options.format)
    return report


def _write_jsonl(job: ExportJob, rows: Rows) -> None:
    """The line formats: each output file's datasets, line after line."""
    for target, group in job.outputs:
        with job.output(target) as fh:
            for dataset in group:
                before = job.counter.count
                if job.options.format == "tokens":
                    tokens = job.token_lines(dataset)
                    for part in token_batches(rows, dataset):
                        job.counter.add(tokens.write(fh.write, part))
                elif job.fast(dataset):
                    for part in done_rows(rows, dataset.id):
                        write_lines(fh.write, dataset.name, part)
                        job.counter.add(len(part))
                else:
                    lines = job.lines(dataset)
                    for batch in full_batches(rows, dataset, turns=lines.turns):
                        job.counter.add(lines.write(fh.write, batch))
                    job.counter.add(lines.finish(fh.write))
                job.written[dataset.id] = job.counter.count - before


def export_fast(
    db: str | os.PathLike[str] | None, out: str | os.PathLike[str], **how: Any
) -> ExportReport | None:
    """:func:`export_rows` through plain sqlite3 in this thread, or None where that path
    does not apply (``how``: its keyword arguments)."""
    return access.read_fast(db, lambda rows: export_rows(rows, out, **how))


async def export_database(
    database: Database, out: str | os.PathLike[str], **how: Any
) -> ExportReport:
    """Write the export from any database, in one read transaction: a consistent
    snapshot even while workers commit (``store.access`` picks the adapter; ``how``:
    :func:`export_rows`'s keyword arguments)."""
    return await access.read(database, lambda rows: export_rows(rows, out, **how))


def _line_batches(
    rows: Rows, dataset_names: Sequence[str], options: ExportOptions
) -> Iterator[list[bytes]]:
    datasets = dataset_refs(rows, dataset_names)
    shared = len(datasets) > 1
    index = LineIndex()
    for dataset in datasets:
        out: list[bytes] = []
        # Every writer puts a line, then its newline: every other entry is a line.
        if options.format == "tokens":
            tokens = TokenWriter(
                dataset, options.provenance, options.exclude_flags, options.merge_turns
            )
            for part in token_batches(rows, dataset):
                tokens.write(out.append, part)
                yield out[::2]
                out.clear()
            continue
        if fast_rows(options, dataset):
            for part in done_rows(rows, dataset.id):
                write_lines(out.append, dataset.name, part)
                yield out[::2]
                out.clear()
            continue
        lines = LineWriter(dataset, options, shared=shared, index=index)
        for batch in full_batches(rows, dataset, turns=lines.turns):
            lines.write(out.append, batch)
            yield out[::2]
            out.clear()
        if lines.finish(out.append):
            yield out[::2]
            out.clear()


def line_batches(
    database: Database,
    *,
    dataset_names: Sequence[str] = (),
    options: ExportOptions | None = None,
) -> Batches[list[bytes]]:
    """The done items' lines one export file would hold, in its order, without a file:
    the same line shapes as :func:`export_database` (one read transaction throughout,
    ended by the last batch or the iterator's ``aclose``).

    ``split`` and ``include_failed`` name files and do not apply; each line is the bytes
    of one JSON object, without its newline.
    """
    chosen = options or ExportOptions()
    if chosen.split or chosen.include_failed is not None or chosen.card is not None:
        raise ConfigError(
            "the lines of an export are one stream: split, include_failed and card name files"
        )
    if chosen.format in TABLE_FORMATS:
        raise ConfigError(
            f"format {chosen.format!r} is a file format; the lines are those of 'messages'"
        )
    produce = functools.partial(_line_batches, dataset_names=dataset_names, options=chosen)
    return access.read_batches(database, produce)


async def iter_lines(
    database: Database,
    *,
    dataset_names: Sequence[str] = (),
    options: ExportOptions | None = None,
) -> AsyncIterator[bytes]:
    """:func:`line_batches`, a line at a time."""
    batches = line_batches(database, dataset_names=dataset_names, options=options)
    async with batches:
        async for lines in batches:
            for line in lines:
                yield line


async def export_jsonl(
    database: Database,
    out: str | os.PathLike[str],
    *,
    dataset_names: Sequence[str] = (),
    progress: Progress | None = None,
    options: ExportOptions | None = None,
) -> int:
    """:func:`export_database`, returning how many done items were written."""
    report = await export_database(
        database, out, dataset_names=dataset_names, progress=progress, options=options
    )
    return report.lines
