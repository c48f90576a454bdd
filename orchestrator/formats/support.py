"""Which export option each format honours: the one table every export is checked by.

An option a format has no place for is refused before anything is read, naming the
formats that take it, rather than dropped without a word (an export that exits 0
without the columns asked for is training data quietly missing a part). Options that
cannot go together are refused here as well. What depends on a dataset (its endpoint,
its kind of rows) is judged per dataset by ``export.check_shape``.

Nothing heavy is imported: ``ExportOptions`` checks itself with this on every export.
"""

from __future__ import annotations

from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.settings.choices import EXPORT_FORMATS

_ALL = frozenset(EXPORT_FORMATS)
_TOKENS = frozenset({"messages", "sharegpt", "completions", "parquet"})

# Option (or option=value) -> (the formats that honour it, why the others cannot).
SUPPORT: dict[str, tuple[frozenset[str], str]] = {
    "reasoning=inline": (
        _ALL - {"specforge", "completions", "tokens"},
        "specforge keeps reasoning in reasoning_content (its validator refuses <think> "
        "markers in content), completions writes the text as generated, its reasoning "
        "never split out, and tokens writes the ids the server generated, reasoning's too",
    ),
    "reasoning=drop": (
        _ALL - {"completions", "tokens"},
        "completions writes the text as generated, its reasoning never split out, and "
        "tokens the ids the server generated, reasoning's too",
    ),
    "exclude_flags": (_ALL, ""),
    "provenance": (_ALL, ""),
    "parsed": (_ALL - {"tokens"}, "tokens rows hold ids, not the answer's text"),
    "group_samples": (
        frozenset({"messages", "sharegpt", "openai-batch", "completions"}),
        "it puts a prompt's answers as a list in one line: specforge writes one "
        "conversation a line (each sample its own) and parquet one conversation a row "
        "(with its sample column)",
    ),
    "split": (_ALL, ""),
    "include_failed": (_ALL, ""),
    "logprobs": (_TOKENS, "the openai-batch and specforge lines have no place for them"),
    "token_ids": (_TOKENS, "the openai-batch and specforge lines have no place for them"),
    "per_turn": (
        frozenset({"messages", "sharegpt", "specforge", "parquet"}),
        "it splits conversations; openai-batch and completions lines hold none",
    ),
    "shard_rows": (_ALL & {"parquet"}, "shards are a table format's files"),
    "merge_turns": (frozenset({"tokens"}), "only token rows are merged by their ids"),
    "card": (_ALL, ""),
}

# Options that cannot go together, and why.
CONFLICTS: tuple[tuple[str, str, str], ...] = (
    ("group_samples", "per_turn", "--per-turn writes one conversation a line (each sample's own)"),
    ("logprobs", "per_turn", "an answer's tokens belong to one line: export without --per-turn"),
    ("token_ids", "per_turn", "an answer's tokens belong to one line: export without --per-turn"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings(options: Any) -> list[str]:
    """The table's entries ``options`` (an ``ExportOptions``) use: each option set away
    from its default, ``reasoning`` by its value."""
    used = [f"reasoning={options.reasoning}"] if options.reasoning != "separate" else []
    for name in SUPPORT:
        if "=" not in name and getattr(options, name) not in (None, False, 0):
            used.append(name)
    return used


def check(options: Any) -> None:
    """``ConfigError`` for the first option ``options.format`` does not honour, or the
    first pair of options that cannot go together."""
    fmt = options.format
    used = settings(options)
    for name in used:
        formats, why = SUPPORT[name]
        if fmt not in formats:
            option, _, value = name.partition("=")
            shown = f"{_flag(option)} {value}".strip()
            takes = ", ".join(f for f in EXPORT_FORMATS if f in formats)
            raise ConfigError(
                f"{shown} is not for --format {fmt}: {why}; it is for --format {takes}"
            )
    for first, second, why in CONFLICTS:
        if first in used and second in used:
            raise ConfigError(f"{_flag(first)} and {_flag(second)} do not go together: {why}")
    if options.shard_rows is not None and not options.split:
        raise ConfigError(
            "shard_rows: shards are written with --split (one folder per dataset); "
            "without it the export is one file"
        )
