"""``orchestrator deploy``: files for running workers as services."""

from __future__ import annotations

import click

from orchestrator.cli.common import Commands, run_sync, split_servers
from orchestrator.cli.options import POSITIVE, Row, shown, table


@click.group(cls=Commands)
def deploy() -> None:
    """Files for running workers as services."""


@deploy.command("systemd")
@click.option("--user", default="orchestrator", show_default=True, help="User and group to run as.")
@click.option(
    "--db",
    default="/var/lib/orchestrator/orchestrator.db",
    show_default=True,
    metavar="PATH|URL",
    help="Absolute SQLite path; its directory is the only place the service may write.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    metavar="URL",
    callback=split_servers,
    help="Server base URL; repeat for several.",
)
@click.option(
    "--template", is_flag=True, help="orchestrator-worker@.service: one instance per env file."
)
@click.option(
    "--executable",
    metavar="PATH",
    help="The orchestrator script to start (default: this installation's).",
)
def deploy_systemd(
    user: str, db: str, servers: tuple[str, ...], template: bool, executable: str | None
) -> None:
    """Print a hardened systemd unit for this installation.

    orchestrator deploy systemd > /etc/systemd/system/orchestrator-worker.service
    """
    from orchestrator.ops.deploy import UnitSpec, installed_executable, render_unit

    spec = UnitSpec(
        executable=executable or installed_executable(),
        user=user,
        db=db,
        servers=servers,
        template=template,
    )
    click.echo(run_sync(lambda: render_unit(spec)), nl=False)


_SLURM: tuple[Row, ...] = (
    (
        "--db",
        "The PostgreSQL queue every task shares (no password: use ~/.pgpass).",
        {"required": True, "metavar": "URL"},
    ),
    (
        "--launch",
        "A server each task starts, with {port} in it (as `run --launch`); repeatable.",
        {"multiple": True, "metavar": "CMD"},
    ),
    (
        ("--server", "servers"),
        "A server already running, for every task; repeatable.",
        {"multiple": True, "metavar": "URL", "callback": split_servers},
    ),
    (("--dataset", "datasets"), "Only these datasets; repeatable.", {"multiple": True}),
    (
        "--run-args",
        "More `orchestrator run` options, as typed.",
        {"default": "", "metavar": "ARGS"},
    ),
    (
        "--array",
        "Tasks of an array job, one node and one worker each.",
        shown(1, click.IntRange(min=1)),
    ),
    ("--nodes", "One job over N nodes instead, one worker per node under srun.", POSITIVE),
    ("--time", "The time limit, as sbatch takes it (30:00:00).", {"metavar": "LIMIT"}),
    ("--partition", "The partition to run in.", {}),
    ("--gpus-per-node", "GPUs each node needs.", POSITIVE),
    ("--cpus-per-task", "CPUs each task needs.", POSITIVE),
    ("--mem", "Memory per node, as sbatch takes it (e.g. 200G).", {"metavar": "SIZE"}),
    ("--job-name", "The job's name.", shown("orchestrator")),
    (
        "--output",
        "Each task's log, in sbatch's filename pattern (default: "
        "orchestrator-%x-%A_%a.log for an array, orchestrator-%x-%j.log for --nodes).",
        {"metavar": "PATTERN"},
    ),
    (
        "--grace",
        "Seconds in-flight answers get to finish after the stop signal.",
        shown(120.0, click.FloatRange(min=0)),
    ),
    (
        "--signal-lead",
        "Seconds before the time limit that the worker is told to stop.",
        shown(300, click.IntRange(min=1)),
    ),
    (
        "--max-restarts",
        "Times a task requeues itself while work is left.",
        shown(20, click.IntRange(min=0)),
    ),
    (
        ("--sbatch-arg", "sbatch_args"),
        "Another #SBATCH line, such as --account=X; repeatable.",
        {"multiple": True, "metavar": "OPTION"},
    ),
    ("--executable", "The orchestrator script the nodes run.", {"metavar": "PATH"}),
)


@deploy.command("slurm")
@table(*_SLURM)
def deploy_slurm(executable: str | None, **options: object) -> None:
    """Print an sbatch script: workers on Slurm nodes sharing one PostgreSQL queue.

    orchestrator deploy slurm --db postgresql://db-host/run --array 4 --time 30:00:00
    --gpus-per-node 8 --launch 'python -m sglang.launch_server --model-path M --port {port}'
    > run.sbatch && sbatch run.sbatch
    """
    from orchestrator.ops.deploy import installed_executable
    from orchestrator.ops.slurm import SlurmSpec, render_sbatch

    spec = SlurmSpec(executable=executable or installed_executable(), **options)  # type: ignore[arg-type]
    click.echo(run_sync(lambda: render_sbatch(spec)), nl=False)
