"""One launched server's process: started under its watchdog, in a process group of its
own, its output in a rotated log file; stopped with SIGTERM, then SIGKILL.

The worker holds the write end of the watchdog's pipe and nothing else does (it is not
inherited by other children): the pipe closes when the worker exits or dies, and the
watchdog then stops the server (orchestrator.inference.launch.watchdog).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import structlog

from orchestrator.inference.launch.spec import LaunchSpec, SuperviseSettings

log = structlog.get_logger("orchestrator.inference.launch")

#: Lines of a server's log shown when it fails to start or dies.
TAIL_LINES = 15


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Another process listens on ``port`` (connections of a server just killed, left
    in TIME_WAIT, do not count: servers bind with SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def describe_exit(code: int | None) -> str:
    """A process's end in words: its exit status, or the signal that killed it."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    if code == 127:
        return "exit status 127: command not found"
    return f"exit status {code}"


def group_members(group: int) -> list[int]:
    """The live processes (zombies aside: they hold no port and no memory) of a process
    group, read from ``/proc`` (Linux); empty where there is none."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == group:
            found.append(int(entry))
    return found


def group_alive(group: int) -> bool:
    if os.path.isdir("/proc"):
        return bool(group_members(group))
    try:
        os.killpg(group, 0)
    except OSError:
        return False
    return True


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


class ServerProcess:
    """A server's process under its watchdog, on ``port``, logging to ``log``."""

    def __init__(self, spec: LaunchSpec, port: int, log: Path, settings: SuperviseSettings):
        self.spec, self.port, self.log, self.settings = spec, port, log, settings
        self.argv = spec.argv(port)
        self.proc: asyncio.subprocess.Process | None = None
        self._pipe: int | None = None
        self.pid_file = log.with_suffix(".pid")

    async def start(self) -> None:
        """Start it; the log says when and how, before the server's own lines."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.unlink(missing_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        env_note = " ".join(f"{k}={v}" for k, v in self.spec.env.items())
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(f"==== {stamp} starting on port {self.port} {env_note}: {self.argv}\n")
        read, write = os.pipe()
        s = self.settings
        args = [str(read), str(self.log), str(self.pid_file), str(s.log_max_bytes),
                str(s.log_keep), str(s.stop_timeout), "--", *self.argv]  # fmt: skip
        try:
            with open(self.log, "ab") as err:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "orchestrator.inference.launch.watchdog", *args,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=err, pass_fds=(read,), start_new_session=True,
                    env={**os.environ, **self.spec.env},
                )  # fmt: skip
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def server_pid(self) -> int | None:
        """The server's own pid (the watchdog's child), once it is started."""
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self) -> None:
        """SIGTERM (the watchdog passes it to the server's group, then SIGKILLs what is
        left after ``stop_timeout``); the group SIGKILLed if the watchdog is stuck. Then
        whatever its group still holds is stopped too: a watchdog that died (SIGKILLed)
        took only the server's main process with it, and a restart must not find the
        old server's children on the port."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.settings.stop_timeout + 5)
            except TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        await self._stop_leftovers(proc.pid)
        self.close_pipe()

    async def _stop_leftovers(self, group: int) -> None:
        """SIGTERM to what is left in the watchdog's process group (its id is the
        watchdog's pid, kept by the kernel while a member lives), SIGKILL to what is
        still there after ``stop_timeout``."""
        if not group_alive(group):
            return
        log.warning("server_group_left_behind", group=group, members=group_members(group))
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_timeout
        while group_alive(group) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # no event says when processes of others end
        _signal_group(group, signal.SIGKILL)
        while group_alive(group) and time.monotonic() < deadline + 5:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def close_pipe(self) -> None:
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._pipe)
            self._pipe = None

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last lines of the server's log (from its latest start)."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 16384))
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        kept: list[str] = []
        for line in text.splitlines():
            if line.startswith("==== "):  # a start's header: only the latest start counts
                kept = []
            elif line.strip():
                kept.append(line)
        return kept[-lines:]
