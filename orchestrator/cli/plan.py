"""``orchestrator plan``: what a run will take, before or while it runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import (
    db_option,
    echo_json,
    on_database,
    prices_options,
    run_prices,
    run_sync,
    servers_option,
)

DEFAULT_TOKENS_PER_SECOND = 850.0
"""``plan``'s default rate: the total tokens per second of a typical single-GPU reasoning
run (an 8B model answering a few hundred long requests at once); docs/CONFIG.md."""


@click.command()
@click.option(
    "--config",
    type=click.Path(path_type=Path),
    help="Plan the datasets of a run file (docs/CONFIG.md), counting the answers the "
    "database already holds; without it, plan what the database holds.",
)
@click.option(
    "--tokens-per-second",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TOKENS_PER_SECOND,
    show_default=True,
    help="The servers' total generation rate. The default is a typical single-GPU "
    "reasoning run; `status` shows a running run's.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable.")
@servers_option
@prices_options
@db_option
def plan(
    config: Path | None,
    tokens_per_second: float,
    as_json: bool,
    servers: tuple[str, ...],
    gpu_hour_cost: float | None,
    price_input: float | None,
    price_output: float | None,
    servers_file: Path | None,
    db: str | None,
) -> None:
    """Requests, tokens to generate, time left and database size, per dataset and in total;
    with a price (--gpu-hour-cost, or --price-input/--price-output), what it costs."""
    from orchestrator import runfile
    from orchestrator.store.reader import sqlite_path

    if config is not None:
        # The run file's [prices], where the options give none.
        given = run_sync(lambda: runfile.load_prices(config))
        gpu_hour_cost = given.get("gpu_hour_cost") if gpu_hour_cost is None else gpu_hour_cost
        price_input = given.get("price_input") if price_input is None else price_input
        price_output = given.get("price_output") if price_output is None else price_output
    prices = run_prices(gpu_hour_cost, price_input, price_output, servers_file, servers)

    plans = run_sync(lambda: runfile.load_run(config)) if config is not None else None
    path = sqlite_path(db)
    if plans is not None:
        # A run file is planned before its database exists: then nothing is done yet.
        held = _stored(db) if path is None or os.path.exists(path) else []
        stats = runfile.done_stats(held)
        result = run_sync(
            lambda: runfile.plan_run(plans, tokens_per_second=tokens_per_second, done_stats=stats)
        )
    else:
        # Without one, the database is what is planned: a missing one is refused (exit 3)
        # as by every command that reads it.
        held = _stored(db)
        if not held:
            click.echo(
                f"no datasets in {path or db}: nothing to plan (plan a run file with --config)"
            )
            return
        result = runfile.plan_stored(held, tokens_per_second=tokens_per_second)
    _show(result, prices, as_json)


def _show(result: Any, prices: Any, as_json: bool) -> None:
    """The plan, with its cost when priced (``orchestrator.cost``)."""
    from orchestrator import runfile
    from orchestrator.cost import plan_cost

    cost = plan_cost(result, prices)
    if as_json:
        doc = runfile.plan_json(result)
        if cost is not None:
            doc["cost"] = cost
        echo_json(doc)
        return
    click.echo(runfile.render_plan(result), nl=False)
    if cost is not None:
        click.echo(
            f"cost: ${cost['so_far']:,.2f} done, ${cost['to_go']:,.2f} to go,"
            f" ${cost['total']:,.2f} in all ({cost['basis']})"
        )


def _stored(db: str | None) -> list[Any]:
    """The datasets the database holds, with what is done of each."""
    from orchestrator.store.planning import stored_datasets

    return on_database(db, stored_datasets, mode="read")
