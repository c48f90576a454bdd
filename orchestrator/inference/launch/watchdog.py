"""The process between a worker and one server it launched: it ties the server's life to
the worker's, and keeps the server's log.

    python -m orchestrator.inference.launch.watchdog FD LOG PIDFILE MAX_BYTES KEEP STOP_S -- CMD ...

It runs in a process group of its own, with the server (and whatever the server starts)
in that group. ``FD`` is the read end of a pipe whose write end only the worker holds:
when the worker dies, however it dies (SIGKILL included), the pipe reads end-of-file
and the watchdog stops the whole group. ``PR_SET_PDEATHSIG`` backs that up on both
levels: the watchdog gets SIGTERM when the worker dies, the server SIGKILL when the
watchdog dies. A SIGTERM to the watchdog stops the server: SIGTERM to the group, then
SIGKILL after ``STOP_S`` seconds.

The server's output goes through a pipe to ``LOG``, rotated at ``MAX_BYTES`` with
``KEEP`` older files (``LOG.1`` the newest of them): a server that logs a line per
request cannot fill the disk. The watchdog exits as the server did: its exit status,
or killed by the same signal, so the worker sees the server's own end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pipe alone ties the lives
        pass


class RotatingLog:
    """Bytes appended to a file that is renamed to ``.1`` (and so on) when full."""

    def __init__(self, path: Path, max_bytes: int, keep: int):
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.fh = open(path, "ab")  # noqa: SIM115 (open as long as the server runs)

    def write(self, data: bytes) -> None:
        """Append; a full file is rotated first, so that the current one always ends
        with the latest output (the lines shown when the server dies)."""
        if self.max_bytes and self.fh.tell() >= self.max_bytes:
            self.rotate()
        self.fh.write(data)
        self.fh.flush()

    def rotate(self) -> None:
        self.fh.close()
        for n in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{n + 1}"))
        if self.keep > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self.fh = open(self.path, "ab")  # noqa: SIM115


def _group_members() -> list[int]:
    """The other processes of this group (the server and its children)."""
    me, group = os.getpid(), os.getpgid(0)
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    members.append(int(entry))
            except OSError:
                continue
    return members


def _signal_group(sig: int) -> None:
    for pid in _group_members():
        try:
            os.kill(pid, sig)
        except OSError:
            continue


class Watchdog:
    def __init__(self, cmd: list[str], log: RotatingLog, stop_seconds: float):
        self.cmd, self.log, self.stop_seconds = cmd, log, stop_seconds
        self.stopping = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.copier: threading.Thread | None = None

    def start(self) -> None:
        self.child = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL),
        )
        self.copier = threading.Thread(target=self._copy_output, daemon=True)
        self.copier.start()

    def _copy_output(self) -> None:
        assert self.child is not None and self.child.stdout is not None
        fd = self.child.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self.log.write(chunk)

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL to whatever is left of it."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        _signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_seconds
        while time.monotonic() < deadline and _group_members():
            if self.child is not None:
                self.child.poll()  # reap it, or it stays a member as a zombie
            time.sleep(0.05)
        _signal_group(signal.SIGKILL)


def _watch_pipe(fd: int, watchdog: Watchdog) -> None:
    """End-of-file on the worker's pipe: the worker is gone, so is the server."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    watchdog.stop()


def main(argv: list[str]) -> int:
    fd_text, log_path, pid_file, max_bytes, keep, stop_s, sep, *cmd = argv
    if sep != "--" or not cmd:
        print("usage: watchdog FD LOG PIDFILE MAX_BYTES KEEP STOP_S -- CMD ...", file=sys.stderr)
        return 2
    if os.getpgid(0) != os.getpid():
        # The group it stops must be its own, whoever started it: never its starter's.
        os.setsid()
    set_parent_death_signal(signal.SIGTERM)
    log = RotatingLog(Path(log_path), int(max_bytes), int(keep))
    watchdog = Watchdog(cmd, log, float(stop_s))
    stopper = threading.Thread(target=watchdog.stop, daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: stopper.is_alive() or stopper.start())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle
    try:
        watchdog.start()
    except OSError as exc:
        log.write(f"cannot start {cmd[0]}: {exc.strerror or exc}\n".encode())
        return 127
    assert watchdog.child is not None
    Path(pid_file).write_text(f"{watchdog.child.pid}\n")
    threading.Thread(target=_watch_pipe, args=(int(fd_text), watchdog), daemon=True).start()
    code = watchdog.child.wait()
    _signal_group(signal.SIGKILL)  # what the server started dies with it
    if watchdog.copier is not None:
        watchdog.copier.join(5)  # its last lines into the log before the worker reads them
    if code < 0:  # end as the server did: by the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
