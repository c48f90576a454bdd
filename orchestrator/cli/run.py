"""``orchestrator run``: a worker on the queue until it is stopped or the work is done."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from orchestrator._util import stopsignals
from orchestrator.cli.common import (
    Checked,
    api_key_file_option,
    basic_auth_file_option,
    db_option,
    on_database,
    read_api_key,
    read_basic_auth,
    run_sync,
    servers_option,
)
from orchestrator.cli.launching import launch_options, take_launch_options
from orchestrator.cli.launching import supervisor as launched_servers
from orchestrator.errors import StorageError
from orchestrator.settings.checks import RUN

max_response_option = click.option(
    "--max-response-mb",
    type=Checked(RUN["max_response_mb"]),
    default=64.0,
    show_default=True,
    help="Most MiB of one answer's body; a larger one fails the item (response_too_large) "
    "before it fills memory and the database.",
)


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


def _concurrency(_ctx: click.Context, _param: click.Parameter, value: str) -> int | str:
    from orchestrator.inference.servers_file import parse_cap

    try:
        return parse_cap(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@servers_option
@click.option(
    "--servers-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="More servers, one URL a line, each optionally with its own concurrency=N|auto, "
    "rpm=N and tpm=N ('#' starts a comment, at a line's start or after white space).",
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
    "failed, 7 when items of paused datasets are left pending (8: launched servers would "
    "not stay up).",
)
@click.option(
    "--give-up-after",
    type=Checked(RUN["give_up_after"]),
    metavar="SECONDS",
    help="Stop (exit 4) when no server has answered for this long; by default a worker "
    "waits for its servers as long as it takes.",
)
@click.option(
    "--rpm",
    type=Checked(RUN["rpm"]),
    metavar="N",
    help="Most requests a minute sent to each server (a hosted API's limit; per server: "
    "rpm=N in --servers-file). Without it a server's x-ratelimit-* headers set the pace.",
)
@click.option(
    "--tpm",
    type=Checked(RUN["tpm"]),
    metavar="N",
    help="Most tokens a minute sent to each server (prompt estimate plus max_tokens, "
    "corrected by each answer's usage; per server: tpm=N in --servers-file).",
)
@click.option(
    "--rate-limited-warn-after",
    type=Checked(RUN["rate_limited_warn_after"]),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="Warn (log and status) when a server has answered nothing but HTTP 429 this long.",
)
@click.option(
    "--request-timeout",
    type=Checked(RUN["request_timeout"]),
    default=3600.0,
    show_default=True,
    help="Seconds a whole request may take, streamed or not (long reasoning answers need long).",
)
@click.option(
    "--lease-seconds",
    type=Checked(RUN["lease_seconds"]),
    default=120.0,
    show_default=True,
    help="Lease length; renewed every quarter of it while a request is in flight.",
)
@click.option("--max-attempts", type=Checked(RUN["max_attempts"]), default=8, show_default=True)
@click.option(
    "--retry-backoff",
    type=Checked(RUN["retry_backoff"]),
    default=2.0,
    show_default=True,
    help="First retry delay in seconds; doubles per attempt (±25 %), capped at 300.",
)
@click.option(
    "--grace",
    type=Checked(RUN["grace"]),
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
    "--stream-usage",
    is_flag=True,
    help="Ask streams for usage in every chunk (vLLM's and SGLang's continuous_usage_stats): "
    "a request cut by a stop then counts the tokens it had generated (status, wasted).",
)
@click.option(
    "--stream-idle-timeout",
    type=Checked(RUN["stream_idle_timeout"]),
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
@launch_options
@api_key_file_option
@basic_auth_file_option
@max_response_option
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
    from orchestrator.api.running import RunSettings, configs, run_worker

    launch = take_launch_options(settings)
    files = (servers_file, api_key_file, basic_auth_file)
    specs, basic_auth, api_key, supervisor = _servers(servers, *files, launch, db)
    config, client_config = configs(specs, basic_auth, api_key, RunSettings(**settings))
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
