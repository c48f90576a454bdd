"""``orchestrator requeue``, ``pause`` and ``resume``: the operator's hands on the queue."""

from __future__ import annotations

from typing import Any

import click

from orchestrator.cli.common import db_option, fail, on_database, run_sync
from orchestrator.errors import ConfigError
from orchestrator.items.error_classes import ERROR_CLASSES
from orchestrator.items.quality import parse_flags


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
    "unclosed_think, reasoning_only, tool_mismatch, nul, invalid_json, schema_mismatch, "
    "max_tokens_reduced); implies --state done. Repeatable.",
)
@click.option(
    "--key", "keys", multiple=True, metavar="KEY", help="Only the items of this key. Repeatable."
)
@click.option(
    "--sample",
    "samples",
    multiple=True,
    type=click.IntRange(min=0),
    help="Only this sample of each prompt (enqueue --samples; 0 is the first). Repeatable.",
)
@click.option(
    "--max-tokens",
    type=int,
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
    help="Take back the latest requeue (with --dataset: the latest that moved items of "
    "those datasets, and only those): its items not claimed since, or failed since, get "
    "their state and answers back.",
)
@db_option
@click.pass_context
def requeue(
    ctx: click.Context,
    datasets: tuple[str, ...],
    state: str,
    error_class: str | None,
    flag_names: tuple[str, ...],
    keys: tuple[str, ...],
    samples: tuple[int, ...],
    max_tokens: int | None,
    everything: bool,
    dry_run: bool,
    undo: bool,
    db: str | None,
) -> None:
    """Send items back to pending with their attempts reset.

    Done items need a filter (--dataset, --flag, --error-class) or --all; their answers
    are kept aside, and `requeue --undo` puts them back, unless the items were answered
    again since.
    """
    if undo:
        _refuse_with_undo(ctx)
        _undo(db, datasets, dry_run=dry_run)
        return
    selection = _selection(
        state, datasets, error_class, flag_names, everything, max_tokens, keys, samples
    )
    result = on_database(
        db, lambda d: _requeue(d, selection, dry_run, max_tokens), "read" if dry_run else "write"
    )
    _say_requeued(result, selection.state)


# What selects the items of a new requeue: an undo takes a recorded one back instead.
_SELECTING = {
    "state": "--state",
    "error_class": "--error-class",
    "flag_names": "--flag",
    "keys": "--key",
    "samples": "--sample",
    "max_tokens": "--max-tokens",
    "everything": "--all",
}


def _refuse_with_undo(ctx: click.Context) -> None:
    """--undo with a selection would ignore it: refuse it instead."""
    given = [
        flag
        for name, flag in _SELECTING.items()
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise click.UsageError(f"--undo takes only --dataset and --dry-run, not {', '.join(given)}")


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
    max_tokens: int | None,
    keys: tuple[str, ...] = (),
    samples: tuple[int, ...] = (),
) -> Any:
    """The options through the library's guard; what it refuses is a usage error."""
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
            max_tokens=max_tokens,
            spelling=requeues.COMMAND,
            keys=keys,
            samples=samples,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _say_requeued(result: int | dict[tuple[str, str], int], state: str) -> None:
    if isinstance(result, dict):
        total = sum(result.values())
        click.echo(f"would requeue {total:,} {state} items (dry run, nothing changed)")
        for (name, item_state), n in result.items():
            click.echo(f"  {name}  {item_state} {n:,}")
        if total and state == "done":
            click.echo(
                f"  their {total:,} answers leave the export until generated again; should "
                "that fail, `orchestrator requeue --undo` brings them back"
            )
        return
    click.echo(f"requeued {result:,} {state} items")
    if result and state == "done":
        click.echo(
            "  their answers are kept aside: `orchestrator requeue --undo` puts them back, "
            "also for items whose new run fails"
        )


def _undo(db: str | None, datasets: tuple[str, ...], *, dry_run: bool) -> None:
    """``requeue --undo``: the latest requeue, taken back (--dry-run: only say what)."""
    from orchestrator.store import check_datasets
    from orchestrator.store import requeue as requeues

    async def go(database: Any) -> Any:
        await check_datasets(database, datasets)
        if dry_run:
            return await requeues.undo_preview(database, dataset_names=datasets)
        return await requeues.undo(database, dataset_names=datasets)

    report = on_database(db, go, mode="read" if dry_run else "write")
    click.echo(_undo_message(report, datasets, dry_run=dry_run))


def _undo_message(report: Any, datasets: tuple[str, ...], *, dry_run: bool) -> str:
    """What an undo did (or would do), in one line."""
    if report.requeue_id is None:
        if not datasets or report.latest is None:
            return "nothing to undo: no requeue since the last undo"
        moved = ", ".join(report.latest_datasets) or "no dataset still requeued"
        return (
            f"nothing to undo for dataset {', '.join(datasets)}: the latest requeue, "
            f"#{report.latest}, moved items of {moved}"
        )
    verb = "would put back" if dry_run else "put back"
    text = f"{verb} {report.restored:,} items of requeue #{report.requeue_id}"
    if report.refailed:
        text += f", {report.refailed:,} of them had failed when run again"
    text += f" ({report.kept:,} claimed since and answered, or running, are left as they are)"
    if report.left:
        text += (
            f"; its {report.left:,} items of other datasets stay requeued "
            "(`orchestrator requeue --undo` takes them back)"
        )
    return text


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
