"""``orchestrator dataset``: one dataset's settings changed, or the dataset deleted (and
brought back), without its source."""

from __future__ import annotations

from typing import Any

import click

from orchestrator.cli.common import Checked, Commands, db_option, on_database, request_options
from orchestrator.cli.enqueue import changed_line, settings_spec
from orchestrator.settings.checks import DATASET
from orchestrator.settings.dataset_options import ON_INVALID, ON_OVERFLOW, ON_TRUNCATED


@click.group(cls=Commands)
def dataset() -> None:
    """Change a dataset's settings, or delete it (and undo that)."""


@dataset.command("set")
@click.argument("name")
@request_options("Any other request body field, as `enqueue --param`; repeatable.")
@click.option(
    "--unset",
    multiple=True,
    metavar="KEY",
    help="Remove this request parameter (max_tokens, temperature, ...); repeatable.",
)
@click.option(
    "--concurrency",
    type=Checked(DATASET["concurrency"]),
    help="Most requests of this dataset in flight at once, across all workers.",
)
@click.option(
    "--priority", type=Checked(DATASET["priority"]), help="Higher priority datasets go first."
)
@click.option("--on-truncated", type=click.Choice(ON_TRUNCATED), help="As `enqueue`.")
@click.option("--on-invalid", type=click.Choice(ON_INVALID), help="As `enqueue`.")
@click.option("--on-overflow", type=click.Choice(ON_OVERFLOW), help="As `enqueue`.")
@db_option
@click.pass_context
def set_settings(ctx: click.Context, name: str, db: str | None, **given: Any) -> None:
    """Change the settings given of dataset NAME, and only those: every other parameter,
    its source and template stay. They apply to its pending items; done items keep their
    answers (requeue them to generate them again).

    orchestrator dataset set NAME --max-tokens 4096
    """
    unset = given.pop("unset")
    if not unset and all(value in (None, ()) for value in given.values()):
        raise click.UsageError("name a setting to change (e.g. --max-tokens 4096)", ctx)
    spec = settings_spec(name, given)

    async def change(database: Any) -> Any:
        from orchestrator.store.datasets import change_settings

        return await change_settings(database, spec, unset=unset)

    report = on_database(db, change, mode="write")
    click.echo(changed_line(report.dataset, report.changed, report.pending))


@dataset.command("delete")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="Say what would go (items by state, answers).")
@click.option(
    "--with-outputs",
    is_flag=True,
    help="Delete it although it holds answers (they are kept aside with it until purged).",
)
@click.option(
    "--undo",
    is_flag=True,
    help="Bring back the latest deletion of NAME, every row as it was (until purged).",
)
@db_option
@click.pass_context
def delete(
    ctx: click.Context, name: str, dry_run: bool, with_outputs: bool, undo: bool, db: str | None
) -> None:
    """Delete dataset NAME: its items, answers and history leave the queue, status,
    plans and exports, and are kept aside until `orchestrator dataset purge NAME`;
    `--undo` brings them back. Refused while items of it are running (pause it and let
    them finish), and when it holds answers unless --with-outputs.
    """
    from orchestrator.store import deletion

    if undo and with_outputs:
        raise click.UsageError("--undo takes only NAME and --dry-run, not --with-outputs", ctx)
    mode = "read" if dry_run else "write"
    if undo:
        report = on_database(db, lambda d: deletion.undo_delete(d, name, dry_run=dry_run), mode)
        verb = "would bring back" if dry_run else "brought back"
        click.echo(f"{verb} dataset {name!r}: {_took(report)}")
        return
    report = on_database(
        db,
        lambda d: deletion.delete_dataset(d, name, with_outputs=with_outputs, dry_run=dry_run),
        mode,
    )
    if dry_run:
        click.echo(f"would delete dataset {name!r} (dry run, nothing changed): {_took(report)}")
        refused = deletion.refusal(report, with_outputs)
        if refused is not None:
            click.echo(f"  refused as asked: {refused}")
        return
    click.echo(
        f"deleted dataset {name!r} (deletion #{report.deletion_id}): {_took(report)}; kept "
        f"aside: `orchestrator dataset delete {name} --undo` brings it back, "
        f"`orchestrator dataset purge {name}` drops it for good"
    )


def _took(report: Any) -> str:
    """``1,200 items (1,000 done, 200 pending), 1,000 answers``."""
    states = ", ".join(f"{n:,} {state}" for state, n in sorted(report.states.items()))
    text = f"{report.items:,} items" + (f" ({states})" if states else "")
    return text + f", {report.answers:,} answers" if report.answers else text


@dataset.command("purge")
@click.argument("name")
@db_option
def purge(name: str, db: str | None) -> None:
    """Drop for good what deleting dataset NAME kept aside (no undo after this)."""
    from orchestrator.store import deletion

    purged = on_database(db, lambda d: deletion.purge_deleted(d, name), mode="write")
    if not purged:
        click.echo(f"nothing kept of a deleted dataset {name!r}: nothing purged")
        return
    click.echo(f"purged {purged} deletion(s) of dataset {name!r}: they cannot be undone now")
