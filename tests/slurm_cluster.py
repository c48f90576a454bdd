"""A single-node Slurm cluster in a temporary directory, for tests that submit real jobs.

Debian's slurmctld and slurmd (22.05 and later), configured with ``auth/none`` so that
no munge daemon is needed, process tracking by ``/proc`` (no cgroups in a container),
and a credential lifetime of a few seconds, which is also how long a requeued job waits
before it may start again (120 s by default). Every command of the cluster reads its
configuration through ``SLURM_CONF``; nothing outside the directory is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def missing() -> list[str]:
    """The Slurm programs this machine lacks (none: a cluster can be started)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


CONF = """\
ClusterName=orchtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=3600
ReturnToService=2
MpiDefault=none
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """slurmctld and slurmd of one node, started in ``root``; ``env`` is what a command
    of this cluster needs."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.host = socket.gethostname()

    def start(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            CONF.format(
                host=self.host,
                dir=self.root,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                cpus=os.cpu_count() or 1,
            )
        )
        subprocess.run(["slurmctld", "-c", "-f", str(self.conf)], env=self.env, check=True)
        subprocess.run(["slurmd", "-f", str(self.conf), "-N", self.host], env=self.env, check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.command("sinfo", "-h", "-o", "%T").strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster did not come up: {self.logs()}")

    def command(self, *argv: str, check: bool = False) -> str:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {result.stderr}")
        return result.stdout

    def submit(self, script: Path) -> str:
        """``sbatch`` the script; the job's id."""
        out = self.command("sbatch", "--parsable", str(script), check=True)
        return out.strip().split(";")[0]

    def jobs(self, job: str) -> dict[str, str]:
        """Each task of the job (``ID`` or ``ID_TASK``) and its state, finished ones too."""
        out = self.command("scontrol", "-o", "show", "job", job)
        found: dict[str, str] = {}
        for line in out.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            task = fields.get("ArrayTaskId")
            name = f"{fields['ArrayJobId']}_{task}" if task else fields.get("JobId", "")
            found[name] = fields.get("JobState", "")
        return found

    def wait(self, job: str, timeout: float, until: tuple[str, ...] = ("COMPLETED",)) -> None:
        """Until every task of the job is in one of ``until``'s states."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.jobs(job)
            if states and all(s in until for s in states.values()):
                return
            if any(s in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") for s in states.values()):
                break
            time.sleep(1)
        raise AssertionError(f"job {job}: {states}, waited for {until}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            if not pid_file.exists():
                continue
            pid = int(pid_file.read_text().strip() or 0)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                os.kill(pid, signal.SIGKILL)
