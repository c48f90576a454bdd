"""The options of the servers a command launches itself (``run``, ``plan``, ``doctor``),
made into launch specs and a supervisor by ``orchestrator.inference.launch``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import run_sync, usage_errors
from orchestrator.cli.options import POSITIVE, Row, shown, table

_OPTIONS: tuple[Row, ...] = (
    (
        "--launch",
        "Start this server and supervise it (repeatable): on a free port put for "
        "{port}, ready once /health and /v1/models answer, restarted when it dies.",
        {"multiple": True, "metavar": "'CMD ... --port {port}'"},
    ),
    (
        "--engine",
        "Launch this engine's server for --model, its command line built with "
        "metrics on (SGLang's launch_server, vllm serve, llama-server).",
        {"type": click.Choice(["sglang", "vllm", "llama.cpp"])},
    ),
    (("--model", "engine_model"), "The model --engine serves.", {"metavar": "PATH"}),
    (
        "--tp",
        "Tensor-parallel GPUs per --engine server.",
        shown(1, click.IntRange(min=1)),
    ),
    (
        "--engine-args",
        "More arguments for the --engine server, as one quoted string.",
        {"default": "", "metavar": "'ARGS'"},
    ),
    (
        "--engine-bin",
        "The engine's executable (python for SGLang), if not the one on PATH.",
        {"metavar": "PATH"},
    ),
    (
        "--served-model-name",
        "The name the --engine server serves the model under.",
        {"metavar": "NAME"},
    ),
    (
        "--gpus-per-server",
        "One replica of each launched server per this many GPUs (from "
        "CUDA_VISIBLE_DEVICES, else nvidia-smi -L), each with its own CUDA_VISIBLE_DEVICES.",
        POSITIVE,
    ),
    ("--replicas", "Copies of each launched server, for CPU engines (llama.cpp).", POSITIVE),
    (
        "--startup-timeout",
        "Seconds a launched server may take to load and answer (a 600 GB model "
        "takes minutes); progress is logged meanwhile.",
        shown(1800.0, click.FloatRange(min=0, min_open=True)),
    ),
    (
        "--restart-backoff",
        "Seconds before a dead server's first restart; doubles per death.",
        shown(5.0, click.FloatRange(min=0)),
    ),
    (
        "--max-server-deaths",
        "Deaths within --server-death-window after which a server is given up on.",
        shown(5, click.IntRange(min=1)),
    ),
    (
        "--server-death-window",
        None,
        shown(3600.0, click.FloatRange(min=0, min_open=True), metavar="SECONDS"),
    ),
    (
        "--launch-dir",
        "Where launched servers' logs go (env ORCHESTRATOR_LAUNCH_DIR; default: "
        "DB.servers/ beside an SQLite database, else ~/.local/state/orchestrator/servers).",
        {"type": click.Path(path_type=Path, file_okay=False)},
    ),
)


#: What ``doctor`` takes: commands only (its --model is the model servers must serve).
COMMANDS_ONLY = ("--launch", "--startup-timeout", "--launch-dir")

#: Every launch option (``run``, ``plan``).
launch_options = table(*_OPTIONS)

#: ``--launch``, ``--startup-timeout`` and ``--launch-dir`` only (``doctor``).
launch_commands_options = table(*(row for row in _OPTIONS if row[0] in COMMANDS_ONLY))


def take_launch_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The launch options, taken out of a command's keyword arguments (those a command
    does not have, or left unset, keep ``LaunchPlan``'s defaults)."""
    from dataclasses import fields

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

    with usage_errors():
        plan = LaunchPlan(**options, file_launches=tuple(file_launches or ()))
        plan.preset()
        plan.supervise()
    return run_sync(lambda: build(plan, sqlite_path(db)))
