"""Telling systemd about a worker's life: readiness, stopping, status, watchdog pings.

The notify protocol is one datagram per message on the AF_UNIX socket named by
``$NOTIFY_SOCKET``, so it is spoken here directly rather than through a dependency.
Without ``$NOTIFY_SOCKET`` (a run in a terminal) every method does nothing.

The watchdog pings come from a task on the worker's own event loop, not from a thread:
a loop that hangs stops pinging, and systemd (``WatchdogSec=``) kills and restarts the
worker, whose leases are then reclaimed at once by its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("orchestrator.systemd")


def notify_address(value: str | None) -> str | bytes | None:
    """The socket address in ``$NOTIFY_SOCKET``: a path, or ``@name`` in the abstract namespace."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock and other address kinds: not spoken here


def watchdog_interval(environ: Mapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between pings (half the watchdog timeout), or None when no watchdog is set.

    ``$WATCHDOG_PID`` names the process the watchdog is meant for; a child that merely
    inherited the environment must not ping on its parent's behalf.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    target = environ.get("WATCHDOG_PID", "")
    if target and target != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 1_000_000 / 2


class SystemdNotifier:
    """The worker's ``Notifier`` for systemd, plus the watchdog task.

    Use ``async with notifier:`` (or ``await start()`` / ``await stop()``) around
    ``Worker.run()`` so that the watchdog pings only while the loop is alive.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = notify_address(env.get("NOTIFY_SOCKET"))
        self.interval = watchdog_interval(env) if self.address is not None else None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._failed = False
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # A full or vanished socket must never block or stop the worker.
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, message: str) -> bool:
        """Send one notification; False (logged once) when it could not be delivered."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:
                log.warning("notify_failed", message=message.split("=", 1)[0], error=str(exc))
                self._failed = True
            return False
        self._failed = False
        return True

    def ready(self) -> None:
        self.send("READY=1\nSTATUS=working")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=stopping: finishing in-flight requests")

    def status(self, text: str) -> None:
        # One line: a newline would start another assignment.
        self.send("STATUS=" + " ".join(text.split()))

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def start(self) -> None:
        """Start pinging the watchdog, when systemd asked for it."""
        if self.interval is not None and self._task is None:
            log.debug("watchdog_started", interval_s=self.interval)
            self._task = asyncio.create_task(self._watchdog(self.interval), name="watchdog")

    async def stop(self) -> None:
        """Stop pinging and close the socket."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> SystemdNotifier:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
