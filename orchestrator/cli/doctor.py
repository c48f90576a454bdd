"""``orchestrator doctor``: whether a run can go the distance, before it starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import read_api_key, read_basic_auth, run_async, run_sync
from orchestrator.cli.launching import launch_commands_options, supervisor, take_launch_options
from orchestrator.cli.options import (
    api_key_file_option,
    basic_auth_file_option,
    db_option,
    servers_option,
)


@click.command()
@servers_option
@click.option("--model", help="Model the servers must serve (default: the datasets' models).")
@click.option(
    "--bytes-per-item",
    type=click.IntRange(min=0),
    help="Bytes each remaining answer adds to the database (default: measured).",
)
@click.option("--clock-tolerance", type=click.FloatRange(min=0), default=60.0, show_default=True)
@click.option(
    "--batch-api",
    is_flag=True,
    help="Check that each server offers the Batch API, as run --batch-api needs.",
)
@launch_commands_options
@api_key_file_option
@basic_auth_file_option
@db_option
def doctor(
    servers: tuple[str, ...],
    api_key_file: Path | None,
    basic_auth_file: Path | None,
    db: str | None,
    **expected: Any,
) -> None:
    """Check a run can go the distance: database, servers, model, disk, clock.

    One PASS/FAIL line per check; exit code 1 when any fails. Reads only. Servers
    given with --launch are started for the checks, then stopped.
    """
    from orchestrator.api.running import without_credentials
    from orchestrator.inference.servers_file import ServerSpec
    from orchestrator.ops.doctor import DoctorConfig, passed, run_checks, run_checks_launched

    launched = supervisor(take_launch_options(expected), db)
    api_key = read_api_key(api_key_file)
    shared = read_basic_auth(basic_auth_file)
    specs, basic_auth = run_sync(
        lambda: without_credentials([ServerSpec(s) for s in servers], api_key, shared)
    )
    urls = tuple(spec.url for spec in specs)
    config = DoctorConfig(db=db, servers=urls, api_key=api_key, basic_auth=basic_auth, **expected)
    checks = run_async(
        run_checks(config) if launched is None else run_checks_launched(config, launched)
    )
    for check in checks:
        click.echo(check.line)
    if not passed(checks):
        sys.exit(1)
