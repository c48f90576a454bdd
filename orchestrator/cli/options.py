"""Options declared once: those several commands take alike, and the rows a command with
many options lists them in, so that a long list reads as a table, not as a wall of
decorators each spelling out the same keywords.

Nothing heavy is imported here: ``orchestrator --help`` loads this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from orchestrator.cli.common import Checked, split_servers
from orchestrator.settings import checks
from orchestrator.settings.prices import PRICE_HELP

F = TypeVar("F", bound=Callable[..., Any])

#: One option: its names (the parameter's name after them where it differs), its help
#: (None: none), and click's other keywords.
Row = tuple[str | tuple[str, ...], str | None, Mapping[str, Any]]

#: The keywords of an on/off option.
FLAG: Mapping[str, Any] = {"is_flag": True}

#: The keywords of a count that must be 1 or more, with no default.
POSITIVE: Mapping[str, Any] = {"type": click.IntRange(min=1)}


def stacked(command: F, options: list[Callable[..., Any]]) -> F:
    """``command`` with ``options`` in the order listed (as stacked decorators would be)."""
    for option in reversed(options):
        command = option(command)
    return command


def table(*rows: Row) -> Callable[[F], F]:
    """A decorator adding the rows' options, the first one first in ``--help``."""
    options = [
        click.option(*((names,) if isinstance(names, str) else names), help=text, **keywords)
        for names, text, keywords in rows
    ]
    return lambda command: stacked(command, options)


def datasets_option(text: str) -> Callable[[F], F]:
    """``--dataset`` repeated: the datasets a command keeps to."""
    return click.option("--dataset", "datasets", multiple=True, help=text)


def run_file_option(text: str) -> Callable[[F], F]:
    """``--config RUN.toml``: the datasets and settings of a run file (docs/CONFIG.md)."""
    return click.option("--config", type=click.Path(path_type=Path), help=text)


def json_option(text: str) -> Callable[[F], F]:
    """``--json``: the command's answer for programs rather than people."""
    return click.option("--json", "as_json", is_flag=True, help=text)


def shown(default: Any, kind: Any = None, **more: Any) -> dict[str, Any]:
    """The keywords of an option whose default ``--help`` shows (``[default: 5]``), of
    type ``kind`` when given."""
    keywords = {"default": default, "show_default": True, **more}
    return keywords if kind is None else {"type": kind, **keywords}


db_option = click.option(
    "--db",
    envvar="ORCHESTRATOR_DB",
    default=None,
    metavar="PATH|URL",
    help="Database: a SQLite file path or an SQLAlchemy URL "
    "(env ORCHESTRATOR_DB; default ./orchestrator.db).",
)


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
    type=Checked(checks.WINDOW),
    default=300.0,
    show_default=True,
    help="Seconds of recent history for the recent rates (at least 1).",
)


def prices_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--gpu-hour-cost``, the token prices (``--price-input``, ...) and
    ``--servers-file``: what the run costs (``orchestrator.settings.prices``), per server
    where the file says."""
    options = [
        click.option(
            "--" + name.replace("_", "-"),
            type=Checked(checks.PRICES[name]),
            metavar="FRACTION" if name == "batch_discount" else "USD",
            help=text,
        )
        for name, text in PRICE_HELP.items()
    ]
    servers_file = click.option(
        "--servers-file",
        type=click.Path(path_type=Path, dir_okay=False),
        help="The run's servers file: its servers' own prices (gpu_hour_cost=, price_input=, "
        "price_cached_input=, price_output=, batch_discount=), the options above for the "
        "others.",
    )
    return stacked(command, [*options, servers_file])


def request_options(param_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--model``, ``--max-tokens``, ``--temperature``, ``--top-p`` and ``--param``: a
    dataset's request body, as ``enqueue`` takes it and ``dataset set`` changes it."""
    options = [
        click.option("--model", help="Model name sent with every request of the dataset."),
        click.option(
            "--max-tokens", type=click.IntRange(min=1), help="max_tokens of each request."
        ),
        click.option("--temperature", type=click.FloatRange(min=0), help="Sampling temperature."),
        click.option(
            "--top-p", type=click.FloatRange(min=0, max=1), help="Nucleus sampling top_p."
        ),
        click.option("--param", "params", multiple=True, metavar="KEY=JSON", help=param_help),
    ]
    return lambda command: stacked(command, options)


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
