"""``orchestrator deploy``: files for running workers as services."""

from __future__ import annotations

import click

from orchestrator.cli.common import run_sync, split_servers


@click.group()
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
    callback=split_servers,
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
    from orchestrator.ops.deploy import UnitSpec, installed_executable, render_unit

    spec = UnitSpec(
        executable=executable or installed_executable(),
        user=user,
        db=db,
        servers=servers,
        template=template,
    )
    click.echo(run_sync(lambda: render_unit(spec)), nl=False)
