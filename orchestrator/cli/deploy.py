"""``orchestrator deploy``: files for running workers as services."""

from __future__ import annotations

import click

from orchestrator.cli.common import Commands, run_sync, split_servers


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


@deploy.command("slurm")
@click.option(
    "--db",
    required=True,
    metavar="URL",
    help="The PostgreSQL queue every task shares (no password: use ~/.pgpass).",
)
@click.option(
    "--launch",
    multiple=True,
    metavar="CMD",
    help="A server each task starts, with {port} in it (as `run --launch`); repeatable.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    metavar="URL",
    callback=split_servers,
    help="A server already running, for every task; repeatable.",
)
@click.option("--dataset", "datasets", multiple=True, help="Only these datasets; repeatable.")
@click.option(
    "--run-args", default="", metavar="ARGS", help="More `orchestrator run` options, as typed."
)
@click.option(
    "--array",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tasks of an array job, one node and one worker each.",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    help="One job over N nodes instead, one worker per node under srun.",
)
@click.option("--time", metavar="LIMIT", help="The time limit, as sbatch takes it (30:00:00).")
@click.option("--partition", help="The partition to run in.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), help="GPUs each node needs.")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="CPUs each task needs.")
@click.option("--mem", metavar="SIZE", help="Memory per node, as sbatch takes it (e.g. 200G).")
@click.option("--job-name", default="orchestrator", show_default=True, help="The job's name.")
@click.option(
    "--output",
    metavar="PATTERN",
    help="Each task's log, in sbatch's filename pattern (default: "
    "orchestrator-%x-%A_%a.log for an array, orchestrator-%x-%j.log for --nodes).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Seconds in-flight answers get to finish after the stop signal.",
)
@click.option(
    "--signal-lead",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Seconds before the time limit that the worker is told to stop.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Times a task requeues itself while work is left.",
)
@click.option(
    "--sbatch-arg",
    "sbatch_args",
    multiple=True,
    metavar="OPTION",
    help="Another #SBATCH line, such as --account=X; repeatable.",
)
@click.option("--executable", metavar="PATH", help="The orchestrator script the nodes run.")
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
