"""The servers a run launched: started, waited for, watched, restarted, given up on,
stopped. The worker routes to them as to any ``--server``; all HTTP (the looks at
``/health`` and ``/v1/models``) goes through ``orchestrator.inference.probes``.

A server is ready once ``/health`` and ``/v1/models`` answer with its process alive (an
answer from another process on its port does not count). One that never gets there is
given up on at once: its command, exit status and last log lines in one line. A server
that exits, or misses ``health_misses`` looks at ``/health`` in a row, is reported to
the pool first (its in-flight items go back without an attempt charged), then restarted
on the same port after a backoff; ``max_deaths`` within ``death_window`` and it is
given up on. ``servers.json`` beside the logs says where each one stands (``status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from orchestrator._util import procinfo
from orchestrator.errors import ConfigError, ServersLost
from orchestrator.inference import probes, server_metrics
from orchestrator.inference.launch.process import (
    ServerProcess,
    describe_exit,
    free_port,
    port_in_use,
)
from orchestrator.inference.launch.spec import LaunchSpec, SuperviseSettings
from orchestrator.inference.launch.state import STATE_FILE, forget_old
from orchestrator.inference.servers_file import ServerSpec

if TYPE_CHECKING:
    import aiohttp


log = structlog.get_logger("orchestrator.inference.launch")

#: Seconds between two looks while a server starts (from 50 ms, doubling to this), and
#: between two progress lines.
READY_POLL = 0.5
PROGRESS_EVERY = 15.0


@dataclass(slots=True)
class Launched:
    """One launched server as the supervisor keeps it."""

    name: str
    spec: LaunchSpec
    port: int
    log: Path
    state: str = "new"  # starting, up, restarting, given_up, stopped
    restarts: int = 0
    deaths: list[float] = field(default_factory=list)
    last_exit: str | None = None
    failure: str | None = None  # why it did not start, when it did not
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> str:
        return self.spec.command.replace("{port}", str(self.port))

    def shown(self) -> dict[str, Any]:
        process = self.process
        pid = process.server_pid() if process is not None else None
        live = self.state in ("starting", "up")
        return {
            "name": self.name,
            "url": self.url,
            "command": self.command,
            "env": dict(self.spec.env),
            "state": self.state,
            "pid": pid if live else None,
            "watchdog_pid": process.proc.pid if live and process and process.proc else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "log": str(self.log),
        }


class Supervisor:
    """Launches ``specs`` and keeps them up. Ports are picked when it is made, so the
    worker's server list is known before anything starts."""

    def __init__(self, specs: Sequence[LaunchSpec], settings: SuperviseSettings, base: Path):
        if not specs:
            raise ConfigError("nothing to launch")
        self.settings = settings
        self.dir = Path(os.path.abspath(base)) / f"{procinfo.hostname()}-{os.getpid()}"
        ports: list[int] = []
        for spec in specs:
            port = spec.port or free_port()
            while port in ports and not spec.port:  # the kernel may hand one out twice
                port = free_port()
            if port in ports:
                raise ConfigError(f"two launched servers are given the same port {port}")
            ports.append(port)
        self.servers = [
            Launched(f"server-{n}", spec, port, self.dir / f"server-{n}.log")
            for n, (spec, port) in enumerate(zip(specs, ports, strict=True), start=1)
        ]
        self.session: aiohttp.ClientSession | None = None
        self._stopping = asyncio.Event()
        self.on_down: Callable[[str, str], None] = lambda url, reason: None
        self.on_given_up: Callable[[str, str], None] = lambda url, reason: None
        self._watchers: list[asyncio.Task[None]] = []

    def server_specs(self) -> list[ServerSpec]:
        return [ServerSpec(s.url, s.spec.concurrency) for s in self.servers]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    # ------------------------------------------------------------------ starting

    async def start(self, session: aiohttp.ClientSession, stopping: asyncio.Event) -> None:
        """Start every server and wait until each is ready or given up on; raise
        ``ServersLost`` when none is ready. ``stopping`` set cuts the wait short."""
        self.session = session
        self._stopping = stopping
        self.dir.mkdir(parents=True, exist_ok=True)
        forget_old(self.dir.parent)
        results = await asyncio.gather(*(self._first_start(s) for s in self.servers))
        self._write_state()
        failed = [why for why in results if why is not None]
        if failed and len(failed) == len(self.servers) and not stopping.is_set():
            raise ServersLost(
                f"no launched server started ({len(failed)} tried): " + " | ".join(failed)
            )

    async def _first_start(self, server: Launched) -> str | None:
        """None once ready; else why not (and the server is given up on)."""
        why = await self._start(server)
        if why is None or self._stopping.is_set():
            return None
        server.state = "given_up"
        server.failure = why
        message = f"{server.name}: {why}"
        log.error("server_launch_failed", server=server.url, command=server.command, error=why)
        self.on_given_up(server.url, message)
        return message

    async def _start(self, server: Launched) -> str | None:
        """Start the process and wait for it to be ready: None, or why it is not."""
        server.state = "starting"
        if port_in_use(server.port):
            return (
                f"{server.command!r} cannot start: port {server.port} is already in use by "
                "another process"
            )
        process = ServerProcess(server.spec, server.port, server.log, self.settings)
        server.process = process
        try:
            await process.start()
        except OSError as exc:
            return f"{server.command!r} cannot start: {exc.strerror or exc}"
        log.info("server_starting", server=server.url, command=server.command, log=str(server.log))
        self._write_state()
        why = await self._until_ready(server, process)
        if why is None:
            server.state = "up"
            log.info("server_launched", server=server.url, pid=process.server_pid())
            self._write_state()
            return None
        await process.stop()
        tail = " / ".join(process.tail())
        server.last_exit = describe_exit(process.returncode)
        return f"{server.command!r} {why}; last log lines ({server.log}): {tail or '(none)'}"

    async def _until_ready(self, server: Launched, process: ServerProcess) -> str | None:
        """Poll ``/health`` and ``/v1/models`` until both answer, saying how long it has
        been every ``PROGRESS_EVERY`` seconds; None, or why it never got there."""
        assert self.session is not None
        limit = self.settings.startup_timeout
        started = time.monotonic()
        next_note = started + PROGRESS_EVERY
        reason = "not answering yet"
        delay = 0.05
        while not self._stopping.is_set():
            if process.returncode is not None:
                return f"exited ({describe_exit(process.returncode)}) before it was ready"
            probe = await probes.probe(self.session, server.url, min(10.0, limit))
            if probe.ok:
                listed = await probes.models(self.session, server.url, min(30.0, limit))
                if listed.status == 200 and process.returncode is None:
                    return None
                reason = f"/v1/models: {listed.reason or listed.status}"
            else:
                reason = probe.reason
            now = time.monotonic()
            if now - started >= limit:
                return f"was not ready within {limit:g}s ({reason})"
            if now >= next_note:
                log.info(
                    "server_still_starting",
                    server=server.url,
                    waited_s=round(now - started),
                    timeout_s=limit,
                    reason=reason,
                )
                next_note = now + PROGRESS_EVERY
            await _sleep_unless(self._stopping, delay)
            delay = min(delay * 2, READY_POLL)
        return "not started: the run is stopping"

    # ------------------------------------------------------------------ watching

    def watch(self) -> None:
        """Watch each ready server from now on (restarting it when it dies)."""
        for server in self.servers:
            if server.state == "up":
                task = asyncio.create_task(self._watch(server), name=f"watch {server.name}")
                self._watchers.append(task)

    async def _watch(self, server: Launched) -> None:
        while not self._stopping.is_set():
            assert server.process is not None
            why = await self._until_down(server, server.process)
            if why is None:
                return  # stopping
            if not await self._died(server, why):
                return
            while True:  # a restart that does not get ready counts as another death
                started = await self._start(server)
                if started is None:
                    server.restarts += 1
                    break
                if self._stopping.is_set() or not await self._died(server, started):
                    return

    async def _until_down(self, server: Launched, process: ServerProcess) -> str | None:
        """Why the server went down (its process exited, or it stopped answering
        ``/health``); None when the run stops first."""
        assert self.session is not None
        exited = asyncio.ensure_future(process.wait())
        misses = 0
        try:
            while not self._stopping.is_set():
                done, _ = await asyncio.wait({exited}, timeout=self.settings.health_every)
                if done or self._stopping.is_set():
                    break
                probe = await probes.probe(self.session, server.url, self.settings.health_timeout)
                misses = 0 if probe.ok else misses + 1
                if misses >= self.settings.health_misses:
                    return f"stopped answering /health ({misses} looks in a row: {probe.reason})"
            if self._stopping.is_set():
                return None
            return f"exited ({describe_exit(process.returncode)})"
        finally:
            exited.cancel()

    async def _died(self, server: Launched, why: str) -> bool:
        """Report a death; wait out the backoff. False: given up on (or stopping)."""
        now = time.monotonic()
        server.deaths = [t for t in server.deaths if now - t < self.settings.death_window]
        server.deaths.append(now)
        # The pool first: items in flight there go back with their attempt given back.
        self.on_down(server.url, f"launched server {why}")
        process = server.process
        if process is not None:
            await process.stop()
            server.last_exit = describe_exit(process.returncode)
        tail = " / ".join(process.tail()) if process is not None else ""
        deaths = len(server.deaths)
        if deaths >= self.settings.max_deaths:
            server.state = "given_up"
            window = self.settings.death_window
            message = (
                f"{server.name} ({server.command!r}) given up on: it died {deaths} times "
                f"within {window:g}s, last {why}; last log lines ({server.log}): {tail}"
            )
            log.error("server_given_up", server=server.url, deaths=deaths, error=message)
            self._write_state()
            self.on_given_up(server.url, message)
            return False
        delay = min(
            self.settings.restart_backoff * 2 ** (deaths - 1), self.settings.restart_backoff_cap
        )
        server.state = "restarting"
        log.warning(
            "server_died",
            server=server.url,
            reason=why,
            deaths=deaths,
            restart_in_s=round(delay, 1),
            log=str(server.log),
            last_lines=tail,
        )
        self._write_state()
        await _sleep_unless(self._stopping, delay)
        return not self._stopping.is_set()

    # ------------------------------------------------------------------ stopping

    async def stop(self) -> None:
        """Stop watching, then stop every server (SIGTERM, then SIGKILL)."""
        self._stopping.set()
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        running = [s for s in self.servers if s.process is not None]
        if running:
            log.info("stopping_servers", servers=[s.url for s in running])
        await asyncio.gather(*(s.process.stop() for s in running if s.process is not None))
        for server in running:
            if server.state != "given_up" and server.process is not None:
                server.state = "stopped"
                server.last_exit = describe_exit(server.process.returncode)
        if running:
            log.info("servers_stopped", exits={s.url: s.last_exit for s in running})
        self._write_state(stopped=True)

    def _write_state(self, *, stopped: bool = False) -> None:
        """``servers.json``: the servers, their states and logs, for ``status``."""
        doc = {
            "host": procinfo.hostname(),
            "worker_pid": os.getpid(),
            "updated_at": time.time(),
            "stopped": stopped,
            "servers": [s.shown() for s in self.servers],
        }
        path = self.dir / STATE_FILE
        with contextlib.suppress(OSError):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)


async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


async def look_briefly(supervisor: Supervisor, session: aiohttp.ClientSession) -> dict[str, Any]:
    """Start the first server ``supervisor`` has, read its context length and whose
    metrics it serves, and stop it: what ``plan`` says of a server before the run."""
    server = supervisor.servers[0]
    supervisor.servers = [server]
    started = time.monotonic()
    try:
        try:
            await supervisor.start(session, asyncio.Event())
        except ServersLost:
            return {"name": server.name, "command": server.command, "error": server.failure}
        ready_s = round(time.monotonic() - started, 1)
        context = await probes.context_length(session, server.url, 30.0)
        try:
            text = await probes.metrics_text(session, server.url, 30.0)
            kind = server_metrics.view(server_metrics.parse(text))["kind"]
        except probes.RequestFailed:
            kind = None
        return {
            "name": server.name,
            "command": server.command,
            "ready_s": ready_s,
            "context_length": context,
            "metrics": kind,
        }
    finally:
        await supervisor.stop()
