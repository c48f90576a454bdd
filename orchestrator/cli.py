"""The ``orchestrator`` command: parse options, call the library, print the result.

No SQL and no HTTP here. Errors from ``orchestrator.errors`` become a one-line message
on stderr and the error's exit code (2 bad input or options, 3 storage).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
import orjson

from orchestrator import __version__
from orchestrator.errors import ConfigError, OrchestratorError, StorageError

T = TypeVar("T")

# orchestrator.logs.LEVELS, spelled out: importing orchestrator.logs loads structlog (and
# asyncio with it), which the read-only fast paths never need. A test keeps them equal.
LOG_LEVELS = ("debug", "info", "warning", "error")
# orchestrator.formats.export.FORMATS and REASONING_MODES, spelled out for the same reason.
EXPORT_FORMATS = ("messages", "sharegpt", "openai-batch")
REASONING_MODES = ("separate", "inline", "drop")
# Commands that set up logging only when they leave their sqlite3 fast path.
_LAZY_LOGGING = frozenset({"status", "export"})
_pending_logs: tuple[str, bool | None] | None = None
# The largest number a dataset setting may hold: what a PostgreSQL INTEGER column takes.
INT_MAX = 2**31 - 1

db_option = click.option(
    "--db",
    envvar="ORCHESTRATOR_DB",
    default=None,
    metavar="PATH|URL",
    help="Database: a SQLite file path or an SQLAlchemy URL "
    "(env ORCHESTRATOR_DB; default ./orchestrator.db).",
)


def _split_servers(
    _ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    """``--server`` may repeat, and ORCHESTRATOR_SERVERS holds several, space-separated."""
    return tuple(s for entry in values for s in entry.split())


servers_option = click.option(
    "--server",
    "servers",
    multiple=True,
    envvar="ORCHESTRATOR_SERVERS",
    metavar="URL",
    callback=_split_servers,
    help="OpenAI-compatible server base URL; repeat for several "
    "(env ORCHESTRATOR_SERVERS, space-separated).",
)

window_option = click.option(
    "--window",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds of recent history for the recent rates.",
)

api_key_file_option = click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the server's API key (else env ORCHESTRATOR_API_KEY).",
)

basic_auth_file_option = click.option(
    "--basic-auth-file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="ORCHESTRATOR_BASIC_AUTH_FILE",
    help="File holding USER:PASSWORD for the servers' HTTP Basic auth: kept out of the "
    "process arguments, unlike http://USER:PASSWORD@HOST (env ORCHESTRATOR_BASIC_AUTH_FILE).",
)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn our errors into a message and an exit code."""
    from orchestrator import aio  # here, not at the top: the read-only fast paths never need it

    return run_sync(functools.partial(aio.run, coro))


def run_sync(fn: Callable[[], T]) -> T:
    """Call a function; turn our errors into a message and an exit code."""
    try:
        return fn()
    except OrchestratorError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        # A file the command had to read or write, and the system's reason, in one line.
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"error: {where}{exc.strerror or exc}", err=True)
        sys.exit(ConfigError.exit_code)


def _tty_progress(label: str) -> Callable[[int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(n: int) -> None:
        click.echo(f"\r{label} {n:,}", nl=False, err=True)

    return show


def _end_progress(progress: Callable[[int], None] | None) -> None:
    if progress is not None:
        click.echo("", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="orchestrator")
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    envvar="ORCHESTRATOR_LOG_LEVEL",
    default="info",
    show_default=True,
)
@click.option(
    "--log-json/--no-log-json",
    default=None,
    help="JSON log lines (default: when stderr is not a terminal).",
)
@click.pass_context
def main(ctx: click.Context, log_level: str, log_json: bool | None) -> None:
    """Durable, resumable batch generation against OpenAI-compatible servers."""
    global _pending_logs
    _pending_logs = (log_level, log_json)
    if ctx.invoked_subcommand not in _LAZY_LOGGING:
        _configure_logs()


def _configure_logs() -> None:
    """Set up logging as the group's options asked, once, before anything may log."""
    global _pending_logs
    if _pending_logs is not None:
        from orchestrator import logs

        level, json = _pending_logs
        _pending_logs = None
        logs.configure(level, json=json)


# ---------------------------------------------------------------------------- db


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@click.option(
    "--into-existing",
    is_flag=True,
    help="Add the queue's tables to a database that already holds another application's.",
)
@db_option
def db_upgrade(into_existing: bool, db: str | None) -> None:
    """Create or upgrade the schema to the version this orchestrator knows."""
    from orchestrator.store import create_database, upgrade
    from orchestrator.store.engine import resolve_url
    from orchestrator.store.migrate import check_open, database_facts, sqlite_facts

    async def go() -> tuple[str | None, str, str]:
        url = resolve_url(db)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            facts = sqlite_facts(str(url.database))
            if facts is not None:
                revision, tables = facts
                check_open(
                    "create",
                    str(url.database),
                    revision=revision,
                    tables=tables,
                    adopt=into_existing,
                )
        database = create_database(url)
        try:
            if not database.is_sqlite:
                revision, tables = await database_facts(database)
                check_open(
                    "create", database.where, revision=revision, tables=tables, adopt=into_existing
                )
            before, after = await upgrade(database)
            return before, after, database.where
        finally:
            await database.close()

    before, after, where = run_async(go())
    if before == after:
        click.echo(f"{where}: schema already at {after}")
    else:
        click.echo(f"{where}: schema upgraded from {before or 'empty'} to {after}")


@db.command("copy")
@click.option("--from", "source", required=True, metavar="PATH|URL", help="Database to copy.")
@click.option(
    "--to", "target", required=True, metavar="PATH|URL", help="An empty database to fill."
)
def db_copy(source: str, target: str) -> None:
    """Copy a run into an empty database: SQLite to PostgreSQL or back, mid-way.

    Every table, in primary-key order, in one transaction on the target (a failed copy
    leaves nothing). Stop the workers first: items running in the source are copied as
    pending with their lease cleared and the attempt given back.
    """
    from orchestrator.store.copy import copy_database

    progress = _tty_progress("copying")
    shown = {"table": ""}

    def show(table: str, n: int) -> None:
        if progress is not None:
            if shown["table"] and shown["table"] != table:
                click.echo("", err=True)
            shown["table"] = table
            click.echo(f"\rcopying {table}: {n:,} rows", nl=False, err=True)

    try:
        report = run_async(copy_database(source, target, progress=show))
    finally:
        _end_progress(progress)
    total = sum(report.rows.values())
    tables = ", ".join(f"{name} {n:,}" for name, n in report.rows.items())
    click.echo(f"copied {total:,} rows from {report.source} to {report.target} ({tables})")
    if report.requeued:
        click.echo(f"{report.requeued:,} items that were running are pending again")


# ---------------------------------------------------------------------------- enqueue

# orchestrator.formats.readers.INPUT_FORMATS and the dataset choices of
# orchestrator.store.datasets, spelled out: importing those modules loads orjson and
# SQLAlchemy before any command runs. A test keeps them equal.
INPUT_FORMATS = ("auto", "messages", "sharegpt", "prompt", "openai-batch", "tokens")
REGENERATE = ("last", "all")
ON_TRUNCATED = ("keep", "retry", "fail")
DEFAULT_TOKENS_PER_SECOND = 850.0
"""``plan``'s default rate: the total tokens per second of a typical single-GPU reasoning
run (an 8B model answering a few hundred long requests at once); docs/CONFIG.md."""


def _parse_params(values: tuple[str, ...]) -> dict[str, Any]:
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
    (``orchestrator.params``): a NaN or a negative temperature stops here."""
    from orchestrator.params import problems

    found = problems(body)
    if found:
        named = [
            (f"--{name.replace('_', '-')}" if options.get(name) is not None else f"--param {name}")
            for name, _ in found
        ]
        raise click.UsageError(
            "; ".join(f"{option}: {why}" for option, (_, why) in zip(named, found, strict=True))
        )


@main.command()
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option(
    "--config",
    type=click.Path(path_type=Path),
    help="Enqueue every dataset of a run file (docs/CONFIG.md) instead of one FILE; the "
    "file is checked as a whole first.",
)
@click.option("--dataset", "-d", help="Dataset name (created on first use).")
@click.option("--model", help="Model name sent with every request of the dataset.")
@click.option("--max-tokens", type=click.IntRange(min=1), help="max_tokens of each request.")
@click.option("--temperature", type=click.FloatRange(min=0), help="Sampling temperature.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1), help="Nucleus sampling top_p.")
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=JSON",
    help="Any other request body field, e.g. --param 'chat_template_kwargs={\"thinking\":true}'.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=INT_MAX),
    help="Most requests of this dataset in flight at once, across all workers.",
)
@click.option(
    "--priority",
    type=click.IntRange(min=-INT_MAX, max=INT_MAX),
    help="Higher priority datasets are worked on first.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(INPUT_FORMATS),
    default="auto",
    show_default=True,
    help="Every line must be in this format (auto: any mix). tokens: pre-tokenised "
    "input_ids/loss_mask rows, with --passthrough only.",
)
@click.option(
    "--regenerate",
    type=click.Choice(REGENERATE),
    help="last: generate each conversation's final answer; all: every assistant turn, in "
    "order. Fixed when the dataset is created (default: the dataset's, else last).",
)
@click.option(
    "--on-truncated",
    type=click.Choice(ON_TRUNCATED),
    help="What an answer cut at max_tokens does: keep it, retry it, or fail the item "
    "(default: the dataset's, else keep).",
)
@click.option(
    "--passthrough",
    is_flag=True,
    help="The rows already hold the answer (conversations ending with it, or tokens rows): "
    "stored as done, no request sent. Fixed when the dataset is created.",
)
@click.option(
    "--update",
    is_flag=True,
    help="Accept new request parameters for an existing dataset: its items not done yet "
    "are sent with them (each output records the parameters it was made with).",
)
@click.option(
    "--skip-invalid", is_flag=True, help="Skip bad lines (listed and counted) instead of failing."
)
@db_option
@click.pass_context
def enqueue(
    ctx: click.Context,
    file: Path | None,
    config: Path | None,
    dataset: str | None,
    model: str | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    params: tuple[str, ...],
    concurrency: int | None,
    priority: int | None,
    fmt: str,
    regenerate: str | None,
    on_truncated: str | None,
    passthrough: bool,
    update: bool,
    skip_invalid: bool,
    db: str | None,
) -> None:
    """Add the prompts of a JSONL FILE to a dataset (all of them, or none on a bad line).

    Lines may be OpenAI chat ({"messages": [...]}), ShareGPT ({"conversations": [...]}),
    {"prompt": "..."} or OpenAI batch request lines ({"custom_id", "body": {...}}). The
    item key is the line's "id" or "custom_id", else its line number. Enqueuing the same
    file again adds nothing.

    With --config RUN.toml, every dataset of the run file instead, each file in its own
    transaction, in the file's order.
    """
    if config is not None:
        given = [
            name
            for name, value in (
                ("FILE", file),
                ("--dataset", dataset),
                ("--model", model),
                ("--max-tokens", max_tokens),
                ("--temperature", temperature),
                ("--top-p", top_p),
                ("--param", params or None),
                ("--concurrency", concurrency),
                ("--priority", priority),
                ("--format", None if fmt == "auto" else fmt),
                ("--regenerate", regenerate),
                ("--on-truncated", on_truncated),
                ("--passthrough", passthrough or None),
            )
            if value is not None
        ]
        if given:
            raise click.UsageError(
                f"--config takes every dataset setting from the run file: drop {', '.join(given)}",
                ctx,
            )
        _enqueue_config(config, update=update, skip_invalid=skip_invalid, db=db)
        return
    if file is None:
        raise click.UsageError("Missing argument 'FILE' (or --config RUN.toml).", ctx)
    if dataset is None:
        raise click.UsageError("Missing option '--dataset' / '-d'.", ctx)

    from orchestrator.enqueueing import EnqueueOptions, enqueue_source
    from orchestrator.errors import InputError
    from orchestrator.store import open_database

    body = _parse_params(params)
    for name, value in (
        ("model", model),
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
    ):
        if value is not None:
            body[name] = value
    _check_params(body, {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p})
    sampling = [
        name
        for name, value in (
            ("--max-tokens", max_tokens),
            ("--temperature", temperature),
            ("--top-p", top_p),
            ("--param", params or None),
            ("--concurrency", concurrency),
            ("--regenerate", regenerate),
            ("--on-truncated", on_truncated),
        )
        if value is not None
    ]
    if passthrough and sampling:
        raise click.UsageError(
            f"--passthrough stores the rows as done and sends no request: "
            f"{', '.join(sampling)} do not apply",
            ctx,
        )
    invalid: list[InputError] = []
    on_invalid = invalid.append if skip_invalid else None
    progress = _tty_progress(f"reading {file}:")
    options = EnqueueOptions(
        dataset=dataset,
        params=body,
        concurrency=concurrency,
        priority=priority,
        format=fmt,
        regenerate=regenerate,
        on_truncated=on_truncated,
        passthrough=passthrough,
        update=update,
        sampling=tuple(sampling),
    )

    async def go() -> Any:
        database = await open_database(db)
        try:
            return await enqueue_source(
                database, options, file, on_invalid=on_invalid, progress=progress
            )
        finally:
            await database.close()

    try:
        report = run_async(go())
    finally:
        _end_progress(progress)
    _show_skipped(invalid, report)
    click.echo(_enqueued(report, str(file)))


def _show_skipped(invalid: list[Any], report: Any) -> None:
    """Lines the reader rejected and lines the store rejected (duplicates), once each."""
    from orchestrator.enqueueing import skipped

    report.invalid = skipped(invalid, report)
    if report.invalid:
        shown = sorted(report.invalid, key=lambda e: e.line or 0)
        for err in shown[:20]:
            click.echo(f"skipped {err}", err=True)
        if len(shown) > 20:
            click.echo(f"... and {len(shown) - 20} more", err=True)


def _enqueued(report: Any, file: str) -> str:
    """The line ``enqueue`` prints for one file."""
    name = report.dataset
    if report.added == 0 and report.already_present:
        return (
            f"nothing new: all {report.already_present:,} items of {file} are already in "
            f"dataset {name!r}"
        )
    verb = "created" if report.created else "into existing"
    details = f"{report.already_present:,} already present"
    if report.invalid:
        details += f", {len(report.invalid):,} invalid lines skipped"
    if report.mode == "passthrough":
        return (
            f"stored {report.added:,} rows as done {verb} pass-through dataset {name!r} ({details})"
        )
    if report.mode == "all":
        details += f"; {report.turns:,} turns to generate"
    return f"enqueued {report.added:,} items {verb} dataset {name!r} ({details})"


def _enqueue_config(config: Path, *, update: bool, skip_invalid: bool, db: str | None) -> None:
    """Every dataset of a run file: checked as a whole, then one transaction per file."""
    from orchestrator.enqueueing import Enqueued, PlanFailed, enqueue_plans
    from orchestrator.runconfig import load_run
    from orchestrator.store import open_database

    plans = run_sync(lambda: load_run(config))
    shown: list[Callable[[int], None] | None] = []

    def progress(plan: Any) -> Callable[[int], None] | None:
        shown.append(_tty_progress(f"reading {plan.file}:"))
        return shown[-1]

    def each(entry: Enqueued) -> None:
        _end_progress(shown.pop())
        _show_skipped(entry.invalid, entry.report)
        click.echo(_enqueued(entry.report, str(entry.plan.file)))

    async def go() -> list[Enqueued] | PlanFailed:
        database = await open_database(db)
        try:
            return await enqueue_plans(
                database,
                config,
                plans,
                update=update,
                skip_invalid=skip_invalid,
                progress=progress,
                each=each,
            )
        finally:
            await database.close()

    result = run_async(go())
    while shown:
        _end_progress(shown.pop())
    if isinstance(result, PlanFailed):
        click.echo(f"error: {result.error}", err=True)
        kept = ", ".join(repr(e.report.dataset) for e in result.done) or "none"
        click.echo(
            f"stopped at dataset {result.plan.name!r} ({len(result.done) + 1} of "
            f"{len(plans)}): nothing of it was enqueued; the datasets before it stay "
            f"enqueued ({kept})",
            err=True,
        )
        sys.exit(result.error.exit_code)
    reports = [entry.report for entry in result]
    added = sum(r.added for r in reports)
    passed = sum(r.added for r in reports if r.mode == "passthrough")
    turns = sum(r.turns for r in reports if r.mode != "passthrough")
    already = sum(r.already_present for r in reports)
    click.echo(
        f"total: {added:,} items added to {len(reports)} datasets ({turns:,} requests to "
        f"generate, {passed:,} rows stored as done, {already:,} already present)"
    )


# ---------------------------------------------------------------------------- plan


@main.command()
@click.option(
    "--config",
    type=click.Path(path_type=Path),
    help="Plan the datasets of a run file (docs/CONFIG.md), counting the answers the "
    "database already holds; without it, plan what the database holds.",
)
@click.option(
    "--tokens-per-second",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TOKENS_PER_SECOND,
    show_default=True,
    help="The servers' total generation rate. The default is a typical single-GPU "
    "reasoning run; `status` shows a running run's.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable.")
@db_option
def plan(config: Path | None, tokens_per_second: float, as_json: bool, db: str | None) -> None:
    """Requests, tokens to generate, time left and database size, per dataset and in total."""
    from orchestrator.runconfig import (
        done_stats,
        load_run,
        plan_json,
        plan_run,
        plan_stored,
        render_plan,
    )
    from orchestrator.store.reader import sqlite_path

    plans = run_sync(lambda: load_run(config)) if config is not None else None
    path = sqlite_path(db)
    exists = path is None or os.path.exists(path)
    if plans is None and not exists:
        click.echo(
            f"error: no database at {path}: nothing to plan (plan a run file with --config)",
            err=True,
        )
        sys.exit(ConfigError.exit_code)

    async def stored() -> list[Any]:
        from orchestrator.store import open_database
        from orchestrator.store.planning import stored_datasets

        database = await open_database(db, mode="read")
        try:
            return await stored_datasets(database)
        finally:
            await database.close()

    held = run_async(stored()) if exists else []
    if plans is not None:
        result = run_sync(
            lambda: plan_run(
                plans, tokens_per_second=tokens_per_second, done_stats=done_stats(held)
            )
        )
    elif not held:
        click.echo(f"no datasets in {path or db}: nothing to plan (plan a run file with --config)")
        return
    else:
        result = plan_stored(held, tokens_per_second=tokens_per_second)
    if as_json:
        click.echo(orjson.dumps(plan_json(result), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_plan(result), nl=False)


# ---------------------------------------------------------------------------- run


def _read_api_key(api_key_file: Path | None) -> str | None:
    if api_key_file is not None:
        try:
            return api_key_file.read_text().strip() or None
        except OSError as exc:
            raise click.BadParameter(
                f"{api_key_file}: {exc.strerror}", param_hint="--api-key-file"
            ) from exc
    return os.environ.get("ORCHESTRATOR_API_KEY") or None


max_response_option = click.option(
    "--max-response-mb",
    type=click.FloatRange(min=0.001),
    default=64.0,
    show_default=True,
    help="Most MiB of one answer's body; a larger one fails the item (response_too_large) "
    "before it fills memory and the database.",
)


def _checked_servers(servers: tuple[str, ...]) -> tuple[str, ...]:
    """``--server`` / ORCHESTRATOR_SERVERS URLs through the one URL check of every server
    source (a servers file's lines get the same): refused with the source named, or
    corrected (a ``/v1``, a trailing slash) with a note."""
    import structlog

    from orchestrator.servers import check_server_url

    ctx = click.get_current_context()
    from_env = ctx.get_parameter_source("servers") == click.core.ParameterSource.ENVIRONMENT
    source = "ORCHESTRATOR_SERVERS" if from_env else "--server"
    checked = []
    for url in servers:
        fixed, note = run_sync(lambda url=url: check_server_url(url, source))
        if note:
            structlog.get_logger("orchestrator.cli").info(
                "server_url_corrected", source=source, note=note
            )
        checked.append(fixed)
    return tuple(checked)


def _concurrency(_ctx: click.Context, _param: click.Parameter, value: str) -> int | str:
    from orchestrator.servers import parse_cap

    try:
        return parse_cap(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command()
@servers_option
@click.option(
    "--servers-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="More servers, one URL a line, each optionally with its own concurrency=N|auto "
    "('#' starts a comment).",
)
@click.option(
    "--concurrency",
    default="64",
    show_default=True,
    metavar="N|auto",
    callback=_concurrency,
    help="Most requests in flight per server (the worker's total is the sum over the "
    "healthy servers); 'auto' adapts each server's to what it takes, from its /metrics.",
)
@click.option("--dataset", "datasets", multiple=True, help="Only work on these datasets.")
@click.option(
    "--exit-when-done",
    is_flag=True,
    help="Exit once no item is pending or running: 0 when every item is done, 6 when some "
    "failed, 7 when items of paused datasets are left pending.",
)
@click.option(
    "--give-up-after",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Stop (exit 4) when no server has answered for this long; by default a worker "
    "waits for its servers as long as it takes.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=3600.0,
    show_default=True,
    help="Seconds a whole request may take, streamed or not (long reasoning answers need long).",
)
@click.option(
    "--lease-seconds",
    type=click.FloatRange(min=2),
    default=120.0,
    show_default=True,
    help="Lease length; renewed every quarter of it while a request is in flight.",
)
@click.option("--max-attempts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--retry-backoff",
    type=click.FloatRange(min=0.01),
    default=2.0,
    show_default=True,
    help="First retry delay in seconds; doubles per attempt (±25 %), capped at 300.",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.",
)
@click.option(
    "--stream/--no-stream",
    default=False,
    show_default=True,
    help="Stream answers (then --stream-idle-timeout also bounds silence).",
)
@click.option(
    "--stream-idle-timeout",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    help="Seconds a stream may go without a data event (SSE comments do not count).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    help="Serve Prometheus metrics at /metrics (and /health) on this port (0: any free one).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics server binds; another than loopback exposes it to the network.",
)
@api_key_file_option
@basic_auth_file_option
@max_response_option
@db_option
def run(
    servers: tuple[str, ...],
    servers_file: Path | None,
    concurrency: int | str,
    datasets: tuple[str, ...],
    exit_when_done: bool,
    give_up_after: float | None,
    request_timeout: float,
    lease_seconds: float,
    max_attempts: int,
    retry_backoff: float,
    grace: float,
    stream: bool,
    stream_idle_timeout: float,
    metrics_port: int | None,
    metrics_host: str,
    api_key_file: Path | None,
    basic_auth_file: Path | None,
    max_response_mb: float,
    db: str | None,
) -> None:
    """Work on the queue: claim items, call the servers, commit each answer once.

    SIGTERM or SIGINT stops claiming and lets in-flight requests finish within --grace;
    a second signal stops at once. Unfinished items go back to pending.
    """
    from orchestrator.running import RunSettings, configs, run_worker, without_credentials
    from orchestrator.servers import merge_servers, parse_servers_file
    from orchestrator.store import open_database

    servers = _checked_servers(servers)
    listed = run_sync(lambda: parse_servers_file(servers_file)) if servers_file else []
    api_key = _read_api_key(api_key_file)
    specs, basic_auth = run_sync(
        lambda: without_credentials(merge_servers(servers, listed), api_key, basic_auth_file)
    )
    if not specs:
        raise click.UsageError(
            "give at least one --server URL (or --servers-file, or ORCHESTRATOR_SERVERS)"
        )
    settings = RunSettings(
        concurrency=concurrency,
        datasets=datasets,
        exit_when_done=exit_when_done,
        give_up_after=give_up_after,
        request_timeout=request_timeout,
        lease_seconds=lease_seconds,
        max_attempts=max_attempts,
        retry_backoff=retry_backoff,
        grace=grace,
        stream=stream,
        stream_idle_timeout=stream_idle_timeout,
        max_response_mb=max_response_mb,
    )
    config, client_config = configs(specs, basic_auth, api_key, settings)

    async def go() -> Any:
        database = await open_database(db, mode="write")
        try:
            return await run_worker(
                database,
                config,
                client_config,
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                signals=True,
            )
        finally:
            await database.close()

    outcome = run_async(go())
    _say_how_run_ended(outcome.stats, outcome.stopped)


def _say_how_run_ended(stats: Any, stopped: list[Any]) -> None:
    """The worker's last line for a person, and the exit code of how it ended."""
    from orchestrator import logs
    from orchestrator.errors import ItemsFailed, ItemsLeftPending

    if not logs.json_lines():  # else the worker_stopped event says it, as JSON
        click.echo(
            f"worker stopped: {stats.completed:,} done, {stats.failed:,} failed, "
            f"{stats.retried:,} retried, {stats.released:,} released",
            err=True,
        )
    if stats.dropped:
        # The database refused them until the stop deadline: their leases expire and
        # the items run again, but this worker did not finish cleanly.
        click.echo(
            f"error: {stats.dropped:,} answers could not be written before the stop and were "
            "dropped (their items run again once their leases expire)",
            err=True,
        )
        sys.exit(StorageError.exit_code)
    for reason in stopped:
        kind = "incomplete" if isinstance(reason, (ItemsFailed, ItemsLeftPending)) else "error"
        click.echo(f"{kind}: {reason}", err=True)
        sys.exit(reason.exit_code)


# ---------------------------------------------------------------------------- status


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable (docs/STATUS.md).")
@window_option
@servers_option
@db_option
def status(as_json: bool, window: float, servers: tuple[str, ...], db: str | None) -> None:
    """Progress, rates, errors and ETA per dataset and in total.

    With --server (or ORCHESTRATOR_SERVERS), each server's own view from its /metrics
    (SGLang or vLLM names) is shown beside them.
    """
    from orchestrator.monitor.text import render_status

    snap = _status_snapshot(db, window, servers)
    if as_json:
        click.echo(orjson.dumps(snap, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_status(snap))


def _status_snapshot(db: str | None, window: float, servers: tuple[str, ...]) -> dict[str, Any]:
    """The status document (docs/STATUS.md), with the servers' own view when asked."""
    import sqlite3

    from orchestrator.store.reader import open_reader, sqlite_path
    from orchestrator.store.stats import snapshot_sqlite

    snap: dict[str, Any] | None = None
    # An SQLite file at the current schema is read through plain sqlite3, without
    # loading SQLAlchemy; anything else (or any error) goes the full way below.
    path = sqlite_path(db)
    reader = open_reader(path) if path else None
    if reader is not None:
        with reader, contextlib.suppress(sqlite3.Error):
            snap = snapshot_sqlite(reader, window=window)
    if snap is None:
        _configure_logs()
        from orchestrator.store import open_database, snapshot

        async def go() -> dict[str, Any]:
            database = await open_database(db, mode="read")
            try:
                return await snapshot(database, window=window)
            finally:
                await database.close()

        snap = run_async(go())
    if servers:
        from orchestrator.server_metrics import scrape

        snap["servers"] = [scrape(server) for server in servers]
    return snap


@main.command()
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@window_option
@click.option(
    "--count", type=click.IntRange(min=0), default=0, help="Stop after this many views (0: never)."
)
@servers_option
@db_option
def watch(
    interval: float, window: float, count: int, servers: tuple[str, ...], db: str | None
) -> None:
    """A live view of status: a progress bar per dataset, rates, ETA, errors, servers.

    Redrawn in place (over ssh too); Ctrl-C leaves it.
    """
    import time

    from rich.console import Console
    from rich.live import Live

    from orchestrator.monitor.live import render

    console = Console()
    shown = 0
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(render(_status_snapshot(db, window, servers)), refresh=True)
                shown += 1
                if count and shown >= count:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (the dashboard has no authentication).",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Another name the page may be reached by (a proxy's, a DNS name): requests whose "
    "Host header is none of loopback, an IP address, --host or these are refused.",
)
@window_option
@servers_option
@db_option
def dashboard(
    port: int,
    host: str,
    allow_hosts: tuple[str, ...],
    window: float,
    servers: tuple[str, ...],
    db: str | None,
) -> None:
    """A web page of the run that updates itself: progress, throughput and errors over
    the whole run, completion lengths, servers, ETA. Only reads the database."""
    _configure_logs()
    from orchestrator.monitor.dashboard import serve

    def ready(url: str) -> None:
        click.echo(f"dashboard on {url} (Ctrl-C stops it)", err=True)

    with contextlib.suppress(KeyboardInterrupt):
        run_async(
            serve(
                db,
                host=host,
                port=port,
                servers=servers,
                window=window,
                ready=ready,
                allow_hosts=allow_hosts,
            )
        )


@main.command()
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@window_option
@servers_option
@db_option
def report(out: Path, window: float, servers: tuple[str, ...], db: str | None) -> None:
    """The dashboard's page as one static HTML file, data included (no network needed)."""
    _configure_logs()
    from orchestrator.monitor.dashboard import gather_report, write_report

    data = run_async(gather_report(db, servers=servers, window=window))
    run_sync(lambda: write_report(out, data))
    click.echo(f"wrote {out}")


# ---------------------------------------------------------------------------- operator


@main.command()
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option(
    "--state",
    type=click.Choice(["failed", "done"]),
    default="failed",
    show_default=True,
    help="Which items go back (done items' answers are kept aside: see --undo).",
)
@click.option("--error-class", help="Only items that failed with this error class.")
@click.option(
    "--flag",
    "flag_names",
    multiple=True,
    metavar="FLAG",
    help="Only done items whose output has this quality flag (truncated, empty, "
    "unclosed_think, reasoning_only, tool_mismatch); implies --state done. Repeatable.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    help="Give the requeued items this max_tokens (e.g. more room for truncated answers).",
)
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Requeue every done item (with --state done and no other filter).",
)
@click.option("--dry-run", is_flag=True, help="Print what would move, per dataset and state.")
@click.option(
    "--undo",
    is_flag=True,
    help="Take back the latest requeue: its items not claimed since get their state and "
    "answers back.",
)
@db_option
def requeue(
    datasets: tuple[str, ...],
    state: str,
    error_class: str | None,
    flag_names: tuple[str, ...],
    max_tokens: int | None,
    everything: bool,
    dry_run: bool,
    undo: bool,
    db: str | None,
) -> None:
    """Send items back to pending with their attempts reset.

    Done items need a filter (--dataset, --flag, --error-class) or --all; their answers
    are kept aside, and `requeue --undo` puts them back until the items run again.
    """
    from orchestrator.quality import parse_flags
    from orchestrator.store import check_datasets, open_database
    from orchestrator.store import requeue as requeues

    if undo:
        _requeue_undo(db, dry_run=dry_run)
        return
    flags = 0
    for names in flag_names:
        flags |= run_sync(lambda names=names: parse_flags(names))
    if flags:
        state = "done"
    if state == "done" and not (datasets or flags or error_class or everything):
        raise click.UsageError(
            "requeue --state done sends answers back to be generated again: name which "
            "(--dataset, --flag, --error-class), or say --all; --dry-run shows what would move"
        )
    selection = requeues.Selection(
        state=state, dataset_names=datasets, error_class=error_class, flags=flags
    )

    async def go() -> int | dict[tuple[str, str], int]:
        database = await open_database(db, mode="read" if dry_run else "write")
        try:
            await check_datasets(database, datasets)
            if dry_run:
                return await requeues.preview(database, selection)
            return await requeues.requeue(database, selection, max_tokens=max_tokens)
        finally:
            await database.close()

    result = run_async(go())
    if isinstance(result, dict):
        total = sum(result.values())
        click.echo(f"would requeue {total:,} {state} items (dry run, nothing changed)")
        for (name, item_state), n in result.items():
            click.echo(f"  {name}  {item_state} {n:,}")
        return
    click.echo(f"requeued {result:,} {state} items")
    if result and state == "done":
        click.echo("  their answers are kept aside: `orchestrator requeue --undo` puts them back")


def _requeue_undo(db: str | None, *, dry_run: bool) -> None:
    """``requeue --undo``: the latest requeue, taken back (--dry-run: only say what)."""
    from orchestrator.store import open_database
    from orchestrator.store import requeue as requeues

    async def go() -> Any:
        database = await open_database(db, mode="read" if dry_run else "write")
        try:
            if dry_run:
                return await requeues.undo_preview(database)
            return await requeues.undo(database)
        finally:
            await database.close()

    report = run_async(go())
    if report.requeue_id is None:
        click.echo("nothing to undo: no requeue since the last undo")
        return
    verb = "would put back" if dry_run else "put back"
    click.echo(
        f"{verb} {report.restored:,} items of requeue #{report.requeue_id} "
        f"({report.kept:,} claimed since are left as they are)"
    )


def _set_paused(dataset: str, paused: bool, db: str | None) -> None:
    from orchestrator.store import open_database, set_paused

    async def go() -> bool:
        database = await open_database(db, mode="write")
        try:
            return await set_paused(database, dataset, paused)
        finally:
            await database.close()

    if not run_async(go()):
        click.echo(f"error: no such dataset: {dataset}", err=True)
        sys.exit(ConfigError.exit_code)
    click.echo(f"dataset {dataset!r} {'paused' if paused else 'resumed'}")


@main.command()
@click.argument("dataset")
@db_option
def pause(dataset: str, db: str | None) -> None:
    """Stop claiming items of DATASET (in-flight ones finish)."""
    _set_paused(dataset, True, db)


@main.command()
@click.argument("dataset")
@db_option
def resume(dataset: str, db: str | None) -> None:
    """Claim items of DATASET again."""
    _set_paused(dataset, False, db)


# ---------------------------------------------------------------------------- export


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(EXPORT_FORMATS),
    default="messages",
    show_default=True,
    help="Line format: OpenAI messages, ShareGPT (SpecForge / EAGLE-3 trainers) or the "
    "OpenAI Batch API output (failed items in OUT.errors.jsonl).",
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
    "--split", is_flag=True, help="OUT is a directory: one OUT/<dataset>.jsonl per dataset."
)
@click.option(
    "--exclude-flag",
    "exclude_flags",
    multiple=True,
    metavar="FLAG[,FLAG]",
    help="Leave out answers with this quality flag: truncated, empty, unclosed_think, "
    "reasoning_only, tool_mismatch. Repeat or comma-separate.",
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
@db_option
def export(
    out: Path,
    datasets: tuple[str, ...],
    fmt: str,
    reasoning: str,
    split: bool,
    exclude_flags: tuple[str, ...],
    include_failed: Path | None,
    provenance: bool,
    db: str | None,
) -> None:
    """Write done items to OUT as JSONL, by dataset then input order.

    The default line: {"id", "dataset", "messages": [...input, assistant answer],
    "finish_reason", "usage"}; the README shows every format. Each file is written under
    a temporary name and renamed once all are complete: never half a file.
    """
    import sqlite3

    from orchestrator.formats.export import (
        ExportOptions,
        ExportReport,
        export_database,
        export_sqlite,
    )
    from orchestrator.quality import flag_names, parse_flags
    from orchestrator.store.reader import open_reader, sqlite_path

    def options() -> ExportOptions:
        mask = 0
        for spec in exclude_flags:
            mask |= parse_flags(spec)
        return ExportOptions(
            format=fmt,
            reasoning=reasoning,
            exclude_flags=mask,
            provenance=provenance,
            split=split,
            include_failed=include_failed,
        )

    chosen = run_sync(options)
    progress = _tty_progress(f"writing {out}:")

    async def go() -> ExportReport:
        from orchestrator.store import open_database

        database = await open_database(db, mode="read")
        try:
            return await export_database(
                database,
                out,
                dataset_names=datasets,
                progress=progress,
                options=chosen,
                warn=False,
            )
        finally:
            await database.close()

    # An SQLite file at the current schema is read through plain sqlite3 in this thread;
    # anything else is opened (created, upgraded) by the store first, and so is a file
    # the quick read fails on, so that the error is reported the store's way.
    report: ExportReport | None = None
    path = sqlite_path(db)
    reader = open_reader(path) if path else None
    try:
        if reader is not None:
            with reader, contextlib.suppress(sqlite3.Error):
                report = run_sync(
                    functools.partial(
                        export_sqlite,
                        reader,
                        out,
                        dataset_names=datasets,
                        progress=progress,
                        options=chosen,
                        warn=False,
                    )
                )
        if report is None:
            _configure_logs()
            report = run_async(go())
    finally:
        _end_progress(progress)
    # `export -`: the lines are standard output, so the summary goes to stderr.
    piped = str(out) == "-"
    where = f"{len(report.files):,} files in {out}" if split else str(out)
    where = "standard output" if piped else where
    click.echo(f"exported {report.lines:,} items to {where}", err=piped)
    if chosen.exclude_flags:
        names = ", ".join(flag_names(chosen.exclude_flags))
        click.echo(f"left out {report.excluded:,} answers flagged {names}", err=piped)
    if report.failed_files:
        files = report.failed_files
        into = str(files[0]) if len(files) == 1 else f"{len(files):,} files in {out}"
        click.echo(f"wrote {report.failed:,} failed items to {into}", err=piped)
    if report.mixed:
        _warn_mixed(report, fmt)


def _warn_mixed(report: Any, fmt: str) -> None:
    """The export's warning event, and in a terminal's text logs a line of its own."""
    from orchestrator import logs
    from orchestrator.formats.export import MIXED_TOKEN_ROWS, warn_mixed

    _configure_logs()
    warn_mixed(report, fmt)
    if not logs.json_lines():  # else the export_mixed_token_rows event says it, as JSON
        for path, tokens, others in report.mixed:
            click.echo(
                f"warning: {path}: {tokens:,} pre-tokenised rows among {others:,} other "
                f"lines; {MIXED_TOKEN_ROWS}",
                err=True,
            )


# ---------------------------------------------------------------------------- sim-server


@main.command("sim-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=30000,
    show_default=True,
    help="0 picks a free port; the listening line says which.",
)
@click.option(
    "--model",
    default=None,
    help="Serve only this model name (others get 404); by default it answers to any name.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=0),
    default=0,
    help="Context length: a request whose prompt and max_tokens exceed it gets a 400.",
)
@click.option(
    "--latency",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds per request.",
)
@click.option(
    "--per-token",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds per generated token.",
)
@click.option("--mean-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--error-rate",
    "faults",
    multiple=True,
    metavar="KIND=RATE",
    help="Inject faults: 500, 503, 429, 400, reset, hang, malformed (e.g. 500=0.05).",
)
@click.option(
    "--outage",
    "outages",
    multiple=True,
    metavar="START:DURATION",
    help="Answer 503 everywhere from START for DURATION seconds.",
)
@click.option("--retry-after", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option(
    "--reasoning",
    type=click.Choice(["none", "field", "think", "think-end"]),
    default="none",
    show_default=True,
    help="Answer with thinking: in a separate field (a server with a reasoning parser), "
    "in the content between <think> tags (one without), or ending with </think> alone.",
)
@click.option(
    "--reasoning-field",
    type=click.Choice(["reasoning_content", "reasoning"]),
    default="reasoning_content",
    show_default=True,
    help="Field of --reasoning field: SGLang and older vLLM, or newer vLLM.",
)
@click.option(
    "--tool-call-rate",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Fraction of requests offering tools (tool_choice auto) answered with a tool call.",
)
@click.option(
    "--kv-tokens",
    type=click.IntRange(min=0),
    default=0,
    help="Batch continuously, as SGLang does, with a KV cache of this many tokens.",
)
@click.option(
    "--max-running",
    type=click.IntRange(min=0),
    default=0,
    help="Batch continuously, at most this many requests decoded together.",
)
@click.option(
    "--step-time",
    type=click.FloatRange(min=0),
    default=0.01,
    show_default=True,
    help="Batching: seconds of one decode step ...",
)
@click.option(
    "--step-per-request",
    type=click.FloatRange(min=0),
    default=0.0002,
    show_default=True,
    help="... plus this much per request in the batch.",
)
@click.option(
    "--prefill-per-token",
    type=click.FloatRange(min=0),
    default=0.00002,
    show_default=True,
    help="Batching: seconds per prompt token prefilled.",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Batching: multiplies every simulated duration (0.1 runs ten times faster).",
)
def sim_server(
    host: str,
    port: int,
    model: str | None,
    max_model_len: int,
    latency: float,
    per_token: float,
    mean_tokens: int,
    seed: int,
    faults: tuple[str, ...],
    outages: tuple[str, ...],
    retry_after: float,
    reasoning: str,
    reasoning_field: str,
    tool_call_rate: float,
    kv_tokens: int,
    max_running: int,
    step_time: float,
    step_per_request: float,
    prefill_per_token: float,
    time_scale: float,
) -> None:
    """A simulated OpenAI-compatible inference server for tests, rehearsals, benchmarks."""
    from orchestrator.sim import SimConfig, parse_fault, parse_outage, run_forever

    try:
        config = SimConfig(
            model=model,
            latency=latency,
            per_token=per_token,
            mean_tokens=mean_tokens,
            seed=seed,
            faults=dict(parse_fault(f) for f in faults),
            outages=[parse_outage(o) for o in outages],
            retry_after=retry_after,
            reasoning=reasoning,
            reasoning_field=reasoning_field,
            tool_call_rate=tool_call_rate,
            kv_tokens=kv_tokens,
            max_running=max_running,
            step_time=step_time,
            step_per_request=step_per_request,
            prefill_per_token=prefill_per_token,
            time_scale=time_scale,
            max_model_len=max_model_len,
            # From the environment, never the command line, where ps would show it.
            api_key=os.environ.get("SIM_API_KEY") or None,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    run_forever(config, host, port)


# ---------------------------------------------------------------------------- demo


@main.command()
@click.option(
    "--dir",
    "workdir",
    type=click.Path(path_type=Path),
    default=Path("orchestrator-demo"),
    show_default=True,
    help="Where the database, sample and export go.",
)
@click.option("--items", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True)
@click.pass_context
def demo(ctx: click.Context, workdir: Path, items: int, concurrency: int) -> None:
    """Simulate a whole run: server, enqueue, run with live progress, export.

    Interrupt it with Ctrl-C and start it again: it resumes where it stopped.
    """
    from orchestrator.demo import run_demo

    parent = ctx.parent
    if parent is not None and parent.get_parameter_source("log_level") in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        # The progress line is the show here; only warnings interrupt it.
        from orchestrator import logs

        logs.configure("warning", json=parent.params.get("log_json"))

    run_async(run_demo(workdir, items=items, concurrency=concurrency))


# ---------------------------------------------------------------------------- deploy


@main.group()
def deploy() -> None:
    """Files for running workers as services."""


@deploy.command("systemd")
@click.option("--user", default="orchestrator", show_default=True, help="User and group to run as.")
@click.option(
    "--db",
    default="/var/lib/orchestrator/orchestrator.db",
    show_default=True,
    metavar="PATH|URL",
    help="Absolute SQLite path; its directory is the only place the service may write.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    metavar="URL",
    callback=_split_servers,
    help="Server base URL; repeat for several.",
)
@click.option(
    "--template", is_flag=True, help="orchestrator-worker@.service: one instance per env file."
)
@click.option(
    "--executable",
    metavar="PATH",
    help="The orchestrator script to start (default: this installation's).",
)
def deploy_systemd(
    user: str, db: str, servers: tuple[str, ...], template: bool, executable: str | None
) -> None:
    """Print a hardened systemd unit for this installation.

    orchestrator deploy systemd > /etc/systemd/system/orchestrator-worker.service
    """
    from orchestrator.deploy import UnitSpec, installed_executable, render_unit

    spec = UnitSpec(
        executable=executable or installed_executable(),
        user=user,
        db=db,
        servers=servers,
        template=template,
    )
    try:
        click.echo(render_unit(spec), nl=False)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


# ---------------------------------------------------------------------------- doctor


@main.command()
@servers_option
@click.option("--model", help="Model the servers must serve (default: the datasets' models).")
@click.option(
    "--bytes-per-item",
    type=click.IntRange(min=0),
    help="Bytes each remaining answer adds to the database (default: measured).",
)
@click.option("--clock-tolerance", type=click.FloatRange(min=0), default=60.0, show_default=True)
@api_key_file_option
@basic_auth_file_option
@db_option
def doctor(
    servers: tuple[str, ...],
    model: str | None,
    bytes_per_item: int | None,
    clock_tolerance: float,
    api_key_file: Path | None,
    basic_auth_file: Path | None,
    db: str | None,
) -> None:
    """Check a run can go the distance: database, servers, model, disk, clock.

    One PASS/FAIL line per check; exit code 1 when any fails. Reads only.
    """
    from orchestrator.doctor import DoctorConfig, passed, run_checks
    from orchestrator.running import without_credentials
    from orchestrator.servers import ServerSpec

    api_key = _read_api_key(api_key_file)
    specs, basic_auth = run_sync(
        lambda: without_credentials([ServerSpec(s) for s in servers], api_key, basic_auth_file)
    )
    config = DoctorConfig(
        db=db,
        servers=tuple(spec.url for spec in specs),
        model=model,
        api_key=api_key,
        basic_auth=basic_auth,
        clock_tolerance=clock_tolerance,
        bytes_per_item=bytes_per_item,
    )
    checks = run_async(run_checks(config))
    for check in checks:
        click.echo(check.line)
    if not passed(checks):
        sys.exit(1)
