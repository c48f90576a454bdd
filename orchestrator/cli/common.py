"""What every command shares: the common options, the logging set-up the group defers,
the one way a command opens the database, and errors turned into exit codes.

Nothing heavy is imported at module level: ``orchestrator --help`` and the read-only
fast paths load this module, and never SQLAlchemy, asyncio or structlog.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from orchestrator.errors import ConfigError, OrchestratorError

if TYPE_CHECKING:
    from orchestrator.store import Database

T = TypeVar("T")

# orchestrator.logs.LEVELS, spelled out: importing orchestrator.logs loads structlog (and
# asyncio with it), which the read-only fast paths never need. A test keeps them equal.
LOG_LEVELS = ("debug", "info", "warning", "error")

_pending_logs: tuple[str, bool | None] | None = None

db_option = click.option(
    "--db",
    envvar="ORCHESTRATOR_DB",
    default=None,
    metavar="PATH|URL",
    help="Database: a SQLite file path or an SQLAlchemy URL "
    "(env ORCHESTRATOR_DB; default ./orchestrator.db).",
)


def split_servers(
    _ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    """``--server`` may repeat, and ORCHESTRATOR_SERVERS holds several, space-separated."""
    return tuple(s for entry in values for s in entry.split())


servers_option = click.option(
    "--server",
    "servers",
    multiple=True,
    envvar="ORCHESTRATOR_SERVERS",
    metavar="URL",
    callback=split_servers,
    help="OpenAI-compatible server base URL; repeat for several "
    "(env ORCHESTRATOR_SERVERS, space-separated).",
)

window_option = click.option(
    "--window",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds of recent history for the recent rates.",
)

api_key_file_option = click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the server's API key (else env ORCHESTRATOR_API_KEY).",
)

basic_auth_file_option = click.option(
    "--basic-auth-file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="ORCHESTRATOR_BASIC_AUTH_FILE",
    help="File holding USER:PASSWORD for the servers' HTTP Basic auth: kept out of the "
    "process arguments, unlike http://USER:PASSWORD@HOST (env ORCHESTRATOR_BASIC_AUTH_FILE).",
)


def defer_logs(level: str, json: bool | None) -> None:
    """Keep the group's logging options until a command needs logs (``configure_logs``)."""
    global _pending_logs
    _pending_logs = (level, json)


def configure_logs() -> None:
    """Set up logging as the group's options asked, once, before anything may log."""
    global _pending_logs
    if _pending_logs is not None:
        from orchestrator import logs

        level, json = _pending_logs
        _pending_logs = None
        logs.configure(level, json=json)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; turn our errors into a message and an exit code."""
    from orchestrator import aio  # here, not at the top: the read-only fast paths never need it

    return run_sync(functools.partial(aio.run, coro))


def run_sync(fn: Callable[[], T]) -> T:
    """Call a function; turn our errors into a message and an exit code."""
    try:
        return fn()
    except OrchestratorError as exc:
        fail(str(exc), exc.exit_code)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            raise  # the reader went away: a quiet end (``quiet_broken_pipe``), no message
        # A file the command had to read or write, and the system's reason, in one line.
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}", ConfigError.exit_code)


# What a shell reports for a writer that SIGPIPE ended (`seq 1000000 | head -1`).
BROKEN_PIPE_EXIT = 128 + 13


def quiet_broken_pipe() -> NoReturn:
    """End as a writer whose reader has gone: nothing more printed, exit status 141.

    Standard output and error are pointed at /dev/null first, so that flushing what is
    still buffered at exit cannot fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd)
    os.close(devnull)
    sys.exit(BROKEN_PIPE_EXIT)


def refuse_closed_stdout() -> None:
    """Stop before anything runs when standard output is closed (``>&-``).

    Python then drops every print without a word, so a command's output would be lost;
    and the next file opened could take descriptor 1.
    """
    if sys.stdout is None:
        fail(
            "standard output is closed (>&-): nothing could be written to it; redirect "
            "it to a file, or to /dev/null to discard it",
            ConfigError.exit_code,
        )


def fail(message: str, exit_code: int) -> NoReturn:
    """``error: message`` on stderr, and the exit code."""
    click.echo(f"error: {message}", err=True)
    sys.exit(exit_code)


@contextlib.asynccontextmanager
async def opened(db: str | None, mode: str = "create") -> AsyncIterator[Database]:
    """The database as ``mode`` allows (``orchestrator.store.open_database``), closed after."""
    from orchestrator.store import open_database

    database = await open_database(db, mode=mode)
    try:
        yield database
    finally:
        await database.close()


def on_database(
    db: str | None, call: Callable[[Database], Awaitable[T]], mode: str = "create"
) -> T:
    """``call(database)`` on the opened database, errors turned into exit codes."""

    async def go() -> T:
        async with opened(db, mode) as database:
            return await call(database)

    return run_async(go())


def tty_progress(label: str) -> Callable[[int], None] | None:
    """A counter redrawn on stderr when it is a terminal; None otherwise."""
    if not sys.stderr.isatty():
        return None

    def show(n: int) -> None:
        click.echo(f"\r{label} {n:,}", nl=False, err=True)

    return show


def end_progress(progress: Callable[[int], None] | None) -> None:
    if progress is not None:
        click.echo("", err=True)


@contextlib.contextmanager
def progress_shown(label: str) -> Iterator[Callable[[int], None] | None]:
    """``tty_progress(label)``, its line ended however the block ends."""
    progress = tty_progress(label)
    try:
        yield progress
    finally:
        end_progress(progress)


def read_api_key(api_key_file: Path | None) -> str | None:
    """The API key from ``--api-key-file``, else env ORCHESTRATOR_API_KEY."""
    if api_key_file is not None:
        try:
            return api_key_file.read_text().strip() or None
        except OSError as exc:
            raise click.BadParameter(
                f"{api_key_file}: {exc.strerror}", param_hint="--api-key-file"
            ) from exc
    return os.environ.get("ORCHESTRATOR_API_KEY") or None


def echo_json(document: Any) -> None:
    import orjson

    click.echo(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
