"""``orchestrator requeue``, ``pause`` and ``resume``: the operator's hands on the queue."""

from __future__ import annotations

from typing import Any

import click

from orchestrator.cli.common import db_option, fail, on_database, run_sync
from orchestrator.error_classes import ERROR_CLASSES
from orchestrator.errors import ConfigError


@click.command()
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option(
    "--state",
    type=click.Choice(["failed", "done"]),
    default="failed",
    show_default=True,
    help="Which items go back (done items' answers are kept aside: see --undo).",
)
@click.option(
    "--error-class",
    metavar="CLASS",
    help="Only items that failed with this error class: "
    + ", ".join(ERROR_CLASSES)
    + " (docs/OPERATIONS.md says what each means).",
)
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
    if undo:
        _undo(db, dry_run=dry_run)
        return
    selection = _selection(state, datasets, error_class, flag_names, everything)
    result = on_database(
        db, lambda d: _requeue(d, selection, dry_run, max_tokens), "read" if dry_run else "write"
    )
    _say_requeued(result, selection.state)


async def _requeue(
    database: Any, selection: Any, dry_run: bool, max_tokens: int | None
) -> int | dict[tuple[str, str], int]:
    from orchestrator.store import check_datasets
    from orchestrator.store import requeue as requeues

    await check_datasets(database, selection.dataset_names)
    if dry_run:
        return await requeues.preview(database, selection)
    return await requeues.requeue(database, selection, max_tokens=max_tokens)


def _selection(
    state: str,
    datasets: tuple[str, ...],
    error_class: str | None,
    flag_names: tuple[str, ...],
    everything: bool,
) -> Any:
    """The options through the library's guard; what it refuses is a usage error."""
    from orchestrator.quality import parse_flags
    from orchestrator.store import requeue as requeues

    flags = 0
    for names in flag_names:
        flags |= run_sync(lambda names=names: parse_flags(names))
    try:
        return requeues.checked_selection(
            state,
            dataset_names=datasets,
            error_class=error_class,
            flags=flags,
            everything=everything,
            spelling=requeues.COMMAND,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _say_requeued(result: int | dict[tuple[str, str], int], state: str) -> None:
    if isinstance(result, dict):
        total = sum(result.values())
        click.echo(f"would requeue {total:,} {state} items (dry run, nothing changed)")
        for (name, item_state), n in result.items():
            click.echo(f"  {name}  {item_state} {n:,}")
        return
    click.echo(f"requeued {result:,} {state} items")
    if result and state == "done":
        click.echo("  their answers are kept aside: `orchestrator requeue --undo` puts them back")


def _undo(db: str | None, *, dry_run: bool) -> None:
    """``requeue --undo``: the latest requeue, taken back (--dry-run: only say what)."""
    from orchestrator.store import requeue as requeues

    undo = requeues.undo_preview if dry_run else requeues.undo
    report = on_database(db, undo, mode="read" if dry_run else "write")
    if report.requeue_id is None:
        click.echo("nothing to undo: no requeue since the last undo")
        return
    verb = "would put back" if dry_run else "put back"
    click.echo(
        f"{verb} {report.restored:,} items of requeue #{report.requeue_id} "
        f"({report.kept:,} claimed since are left as they are)"
    )


def _set_paused(dataset: str, paused: bool, db: str | None) -> None:
    from orchestrator.store import set_paused

    if not on_database(db, lambda d: set_paused(d, dataset, paused), mode="write"):
        fail(f"no such dataset: {dataset}", ConfigError.exit_code)
    click.echo(f"dataset {dataset!r} {'paused' if paused else 'resumed'}")


@click.command()
@click.argument("dataset")
@db_option
def pause(dataset: str, db: str | None) -> None:
    """Stop claiming items of DATASET (in-flight ones finish)."""
    _set_paused(dataset, True, db)


@click.command()
@click.argument("dataset")
@db_option
def resume(dataset: str, db: str | None) -> None:
    """Claim items of DATASET again."""
    _set_paused(dataset, False, db)
