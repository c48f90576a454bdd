"""``orchestrator export``: done items as training data, all files or none.

An SQLite file at the current schema is read through plain sqlite3, so that the export
loads neither SQLAlchemy nor asyncio; anything else goes through the store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from orchestrator._util.atomicfile import is_stdout
from orchestrator.cli.common import (
    configure_logs,
    db_option,
    on_database,
    progress_shown,
    run_sync,
)
from orchestrator.items.quality import flag_names, parse_flags
from orchestrator.settings.choices import EXPORT_FORMATS, REASONING_MODES

if TYPE_CHECKING:
    from orchestrator.formats.options import ExportOptions, ExportReport


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(EXPORT_FORMATS),
    default="messages",
    show_default=True,
    help="Line format: OpenAI messages, ShareGPT (EAGLE-3 trainers), the OpenAI Batch API "
    "output (failed items in OUT.errors.jsonl), SpecForge's regenerated data (rows its "
    "validator refuses in OUT_skipped.jsonl, failed items in OUT_error.jsonl), "
    "completions: prompt and completion (datasets enqueued with --endpoint completions); "
    "or parquet: the messages rows as a Parquet table.",
)
@click.option(
    "--reasoning",
    type=click.Choice(REASONING_MODES),
    default="separate",
    show_default=True,
    help="Generated reasoning: in reasoning_content, inline in the content as "
    "<think>...</think>, or dropped.",
)
@click.option(
    "--split",
    is_flag=True,
    help="OUT is a directory: one OUT/<dataset>.jsonl per dataset; with --format parquet "
    "one folder of shards per dataset, OUT/<dataset>/train-00000-of-00001.parquet, and the "
    "dataset card OUT/README.md.",
)
@click.option(
    "--shard-rows",
    type=click.IntRange(min=1),
    metavar="N",
    help="With --format parquet --split: at most N rows per shard  [default: 100,000].",
)
@click.option(
    "--card",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="Also write the dataset card (the Hugging Face Hub's README.md: configs naming "
    "the files, then each dataset's counts, model, tokens, flags and failures) to FILE.",
)
@click.option(
    "--exclude-flag",
    "exclude_flags",
    multiple=True,
    metavar="FLAG[,FLAG]",
    help="Leave out answers with this quality flag: truncated, empty, unclosed_think, "
    "reasoning_only, tool_mismatch, nul, invalid_json, schema_mismatch, max_tokens_reduced. "
    "Repeat or comma-separate.",
)
@click.option(
    "--include-failed",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="Also write the failed items (key, dataset, error, attempts) to FILE as JSONL.",
)
@click.option(
    "--provenance",
    is_flag=True,
    help="Add model, params, params_hash, server, created_at, started_at and flags.",
)
@click.option(
    "--per-turn",
    is_flag=True,
    help="One line per generated assistant turn (id <id>#turn<k>), the conversation up to "
    "it, earlier turns without their reasoning: SpecForge's per-turn rows.",
)
@click.option(
    "--parsed",
    is_flag=True,
    help="Add parsed: the answer's JSON value, for datasets asking for structured output "
    "(response_format, --json-schema); null where the answer is not the JSON asked for.",
)
@click.option(
    "--logprobs",
    is_flag=True,
    help="Add each answer's token logprobs: token_logprobs, top_token_ids (top_tokens when "
    "the server gave no ids) and top_logprobs, per token (enqueue --logprobs K).",
)
@click.option(
    "--token-ids",
    is_flag=True,
    help="Add token_ids: the ids of the tokens the model produced, where the server gave them.",
)
@click.option(
    "--group-samples",
    is_flag=True,
    help='A prompt\'s samples (enqueue --samples) in one line, its answers in "answers" '
    '(openai-batch: one choice each); without it, a line per sample with its "sample".',
)
@db_option
def export(
    out: Path,
    datasets: tuple[str, ...],
    fmt: str,
    reasoning: str,
    split: bool,
    shard_rows: int | None,
    card: Path | None,
    exclude_flags: tuple[str, ...],
    include_failed: Path | None,
    provenance: bool,
    per_turn: bool,
    parsed: bool,
    logprobs: bool,
    token_ids: bool,
    group_samples: bool,
    db: str | None,
) -> None:
    """Write done items to OUT as JSONL, by dataset then input order.

    The default line: {"id", "dataset", "messages": [...input, assistant answer],
    "finish_reason", "usage"}; docs/INPUTS-AND-EXPORTS.md shows every format. Each file is
    written under a temporary name and renamed once all are complete: never half a file.
    """
    files = {"split": split, "include_failed": include_failed, "shard_rows": shard_rows}
    files |= {"card": card, "per_turn": per_turn, "parsed": parsed}
    files |= {"logprobs": logprobs, "token_ids": token_ids}
    files["group_samples"] = group_samples
    chosen = run_sync(lambda: _options(fmt, reasoning, exclude_flags, provenance, **files))
    with progress_shown(f"writing {out}:") as progress:
        report = _export_any(db, out, datasets, chosen, progress)
    _say_exported(report, out, chosen)
    if report.mixed:
        _warn_mixed(report, fmt)


def _options(
    fmt: str, reasoning: str, exclude_flags: tuple[str, ...], provenance: bool, **files: Any
) -> ExportOptions:
    from orchestrator.formats.options import ExportOptions

    mask = 0
    for spec in exclude_flags:
        mask |= parse_flags(spec)
    return ExportOptions(
        format=fmt,
        reasoning=reasoning,
        exclude_flags=mask,
        provenance=provenance,
        **files,
    )


def _export_any(
    db: str | None,
    out: Path,
    datasets: tuple[str, ...],
    chosen: ExportOptions,
    progress: Callable[[int], None] | None,
) -> ExportReport:
    """The export through plain sqlite3 when it can, else through the store."""
    from orchestrator.formats.export import export_database, export_fast

    # An SQLite file at the current schema is read through plain sqlite3 in this thread;
    # anything else is opened (created, upgraded) by the store first, and so is a file
    # the quick read fails on, so that the error is reported the store's way.
    read = {"dataset_names": datasets, "progress": progress, "options": chosen, "warn": False}
    report = run_sync(functools.partial(export_fast, db, out, **read))
    if report is None:
        configure_logs()
        report = on_database(db, lambda d: export_database(d, out, **read), mode="read")
    return report


def _say_exported(report: ExportReport, out: Path, chosen: ExportOptions) -> None:
    # `export -`, /dev/stdout: the lines are standard output, so the summary goes to stderr.
    piped = is_stdout(out)
    where = f"{len(report.files):,} files in {out}" if chosen.split else str(out)
    where = "standard output" if piped else where
    if chosen.per_turn:
        click.echo(
            f"exported {report.lines:,} turns of {report.items:,} items to {where}", err=piped
        )
    else:
        click.echo(f"exported {report.lines:,} items to {where}", err=piped)
    if report.summary:
        click.echo(report.summary, err=True)
    if chosen.exclude_flags:
        names = ", ".join(flag_names(chosen.exclude_flags))
        click.echo(f"left out {report.excluded:,} answers flagged {names}", err=piped)
    if report.card is not None:
        click.echo(f"wrote the dataset card {report.card}", err=piped)
    if report.failed_files:
        files = report.failed_files
        into = str(files[0]) if len(files) == 1 else f"{len(files):,} files in {out}"
        click.echo(f"wrote {report.failed:,} failed items to {into}", err=piped)


def _warn_mixed(report: Any, fmt: str) -> None:
    """The export's warning event, and in a terminal's text logs a line of its own."""
    from orchestrator import logs
    from orchestrator.formats.export import MIXED_TOKEN_ROWS, warn_mixed

    configure_logs()
    warn_mixed(report, fmt)
    if not logs.json_lines():  # else the export_mixed_token_rows event says it, as JSON
        for path, tokens, others in report.mixed:
            click.echo(
                f"warning: {path}: {tokens:,} pre-tokenised rows among {others:,} other "
                f"lines; {MIXED_TOKEN_ROWS}",
                err=True,
            )
