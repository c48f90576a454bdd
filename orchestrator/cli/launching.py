"""The options of the servers a command launches itself (``run``, ``plan``, ``doctor``),
made into launch specs and a supervisor by ``orchestrator.inference.launch``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from orchestrator.cli.common import run_sync

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
    chosen = [_OPTIONS[LAUNCH_KEYS.index(key)] for key in COMMANDS_ONLY]
    for option in reversed(chosen):
        command = option(command)
    return command


LAUNCH_KEYS = (
    "launch",
    "engine",
    "engine_model",
    "tp",
    "engine_args",
    "engine_bin",
    "served_model_name",
    "gpus_per_server",
    "replicas",
    "startup_timeout",
    "restart_backoff",
    "max_server_deaths",
    "server_death_window",
    "launch_dir",
)


_DEFAULTS = {
    "launch": (),
    "tp": 1,
    "engine_args": "",
    "startup_timeout": 1800.0,
    "restart_backoff": 5.0,
    "max_server_deaths": 5,
    "server_death_window": 3600.0,
}


def take_launch_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The launch options, taken out of a command's keyword arguments (those a command
    does not have at their defaults)."""
    return {key: settings.pop(key, _DEFAULTS.get(key)) for key in LAUNCH_KEYS}


def supervisor(
    options: dict[str, Any], db: str | None, file_launches: list[Any] | None = None
) -> Any:
    """The supervisor of what the options (and a servers file's ``launch`` lines) say
    to launch; None when there is nothing to launch."""
    from orchestrator.errors import ConfigError
    from orchestrator.inference.launch.spec import Preset, SuperviseSettings, build_specs
    from orchestrator.inference.launch.state import default_dir
    from orchestrator.inference.launch.supervisor import Supervisor
    from orchestrator.store.reader import sqlite_path

    o = options
    preset = None
    if o["engine"]:
        if not o["engine_model"]:
            raise click.UsageError("--engine needs --model PATH")
        preset = Preset(
            o["engine"],
            o["engine_model"],
            o["tp"],
            o["engine_args"],
            o["engine_bin"],
            o["served_model_name"],
        )
    elif o["engine_model"] or o["engine_args"] or o["engine_bin"] or o["tp"] != 1:
        raise click.UsageError("--model, --tp, --engine-args and --engine-bin go with --engine")
    commands = [(cmd, None, None) for cmd in o["launch"]]
    commands += [(ln.command, ln.concurrency, ln.port) for ln in file_launches or []]

    def build() -> Any:
        specs = build_specs(
            commands, preset, gpus_per_server=o["gpus_per_server"], replicas=o["replicas"]
        )
        if not specs:
            return None
        try:
            settings = SuperviseSettings(
                startup_timeout=o["startup_timeout"],
                restart_backoff=o["restart_backoff"],
                max_deaths=o["max_server_deaths"],
                death_window=o["server_death_window"],
            )
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        base = o["launch_dir"] or default_dir(sqlite_path(db))
        return Supervisor(specs, settings, base)

    return run_sync(build)
