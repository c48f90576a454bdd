"""The dataset card: ``README.md`` in the Hugging Face Hub's format, beside the export.

A YAML header whose ``configs`` name each dataset's files (one config per dataset with
``split``, one ``default`` config for a single file), so that ``load_dataset(FOLDER,
CONFIG)`` and the Hub's viewer find them, then text: per dataset its counts, the model
and parameters of its answers, token percentiles, the share of answers with reasoning,
quality flags and failures by class, and the first and last answer's times. The figures
come from the store (``store.stats.card_figures``) in the export's own read transaction,
so the card describes exactly the rows written; the text is the template files beside
this module. The card is staged with the export's files and renamed with them.
"""

from __future__ import annotations

import datetime
import os
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.settings.choices import TABLE_FORMATS
from orchestrator.store.stats import card_figures

if TYPE_CHECKING:
    from orchestrator.formats.writers.job import ExportJob
    from orchestrator.store.outputs import DatasetRef
    from orchestrator.store.reader import Rows

# The Hub's size buckets (its card metadata's size_categories), by upper bound.
_SIZES = [
    (1_000, "n<1K"),
    (10_000, "1K<n<10K"),
    (100_000, "10K<n<100K"),
    (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"),
    (100_000_000, "10M<n<100M"),
    (1_000_000_000, "100M<n<1B"),
]


def write_card(job: ExportJob, rows: Rows) -> None:
    """Write ``job``'s card (``job.card``) from the datasets it exported."""
    assert job.card is not None
    card = job.card
    datasets = [d for _, group in job.outputs for d in group]
    figures = {
        d.id: card_figures(rows, d.id, exclude_flags=job.options.exclude_flags) for d in datasets
    }
    excluded = job.excluded_by_dataset()
    text = render(job, card, datasets, figures, excluded)
    with job.staged.open(card) as fh:
        fh.write(text.encode())


def _template(name: str) -> Template:
    return Template(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))


def _relative(path: Path, card: Path) -> str:
    """A data file's path as the card's configs name it: from the card's folder, with /."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(card.parent))
    return Path(rel).as_posix()


def configs(job: ExportJob, card: Path) -> list[dict[str, Any]]:
    """The ``configs`` of the card's YAML: each output's files under a ``train`` split,
    named by the output's file or folder name with ``split`` (``default`` without)."""
    table = job.options.format in TABLE_FORMATS
    out = []
    for target, _ in job.outputs:
        name = (target.name if table else target.stem) if job.options.split else "default"
        paths = [_relative(f, card) for f in job.files_of(target)]
        out.append({"config_name": name, "data_files": [{"split": "train", "path": paths}]})
    return out


def _yaml(job: ExportJob, card: Path, written: int) -> str:
    """The metadata block: JSON scalars are YAML scalars, so each value is quoted by orjson."""
    lines = ["configs:"]
    for config in configs(job, card):
        lines.append(f"- config_name: {_q(config['config_name'])}")
        lines.append("  data_files:")
        for entry in config["data_files"]:
            lines.append(f"  - split: {_q(entry['split'])}")
            lines.append("    path:")
            lines += [f"    - {_q(p)}" for p in entry["path"]]
    size = next((label for bound, label in _SIZES if written < bound), "1B<n<10B")
    lines += ["tags:", "- synthetic", "size_categories:", f"- {_q(size)}"]
    return "\n".join(lines)


def _q(text: str) -> str:
    return orjson.dumps(text).decode()


def _when(at: float | None) -> str:
    if at is None:
        return "none"
    moment = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _n(value: Any) -> str:
    return "n/a" if value is None else f"{value:,}"


def render(
    job: ExportJob,
    card: Path,
    datasets: list[DatasetRef],
    figures: dict[int, dict[str, Any]],
    excluded: dict[int, int],
) -> str:
    """The card's text."""
    written = sum(job.written.get(d.id, 0) for d in datasets)
    overview = []
    for d in datasets:
        f = figures[d.id]
        counts = f["counts"]
        files = sum(len(job.files_of(t)) for t, group in job.outputs if d in group)
        overview.append(
            f"| {d.name} | {_n(job.written.get(d.id, 0))} | {_n(sum(counts.values()))} | "
            f"{_n(counts['done'])} | {_n(counts['failed'])} | {_n(excluded.get(d.id, 0))} "
            f"| {files} |"
        )
    starts = [f["first_answer_at"] for f in figures.values() if f["first_answer_at"]]
    ends = [f["last_answer_at"] for f in figures.values() if f["last_answer_at"]]
    sections = [_section(d, figures[d.id], job.written.get(d.id, 0), excluded) for d in datasets]
    return _template("card_template.md").substitute(
        metadata=_yaml(job, card, written),
        title=Path(os.path.abspath(card)).parent.name,
        rows_written=f"{written:,}",
        dataset_count=len(datasets),
        dataset_word="dataset" if len(datasets) == 1 else "datasets",
        first=_when(min(starts)) if starts else "none",
        last=_when(max(ends)) if ends else "none",
        overview="\n".join(overview),
        sections="\n".join(sections),
    )


def _section(dataset: DatasetRef, f: dict[str, Any], rows: int, excluded: dict[int, int]) -> str:
    counts = f["counts"]
    answers, reasoned = f["answers"], f["with_reasoning"]
    share = f"{reasoned / answers:.1%} ({reasoned:,} of {answers:,})" if answers else "n/a"
    models = [
        f"- `{m['model'] or 'unknown model'}` with `{m['params'] or '{}'}`: "
        f"{m['answers']:,} answers"
        for m in f["models"]
    ]
    flags = ", ".join(f"{name} {n:,}" for name, n in f["flags"].items())
    failures = ", ".join(f"{cls} {n:,}" for cls, n in f["failed_by_class"].items()) or "none"
    return _template("card_dataset.md").substitute(
        name=dataset.name,
        rows=f"{rows:,}",
        excluded=f"{excluded.get(dataset.id, 0):,}",
        total=f"{sum(counts.values()):,}",
        done=f"{counts['done']:,}",
        failed=f"{counts['failed']:,}",
        left=f"{counts['pending'] + counts['running']:,}",
        reasoning=share,
        prompt_p50=_n(f["prompt_tokens"]["p50"]),
        prompt_p90=_n(f["prompt_tokens"]["p90"]),
        completion_p50=_n(f["completion_tokens"]["p50"]),
        completion_p90=_n(f["completion_tokens"]["p90"]),
        first=_when(f["first_answer_at"]),
        last=_when(f["last_answer_at"]),
        models="\n".join(models) or "- none yet",
        flags=flags,
        failures=failures,
        billed=_billed(f["billed"]["kept"]),
        billed_away=_billed(f["billed"]["thrown_away"]),
    )


def _billed(b: dict[str, int]) -> str:
    """Tokens billed, as a provider's invoice counts them (``store.spend``)."""
    return (
        f"{b['requests']:,} requests: {b['prompt_tokens']:,} prompt tokens "
        f"({b['cached_tokens']:,} cached), {b['completion_tokens']:,} completion tokens"
    )
