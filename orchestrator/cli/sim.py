"""``orchestrator sim-server`` and ``demo``: the simulated inference server, alone or in a
whole simulated run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import run_async
from orchestrator.sim.options import sim_config, sim_options


@click.command("sim-server")
@sim_options()
def sim_server(host: str, port: int, **options: Any) -> None:
    """A simulated OpenAI-compatible inference server for tests, rehearsals, benchmarks."""
    from orchestrator.sim.server import run_forever

    run_forever(sim_config(options), host, port)


@click.command()
@click.option(
    "--dir",
    "workdir",
    type=click.Path(path_type=Path),
    default=Path("orchestrator-demo"),
    show_default=True,
    help="Where the database, sample and export go.",
)
@click.option("--items", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True)
@click.pass_context
def demo(ctx: click.Context, workdir: Path, items: int, concurrency: int) -> None:
    """Simulate a whole run: server, enqueue, run with live progress, export.

    Interrupt it with Ctrl-C and start it again: it resumes where it stopped.
    """
    from orchestrator.api.demo import run_demo

    parent = ctx.parent
    if parent is not None and parent.get_parameter_source("log_level") in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        # The progress line is the show here; only warnings interrupt it.
        from orchestrator import logs

        logs.configure("warning", json=parent.params.get("log_json"))

    run_async(run_demo(workdir, items=items, concurrency=concurrency))
