"""The ``orchestrator`` command: parse options, call the library, print the result.

One module per group of commands; each imports what it needs inside its commands, so
that ``orchestrator --help`` and the read-only fast paths (status, export on SQLite)
load neither SQLAlchemy nor asyncio. No SQL and no HTTP here. Errors from
``orchestrator.errors`` become a one-line message on stderr and the error's exit code
(2 bad input or options, 3 storage). A reader that went away (``| head``) ends a command
quietly with status 141, as SIGPIPE ends other tools; a closed standard output (``>&-``)
is refused before anything runs.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from orchestrator import __version__
from orchestrator._util import stopsignals
from orchestrator.cli import (
    datasets,
    db,
    deploy,
    doctor,
    enqueue,
    export,
    inspect,
    plan,
    requeue,
    run,
    sim,
    status,
)
from orchestrator.cli.common import (
    LOG_LEVELS,
    Commands,
    configure_logs,
    defer_logs,
    quiet_broken_pipe,
    refuse_closed_stdout,
)

# Commands that set up logging only when they leave their sqlite3 fast path.
_LAZY_LOGGING = frozenset({"status", "export", "inspect"})


class _Commands(Commands):
    """The command group; a reader that stops reading (``| head``) ends a command quietly,
    and a mistyped command is answered with the close names."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            if sys.stdout is not None:
                sys.stdout.flush()  # what is still buffered fails here, not at exit
            return result
        except BrokenPipeError:
            quiet_broken_pipe()


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="orchestrator")
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    envvar="ORCHESTRATOR_LOG_LEVEL",
    default="info",
    show_default=True,
)
@click.option(
    "--log-json/--no-log-json",
    default=None,
    help="JSON log lines (default: when stderr is not a terminal).",
)
@click.pass_context
def main(ctx: click.Context, log_level: str, log_json: bool | None) -> None:
    """Durable, resumable batch generation against OpenAI-compatible servers."""
    if ctx.invoked_subcommand == "run":
        stopsignals.hold()  # a worker stops cleanly on a signal, from now on
    else:
        stopsignals.release()  # other commands take signals as they always have
    refuse_closed_stdout()
    defer_logs(log_level, log_json)
    if ctx.invoked_subcommand not in _LAZY_LOGGING:
        configure_logs()


for _command in (
    db.db,
    enqueue.enqueue,
    plan.plan,
    run.run,
    status.status,
    status.watch,
    status.dashboard,
    status.report,
    inspect.inspect,
    requeue.requeue,
    requeue.pause,
    requeue.resume,
    datasets.dataset,
    export.export,
    sim.sim_server,
    sim.demo,
    deploy.deploy,
    doctor.doctor,
):
    main.add_command(_command)
