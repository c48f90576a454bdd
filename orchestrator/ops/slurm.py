"""The sbatch script for workers on a Slurm cluster, rendered for this installation.

This is the one place the script text lives: ``orchestrator deploy slurm`` prints it.
What the script does, and why:

* **An array job by default**, one worker per task, each task a node of its own with
  its servers: a preempted or failed task is requeued alone while the others go on.
  ``--nodes N`` is the other shape: one job over N nodes, one worker per node under
  ``srun``; the whole job is requeued together.
* **The queue is PostgreSQL**: every task leases items from the same database. SQLite
  on a shared file system loses its locks; the script refuses it.
* **A stop signal well before the time limit** (``--signal``): the worker gets SIGTERM
  ``--signal-lead`` seconds before the end, stops claiming, lets in-flight answers
  finish within ``--grace``, gives the rest back and exits 0. The array form signals
  the batch shell only (``B:``), which passes it on to the worker alone, so that the
  worker stops its launched servers after its in-flight answers; under ``srun`` Slurm
  signals every process of the step, servers included.
* **Requeued while work is left**: when the worker stopped (a clean stop at the
  signal, a crash, servers unreachable) and the queue still holds pending or running
  items of its datasets, the script requeues its own task (``scontrol requeue``), at
  most ``--max-restarts`` times; with nothing left, the task ends with the worker's
  code. Preemption and a failed node are requeued by Slurm itself (``--requeue``). An
  exit that needs a person (a bad setting, a database refusal, items failed) is not
  requeued: the task ends with that code and its log says why. The items left are
  counted by the same ``orchestrator`` the task runs (``status --items-left``), never by
  an interpreter of the host the script was written on; a count that cannot be read
  ends the task with an error, never requeued.
* **No secret in the script**: a password in ``--db``, credentials in a ``--server``
  URL, an API key or token in a ``--launch`` line or ``--run-args`` are refused
  (``ops.secrets``); they go in ~/.pgpass and the job's environment.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from orchestrator._util.urls import mask, take_userinfo
from orchestrator.errors import NEEDS_A_PERSON, ConfigError
from orchestrator.ops.secrets import check_commands, check_servers

DEFAULT_GRACE = 120.0
DEFAULT_SIGNAL_LEAD = 300
DEFAULT_MAX_RESTARTS = 20
# After --grace: giving the rest back, and launched servers' stop (SIGTERM, then SIGKILL
# after 30 s).
STOP_MARGIN = 60
# Time limits as Slurm reads them: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$|^UNLIMITED$|^INFINITE$")
_NAME = re.compile(r"^[A-Za-z0-9_.@%+=-]+$")

_KEY_ADVICE = (
    "a server the task launches listens on the node itself and needs no key; to give one, "
    "export it before sbatch (sbatch passes the environment on) as the engine's own "
    "variable (vLLM: VLLM_API_KEY) and as ORCHESTRATOR_API_KEY for the worker"
)


@dataclass(frozen=True, slots=True)
class SlurmSpec:
    """What a cluster's job needs to know: where the queue and the program are, what each
    task starts, and the shape and limits of the job."""

    db: str
    executable: str
    launch: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    run_args: str = ""
    array: int = 1
    nodes: int | None = None
    time: str | None = None
    partition: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    job_name: str = "orchestrator"
    output: str | None = None  # default: one log per task, by the shape
    grace: float = DEFAULT_GRACE
    signal_lead: int = DEFAULT_SIGNAL_LEAD
    max_restarts: int = DEFAULT_MAX_RESTARTS
    sbatch_args: tuple[str, ...] = field(default=())


def check_db(db: str) -> str:
    """The queue's URL: PostgreSQL only, and no password in it (the script is a file)."""
    scheme = db.partition("://")[0] if "://" in db else ""
    if not scheme.startswith("postgres"):
        raise ConfigError(
            f"--db {db}: tasks on several nodes share one queue, which needs PostgreSQL "
            "(postgresql://HOST/NAME); SQLite on a shared file system loses its locks"
        )
    _, userinfo = take_userinfo(db, "--db")
    if userinfo is not None and ":" in userinfo:
        shown = mask(db)
        raise ConfigError(
            f"--db {shown}: its URL holds a password, which the script would show to anyone "
            "who can read it or the job's environment; give the URL without it and put the "
            "password in ~/.pgpass (or the file PGPASSFILE names) on the nodes"
        )
    return db


def _check(spec: SlurmSpec) -> None:
    """Refuse what sbatch or the worker would refuse later, when nobody is watching."""
    if not spec.launch and not spec.servers and "--server" not in spec.run_args:
        raise ConfigError(
            "give each task its servers: --launch 'CMD --port {port}' (started by the worker) "
            "or --server URL (already running)"
        )
    if spec.array < 1 or (spec.nodes is not None and spec.nodes < 1):
        raise ConfigError("--array and --nodes take a count of at least 1")
    if spec.nodes is not None and spec.array != 1:
        raise ConfigError("--array and --nodes are two shapes of job: give one")
    if spec.time is not None and not _TIME.match(spec.time):
        raise ConfigError(
            f"--time {spec.time!r}: give a Slurm time limit, e.g. 30:00:00 or 1-06:00:00"
        )
    if spec.signal_lead <= spec.grace + STOP_MARGIN:
        raise ConfigError(
            f"--signal-lead {spec.signal_lead}: the stop signal must come more than --grace "
            f"({spec.grace:g} s) plus {STOP_MARGIN} s before the time limit, so that in-flight "
            "answers finish, the rest is given back and launched servers are stopped before "
            "Slurm kills the task"
        )
    for name, value in (("--job-name", spec.job_name), ("--partition", spec.partition)):
        if value is not None and not _NAME.match(value):
            raise ConfigError(f"{name} {value!r}: letters, digits and _.@%+=- only")
    for arg in spec.sbatch_args:
        if not arg.startswith("--") or "\n" in arg:
            raise ConfigError(f"--sbatch-arg {arg!r}: one sbatch option, such as --account=X")


def _directives(spec: SlurmSpec) -> list[str]:
    output = spec.output or (
        "orchestrator-%x-%j.log" if spec.nodes is not None else "orchestrator-%x-%A_%a.log"
    )
    lines = [f"--job-name={spec.job_name}", f"--output={output}", "--open-mode=append"]
    if spec.nodes is None:
        lines += [f"--array=0-{spec.array - 1}", "--nodes=1", "--ntasks=1"]
        lines.append(f"--signal=B:TERM@{spec.signal_lead}")
    else:
        lines += [f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
        lines.append(f"--signal=TERM@{spec.signal_lead}")
    lines.append("--requeue")
    optional = (
        ("time", spec.time),
        ("partition", spec.partition),
        ("gpus-per-node", spec.gpus_per_node),
        ("cpus-per-task", spec.cpus_per_task),
        ("mem", spec.mem),
    )
    lines += [f"--{key}={value}" for key, value in optional if value is not None]
    lines += list(spec.sbatch_args)
    return [f"#SBATCH {line}" for line in lines]


def _run_command(spec: SlurmSpec) -> str:
    argv = [spec.executable, "--log-json", "run", "--exit-when-done", "--grace", f"{spec.grace:g}"]
    for command in spec.launch:
        argv += ["--launch", command]
    for server in spec.servers:
        argv += ["--server", server]
    for name in spec.datasets:
        argv += ["--dataset", name]
    text = " ".join(shlex.quote(a) for a in argv)
    return f"{text} {spec.run_args}".rstrip()


_BODY = """\
set -uo pipefail
export ORCHESTRATOR_DB={db}
TASK="${{SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}${{SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}}"
RESTARTS="${{SLURM_RESTART_COUNT:-0}}"
echo "orchestrator task $TASK on $(hostname), restart $RESTARTS"

{start}
rc=$?
echo "orchestrator task $TASK: the worker exited $rc"
case " {needs_a_person} " in
  *" $rc "*) echo "orchestrator task $TASK: not requeued: exit $rc needs a person"; exit "$rc";;
esac
left=$({executable} status --items-left{datasets}) || left=""
case "$left" in
  ""|*[!0-9]*)
    echo "orchestrator task $TASK: cannot tell how many items are left ({executable} status" \
      "--items-left failed, see above): not requeued" >&2
    exit $(( rc ? rc : 1 ));;
esac
if [ "$left" = "0" ]; then
  echo "orchestrator task $TASK: nothing left to do"
  exit "$rc"
fi
if [ "$RESTARTS" -ge {max_restarts} ]; then
  echo "orchestrator task $TASK: $left items left, not requeued after $RESTARTS restarts"
  exit 1
fi
echo "orchestrator task $TASK: $left items left: requeued"
scontrol requeue "$SLURM_JOB_ID"
"""

# The array form: the worker is the batch shell's child, and the shell passes the stop
# signal (B:TERM) to it alone; `wait` returns when a trapped signal arrives, so wait again.
_ARRAY_START = """\
{run} &
worker=$!
trap 'kill -TERM "$worker" 2>/dev/null' TERM INT
wait "$worker"
while kill -0 "$worker" 2>/dev/null; do wait "$worker"; done
wait "$worker\""""

_NODES_START = "srun --kill-on-bad-exit=0 --ntasks-per-node=1 {run}"


def render_sbatch(spec: SlurmSpec) -> str:
    """The sbatch script text: submit it with ``sbatch FILE``."""
    _check(spec)
    db = check_db(spec.db)
    check_servers(
        spec.servers,
        file="the script",
        advice="ORCHESTRATOR_BASIC_AUTH_FILE in the job's environment",
    )
    check_commands(
        [*(("--launch", c) for c in spec.launch), ("--run-args", spec.run_args)],
        file="the script",
        advice=_KEY_ADVICE,
    )
    run = _run_command(spec)
    start = (_ARRAY_START if spec.nodes is None else _NODES_START).format(run=run)
    shape = f"--nodes {spec.nodes}" if spec.nodes is not None else f"--array {spec.array}"
    head = [
        "#!/bin/bash",
        f"# Rendered by `orchestrator deploy slurm` ({shape}); see docs/OPERATIONS.md.",
        "# Submit: sbatch THIS_FILE. Watch: orchestrator status (from any host that reaches",
        "# the database), squeue --me, and the task logs named by --output.",
        *_directives(spec),
        "",
    ]
    body = _BODY.format(
        db=shlex.quote(db),
        start=start,
        needs_a_person=" ".join(str(code) for code in NEEDS_A_PERSON),
        executable=shlex.quote(spec.executable),
        datasets="".join(f" --dataset {shlex.quote(d)}" for d in spec.datasets),
        max_restarts=spec.max_restarts,
    )
    return "\n".join(head) + "\n" + body
