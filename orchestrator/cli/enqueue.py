"""``orchestrator enqueue``: a source (a JSONL, Parquet, CSV or Arrow file, a folder, a
glob, standard input, a Hub dataset), or every dataset of a run file, into the queue."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from orchestrator.cli.common import (
    Checked,
    end_progress,
    on_database,
    progress_shown,
    run_sync,
    tty_progress,
)
from orchestrator.cli.options import (
    FLAG,
    Row,
    db_option,
    request_options,
    run_file_option,
    shown,
    table,
)
from orchestrator.settings import dataset_options as allowed
from orchestrator.settings.checks import COLUMNS, DATASET
from orchestrator.settings.choices import INPUT_FORMATS

if TYPE_CHECKING:
    from orchestrator.api.enqueue import Enqueued, EnqueueOptions, PlanFailed
    from orchestrator.errors import InputError
    from orchestrator.store import DatasetSpec, EnqueueReport


# The dataset settings, by option: all of them come from the run file with --config;
# the sampling ones do not apply to pass-through rows.
_SETTINGS = (
    ("--dataset", "dataset"),
    ("--model", "model"),
    ("--max-tokens", "max_tokens"),
    ("--temperature", "temperature"),
    ("--top-p", "top_p"),
    ("--param", "params"),
    ("--concurrency", "concurrency"),
    ("--priority", "priority"),
    ("--format", "fmt"),
    ("--regenerate", "regenerate"),
    ("--on-truncated", "on_truncated"),
    ("--on-invalid", "on_invalid"),
    ("--on-overflow", "on_overflow"),
    ("--history-reasoning", "history_reasoning"),
    ("--json-schema", "json_schema"),
    ("--passthrough", "passthrough"),
    ("--endpoint", "endpoint"),
    ("--logprobs", "logprobs"),
    ("--token-ids", "token_ids"),
    ("--samples", "samples"),
    ("--seeds", "seeds"),
    ("--sample-requests", "sample_requests"),
    ("--prompt-column", "prompt_column"),
    ("--messages-column", "messages_column"),
    ("--template", "template"),
    ("--template-file", "template_file"),
    ("--system", "system"),
    ("--id-column", "id_column"),
    ("--tools-column", "tools_column"),
    ("--split", "split"),
    ("--hf-config", "hf_config"),
)
# How the library's messages name an option: as the command spells it.
_SPELLING = {name: option for option, name in _SETTINGS} | {"format": "--format"}
_COLUMN_OPTIONS = (
    "prompt_column",
    "messages_column",
    "template",
    "template_file",
    "system",
    "id_column",
    "tools_column",
)
# The settings ``EnqueueOptions`` takes as the options give them, under the same names.
_AS_GIVEN = (
    "dataset",
    "concurrency",
    "priority",
    "regenerate",
    "on_truncated",
    "on_invalid",
    "on_overflow",
    "history_reasoning",
    "passthrough",
    "endpoint",
    "logprobs",
    "token_ids",
    "samples",
    "sample_requests",
    "split",
)
_SAMPLING = (
    "--max-tokens",
    "--temperature",
    "--top-p",
    "--param",
    "--concurrency",
    "--regenerate",
    "--on-truncated",
    "--on-invalid",
    "--on-overflow",
    "--json-schema",
    "--logprobs",
    "--token-ids",
    "--samples",
    "--seeds",
    "--sample-requests",
)


_PARAM_HELP = (
    "Any other request body field, e.g. thinking on: --param "
    "'chat_template_kwargs={\"enable_thinking\":true}' (Qwen3, DeepSeek) or "
    "'chat_template_kwargs={\"thinking\":true}' (Kimi)."
)


def _column(name: str, metavar: str = "COL") -> dict[str, Any]:
    """A column option's keywords: checked by the rule a run file's column is checked by."""
    return {"metavar": metavar, "type": Checked(COLUMNS[name])}


_FILE = {"type": click.Path(path_type=Path)}
# The options after the request body's, in the order --help lists them.
_DATASET_OPTIONS: tuple[Row, ...] = (
    (
        "--concurrency",
        "Most requests of this dataset in flight at once, across all workers.",
        {"type": Checked(DATASET["concurrency"])},
    ),
    (
        "--priority",
        "Higher priority datasets are worked on first.",
        {"type": Checked(DATASET["priority"])},
    ),
    (
        ("--format", "fmt"),
        "Every line must be in this format (auto: any mix). tokens: pre-tokenised "
        "input_ids/loss_mask rows, with --passthrough only.",
        shown("auto", click.Choice(INPUT_FORMATS)),
    ),
    (
        "--regenerate",
        "last: generate each conversation's final answer; all: every assistant turn, in "
        "order, each after the turns generated before it (a turn whose tool calls differ from "
        "the original's ends the conversation); each: every assistant turn against the "
        "original history before it, an item per turn (ID#turnK), all side by side: for "
        "agentic traces, whose tool results answer the original calls. Fixed when the "
        "dataset is created (default: the dataset's, else last).",
        {"type": click.Choice(allowed.REGENERATE)},
    ),
    (
        "--on-truncated",
        "What an answer cut at max_tokens does: keep it, retry it, or fail the item "
        "(default: the dataset's, else keep).",
        {"type": click.Choice(allowed.ON_TRUNCATED)},
    ),
    (
        "--json-schema",
        "A JSON schema file: each request asks for an answer that satisfies it "
        "(response_format json_schema), and each answer is checked against it.",
        _FILE,
    ),
    (
        "--on-invalid",
        "What structured output (response_format) that does not parse or match its "
        "schema does: keep it flagged, retry it, or fail the item (default: the dataset's, "
        "else keep).",
        {"type": click.Choice(allowed.ON_INVALID)},
    ),
    (
        "--on-overflow",
        "A prompt and max_tokens longer than the server's context: fail the item "
        "(context_overflow), or fit: ask again at once with max_tokens lowered to what fits, "
        "flagged max_tokens_reduced (default: the dataset's, else fail).",
        {"type": click.Choice(allowed.ON_OVERFLOW)},
    ),
    (
        "--history-reasoning",
        "Earlier assistant turns go back to the server with their reasoning (keep: "
        "models that think in a tool loop render it, and some APIs refuse a tool-call turn "
        "without it) or without (drop: for a server that refuses it) (default: the "
        "dataset's, else keep).",
        {"type": click.Choice(allowed.HISTORY_REASONING)},
    ),
    (
        "--samples",
        "Answers per prompt, each its own item with its own seed (default: the "
        "dataset's, else 1). Raising it later adds only the missing samples.",
        {"type": Checked(DATASET["samples"])},
    ),
    (
        "--seeds",
        "One seed per sample, all different (default: derived from each prompt's key).",
        {"metavar": "S1,S2,..."},
    ),
    (
        "--sample-requests",
        "How samples are asked for: n: one request with n choices (a server that "
        "ignores n is detected and the dataset falls back); seeds: one request per sample.",
        {"type": click.Choice(("n", "seeds"))},
    ),
    (
        "--passthrough",
        "The rows already hold the answer (conversations ending with it, or tokens rows): "
        "stored as done, no request sent. Fixed when the dataset is created.",
        FLAG,
    ),
    (
        "--endpoint",
        "chat: /v1/chat/completions; completions: /v1/completions with each row's plain "
        "prompt, no chat template (base models, few-shot prompts). Fixed when the dataset is "
        "created (default: the dataset's, else chat).",
        {"type": click.Choice(allowed.ENDPOINTS)},
    ),
    (
        "--logprobs",
        "Keep each answer's token logprobs and the K most likely alternatives per token "
        "(and the token ids where the server gives them); export --logprobs writes them.",
        {"metavar": "K", "type": Checked(DATASET["logprobs"])},
    ),
    (
        "--token-ids",
        "Keep the server's own token ids of every generated turn: the prompt it evaluated "
        "and the ids it generated (vLLM and SGLang say them with return_token_ids, llama.cpp "
        "is asked its /apply-template and /tokenize); export --format tokens writes them.",
        FLAG,
    ),
    (
        "--update",
        "Accept new values of the request parameters given for an existing dataset: its "
        "items not done yet are sent with them (each output records the parameters it was "
        "made with). Parameters not given keep their values; `orchestrator dataset set` "
        "changes one setting without a SOURCE.",
        FLAG,
    ),
    (
        "--prompt-column",
        "Read each row's user message from this text column (any table or JSONL source).",
        _column("prompt_column"),
    ),
    (
        "--messages-column",
        "Read each row's conversation from this column: a list of messages with OpenAI "
        "(role/content) or ShareGPT (from/value) keys, or its JSON text.",
        _column("messages_column"),
    ),
    (
        "--template",
        "Build the user message from the row's columns: 'Solve this.\\n\\n{problem}'; "
        "{a.b} is field b of struct column a, {{ and }} are braces, \\n a newline.",
        _column("template", "TEXT"),
    ),
    (
        "--template-file",
        "A TOML file of templates: system and user, or [[messages]] with role and content.",
        _FILE,
    ),
    (
        "--system",
        "A system message put first in every row built by the options above (not a "
        "template; \\n a newline).",
        _column("system", "TEXT"),
    ),
    ("--id-column", "The item key's column (else id, else place).", _column("id_column")),
    ("--tools-column", "The request's tools: a list, or its JSON text.", _column("tools_column")),
    (
        "--split",
        "The split of a DatasetDict folder or a Hub dataset (hf://) to read.",
        {"type": Checked(DATASET["split"])},
    ),
    (
        "--hf-config",
        "The configuration (subset) of a Hub dataset (hf://ORG/NAME).",
        {"metavar": "NAME", "type": Checked(DATASET["config"])},
    ),
    ("--skip-invalid", "Skip bad rows (listed and counted) instead of failing.", FLAG),
)


@click.command()
@click.argument("source", metavar="SOURCE", required=False)
@run_file_option(
    "Enqueue every dataset of a run file (docs/CONFIG.md) instead of one SOURCE; the "
    "file is checked as a whole first."
)
@click.option(
    "--dataset", "-d", type=Checked(DATASET["dataset"]), help="Dataset name (created on first use)."
)
@request_options(_PARAM_HELP)
@table(*_DATASET_OPTIONS)
@db_option
@click.pass_context
def enqueue(ctx: click.Context, source: str | None, config: Path | None, **options: Any) -> None:
    """Add the prompts of SOURCE to a dataset (all of them, or none on a bad row).

    SOURCE is a JSONL file (.jsonl, .jsonl.gz, .jsonl.zst), a Parquet, CSV/TSV or Arrow
    file, a folder of such shards or a datasets save_to_disk folder (--split for a
    DatasetDict), a glob ('data/train-*.parquet'), - for JSONL on standard input, or
    hf://ORG/NAME for a Hugging Face Hub dataset (--split, --hf-config; needs
    pip install 'orchestrator[hf]').

    Rows may be OpenAI chat ({"messages": [...]}), ShareGPT ({"conversations": [...]}),
    {"prompt": "..."} or OpenAI batch request lines ({"custom_id", "body": {...}}); or
    say which columns hold what: --prompt-column, --messages-column, --template. The
    item key is the row's "id" or "custom_id" (or --id-column), else its place: the
    line number in a JSONL file, FILE:N for a table's N-th row. Enqueuing the same
    source again adds nothing.

    With --config RUN.toml, every dataset of the run file instead, each file in its own
    transaction, in the file's order.
    """
    from orchestrator.api.enqueue import enqueue_source

    db, update, skip_invalid = (options.pop(k) for k in ("db", "update", "skip_invalid"))
    if config is not None:
        _config_alone(ctx, source, options)
        _enqueue_config(config, update=update, skip_invalid=skip_invalid, db=db)
        return
    chosen = _options(ctx, source, options, update=update)
    invalid: list[InputError] = []
    on_invalid = invalid.append if skip_invalid else None
    with progress_shown(f"reading {source}:") as progress:
        report = on_database(
            db,
            lambda d: enqueue_source(d, chosen, source, on_invalid=on_invalid, progress=progress),
        )
    _show_skipped(invalid, report)
    click.echo(_enqueued(report, str(source)))


def _config_alone(ctx: click.Context, file: str | None, settings: dict[str, Any]) -> None:
    """With --config, every dataset setting comes from the run file: none may be given."""
    given = (["SOURCE"] if file is not None else []) + _given(settings)
    if given:
        raise click.UsageError(
            f"--config takes every dataset setting from the run file: drop {', '.join(given)}",
            ctx,
        )


def _given(settings: dict[str, Any], among: tuple[str, ...] | None = None) -> list[str]:
    """The dataset settings given on the command line, by option name."""
    unset = {"fmt": "auto", "params": (), "passthrough": False, "token_ids": False}
    return [
        option
        for option, name in _SETTINGS
        if settings[name] not in (None, unset.get(name)) and (among is None or option in among)
    ]


def _options(
    ctx: click.Context, source: str | None, settings: dict[str, Any], *, update: bool
) -> EnqueueOptions:
    """The dataset's settings from the options, checked as the library checks any source's."""
    from orchestrator.api.enqueue import EnqueueOptions, request_body
    from orchestrator.formats.readers.columns import Columns

    if source is None:
        raise click.UsageError("Missing argument 'SOURCE' (or --config RUN.toml).", ctx)
    if settings["dataset"] is None:
        raise click.UsageError("Missing option '--dataset' / '-d'.", ctx)
    named = {k: settings[k] for k in ("max_tokens", "temperature", "top_p")}
    body = request_body(_parse_params(settings["params"]), model=settings["model"], **named)
    if settings["json_schema"] is not None:
        body["response_format"] = run_sync(lambda: _schema_format(settings["json_schema"]))
    _check_params(body, {**named, "model": settings["model"]})
    sampling = _given(settings, _SAMPLING)
    if settings["passthrough"] and sampling:
        raise click.UsageError(
            f"--passthrough stores the rows as done and sends no request: "
            f"{', '.join(sampling)} do not apply",
            ctx,
        )
    return EnqueueOptions(
        **{name: settings[name] for name in _AS_GIVEN},
        params=body,
        format=settings["fmt"],
        update=update,
        sampling=tuple(sampling),
        seeds=_parse_seeds(settings["seeds"]),
        columns=Columns(**{name: _unescaped(name, settings[name]) for name in _COLUMN_OPTIONS}),
        config=settings["hf_config"],
        spelling=_SPELLING,
    )


def settings_spec(name: str, given: dict[str, Any]) -> DatasetSpec:
    """``dataset set``'s options as the spec of what changes: the request body fields
    given (checked as ``enqueue`` checks them) and the knobs; nothing else."""
    from orchestrator.api.enqueue import request_body
    from orchestrator.store import DatasetSpec

    named = {k: given[k] for k in ("max_tokens", "temperature", "top_p")}
    body = request_body(_parse_params(given["params"]), model=given["model"], **named)
    _check_params(body, {**named, "model": given["model"]})
    knobs = ("concurrency", "priority", "on_truncated", "on_invalid", "on_overflow")
    knobs += ("history_reasoning",)
    return run_sync(lambda: DatasetSpec(name=name, params=body, **{k: given[k] for k in knobs}))


def _schema_format(path: Path) -> dict[str, Any]:
    """``--json-schema FILE`` as the ``response_format`` it sets; a file that cannot be
    read, is not JSON or is no JSON schema stops here, naming it (exit 2)."""
    import orjson

    from orchestrator.errors import ConfigError
    from orchestrator.items.structured import response_format_for

    try:
        schema = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"--json-schema {path}: cannot read it: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"--json-schema {path}: not JSON: {exc}") from None
    return response_format_for(schema, source=f"--json-schema {path}", name=path.stem)


_ESCAPES = re.compile(r"\\(n|t|\\)")


def _unescaped(name: str, value: Any) -> Any:
    """A template or system message as typed in a shell: ``\\n`` a newline, ``\\t`` a
    tab, ``\\\\`` a backslash (a run file and Python have escapes of their own)."""
    if name not in ("template", "system") or value is None:
        return value
    return _ESCAPES.sub(lambda m: {"n": "\n", "t": "\t"}.get(m[1], "\\"), value)


def _parse_seeds(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of integers", param_hint="--seeds"
        ) from None


def _parse_params(values: tuple[str, ...]) -> dict[str, Any]:
    import orjson

    params: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE", param_hint="--param")
        try:
            params[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            params[key] = raw
    return params


def _check_params(body: dict[str, Any], options: dict[str, Any]) -> None:
    """The request body through the check run files and input lines get
    (``orchestrator.items.params``): a NaN or a negative temperature stops here."""
    from orchestrator.items.params import problems

    found = problems(body)
    if found:
        named = [
            (f"--{name.replace('_', '-')}" if options.get(name) is not None else f"--param {name}")
            for name, _ in found
        ]
        raise click.UsageError(
            "; ".join(f"{option}: {why}" for option, (_, why) in zip(named, found, strict=True))
        )


def _show_skipped(invalid: list[InputError], report: EnqueueReport) -> None:
    """Lines the reader rejected and lines the store rejected (duplicates), once each."""
    from orchestrator.api.enqueue import skipped

    report.invalid = skipped(invalid, report)
    if report.invalid:
        shown = sorted(report.invalid, key=lambda e: e.line or 0)
        for err in shown[:20]:
            click.echo(f"skipped {err}", err=True)
        if len(shown) > 20:
            click.echo(f"... and {len(shown) - 20} more", err=True)


def _enqueued(report: EnqueueReport, file: str) -> str:
    """What ``enqueue`` prints for one file: the settings it changed, then what it added."""
    added = _added(report, file)
    if not report.changed:
        return added
    changed = changed_line(report.dataset, report.changed, report.pending)
    return f"{changed}\n{added.replace('nothing new:', 'no new items:', 1)}"


def changed_line(dataset: str, changed: Any, pending: int) -> str:
    """``dataset 'd': max_tokens 2048 → 4096 on 1,200 pending items``, and what of the
    rest: the one way both ``enqueue`` and ``dataset set`` confirm a change."""
    if not changed:
        return f"dataset {dataset!r}: nothing changed (every setting given is as stored)"
    return (
        f"dataset {dataset!r}: {', '.join(map(str, changed))} on {pending:,} pending items "
        "(running ones finish as sent; done ones keep their answers: `orchestrator requeue "
        f"--state done --dataset {dataset}` generates them again)"
    )


def _added(report: EnqueueReport, file: str) -> str:
    """The line ``enqueue`` prints for what one file added."""
    name = report.dataset
    extra = report.samples_added - report.added
    if report.added == 0 and report.already_present and extra > 0:
        return (
            f"added {extra:,} samples to the {report.already_present:,} prompts of {file} in "
            f"dataset {name!r} ({report.samples} samples per prompt)"
        )
    if report.added == 0 and report.already_present:
        return (
            f"nothing new: all {report.already_present:,} items of {file} are already in "
            f"dataset {name!r}"
        )
    verb = "into new" if report.created else "into existing"
    details = f"{report.already_present:,} already present"
    if report.invalid:
        details += f", {len(report.invalid):,} invalid lines skipped"
    if report.mode == "passthrough":
        return (
            f"stored {report.added:,} rows as done {verb} pass-through dataset {name!r} ({details})"
        )
    if report.mode == "all":
        details += f"; {report.turns:,} turns to generate"
    elif report.mode == "each":
        details += "; an item per assistant turn"
    if report.samples > 1:
        details += f"; {report.samples_added:,} samples, {report.samples} per prompt"
    return f"enqueued {report.added:,} items {verb} dataset {name!r} ({details})"


def _enqueue_config(config: Path, *, update: bool, skip_invalid: bool, db: str | None) -> None:
    """Every dataset of a run file: checked as a whole, then one transaction per file."""
    from orchestrator.api.enqueue import PlanFailed, enqueue_plans
    from orchestrator.runfile import load_run

    plans = run_sync(lambda: load_run(config))
    shown: list[Callable[[int], None] | None] = []

    def progress(plan: Any) -> Callable[[int], None] | None:
        shown.append(tty_progress(f"reading {plan.source}:"))
        return shown[-1]

    def each(entry: Enqueued) -> None:
        end_progress(shown.pop())
        _show_skipped(entry.invalid, entry.report)
        click.echo(_enqueued(entry.report, entry.plan.source))

    result = on_database(
        db,
        lambda d: enqueue_plans(
            d, config, plans, update=update, skip_invalid=skip_invalid, progress=progress, each=each
        ),
    )
    while shown:
        end_progress(shown.pop())
    if isinstance(result, PlanFailed):
        _stopped(result, len(plans))
    _total([entry.report for entry in result])


def _stopped(result: PlanFailed, planned: int) -> NoReturn:
    """Where a run file's enqueue stopped, and what stays; exits with the error's code."""
    import sys

    click.echo(f"error: {result.error}", err=True)
    kept = ", ".join(repr(e.report.dataset) for e in result.done) or "none"
    click.echo(
        f"stopped at dataset {result.plan.name!r} ({len(result.done) + 1} of "
        f"{planned}): nothing of it was enqueued; the datasets before it stay "
        f"enqueued ({kept})",
        err=True,
    )
    sys.exit(result.error.exit_code)


def _total(reports: list[EnqueueReport]) -> None:
    added = sum(r.added for r in reports)
    passed = sum(r.added for r in reports if r.mode == "passthrough")
    turns = sum(r.turns for r in reports if r.mode != "passthrough")
    already = sum(r.already_present for r in reports)
    click.echo(
        f"total: {added:,} items added to {len(reports)} datasets ({turns:,} requests to "
        f"generate, {passed:,} rows stored as done, {already:,} already present)"
    )
