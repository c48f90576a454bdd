"""``orchestrator plan``: what a run will take, before or while it runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import echo_json, on_database, run_async, run_prices, run_sync
from orchestrator.cli.launching import launch_options, supervisor, take_launch_options
from orchestrator.cli.options import db_option, json_option, prices_options, run_file_option

DEFAULT_TOKENS_PER_SECOND = 850.0
"""``plan``'s default rate: the total tokens per second of a typical single-GPU reasoning
run (an 8B model answering a few hundred long requests at once); docs/CONFIG.md."""


@click.command()
@run_file_option(
    "Plan the datasets of a run file (docs/CONFIG.md), counting the answers the "
    "database already holds; without it, plan what the database holds."
)
@click.option(
    "--tokens-per-second",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TOKENS_PER_SECOND,
    show_default=True,
    help="The servers' total generation rate. The default is a typical single-GPU "
    "reasoning run; `status` shows a running run's.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    metavar="URL",
    help="Read the server's context length from its /v1/models (max_model_len, as vLLM "
    "serves it) and warn of the requests that will not fit it: a run file's, or the "
    "database's requests left.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    help="The server's context length in tokens, for the same warning.",
)
@json_option("Machine-readable.")
@launch_options
@prices_options
@db_option
def plan(
    config: Path | None,
    tokens_per_second: float,
    servers: tuple[str, ...],
    max_model_len: int | None,
    as_json: bool,
    db: str | None,
    **options: Any,
) -> None:
    """Requests, tokens to generate, time left and database size, per dataset and in total;
    with a price (--gpu-hour-cost, or --price-input/--price-output), what it costs.

    With --launch (or --engine), the first server is started briefly first, to say how
    long it took to be ready, its context length and whose metrics it serves. With the
    context known (that, --server's /v1/models, --max-model-len), the requests that will
    not fit it are warned of.
    """
    from orchestrator import runfile
    from orchestrator.store.reader import sqlite_path

    launch = take_launch_options(options)  # what is left: the price options
    if config is not None:
        # The run file's [prices], where the options give none.
        given = run_sync(lambda: runfile.load_prices(config))
        options |= {key: value for key, value in given.items() if options[key] is None}
    prices = run_prices(**options, servers=servers)
    looked = _look(launch, db)
    if looked is not None and not as_json:
        click.echo(_looked_line(looked))

    plans = run_sync(lambda: runfile.load_run(config)) if config is not None else None
    held = None if plans is not None else _stored(db)
    context = max_model_len or (looked or {}).get("context_length")
    if context is None and servers and (plans or held):
        context = _served_context(servers, plans or held)
        if context is None:
            click.echo(
                "warning: no --server said its context length (max_model_len in /v1/models): "
                "give --max-model-len to check the requests against it",
                err=True,
            )
    path = sqlite_path(db)
    if plans is not None:
        # A run file is planned before its database exists: then nothing is done yet.
        held = _stored(db) if path is None or os.path.exists(path) else []
        stats = runfile.done_stats(held)
        result = run_sync(
            lambda: runfile.plan_run(
                plans, tokens_per_second=tokens_per_second, done_stats=stats, context=context
            )
        )
    else:
        # Without one, the database is what is planned: a missing one is refused (exit 3)
        # as by every command that reads it.
        if not held:
            click.echo(
                f"no datasets in {path or db}: nothing to plan (plan a run file with --config)"
            )
            return
        overflows = _overflows(db, held, context) if context is not None else None
        result = runfile.plan_stored(
            held, tokens_per_second=tokens_per_second, context=context, overflows=overflows
        )
    _show(result, prices, as_json, looked)


def _show(result: Any, prices: Any, as_json: bool, looked: dict[str, Any] | None) -> None:
    """The plan, with its cost when priced (``orchestrator.settings.prices``) and the launched
    server's look."""
    from orchestrator import runfile
    from orchestrator.settings.prices import plan_cost

    cost = plan_cost(result, prices)
    if as_json:
        doc = runfile.plan_json(result)
        if cost is not None:
            doc["cost"] = cost
        echo_json(doc if looked is None else {**doc, "launched": looked})
        return
    click.echo(runfile.render_plan(result), nl=False)
    if cost is not None:
        click.echo(
            f"cost: ${cost['so_far']:,.2f} done, ${cost['to_go']:,.2f} to go,"
            f" ${cost['total']:,.2f} in all ({cost['basis']})"
        )


def _served_context(servers: tuple[str, ...], plans: Any) -> int | None:
    """The smallest context the servers say the run's models have (``/v1/models``):
    a request that fits it fits every server. None: no server says."""
    import asyncio

    import aiohttp

    from orchestrator.inference.probes import models

    async def look() -> list[dict[str, int]]:
        async with aiohttp.ClientSession() as session:
            return [(await models(session, url, 10)).contexts for url in servers]

    wanted = {p.params.get("model") for p in plans}
    found = [
        length
        for contexts in asyncio.run(look())
        for model, length in contexts.items()
        if model in wanted or len(contexts) == 1
    ]
    return min(found) if found else None


def _overflows(db: str | None, held: list[Any], context: int) -> dict[str, tuple[int, int]]:
    """The database's requests left that will not fit ``context``, by dataset."""
    from orchestrator import runfile
    from orchestrator.store.planning import scan_open_requests

    each, found = runfile.overflow_counter(held, context)
    on_database(db, lambda d: scan_open_requests(d, each), mode="read")
    return found


def _stored(db: str | None) -> list[Any]:
    """The datasets the database holds, with what is done of each."""
    from orchestrator.store.planning import stored_datasets

    return on_database(db, stored_datasets, mode="read")


def _look(launch: dict[str, Any], db: str | None) -> dict[str, Any] | None:
    """The first launched server, started and stopped again (None: none to launch)."""
    launched = supervisor(launch, db)
    if launched is None:
        return None
    from orchestrator.inference.launch.supervisor import look_briefly
    from orchestrator.inference.probes import plain_session

    async def look() -> dict[str, Any]:
        async with plain_session("orchestrator-plan", None, {}) as session:
            return await look_briefly(launched, session)

    return run_async(look())


def _looked_line(looked: dict[str, Any]) -> str:
    if looked.get("error"):
        return f"launched {looked['name']}: did not start: {looked['error']}"
    context = looked["context_length"]
    shown = f"{context:,} tokens" if context else "not said"
    return (
        f"launched {looked['name']}: ready in {looked['ready_s']:g}s, context length {shown}, "
        f"metrics: {looked['metrics'] or 'none'} ({looked['command']})"
    )
