"""The ``orchestrator`` command: parse options, call the library, print the result.

No SQL and no HTTP here. Errors from ``orchestrator.errors`` become a one-line message
on stderr and the error's exit code (2 bad input or options, 3 storage).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
import orjson

from orchestrator import __version__, logs
from orchestrator.errors import ConfigError, OrchestratorError

T = TypeVar("T")

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

api_key_file_option = click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the server's API key (else env ORCHESTRATOR_API_KEY).",
)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn our errors into a message and an exit code."""
    try:
        return asyncio.run(coro)
    except OrchestratorError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


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
    type=click.Choice(logs.LEVELS),
    envvar="ORCHESTRATOR_LOG_LEVEL",
    default="info",
    show_default=True,
)
@click.option(
    "--log-json/--no-log-json",
    default=None,
    help="JSON log lines (default: when stderr is not a terminal).",
)
def main(log_level: str, log_json: bool | None) -> None:
    """Durable, resumable batch generation against OpenAI-compatible servers."""
    logs.configure(log_level, json=log_json)


# ---------------------------------------------------------------------------- db


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@db_option
def db_upgrade(db: str | None) -> None:
    """Create or upgrade the schema to the version this orchestrator knows."""
    from orchestrator.store import create_database, upgrade

    async def go() -> tuple[str | None, str, str]:
        database = create_database(db)
        try:
            before, after = await upgrade(database)
            return before, after, database.where
        finally:
            await database.close()

    before, after, where = run_async(go())
    if before == after:
        click.echo(f"{where}: schema already at {after}")
    else:
        click.echo(f"{where}: schema upgraded from {before or 'empty'} to {after}")


# ---------------------------------------------------------------------------- enqueue


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


@main.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--dataset", "-d", required=True, help="Dataset name (created on first use).")
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
    type=click.IntRange(min=1),
    help="Most requests of this dataset in flight at once, across all workers.",
)
@click.option("--priority", type=int, help="Higher priority datasets are worked on first.")
@click.option(
    "--skip-invalid", is_flag=True, help="Skip bad lines (listed and counted) instead of failing."
)
@db_option
def enqueue(
    file: Path,
    dataset: str,
    model: str | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    params: tuple[str, ...],
    concurrency: int | None,
    priority: int | None,
    skip_invalid: bool,
    db: str | None,
) -> None:
    """Add the prompts of a JSONL FILE to a dataset (all of them, or none on a bad line).

    Lines may be OpenAI chat ({"messages": [...]}), ShareGPT ({"conversations": [...]}),
    {"prompt": "..."} or OpenAI batch request lines ({"custom_id", "body": {...}}). The
    item key is the line's "id" or "custom_id", else its line number. Enqueuing the same
    file again adds nothing.
    """
    from orchestrator.errors import InputError
    from orchestrator.formats import iter_records
    from orchestrator.store import DatasetSpec, open_database
    from orchestrator.store import enqueue as do_enqueue

    body = _parse_params(params)
    for name, value in (
        ("model", model),
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
    ):
        if value is not None:
            body[name] = value
    spec = DatasetSpec(name=dataset, params=body, concurrency=concurrency, priority=priority)
    invalid: list[InputError] = []
    on_invalid = invalid.append if skip_invalid else None
    progress = _tty_progress(f"reading {file}:")

    async def go() -> Any:
        database = await open_database(db)
        try:
            return await do_enqueue(
                database,
                spec,
                iter_records(file, on_invalid=on_invalid),
                path=str(file),
                on_invalid=on_invalid,
                progress=progress,
            )
        finally:
            await database.close()

    try:
        report = run_async(go())
    finally:
        _end_progress(progress)
    # Lines the reader rejected and lines the store rejected (duplicates) both land here.
    errors = {(e.line, str(e)): e for e in [*invalid, *report.invalid]}
    if errors:
        shown = sorted(errors.values(), key=lambda e: e.line or 0)
        for err in shown[:20]:
            click.echo(f"skipped {err}", err=True)
        if len(shown) > 20:
            click.echo(f"... and {len(shown) - 20} more", err=True)
    verb = "created" if report.created else "into existing"
    if report.added == 0 and report.already_present:
        click.echo(
            f"nothing new: all {report.already_present:,} items of {file} are already in "
            f"dataset {dataset!r}"
        )
    else:
        click.echo(
            f"enqueued {report.added:,} items {verb} dataset {dataset!r}"
            f" ({report.already_present:,} already present"
            + (f", {len(errors):,} invalid lines skipped" if errors else "")
            + ")"
        )


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


@main.command()
@servers_option
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Most requests in flight in this worker.",
)
@click.option("--dataset", "datasets", multiple=True, help="Only work on these datasets.")
@click.option("--exit-when-done", is_flag=True, help="Exit once no item is pending or running.")
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=3600.0,
    show_default=True,
    help="Seconds a non-streaming request may take (long reasoning answers need long).",
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
    help="Stream answers (then --stream-idle-timeout bounds silence instead).",
)
@click.option(
    "--stream-idle-timeout", type=click.FloatRange(min=1), default=120.0, show_default=True
)
@api_key_file_option
@db_option
def run(
    servers: tuple[str, ...],
    concurrency: int,
    datasets: tuple[str, ...],
    exit_when_done: bool,
    request_timeout: float,
    lease_seconds: float,
    max_attempts: int,
    retry_backoff: float,
    grace: float,
    stream: bool,
    stream_idle_timeout: float,
    api_key_file: Path | None,
    db: str | None,
) -> None:
    """Work on the queue: claim items, call the servers, commit each answer once.

    SIGTERM or SIGINT stops claiming and lets in-flight requests finish within --grace;
    a second signal stops at once. Unfinished items go back to pending.
    """
    from orchestrator.client import ClientConfig, InferenceClient
    from orchestrator.store import check_datasets, open_database
    from orchestrator.systemd import SystemdNotifier
    from orchestrator.worker import Worker, WorkerConfig

    server_list = servers
    config = (
        WorkerConfig(
            servers=server_list,
            concurrency=concurrency,
            datasets=datasets,
            exit_when_done=exit_when_done,
            lease_seconds=lease_seconds,
            max_attempts=max_attempts,
            grace_seconds=grace,
        )
        if server_list
        else None
    )
    if config is None:
        raise click.UsageError("give at least one --server URL (or ORCHESTRATOR_SERVERS)")
    client_config = ClientConfig(
        request_timeout=request_timeout,
        stream=stream,
        stream_idle_timeout=stream_idle_timeout,
        api_key=_read_api_key(api_key_file),
    )

    async def go() -> Any:
        database = await open_database(db)
        try:
            await check_datasets(database, datasets)
            # Under systemd (Type=notify): READY=1, STOPPING=1, status and watchdog pings.
            async with InferenceClient(client_config) as client, SystemdNotifier() as notifier:
                worker = Worker(database, client, config, notifier=notifier)
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, worker.request_stop)
                return await worker.run()
        finally:
            await database.close()

    stats = run_async(go())
    click.echo(
        f"worker stopped: {stats.completed:,} done, {stats.failed:,} failed, "
        f"{stats.retried:,} retried, {stats.released:,} released",
        err=True,
    )


# ---------------------------------------------------------------------------- status


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable (docs/STATUS.md).")
@click.option(
    "--window",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds of recent history for the recent rates.",
)
@db_option
def status(as_json: bool, window: float, db: str | None) -> None:
    """Progress, rates, errors and ETA per dataset and in total."""
    from orchestrator.monitor.text import render_status
    from orchestrator.store import open_database, snapshot

    async def go() -> dict[str, Any]:
        database = await open_database(db)
        try:
            return await snapshot(database, window=window)
        finally:
            await database.close()

    snap = run_async(go())
    if as_json:
        click.echo(orjson.dumps(snap, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_status(snap))


# ---------------------------------------------------------------------------- operator


@main.command()
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option(
    "--state",
    type=click.Choice(["failed", "done"]),
    default="failed",
    show_default=True,
    help="Which items go back (done items lose their outputs).",
)
@click.option("--error-class", help="Only items that failed with this error class.")
@db_option
def requeue(datasets: tuple[str, ...], state: str, error_class: str | None, db: str | None) -> None:
    """Send items back to pending with their attempts reset."""
    from orchestrator.store import Queue, check_datasets, open_database

    async def go() -> int:
        database = await open_database(db)
        try:
            await check_datasets(database, datasets)
            return await Queue(database).requeue(
                dataset_names=datasets, state=state, error_class=error_class
            )
        finally:
            await database.close()

    n = run_async(go())
    click.echo(f"requeued {n:,} {state} items")


def _set_paused(dataset: str, paused: bool, db: str | None) -> None:
    from orchestrator.store import open_database, set_paused

    async def go() -> bool:
        database = await open_database(db)
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
@db_option
def export(out: Path, datasets: tuple[str, ...], db: str | None) -> None:
    """Write done items to OUT as JSONL, by dataset then input order.

    Each line: {"id", "dataset", "messages": [...input, assistant answer], "finish_reason",
    "usage"}. Written to a temporary file and renamed: never half a file.
    """
    from orchestrator.formats.export import export_jsonl
    from orchestrator.store import open_database

    progress = _tty_progress(f"writing {out}:")

    async def go() -> int:
        database = await open_database(db)
        try:
            return await export_jsonl(database, out, dataset_names=datasets, progress=progress)
        finally:
            await database.close()

    try:
        n = run_async(go())
    finally:
        _end_progress(progress)
    click.echo(f"exported {n:,} items to {out}")


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
@click.option("--model", default="sim-model", show_default=True)
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
def sim_server(
    host: str,
    port: int,
    model: str,
    latency: float,
    per_token: float,
    mean_tokens: int,
    seed: int,
    faults: tuple[str, ...],
    outages: tuple[str, ...],
    retry_after: float,
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
@db_option
def doctor(
    servers: tuple[str, ...],
    model: str | None,
    bytes_per_item: int | None,
    clock_tolerance: float,
    api_key_file: Path | None,
    db: str | None,
) -> None:
    """Check a run can go the distance: database, servers, model, disk, clock.

    One PASS/FAIL line per check; exit code 1 when any fails. Reads only.
    """
    from orchestrator.doctor import DoctorConfig, passed, run_checks

    config = DoctorConfig(
        db=db,
        servers=servers,
        model=model,
        api_key=_read_api_key(api_key_file),
        clock_tolerance=clock_tolerance,
        bytes_per_item=bytes_per_item,
    )
    checks = run_async(run_checks(config))
    for check in checks:
        click.echo(check.line)
    if not passed(checks):
        sys.exit(1)
