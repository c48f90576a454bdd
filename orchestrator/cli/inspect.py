"""``orchestrator inspect``: single items as a person reads them, or as JSON lines.

Parses the options, reads through ``store.item_detail`` (plain sqlite3 on an SQLite file at
the current schema, the store otherwise) and prints with ``monitor.inspection``. It only
reads: the database is opened read-only either way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from orchestrator.cli.common import configure_logs, db_option, on_database, run_sync
from orchestrator.errors import ConfigError
from orchestrator.items.error_classes import ERROR_CLASSES
from orchestrator.items.quality import flag_names, parse_flags

if TYPE_CHECKING:
    from orchestrator.store.item_detail import ItemRecord, Selection
    from orchestrator.store.reader import Rows

_STATES = ("pending", "running", "done", "failed")


@click.command("inspect")
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets.")
@click.option("--id", "key", metavar="KEY", help="The item with this key (its input id).")
@click.option(
    "--sample",
    type=click.IntRange(min=1),
    metavar="N",
    help="N items at random among those the other options match.",
)
@click.option(
    "--seed", type=int, help="The seed of --sample: the same seed shows the same items again."
)
@click.option(
    "--flag",
    "flag_names",
    multiple=True,
    metavar="FLAG[,FLAG]",
    help="Only items with an answer (current, or set aside by a requeue) carrying this quality "
    "flag: truncated, empty, unclosed_think, reasoning_only, tool_mismatch, nul, invalid_json, "
    "schema_mismatch, max_tokens_reduced. Repeatable.",
)
@click.option(
    "--error-class",
    metavar="CLASS",
    help="Only items with an attempt that failed with this class, whatever they became: "
    + ", ".join(ERROR_CLASSES)
    + ".",
)
@click.option("--state", type=click.Choice(_STATES), help="Only items in this state.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per item (docs/API.md).")
@click.option("--full", is_flag=True, help="Show long texts whole (else folded in the middle).")
@db_option
def inspect(as_json: bool, full: bool, db: str | None, **chosen: Any) -> None:
    """Show items whole: the request as sent, the answer with its reasoning (every turn
    of a regenerate-all conversation), usage, finish reason, quality flags, every attempt
    with its error and server, requeues and the answers they set aside, the lease.

    Items come by dataset, then input order. Reads only.
    """
    selection = _selection(**chosen)
    show = _printer(as_json, full)
    matched: list[int] = []
    gone: list[bool] = []

    def read(rows: Rows) -> int:
        from orchestrator.store.item_detail import inspect_items

        shown = 0
        try:
            for batch in inspect_items(rows, selection, matched=matched.append):
                for record in batch:
                    show(record)
                    shown += 1
            sys.stdout.flush()
        except BrokenPipeError:  # the reader went away (``| head``): the read ends here
            gone.append(True)
        return shown

    shown = _read(db, read)
    if gone:  # nothing more to say, and nothing left to flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    _say(selection, shown, matched[0] if matched else shown, as_json)


def _selection(datasets: tuple[str, ...], flag_names: tuple[str, ...], **chosen: Any) -> Selection:
    """The options through the store's one check; what it refuses is a usage error."""
    from orchestrator.store.item_detail import COMMAND, checked_selection

    flags = 0
    for names in flag_names:
        flags |= run_sync(lambda names=names: parse_flags(names))
    try:
        return checked_selection(dataset_names=datasets, flags=flags, spelling=COMMAND, **chosen)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _read(db: str | None, read: Callable[[Rows], int]) -> int:
    """``read`` through plain sqlite3 when it can, else through the store (read-only)."""
    from orchestrator.store import access

    done, shown = run_sync(lambda: access.read_fast_once(db, read))
    if done:
        return shown
    configure_logs()
    return on_database(db, lambda database: access.read(database, read), mode="read")


def _printer(as_json: bool, full: bool) -> Callable[[ItemRecord], None]:
    if as_json:
        from orchestrator.monitor.inspection import as_json as line

        out = sys.stdout.buffer
        return lambda record: out.write(line(record) + b"\n")  # type: ignore[func-returns-value]
    from rich.console import Console

    from orchestrator.monitor.inspection import render

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; a reader that stopped reading is no failure of ours.
            raise BrokenPipeError

    console = _Console(highlight=False, markup=False, emoji=False)
    return lambda record: console.print(render(record, full=full))


def _say(selection: Selection, shown: int, matched: int, as_json: bool) -> None:
    """What was shown, on stderr (stdout holds the items alone)."""
    sys.stdout.flush()
    if not matched:
        click.echo(f"no items match{_described(selection)}", err=True)
    elif selection.sample is not None:
        click.echo(
            f"sampled {shown:,} of {matched:,} matching items (seed {selection.seed}: "
            f"--seed {selection.seed} shows the same ones)",
            err=True,
        )
    elif not as_json:
        click.echo(f"{shown:,} item{'' if shown == 1 else 's'}", err=True)


def _described(selection: Selection) -> str:
    parts: list[tuple[str, Any]] = [
        *(("--dataset", name) for name in selection.dataset_names),
        ("--id", selection.key),
        ("--state", selection.state),
        ("--error-class", selection.error_class),
        ("--flag", ",".join(flag_names(selection.flags)) or None),
    ]
    given = " ".join(f"{option} {value}" for option, value in parts if value is not None)
    return f": {given}" if given else " (the database holds no items)"
