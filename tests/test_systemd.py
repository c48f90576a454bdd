"""The worker under systemd: notify protocol, watchdog, and the units themselves.

A real AF_UNIX datagram socket stands in for systemd's notify socket; a real
``orchestrator run`` process talks to it. The units go through ``systemd-analyze``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.ops.deploy import UnitSpec, installed_executable, render_unit
from orchestrator.ops.systemd import SystemdNotifier, notify_address, watchdog_interval
from tests.helpers import REPO, SimProcess, cli, events, prompts, start_worker, write_jsonl


class NotifySocket:
    """A fake systemd: receives notifications in a thread and timestamps them."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            with self._lock:
                self.messages.append((time.monotonic(), data.decode()))

    def lines(self, since: float = 0.0) -> list[tuple[float, str]]:
        """Every ``KEY=VALUE`` received, one per entry, with its arrival time."""
        with self._lock:
            return [(t, line) for t, m in self.messages if t >= since for line in m.splitlines()]

    def wait_for(self, line: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, got in self.lines():
                if got == line:
                    return t
            time.sleep(0.02)
        raise AssertionError(f"{line!r} not received within {timeout} s: {self.lines()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    fake = NotifySocket(tmp_path / "notify")
    yield fake
    fake.close()


# ------------------------------------------------------------------ protocol units


def test_address_forms() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@abstract/name") == b"\0abstract/name"
    assert notify_address(None) is None
    assert notify_address("vsock:2:1234") is None


def test_watchdog_only_for_the_named_process() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "2"}, pid=2) == 30.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


async def test_without_notify_socket_nothing_happens() -> None:
    notifier = SystemdNotifier({"WATCHDOG_USEC": "1000"})
    async with notifier:
        notifier.ready()
        notifier.status("x")
        assert not notifier.enabled and notifier.interval is None


async def test_messages_reach_an_abstract_socket() -> None:
    name = f"orchestrator-test-{time.monotonic_ns()}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(b"\0" + name.encode())
    receiver.settimeout(5)
    try:
        async with SystemdNotifier({"NOTIFY_SOCKET": "@" + name}) as notifier:
            notifier.ready()
            notifier.status("12 done,\n3 failed")
        assert receiver.recv(4096) == b"READY=1\nSTATUS=working"
        assert receiver.recv(4096) == b"STATUS=12 done, 3 failed"
    finally:
        receiver.close()


async def test_a_vanished_socket_does_not_stop_the_worker(tmp_path: Path) -> None:
    async with SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}) as notifier:
        assert notifier.send("READY=1") is False
        notifier.stopping()


async def test_a_hung_event_loop_stops_the_pings(notify_socket: NotifySocket) -> None:
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "100000"}
    async with SystemdNotifier(env):
        await asyncio.sleep(0.5)
        before = [t for t, line in notify_socket.lines() if line == "WATCHDOG=1"]
        assert len(before) >= 5, before  # every 50 ms while the loop runs
        hung_at = time.monotonic()
        time.sleep(1.0)  # noqa: ASYNC251 (the point: the loop is stuck, no task runs)
        resumed_at = time.monotonic()
        await asyncio.sleep(0.3)
    pings = [t for t, line in notify_socket.lines() if line == "WATCHDOG=1"]
    during = [t for t in pings if hung_at + 0.05 < t < resumed_at]
    assert during == [], "a ping came while the loop was blocked"
    assert any(t >= resumed_at for t in pings), "pings did not resume with the loop"
    count = len(pings)
    await asyncio.sleep(0.3)
    assert len([t for t, line in notify_socket.lines() if line == "WATCHDOG=1"]) == count


# ------------------------------------------------------------------ a real worker


def test_worker_process_notifies_systemd(
    tmp_path: Path, notify_socket: NotifySocket, sim_process: Callable[..., SimProcess]
) -> None:
    db = tmp_path / "q.db"
    src = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    assert cli("enqueue", str(src), "-d", "ds", "--db", str(db)).returncode == 0
    with socket.socket() as probe:  # a port with no server on it yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"}
    worker = start_worker(db, f"http://127.0.0.1:{port}", env=env)
    # Database open, server not reachable: not ready, but saying why, and alive.
    notify_socket.wait_for("STATUS=waiting for an inference server", 20)
    notify_socket.wait_for("WATCHDOG=1", 5)
    time.sleep(0.5)
    assert "READY=1" not in [line for _, line in notify_socket.lines()]
    sim_process(port=port)
    ready_at = notify_socket.wait_for("READY=1", 20)
    # Pings keep coming while the worker works (every 0.2 s for WATCHDOG_USEC=0.4 s).
    time.sleep(1.2)
    pings = [t for t, line in notify_socket.lines(since=ready_at) if line == "WATCHDOG=1"]
    assert len(pings) >= 4, pings
    worker.send_signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING=1", 10)
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    lines = [line for _, line in notify_socket.lines()]
    assert lines.index("READY=1") < lines.index("STOPPING=1")
    assert lines.count("READY=1") == 1


# ------------------------------------------------------------------ the units

EXAMPLE_EXECUTABLE = "/opt/orchestrator/.venv/bin/orchestrator"


def test_deploy_files_are_what_the_command_prints() -> None:
    for template, name in (
        (False, "orchestrator-worker.service"),
        (True, "orchestrator-worker@.service"),
    ):
        result = cli(
            "deploy", "systemd", "--executable", EXAMPLE_EXECUTABLE, *(["--template"] * template)
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == (REPO / "deploy" / name).read_text(), (
            f"deploy/{name} is out of date: orchestrator deploy systemd "
            f"--executable {EXAMPLE_EXECUTABLE}{' --template' * template} > deploy/{name}"
        )


def test_deploy_fills_in_this_installation(tmp_path: Path) -> None:
    db = tmp_path / "data" / "run.db"
    result = cli(
        "deploy", "systemd", "--user", "gen", "--db", f"sqlite:///{db}",
        "--server", "http://a:1", "--server", "http://b:2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    unit = result.stdout
    assert f"ExecStart={installed_executable()} --log-json run" in unit
    assert "User=gen\n" in unit and "Group=gen\n" in unit
    assert f"ReadWritePaths={db.parent}\n" in unit
    assert f"Environment=ORCHESTRATOR_DB={db}\n" in unit
    assert 'Environment="ORCHESTRATOR_SERVERS=http://a:1 http://b:2"\n' in unit
    for bad in (["--db", "relative.db"], ["--db", "postgresql://h/db"], ["--user", "a b"]):
        result = cli("deploy", "systemd", *bad)
        assert result.returncode == 2 and result.stderr.startswith("error: "), result


def _analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    return subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


@pytest.mark.parametrize("template", [False, True])
def test_units_verify_and_are_hardened(tmp_path: Path, template: bool) -> None:
    executable = installed_executable()
    assert Path(executable).exists()
    spec = UnitSpec(executable=executable, db=str(tmp_path / "orchestrator.db"), template=template)
    name = "orchestrator-worker@.service" if template else "orchestrator-worker.service"
    (tmp_path / name).write_text(render_unit(spec))
    instance = "orchestrator-worker@code.service" if template else name
    if template:
        (tmp_path / instance).symlink_to(tmp_path / name)

    verify = _analyze("verify", "--man=false", f"./{instance}", cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "orchestrator-worker" not in verify.stderr, verify.stderr

    security = _analyze("security", "--offline=true", f"./{instance}", cwd=tmp_path)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert found, security.stdout + security.stderr
    assert float(found.group(1)) <= 2.5, security.stdout


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a unit whose program is missing does not verify."""
    spec = UnitSpec(executable=str(tmp_path / "missing"), db=str(tmp_path / "x.db"))
    (tmp_path / "orchestrator-worker.service").write_text(render_unit(spec))
    verify = _analyze("verify", "--man=false", "./orchestrator-worker.service", cwd=tmp_path)
    assert verify.returncode != 0


MDWE_WORKER = """
import ctypes, mmap, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE
    sys.exit(77)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit(78)
except OSError:
    pass
from orchestrator.cli import main
sys.argv[0] = "orchestrator"
main()
"""


def test_worker_runs_without_writable_executable_memory(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """MemoryDenyWriteExecute=yes: the kernel's same rule (prctl PR_SET_MDWE) on a real run."""
    db = tmp_path / "q.db"
    src = write_jsonl(tmp_path / "in.jsonl", prompts(50))
    assert cli("enqueue", str(src), "-d", "ds", "--db", str(db)).returncode == 0
    sim = sim_process()
    args = ["run", "--server", sim.url, "--db", str(db), "--exit-when-done"]
    result = subprocess.run(
        [sys.executable, "-c", MDWE_WORKER, *args], capture_output=True, text=True, timeout=60
    )
    if result.returncode in (77, 78):
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+)")
    assert result.returncode == 0, result.stderr
    stopped = [e for e in events(result.stderr) if e["event"] == "worker_stopped"]
    assert stopped and stopped[0]["completed"] == 50


# ------------------------------------------------------------------ restarts

#: Signals systemd counts as a clean end (systemd.service(5), "Restart="): not restarted.
CLEAN_SIGNALS = {"SIGHUP", "SIGINT", "SIGTERM", "SIGPIPE"}


def service_settings(unit: str) -> dict[str, list[str]]:
    """The ``[Service]`` section's assignments, each key's values in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in unit.splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def systemd_restarts(unit: str, returncode: int) -> bool:
    """Whether systemd restarts the service after its main process ended with
    ``returncode`` (negative: killed by that signal), as systemd.service(5) says for
    ``Restart=on-failure``, ``RestartPreventExitStatus=`` and ``SuccessExitStatus=``."""
    settings = service_settings(unit)
    assert settings["Restart"] == ["on-failure"], settings.get("Restart")
    prevent = {v for line in settings.get("RestartPreventExitStatus", []) for v in line.split()}
    success = {v for line in settings.get("SuccessExitStatus", []) for v in line.split()}
    if returncode < 0:
        name = signal.Signals(-returncode).name
        names = {name, name.removeprefix("SIG")}
        return name not in CLEAN_SIGNALS and not names & (prevent | success)
    if returncode == 0 or str(returncode) in success:
        return False
    return str(returncode) not in prevent


def _exit_codes(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> dict[str, int]:
    """How real ``orchestrator run`` processes end, one per cause a service meets."""
    got: dict[str, int] = {}

    def queue(name: str, *options: str) -> Path:
        db = tmp_path / f"{name}.db"
        src = write_jsonl(tmp_path / f"{name}.jsonl", prompts(3, prefix=name))
        assert cli("enqueue", str(src), "-d", name, "--db", str(db), *options).returncode == 0
        return db

    def run(cause: str, db: Path, url: str, *extra: str, env: dict[str, str] | None = None) -> None:
        args = ["run", "--server", url, "--db", str(db), "--exit-when-done", *extra]
        got[cause] = cli(*args, env=env, timeout=120).returncode

    sim = sim_process("--latency", "0", "--max-model-len", "4000")
    run("done", queue("done"), sim.url)
    run("bad option", queue("option"), "ftp://127.0.0.1:1")
    run("no database", tmp_path / "missing.db", sim.url)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nothing_there = f"http://127.0.0.1:{probe.getsockname()[1]}"
    run("servers unreachable", queue("outage"), nothing_there, "--give-up-after", "2")
    keyed = SimProcess("--latency", "0", env={"SIM_API_KEY": "right"})
    keyed.start()
    try:
        run("circuit breaker", queue("key"), keyed.url, env={"ORCHESTRATOR_API_KEY": "wrong"})
    finally:
        keyed.stop()
    run("items failed", queue("long", "--max-tokens", "4000"), sim.url)
    paused = queue("paused")
    assert cli("pause", "paused", "--db", str(paused)).returncode == 0
    run("paused left", paused, sim.url)
    crashed = start_worker(queue("crash"), nothing_there)
    crashed.kill()
    got["crash"] = crashed.wait(timeout=30)
    return got


def test_the_unit_restarts_only_what_a_restart_can_fix(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """A setting, the database, the breaker or unfinished items need a person: the
    unit stops there instead of retrying every RestartSec for ever (the breaker's
    trial items sent again each time). A crash and an outage are restarted."""
    unit = cli("deploy", "systemd", "--executable", EXAMPLE_EXECUTABLE)
    assert unit.returncode == 0, unit.stderr
    codes = _exit_codes(tmp_path, sim_process)
    assert codes == {
        "done": 0,
        "bad option": 2,
        "no database": 3,
        "servers unreachable": 4,
        "circuit breaker": 5,
        "items failed": 6,
        "paused left": 7,
        "crash": -signal.SIGKILL,
    }
    restarted = {cause for cause, code in codes.items() if systemd_restarts(unit.stdout, code)}
    assert restarted == {"servers unreachable", "crash"}
    assert systemd_restarts(unit.stdout, 1)  # an unhandled exception: a crash too
    assert systemd_restarts(unit.stdout, -signal.SIGABRT)  # the watchdog's kill
    assert not systemd_restarts(unit.stdout, -signal.SIGTERM)  # systemctl stop
