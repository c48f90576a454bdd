"""``orchestrator deploy slurm``: the script it writes, refused settings through the real
command, and real jobs on a single-node Slurm cluster started from Debian's packages
(tests/slurm_cluster.py) against the test PostgreSQL: a task preempted with
``scancel --signal=TERM`` stops cleanly, requeues itself and resumes, and every item is
answered once; the same with llama.cpp's server as the engine.

The cluster tests are skipped where Slurm is not installed (``.ci/run`` installs it) and
fail under ``CI=true`` instead, as the llama.cpp tier does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.ops.slurm import SlurmSpec, render_sbatch
from tests import slurm_cluster
from tests.helpers import SimProcess, check_export, cli, prompts, query, write_jsonl

PG = "postgresql://127.0.0.1/queue"


def script(**changes: object) -> str:
    spec = SlurmSpec(db=PG, executable="/opt/orc/bin/orchestrator")
    fields = {**{f: getattr(spec, f) for f in spec.__slots__}, **changes}  # type: ignore[attr-defined]
    return render_sbatch(SlurmSpec(**fields))  # type: ignore[arg-type]


def directives(text: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")
    ]


def test_array_script_signals_the_worker_alone_and_requeues_itself() -> None:
    text = script(launch=("llama-server -m /m.gguf --port {port}",), array=4, time="30:00:00")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert directives(text) == [
        "--job-name=orchestrator",
        "--output=orchestrator-%x-%A_%a.log",
        "--open-mode=append",
        "--array=0-3",
        "--nodes=1",
        "--ntasks=1",
        "--signal=B:TERM@300",
        "--requeue",
        "--time=30:00:00",
    ]
    assert "--launch 'llama-server -m /m.gguf --port {port}'" in text
    assert "scontrol requeue" in text and "srun" not in text
    assert "export ORCHESTRATOR_DB=postgresql://127.0.0.1/queue" in text


def test_nodes_script_runs_one_worker_per_node_under_srun() -> None:
    text = script(servers=("http://10.0.0.5:30000",), nodes=4, gpus_per_node=8, mem="200G")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    found = directives(text)
    assert "--nodes=4" in found and "--ntasks-per-node=1" in found
    assert "--signal=TERM@300" in found and "--gpus-per-node=8" in found
    assert "--mem=200G" in found and not any(d.startswith("--array") for d in found)
    assert re.search(r"^srun --kill-on-bad-exit=0 --ntasks-per-node=1 ", text, re.M)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--db", "/data/queue.db"], "needs PostgreSQL"),
        (["--db", "sqlite:////data/q.db"], "needs PostgreSQL"),
        (["--db", "postgresql://u:Secr3tPw@db/q"], "~/.pgpass"),
        (["--db", PG, "--nodes", "2", "--array", "3"], "give one"),
        (["--db", PG, "--time", "thirty hours"], "Slurm time limit"),
        (["--db", PG, "--grace", "300"], "--signal-lead 300"),
        (["--db", PG, "--sbatch-arg", "account=x"], "one sbatch option"),
        (["--db", PG, "--job-name", "a b"], "--job-name"),
    ],
)
def test_refused_settings_say_why(args: list[str], said: str) -> None:
    servers = [] if "--server" in args else ["--server", "http://10.0.0.5:30000"]
    result = cli("deploy", "slurm", *args, *servers)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr and result.stdout == ""
    assert "Secr3tPw" not in result.stderr


FAKE_ORCHESTRATOR = """#!/bin/bash
# The worker exits 0; `status --items-left` answers $FAKE_LEFT, or fails as a missing
# interpreter would.
if [ "$2" = run ]; then exit 0; fi
echo "status $*" >> "$CALLS"
if [ -z "$FAKE_LEFT" ]; then echo "/login/python: No such file or directory" >&2; exit 127; fi
echo "$FAKE_LEFT"
"""


@pytest.mark.parametrize(
    ("left", "code", "requeued", "said"),
    [
        ("", 1, False, "cannot tell how many items are left"),
        ("0", 0, False, "nothing left to do"),
        ("5", 0, True, "5 items left: requeued"),
    ],
)
def test_the_task_counts_what_is_left_with_the_executable_it_runs(
    tmp_path: Path, left: str, code: int, requeued: bool, said: str
) -> None:
    """The script calls no interpreter of the host it was written on; a count it cannot
    read ends the task loudly instead of requeuing it."""
    fake = tmp_path / "node" / "orchestrator"
    fake.parent.mkdir()
    fake.write_text(FAKE_ORCHESTRATOR)
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/bash\necho "scontrol $*" >> "$CALLS"\n')
    scontrol.chmod(0o755)
    args = ("--server", "http://10.0.0.5:30000", "--dataset", "a b", "--executable", str(fake))
    result = cli("deploy", "slurm", "--db", PG, *args)
    assert result.returncode == 0, result.stderr
    assert sys.executable not in result.stdout and " -c " not in result.stdout
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        "CALLS": str(calls),
        "FAKE_LEFT": left,
    }
    run = subprocess.run(
        ["bash", "-c", result.stdout], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == code, run.stdout + run.stderr
    assert said in run.stdout + run.stderr
    made = calls.read_text().splitlines()
    assert made[0] == "status status --items-left --dataset a b"
    assert ("scontrol requeue 7" in made) is requeued


@pytest.mark.parametrize(
    "args",
    [
        ["--launch", "vllm serve m --api-key sk-abcdef123456 --port {port}"],
        ["--launch", "python -m sglang.launch_server --api-key=Secr3tPw --port {port}"],
        ["--launch", "llama-server --hf-token hf_abcdefgh12345 --port {port}"],
        ["--server", "http://u:Secr3tPw@10.0.0.5:30000", "--run-args", "--grace 5"],
    ],
)
def test_a_secret_in_the_script_is_refused(args: list[str]) -> None:
    result = cli("deploy", "slurm", "--db", PG, *args)
    assert result.returncode == 2, result.stdout
    assert "would show" in result.stderr and result.stdout == ""
    for secret in ("sk-abcdef123456", "Secr3tPw", "hf_abcdefgh12345"):
        assert secret not in result.stderr


def test_a_task_needs_servers() -> None:
    result = cli("deploy", "slurm", "--db", PG)
    assert result.returncode == 2 and "--launch" in result.stderr and result.stdout == ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    lacking = slurm_cluster.missing()
    reason = ""
    if lacking:
        reason = f"Slurm is not installed ({', '.join(lacking)}): apt-get install slurmctld slurmd"
    elif os.geteuid() != 0:
        reason = "slurmd runs jobs as their users: the test cluster needs root"
    if reason:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)
    started = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def submit(
    cluster: slurm_cluster.SlurmCluster, tmp_path: Path, db: str, *args: str
) -> tuple[str, Path]:
    pattern = "task-%j.log" if "--nodes" in args else "task-%A_%a.log"
    result = cli("deploy", "slurm", "--db", db, "--output", str(tmp_path / pattern), *args)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "run.sbatch"
    path.write_text(result.stdout)
    return cluster.submit(path), path


def done(db: str) -> int:
    return int(query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0])


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout:g} s for {what}")


@pytest.mark.parametrize("shape", ["array", "nodes"])
def test_preempted_task_stops_cleanly_requeues_and_every_item_is_done_once(
    cluster: slurm_cluster.SlurmCluster,
    tmp_path: Path,
    pg_database: Callable[[], str],
    shape: str,
) -> None:
    """The array form: two tasks, one preempted (SIGTERM to its batch shell). The nodes
    form: one node under srun, SIGTERM to its step, as Slurm sends it at the limit."""
    db = pg_database()
    rows = prompts(40, "s")
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    assert cli("enqueue", str(source), "--dataset", "d", "--model", "m", "--db", db).returncode == 0
    sim = SimProcess("--latency", "1.0")
    sim.start()
    try:
        form = ["--array", "2"] if shape == "array" else ["--nodes", "1"]
        job, _ = submit(
            cluster, tmp_path, db, *form, "--server", sim.url, "--grace", "10",
            "--signal-lead", "90", "--run-args", "--concurrency 2 --retry-backoff 0.1",
        )  # fmt: skip
        wait_for(lambda: done(db) >= 6, 120, "the first answers")
        if shape == "array":
            # Preemption as an operator sends it to the array form: to the batch shell.
            cluster.command("scancel", "--batch", "--signal=TERM", f"{job}_0", check=True)
        else:
            cluster.command("scancel", "--signal=TERM", job, check=True)
        cluster.wait(job, 300)
        served = sim.stats()
    finally:
        sim.stop()
    check_export(db, tmp_path / "out.jsonl", [r["id"] for r in rows])
    name = f"task-{job}_0.log" if shape == "array" else f"task-{job}.log"
    log = (tmp_path / name).read_text()
    assert "items left: requeued" in log and "restart 1" in log, log
    assert "the worker exited 0" in log, log
    # The stop let in-flight answers finish: every answer the server gave is stored.
    assert served["chat_requests"] == served["completed"] == len(rows), served
    assert served["aborted"] == 0, served
    assert query(db, "SELECT count(*) FROM outputs")[0][0] == len(rows)
