"""The options of the servers a command launches itself (``run``, ``plan``, ``doctor``),
made into launch specs and a supervisor by ``orchestrator.inference.launch``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import click

from orchestrator.cli.common import run_sync
from orchestrator.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS = [
    click.option(
        "--launch",
        "launch",
        multiple=True,
        metavar="'CMD ... --port {port}'",
        help="Start this server and supervise it (repeatable): on a free port put for "
        "{port}, ready once /health and /v1/models answer, restarted when it dies.",
    ),
    click.option(
        "--engine",
        type=click.Choice(["sglang", "vllm", "llama.cpp"]),
        help="Launch this engine's server for --model, its command line built with "
        "metrics on (SGLang's launch_server, vllm serve, llama-server).",
    ),
    click.option("--model", "engine_model", metavar="PATH", help="The model --engine serves."),
    click.option(
        "--tp",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Tensor-parallel GPUs per --engine server.",
    ),
    click.option(
        "--engine-args",
        default="",
        metavar="'ARGS'",
        help="More arguments for the --engine server, as one quoted string.",
    ),
    click.option(
        "--engine-bin",
        metavar="PATH",
        help="The engine's executable (python for SGLang), if not the one on PATH.",
    ),
    click.option(
        "--served-model-name",
        metavar="NAME",
        help="The name the --engine server serves the model under.",
    ),
    click.option(
        "--gpus-per-server",
        type=click.IntRange(min=1),
        help="One replica of each launched server per this many GPUs (from "
        "CUDA_VISIBLE_DEVICES, else nvidia-smi -L), each with its own CUDA_VISIBLE_DEVICES.",
    ),
    click.option(
        "--replicas",
        type=click.IntRange(min=1),
        help="Copies of each launched server, for CPU engines (llama.cpp).",
    ),
    click.option(
        "--startup-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=1800.0,
        show_default=True,
        help="Seconds a launched server may take to load and answer (a 600 GB model "
        "takes minutes); progress is logged meanwhile.",
    ),
    click.option(
        "--restart-backoff",
        type=click.FloatRange(min=0),
        default=5.0,
        show_default=True,
        help="Seconds before a dead server's first restart; doubles per death.",
    ),
    click.option(
        "--max-server-deaths",
        type=click.IntRange(min=1),
        default=5,
        show_default=True,
        help="Deaths within --server-death-window after which a server is given up on.",
    ),
    click.option(
        "--server-death-window",
        type=click.FloatRange(min=0, min_open=True),
        default=3600.0,
        show_default=True,
        metavar="SECONDS",
    ),
    click.option(
        "--launch-dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="Where launched servers' logs go (env ORCHESTRATOR_LAUNCH_DIR; default: "
        "DB.servers/ beside an SQLite database, else ~/.local/state/orchestrator/servers).",
    ),
]


#: What ``doctor`` takes: commands only (its --model is the model servers must serve).
COMMANDS_ONLY = ("launch", "startup_timeout", "launch_dir")


def launch_options(command: F) -> F:
    """Every launch option (``run``, ``plan``)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def launch_commands_options(command: F) -> F:
    """``--launch``, ``--startup-timeout`` and ``--launch-dir`` only."""
    for option in reversed([o for o in _OPTIONS if _name(o) in COMMANDS_ONLY]):
        command = option(command)
    return command


def _name(option: Callable[[Any], Any]) -> str:
    """The parameter name an option decorator gives (read without loading ``LaunchPlan``:
    the command line starts without the inference package)."""

    def probe() -> None: ...

    option(probe)
    return str(probe.__click_params__[0].name)  # type: ignore[attr-defined]


def take_launch_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The launch options, taken out of a command's keyword arguments (those a command
    does not have, or left unset, keep ``LaunchPlan``'s defaults)."""
    from orchestrator.inference.launch.plan import LaunchPlan

    taken = {f.name: settings.pop(f.name, None) for f in fields(LaunchPlan)}
    return {key: value for key, value in taken.items() if value is not None}


def supervisor(
    options: dict[str, Any], db: str | None, file_launches: list[Any] | None = None
) -> Any:
    """The supervisor of what the options (and a servers file's ``launch`` lines) say
    to launch; None when there is nothing to launch."""
    from orchestrator.inference.launch.plan import LaunchPlan
    from orchestrator.inference.launch.plan import supervisor as build
    from orchestrator.store.reader import sqlite_path

    try:
        plan = LaunchPlan(**options, file_launches=tuple(file_launches or ()))
        plan.preset()
        plan.supervise()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return run_sync(lambda: build(plan, sqlite_path(db)))
