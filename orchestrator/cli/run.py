"""``orchestrator run``: a worker on the queue until it is stopped or the work is done."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from orchestrator._util import stopsignals
from orchestrator.cli.common import Checked, on_database, read_api_key, read_basic_auth, run_sync
from orchestrator.cli.launching import launch_options, take_launch_options
from orchestrator.cli.launching import supervisor as launched_servers
from orchestrator.cli.options import (
    api_key_file_option,
    basic_auth_file_option,
    db_option,
    servers_option,
)
from orchestrator.errors import StorageError
from orchestrator.settings.run import _KEEP


def _servers(
    servers: tuple[str, ...],
    servers_file: Path | None,
    key_file: Path | None,
    auth_file: Path | None,
    launch: dict[str, Any],
    db: str | None,
) -> tuple[list[Any], dict[str, Any], str | None, Any]:
    """The servers of --server (checked as parsed), --servers-file and those the run
    launches, their Basic credentials, the API key, and the launched servers' supervisor."""
    from orchestrator.api.running import without_credentials
    from orchestrator.inference.servers_file import merge_servers, read_servers_file

    listed, launches = (
        run_sync(lambda: read_servers_file(servers_file)) if servers_file else ([], [])
    )
    supervisor = launched_servers(launch, db, launches)
    api_key = read_api_key(key_file)
    shared = read_basic_auth(auth_file)
    merged = merge_servers(servers, listed)
    if supervisor is not None:
        merged += supervisor.server_specs()
    specs, basic_auth = run_sync(lambda: without_credentials(merged, api_key, shared))
    if not specs:
        raise click.UsageError(
            "give at least one --server URL (or --servers-file, or ORCHESTRATOR_SERVERS), "
            "or a server to start (--launch, --engine)"
        )
    return specs, basic_auth, api_key, supervisor


def settings_options(command: Any) -> Any:
    """The run's settings as options, made from their one list
    (``orchestrator.settings.run``): names, defaults, rules and help as ``Queue.run`` has
    them, but for ``--exit-when-done`` (a service runs until it is stopped)."""
    from orchestrator.settings.run import settings

    for spec, setting in reversed(settings()):
        name = setting.option or "--" + spec.name.replace("_", "-")
        default = spec.default if setting.cli_default is _KEEP else setting.cli_default
        shape: dict[str, Any] = {"help": setting.help}
        if setting.flag() and setting.negatable:
            name = f"{name}/--no-{name[2:]}"
            shape |= {"default": default, "show_default": True}
        elif setting.flag():
            shape |= {"is_flag": True, "default": default}
        elif spec.name == "datasets":
            shape |= {"multiple": True}
        else:
            shape |= {"type": Checked(setting.rule), "metavar": setting.metavar}
            if default is not None:
                shape |= {"default": default, "show_default": True}
        command = click.option(name, spec.name, **shape)(command)
    return command


@click.command()
@servers_option
@click.option(
    "--servers-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="More servers, one URL a line, each optionally with its own concurrency=N|auto, "
    "rpm=N and tpm=N ('#' starts a comment, at a line's start or after white space).",
)
@settings_options
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
@launch_options
@api_key_file_option
@basic_auth_file_option
@db_option
def run(
    servers: tuple[str, ...],
    servers_file: Path | None,
    metrics_port: int | None,
    metrics_host: str,
    api_key_file: Path | None,
    basic_auth_file: Path | None,
    db: str | None,
    **settings: Any,
) -> None:
    """Work on the queue: claim items, call the servers, commit each answer once.

    SIGTERM or SIGINT stops claiming and lets in-flight requests finish within --grace;
    a second signal stops at once. Unfinished items go back to pending. Servers it
    launched (--launch, --engine) are ready before the first claim and stopped after
    the last answer; if none of them will stay up it exits 8.
    """
    from orchestrator.api.running import configs, run_worker
    from orchestrator.settings.run import RunSettings

    launch = take_launch_options(settings)
    files = (servers_file, api_key_file, basic_auth_file)
    specs, basic_auth, api_key, supervisor = _servers(servers, *files, launch, db)
    config, client_config = run_sync(
        lambda: configs(specs, basic_auth, api_key, RunSettings(**settings))
    )
    extra = {"metrics_port": metrics_port, "metrics_host": metrics_host, "launch": supervisor}
    try:
        outcome = on_database(
            db, lambda d: run_worker(d, config, client_config, signals=True, **extra), mode="write"
        )
    finally:
        stopsignals.forget()
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
