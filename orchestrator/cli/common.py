"""What every command shares: the common options, the logging set-up the group defers,
the one way a command opens the database, and errors turned into exit codes.

Nothing heavy is imported at module level: ``orchestrator --help`` and the read-only
fast paths load this module, and never SQLAlchemy, asyncio or structlog.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.settings import checks

if TYPE_CHECKING:
    from orchestrator.store import Database

T = TypeVar("T")

# orchestrator.logs.LEVELS, spelled out: importing orchestrator.logs loads structlog (and
# asyncio with it), which the read-only fast paths never need. A test keeps them equal.
LOG_LEVELS = ("debug", "info", "warning", "error")

_pending_logs: tuple[str, bool | None] | None = None


class Commands(click.Group):
    """A group of commands whose mistyped names are answered with the close ones."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError:
            name = args[0] if args else ""
            if name.startswith("-"):  # an option, not a command: click's own word
                raise
            shown = [n for n in self.list_commands(ctx) if not self.commands[n].hidden]
            close = close_names(name, shown)
            if not close:
                raise
            either = close[0] if len(close) == 1 else "one of " + ", ".join(close)
            message = f"No such command {name!r}. Did you mean {either}?"
            raise click.UsageError(message, ctx) from None


def close_names(name: str, names: list[str]) -> list[str]:
    """The names ``name`` may have meant, quoted: those it begins (``sim`` for
    ``sim-server``), then those difflib finds alike, three at most."""
    lowered = {n.lower(): n for n in names}
    typed = name.lower()
    begun = [n for low, n in lowered.items() if typed and low.startswith(typed)]
    alike = [lowered[n] for n in difflib.get_close_matches(typed, list(lowered), n=3)]
    return [repr(n) for n in dict.fromkeys(begun + alike)][:3]


def split_servers(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    """``--server`` may repeat, and ORCHESTRATOR_SERVERS holds several, space-separated.

    Each URL goes through the one check of every server source here, as it is parsed,
    so that every command taking servers refuses the same URLs, masks the same
    credentials, and names where the URL came from.
    """
    if not values:
        return ()
    from_env = ctx.get_parameter_source(param.name or "") == click.core.ParameterSource.ENVIRONMENT
    source = "ORCHESTRATOR_SERVERS" if from_env else "--server"
    # click splits the variable at white space itself: one text again, so that white
    # space inside a URL's credentials is told from two servers as on a command line.
    entries = (" ".join(values),) if from_env else values
    return run_sync(lambda: _checked_servers(entries, source))


def _checked_servers(values: tuple[str, ...], source: str) -> tuple[str, ...]:
    """The URLs, refused (``servers.check_server_url``) or corrected with a note."""
    import structlog

    from orchestrator._util.urls import split_on_space
    from orchestrator.inference.servers_file import check_server_url

    checked = []
    for entry in values:
        for url in split_on_space(entry, source):
            fixed, note = check_server_url(url, source)
            if note:
                configure_logs()
                structlog.get_logger("orchestrator.cli").info(
                    "server_url_corrected", source=source, note=note
                )
            checked.append(fixed)
    return tuple(checked)


def _cap(text: str) -> int | str:
    """A concurrency as typed: ``auto`` (any case) or a number."""
    return "auto" if text.lower() == "auto" else int(text)


class Checked(click.ParamType):
    """An option's value by a rule of ``orchestrator.settings.checks``: the option refuses what the
    Python API refuses, in the same words (``must be at least 1, got -5``)."""

    def __init__(self, rule: checks.Rule) -> None:
        self.rule = rule
        inner = rule.rule if isinstance(rule, checks.OrNone) else rule
        self._parse: Callable[[str], Any] | None = None
        self.name = "text"
        if isinstance(inner, checks.Integer):
            self._parse, self.name = int, "integer"
        elif isinstance(inner, checks.Number):
            self._parse, self.name = float, "float"
        elif isinstance(inner, checks.Cap):
            self._parse, self.name = _cap, "integer|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        parsed = value
        if isinstance(value, str) and self._parse is not None:
            with contextlib.suppress(ValueError):
                parsed = self._parse(value.strip())
        want = self.rule.expected(parsed)
        if want:
            given = value if self._parse is not None else checks.shown(value)
            self.fail(f"must be {want}, got {given}", param, ctx)
        return parsed


def run_prices(
    servers_file: Path | None, servers: tuple[str, ...] = (), **given: float | None
) -> Any:
    """The run's prices (``orchestrator.settings.prices.RunPrices``) from the options
    (``given``, by the price's name) and the servers of ``--server`` and the servers file,
    each by its URL."""
    from orchestrator.settings.prices import Prices, run_prices

    default = Prices(**given)
    listed = []
    if servers_file is not None:
        # Only then: the servers module loads the HTTP and logging libraries, which the
        # plain sqlite3 path of status never needs.
        from orchestrator.inference.servers_file import parse_servers_file

        listed = run_sync(lambda: parse_servers_file(servers_file))
    own = {spec.url: spec.prices for spec in listed}
    own |= {url: Prices() for url in servers if url not in own}
    return run_prices(default, own)


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
    # Here, not at the top: the read-only fast paths never need it.
    from orchestrator._util import aio

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


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """The library's refusal of what the options asked for (ConfigError), as click's usage
    error: the same words, with the command's usage, exit 2."""
    try:
        yield
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def flag_mask(given: tuple[str, ...]) -> int:
    """Quality flags named by a repeated option (each a name, or names comma-separated),
    as one mask; an unknown name stops the command."""
    from orchestrator.items.quality import parse_flags

    mask = 0
    for names in given:
        mask |= run_sync(lambda names=names: parse_flags(names))
    return mask


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
    """The API key from ``--api-key-file``, else env ORCHESTRATOR_API_KEY: the white
    space around it dropped, one with any inside refused naming where it came from."""
    from orchestrator._util import urls

    if api_key_file is not None:
        return run_sync(lambda: urls.read_api_key(api_key_file))
    env = os.environ.get("ORCHESTRATOR_API_KEY")
    return run_sync(lambda: urls.api_key(env, "ORCHESTRATOR_API_KEY"))


def read_basic_auth(basic_auth_file: Path | None) -> Any:
    """The ``aiohttp.BasicAuth`` of ``--basic-auth-file`` (or its environment variable),
    None without one; a file that is missing, unreadable or not USER:PASSWORD is refused
    naming the option or variable it came from."""
    if basic_auth_file is None:
        return None
    from orchestrator._util import urls

    ctx = click.get_current_context()
    from_env = ctx.get_parameter_source("basic_auth_file") == click.core.ParameterSource.ENVIRONMENT
    source = "ORCHESTRATOR_BASIC_AUTH_FILE" if from_env else "--basic-auth-file"
    return run_sync(lambda: urls.read_basic_auth(basic_auth_file, source))


def echo_json(document: Any) -> None:
    import orjson

    click.echo(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
