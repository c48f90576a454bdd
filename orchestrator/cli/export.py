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

from orchestrator.cli.common import configure_logs, flag_mask, on_database, progress_shown, run_sync
from orchestrator.cli.options import FLAG, Row, datasets_option, db_option, shown, table
from orchestrator.items.quality import ALL_FLAGS
from orchestrator.settings.choices import EXPORT_FORMATS, REASONING_MODES

if TYPE_CHECKING:
    from orchestrator.formats.options import ExportOptions, ExportReport


_FILE = {"type": click.Path(path_type=Path, dir_okay=False), "metavar": "FILE"}
# The options after --dataset, in the order --help lists them.
_OPTIONS: tuple[Row, ...] = (
    (
        ("--format", "fmt"),
        "Line format: OpenAI messages, ShareGPT (EAGLE-3 trainers), the OpenAI Batch API "
        "output (failed items in OUT.errors.jsonl), SpecForge's training data (rows it "
        "cannot take in OUT_skipped.jsonl, failed items in OUT_error.jsonl), "
        "completions: prompt and completion (datasets enqueued with --endpoint completions); "
        "parquet: the messages rows as a Parquet table; or tokens: each generated turn's "
        "input_ids and loss_mask, the server's own ids (enqueue --token-ids).",
        shown("messages", click.Choice(EXPORT_FORMATS)),
    ),
    (
        "--reasoning",
        "Generated reasoning: in reasoning_content, inline in the content as "
        "<think>...</think>, or dropped.",
        shown("separate", click.Choice(REASONING_MODES)),
    ),
    (
        "--split",
        "OUT is a directory: one OUT/<dataset>.jsonl per dataset; with --format parquet "
        "one folder of shards per dataset, OUT/<dataset>/train-00000-of-00001.parquet, and the "
        "dataset card OUT/README.md.",
        FLAG,
    ),
    (
        "--shard-rows",
        "With --format parquet --split: at most N rows per shard  [default: 100,000].",
        {"type": click.IntRange(min=1), "metavar": "N"},
    ),
    (
        "--card",
        "Also write the dataset card (the Hugging Face Hub's README.md: configs naming "
        "the files, then each dataset's counts, model, tokens, flags and failures) to FILE.",
        _FILE,
    ),
    (
        ("--exclude-flag", "exclude_flags"),
        f"Leave out answers with this quality flag: {', '.join(ALL_FLAGS)}. "
        "Repeat or comma-separate.",
        {"multiple": True, "metavar": "FLAG[,FLAG]"},
    ),
    (
        "--include-failed",
        "Also write the failed items (key, dataset, error, attempts) to FILE as JSONL.",
        _FILE,
    ),
    (
        "--provenance",
        "Add model, params, params_hash, server, created_at, started_at and flags.",
        FLAG,
    ),
    (
        "--per-turn",
        "One line per generated assistant turn (id <id>#turn<k>), the conversation up to "
        "it, earlier turns without their reasoning: SpecForge's per-turn rows.",
        FLAG,
    ),
    (
        "--merge-turns",
        "With --format tokens: a conversation in one row (loss_mask 1 on every generated "
        "turn) where each turn's prompt ids begin with the ids of the turn before; the "
        "others stay a row per turn, counted.",
        FLAG,
    ),
    (
        "--parsed",
        "Add parsed: the answer's JSON value, for datasets asking for structured output "
        "(response_format, --json-schema); null where the answer is not the JSON asked for.",
        FLAG,
    ),
    (
        "--logprobs",
        "Add each answer's token logprobs: token_logprobs, top_token_ids (top_tokens when "
        "the server gave no ids) and top_logprobs, per token (enqueue --logprobs K).",
        FLAG,
    ),
    (
        "--token-ids",
        "Add token_ids: the ids of the tokens the model produced, where the server gave them.",
        FLAG,
    ),
    (
        "--group-samples",
        'A prompt\'s samples (enqueue --samples) in one line, its answers in "answers" '
        '(openai-batch: one choice each); without it, a line per sample with its "sample".',
        FLAG,
    ),
)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@datasets_option("Only these datasets.")
@table(*_OPTIONS)
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
    merge_turns: bool,
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
    files |= {"card": card, "per_turn": per_turn, "parsed": parsed, "merge_turns": merge_turns}
    files |= {"logprobs": logprobs, "token_ids": token_ids}
    files["group_samples"] = group_samples
    chosen = run_sync(lambda: _options(fmt, reasoning, exclude_flags, provenance, **files))
    with progress_shown(f"writing {out}:") as progress:
        report = _export_any(db, out, datasets, chosen, progress)
    _say_exported(report, out, chosen)
    if report.mixed:
        _warn_mixed(report, fmt)
    # Last, where it is seen: rows SpecForge cannot take, and the formats that carry them.
    if report.summary:
        click.echo(f"warning: {report.summary}", err=True)


def _options(
    fmt: str, reasoning: str, exclude_flags: tuple[str, ...], provenance: bool, **files: Any
) -> ExportOptions:
    from orchestrator.formats.options import ExportOptions

    return ExportOptions(
        format=fmt,
        reasoning=reasoning,
        exclude_flags=flag_mask(exclude_flags),
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
    from orchestrator._util.atomicfile import is_stdout
    from orchestrator.items.quality import flag_names

    # `export -`, /dev/stdout: the lines are standard output, so the summary goes to stderr.
    piped = is_stdout(out)
    where = f"{len(report.files):,} files in {out}" if chosen.split else str(out)
    where = "standard output" if piped else where
    if chosen.per_turn or chosen.format == "tokens":
        click.echo(
            f"exported {report.lines:,} turns of {report.items:,} items to {where}", err=piped
        )
    else:
        click.echo(f"exported {report.lines:,} items to {where}", err=piped)
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
