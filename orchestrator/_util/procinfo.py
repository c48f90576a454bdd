"""Who holds a lease, and whether that process is still alive.

A lease owner is ``host:pid:start``, where ``start`` is the process start time from
``/proc/PID/stat``. A worker on the same host can then tell a dead holder at once, even
if its pid was reused by another process since; leases held on other hosts can only
expire.
"""

from __future__ import annotations

import os
import socket


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


def hostname() -> str:
    return socket.gethostname()


def owner_id(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{hostname()}:{pid}:{_start_ticks(pid) or '0'}"


def is_dead_local(owner: str) -> bool:
    """True only when ``owner`` ran on this host and that process is gone."""
    parts = owner.rsplit(":", 2)
    if len(parts) != 3:
        return False
    host, pid_text, start = parts
    if host != hostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if os.path.exists("/proc/self/stat"):
        current = _start_ticks(pid)
        return current is None or (start != "0" and current != start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
