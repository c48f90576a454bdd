"""``orchestrator status``, ``watch``, ``dashboard`` and ``report``: the run as it goes.

``status`` reads an SQLite file at the current schema through plain sqlite3, so that it
loads neither SQLAlchemy nor asyncio; anything else goes through the store.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import (
    configure_logs,
    echo_json,
    on_database,
    run_async,
    run_prices,
    run_sync,
)
from orchestrator.cli.options import (
    datasets_option,
    db_option,
    json_option,
    prices_options,
    servers_option,
    window_option,
)


@click.command()
@json_option("Machine-readable (docs/STATUS.md).")
@click.option(
    "--items-left",
    is_flag=True,
    help="Print only the count of items pending or running in datasets not paused (what "
    "a Slurm task reads to requeue itself).",
)
@datasets_option("With --items-left: only these datasets.")
@window_option
@servers_option
@prices_options
@db_option
@click.pass_context
def status(
    ctx: click.Context,
    as_json: bool,
    items_left: bool,
    datasets: tuple[str, ...],
    window: float,
    servers: tuple[str, ...],
    db: str | None,
    **prices: Any,
) -> None:
    """Progress, rates, errors, tokens thrown away and ETA per dataset and in total.

    With --server (or ORCHESTRATOR_SERVERS), each server's own view from its /metrics
    (SGLang or vLLM names) is shown beside them. With a price (--gpu-hour-cost, or
    --price-input/--price-output), the run's cost so far, to go, and wasted.
    """
    from orchestrator.monitor.text import render_status
    from orchestrator.settings.prices import status_cost

    if datasets and not items_left:
        raise click.UsageError("--dataset goes with --items-left", ctx)
    if items_left:
        click.echo(_items_left(_status_snapshot(db, window, ()), datasets))
        return
    pooled = run_prices(**prices, servers=servers)
    snap = _status_snapshot(db, window, servers)
    cost = status_cost(snap, pooled)
    if cost is not None:
        snap["cost"] = cost
    if as_json:
        echo_json(snap)
    else:
        click.echo(render_status(snap))


def _prices(given: dict[str, Any]) -> Any:
    """The run's prices from the price options among ``given`` (taken out of it), and
    its ``servers``."""
    from orchestrator.settings.prices import PRICE_HELP

    named = {name: given.pop(name) for name in (*PRICE_HELP, "servers_file")}
    return run_prices(**named, servers=given.get("servers", ()))


def _items_left(snap: dict[str, Any], names: tuple[str, ...]) -> int:
    """Items pending or running in the datasets not paused (of ``names``, when given)."""
    rows = [d for d in snap["datasets"] if not d["paused"]]
    rows = [d for d in rows if not names or d["name"] in names]
    return sum(d["counts"]["pending"] + d["counts"]["running"] for d in rows)


def _status_snapshot(db: str | None, window: float, servers: tuple[str, ...]) -> dict[str, Any]:
    """The status document (docs/STATUS.md), with the servers' own view when asked."""
    from orchestrator.monitor.status import snapshot_fast

    # An SQLite file at the current schema is read through plain sqlite3, without
    # loading SQLAlchemy; anything else (or any error) goes the full way below.
    snap = snapshot_fast(db, window=window)
    if snap is None:
        configure_logs()
        from orchestrator.monitor.status import snapshot

        snap = on_database(db, lambda d: snapshot(d, window=window), mode="read")
    if servers:
        from orchestrator.inference.server_metrics import scrape

        snap["servers"] = [scrape(server) for server in servers]
    from orchestrator.inference.launch.state import default_dir, read_states
    from orchestrator.store.reader import sqlite_path

    launched = read_states(default_dir(sqlite_path(db)))
    if launched:
        snap["launched"] = launched
    return snap


@click.command()
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@window_option
@click.option(
    "--count", type=click.IntRange(min=0), default=0, help="Stop after this many views (0: never)."
)
@servers_option
@db_option
def watch(
    interval: float, window: float, count: int, servers: tuple[str, ...], db: str | None
) -> None:
    """A live view of status: a progress bar per dataset, rates, ETA, errors, servers.

    Redrawn in place (over ssh too); Ctrl-C leaves it.
    """
    from rich.console import Console
    from rich.live import Live

    from orchestrator.monitor.live import render

    console = Console()
    shown = 0
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(render(_status_snapshot(db, window, servers)), refresh=True)
                shown += 1
                if count and shown >= count:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (the dashboard has no authentication).",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Another name the page may be reached by (a proxy's, a DNS name): requests whose "
    "Host header is none of loopback, an IP address, --host or these are refused.",
)
@window_option
@servers_option
@prices_options
@db_option
def dashboard(db: str | None, **served: Any) -> None:
    """A web page of the run that updates itself: progress, throughput and errors over
    the whole run, completion lengths, servers, ETA; with a price, the cost. Only reads
    the database."""
    configure_logs()
    from orchestrator.monitor.dashboard import serve

    served["prices"] = _prices(served)

    def ready(url: str) -> None:
        click.echo(f"dashboard on {url} (Ctrl-C stops it)", err=True)

    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve(db, ready=ready, **served))


@click.command()
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@window_option
@servers_option
@prices_options
@db_option
def report(
    out: Path, window: float, servers: tuple[str, ...], db: str | None, **prices: Any
) -> None:
    """The dashboard's page as one static HTML file, data included (no network needed);
    with a price, the cost."""
    configure_logs()
    from orchestrator._util.atomicfile import is_stdout
    from orchestrator.monitor.dashboard import gather_report, write_report

    pooled = _prices({**prices, "servers": servers})
    data = run_async(gather_report(db, servers=servers, window=window, prices=pooled))
    run_sync(lambda: write_report(out, data))
    click.echo(f"wrote {out}", err=is_stdout(out))
