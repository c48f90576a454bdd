"""What an export is asked for (:class:`ExportOptions`, checked against the table of
what each format honours, ``formats.support``) and what it reports."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.formats import support
from orchestrator.formats.writers import specforge, tokens
from orchestrator.settings.checks import EXPORT, check_all
from orchestrator.settings.choices import (  # noqa: F401
    EXPORT_FORMATS,
    REASONING_MODES,
    TABLE_FORMATS,
)
from orchestrator.store.outputs import DatasetRef

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """How lines are shaped and which go where; the defaults give the historic format."""

    format: str = "messages"
    reasoning: str = "separate"
    # Done items whose quality flags (orchestrator.items.quality) share a bit with this
    # are left out.
    exclude_flags: int = 0
    provenance: bool = False
    # Structured output: each line gets ``parsed``, its answer's JSON value (None when
    # the answer is not the JSON its request asked for).
    parsed: bool = False
    # A prompt's samples in one line (``answers``), not a line each
    # (orchestrator.formats.writers.sample_groups).
    group_samples: bool = False
    # OUT is a directory with one file per dataset.
    split: bool = False
    # Where failed items go (for openai-batch, instead of OUT.errors.jsonl).
    include_failed: str | os.PathLike[str] | None = None
    # Each answer's token logprobs and top-k, and its token ids (orchestrator.items.tokens).
    logprobs: bool = False
    token_ids: bool = False
    # One line per generated assistant turn (writers.turns).
    per_turn: bool = False
    # tokens: a conversation in one row where each turn's prompt ids extend the last row's.
    merge_turns: bool = False
    # A table format's --split: at most this many rows per shard (None: SHARD_ROWS).
    shard_rows: int | None = None
    # The dataset card (README.md in the Hub's format); a table format's --split writes
    # OUT/README.md without being asked.
    card: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        check_all({name: getattr(self, name) for name in EXPORT}, EXPORT)
        support.check(self)  # every option honoured by the format, or refused here

    @property
    def plain(self) -> bool:
        """The default line shape, which the fast path writes from the narrow rows."""
        return (
            self.format == "messages"
            and self.reasoning == "separate"
            and not self.exclude_flags
            and not self.provenance
            and not self.parsed
            and not self.logprobs
            and not self.token_ids
            and not self.per_turn
            and not self.group_samples
        )


@dataclass(slots=True)
class ExportReport:
    lines: int = 0  # lines written: one per done item, or per generated turn (per_turn)
    excluded: int = 0  # done items left out for their quality flags
    failed: int = 0  # failed items written to failed_files
    files: list[Path] = field(default_factory=list)
    failed_files: list[Path] = field(default_factory=list)
    # (file, pre-tokenised rows, other lines) for each file that mixes the two kinds.
    mixed: list[tuple[Path, int, int]] = field(default_factory=list)
    card: Path | None = None  # the dataset card written beside the files, if any
    # specforge: rows SpecForge cannot take, by reason (writers.specforge.REASONS).
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_files: list[Path] = field(default_factory=list)
    items: int = 0  # done items the lines came from (fewer than lines with per_turn)
    # tokens: generated turns left out of the token rows, by reason (writers.tokens.REASONS).
    left_out: dict[str, int] = field(default_factory=dict)
    # tokens --merge-turns: conversations left a row per turn, their ids not a prefix chain.
    unmerged: int = 0

    @property
    def summary(self) -> str | None:
        """The lines naming the rows skipped or left out, by reason, where they are and
        the formats that carry them whole; None: none were."""
        said = [specforge.summary(self.skipped, self.skipped_files)]
        said += [tokens.summary(self.left_out), tokens.unmerged_summary(self.unmerged)]
        return "\n".join(s for s in said if s) or None


def plain_rows(options: ExportOptions, dataset: DatasetRef) -> bool:
    """Whether the dataset's rows are :func:`plain_record`'s, in any format that writes
    the messages shape (JSONL, Parquet): nothing in them changes the stored answer."""
    plain = options.reasoning == "separate" and not options.exclude_flags
    plain = plain and not options.provenance and not options.per_turn and not options.parsed
    plain = plain and not options.logprobs and not options.token_ids
    plain = plain and dataset.regenerate != "all" and not dataset.passthrough
    return plain and dataset.samples == 1


def fast_rows(options: ExportOptions, dataset: DatasetRef) -> bool:
    """Whether the dataset's lines are written from the narrow rows
    (``writers.lines.write_lines``)."""
    return (
        options.plain
        and dataset.regenerate != "all"
        and not dataset.passthrough
        and dataset.endpoint == "chat"
        and dataset.samples == 1
    )


def check_shape(options: ExportOptions, dataset: DatasetRef) -> None:
    """A dataset of raw completions has no conversation to write, a chat dataset no plain
    prompt: the other format is refused, naming the dataset and the one to use."""
    raw = dataset.endpoint == "completions"
    if raw and options.format != "completions":
        raise ConfigError(
            f"dataset {dataset.name!r} holds raw completions (--endpoint completions): export "
            f"it with --format completions (prompt and completion), not {options.format}"
        )
    if not raw and options.format == "completions":
        raise ConfigError(
            f"dataset {dataset.name!r} holds chat answers: --format completions is for "
            "datasets enqueued with --endpoint completions"
        )
