"""``orchestrator db``: the schema, and copying a run between databases."""

from __future__ import annotations

import click

from orchestrator.cli.common import Commands, run_async, tty_progress
from orchestrator.cli.options import db_option


@click.group(cls=Commands)
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
    from orchestrator.store.migrate import upgrade_database

    before, after, where = run_async(upgrade_database(db, adopt=into_existing))
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

    shown = _TableProgress(tty_progress("copying") is not None)
    try:
        report = run_async(copy_database(source, target, progress=shown))
    finally:
        shown.end()
    total = sum(report.rows.values())
    tables = ", ".join(f"{name} {n:,}" for name, n in report.rows.items())
    click.echo(f"copied {total:,} rows from {report.source} to {report.target} ({tables})")
    if report.requeued:
        click.echo(f"{report.requeued:,} items that were running are pending again")


class _TableProgress:
    """``copying TABLE: N rows`` redrawn on a terminal's stderr, one line per table."""

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self.table = ""

    def __call__(self, table: str, n: int) -> None:
        if self.shown:
            if self.table and self.table != table:
                click.echo("", err=True)
            self.table = table
            click.echo(f"\rcopying {table}: {n:,} rows", nl=False, err=True)

    def end(self) -> None:
        if self.shown:
            click.echo("", err=True)
