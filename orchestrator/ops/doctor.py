"""Pre-flight checks for a long run: each one a PASS or FAIL line a person can act on.

A 30-hour run should not find out at hour 20 that the disk fills up, that the server
serves another model, or that the schema needs an upgrade its workers cannot do. The
checks only read: nothing is created, upgraded or sent for generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from orchestrator._util.urls import credentials_sent, refused_advice
from orchestrator.errors import EmptyDatabase, OrchestratorError, ServersLost
from orchestrator.inference import probes
from orchestrator.inference.client import base_url
from orchestrator.monitor.status import snapshot
from orchestrator.store import Database, list_datasets, open_database, resolve_url
from orchestrator.store.migrate import SCHEMA_REVISION
from orchestrator.store.outputs import output_bytes

log = structlog.get_logger("orchestrator.doctor")

# Bytes an answer adds to the database when no item is done yet to measure: a few
# thousand tokens of text, stored as content and as the message JSON, plus indexes.
DEFAULT_BYTES_PER_ITEM = 32 * 1024
# The WAL may grow to journal_size_limit between checkpoints, beside the database.
WAL_ALLOWANCE = 64 * 1024 * 1024
# Pages, indexes and free space around the measured answer sizes.
STORAGE_OVERHEAD = 1.5
SAMPLE_OUTPUTS = 1000


@dataclass(frozen=True, slots=True)
class Check:
    """One result. ``ok`` is None when the check could not apply (shown as SKIP), or, with
    ``info``, when there is nothing wrong yet to check (INFO: no database before enqueue)."""

    name: str
    ok: bool | None
    detail: str
    info: bool = False

    @property
    def line(self) -> str:
        label = "INFO" if self.info else {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        return f"{label}  {self.name}: {self.detail}"


@dataclass(frozen=True, slots=True)
class DoctorConfig:
    db: str | None = None
    servers: tuple[str, ...] = ()
    model: str | None = None
    api_key: str | None = None
    #: Basic credentials by server, taken out of the URLs (orchestrator._util.urls).
    basic_auth: dict[str, aiohttp.BasicAuth] = field(default_factory=dict, repr=False)
    clock_tolerance: float = 60.0
    bytes_per_item: int | None = None  # None: measured from done items, else the default
    timeout: float = 10.0
    #: Check that each server offers the Batch API (``run --batch-api``).
    batch_api: bool = False


@dataclass(slots=True)
class _DbFacts:
    """What the database check learnt, for the checks after it."""

    readable: bool = False
    models: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    output_bytes: float | None = None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _sqlite_file(db: str | None) -> Path | None:
    url = resolve_url(db)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(url.database).absolute()


async def check_database(config: DoctorConfig, facts: _DbFacts) -> Check:
    """Reachable and at the schema head this orchestrator knows; never upgraded here.

    Opened as every read-only command opens it (``open_database(mode="read")``): the same
    checks, the same advice, and nothing of the file changed, whatever it turns out to be.
    """
    path = _sqlite_file(config.db)
    if path is not None and not path.exists():
        return Check(
            "database",
            None,
            f"{path} not created yet: `orchestrator enqueue` creates it",
            info=True,
        )
    try:
        database = await open_database(config.db, mode="read")
    except EmptyDatabase as exc:
        # Before the first enqueue an empty database is as fine as a missing one.
        return Check("database", None, str(exc), info=True)
    except OrchestratorError as exc:
        return Check("database", False, str(exc))
    try:
        await _learn(database, facts)
    except OrchestratorError as exc:
        return Check("database", False, str(exc))
    finally:
        await database.close()
    total = facts.counts.get("total", 0)
    return Check(
        "database",
        True,
        f"{database.where}: schema {SCHEMA_REVISION}, {total:,} items "
        f"({facts.counts.get('done', 0):,} done)",
    )


async def _learn(database: Database, facts: _DbFacts) -> None:
    datasets = await list_datasets(database)
    facts.models = sorted({m for d in datasets if isinstance(m := d.params.get("model"), str)})
    facts.counts = dict((await snapshot(database))["totals"]["counts"])
    if facts.counts.get("done"):
        facts.output_bytes = await output_bytes(database, SAMPLE_OUTPUTS)
    facts.readable = True


async def check_server(
    session: aiohttp.ClientSession, server: str, wanted: list[str], config: DoctorConfig
) -> list[Check]:
    """``/health`` answers, ``/v1/models`` serves the wanted models, the clocks agree."""
    url = base_url(server)
    name = f"server {url}"
    started = time.monotonic()
    try:
        reply = await probes.get(session, url + "/health", config.timeout)
        status, date = reply.status, reply.date
        received = time.time()
    except probes.RequestFailed as exc:
        reason = str(exc)
        return [
            Check(name, False, f"/health: {reason}"),
            Check(f"models {url}", None, "server unreachable"),
            Check(f"clock {url}", None, "server unreachable"),
        ]
    took = (time.monotonic() - started) * 1000
    checks = [
        Check(name, status == 200, f"/health answered {status} in {took:.0f} ms"),
        await _check_models(session, url, wanted, config.timeout, _sent(server, config)),
        _check_clock(url, date, received, config.clock_tolerance),
    ]
    if config.batch_api:
        checks.append(await _check_batch_api(session, url, config.timeout))
    return checks


async def _check_batch_api(session: aiohttp.ClientSession, url: str, seconds: float) -> Check:
    """The server lists its batches (``GET /v1/batches``): it offers the Batch API."""
    name = f"batch API {url}"
    try:
        reply = await probes.get(session, url + "/v1/batches?limit=1", seconds)
    except probes.RequestFailed as exc:
        return Check(name, False, f"/v1/batches: {exc}")
    if reply.status == 200:
        return Check(name, True, "offers the Batch API (/v1/files, /v1/batches)")
    return Check(
        name,
        False,
        f"GET /v1/batches answered {reply.status}: it does not offer the Batch API; "
        "run without --batch-api",
    )


def _sent(server: str, config: DoctorConfig) -> str:
    return credentials_sent(server, config.api_key, config.basic_auth)


async def _check_models(
    session: aiohttp.ClientSession, url: str, wanted: list[str], seconds: float, sent: str
) -> Check:
    name = f"models {url}"
    try:
        reply = await probes.get(session, url + "/v1/models", seconds)
        status, text = reply.status, reply.body.strip()
        body: Any = json.loads(text.decode()) if status == 200 and text else None
    except (probes.RequestFailed, ValueError) as exc:
        return Check(name, False, f"/v1/models: {str(exc) or type(exc).__name__}")
    if body is None:
        hint = f" ({refused_advice(sent, status)})" if status in (401, 403) else ""
        return Check(name, False, f"/v1/models answered {status}{hint}")
    try:
        served = sorted(str(m["id"]) for m in body["data"])
    except (KeyError, TypeError):
        return Check(name, False, "/v1/models: not an OpenAI model list")
    if not wanted:
        return Check(name, True, f"serves {', '.join(served) or 'nothing'} (no model asked for)")
    missing = [m for m in wanted if m not in served]
    if missing:
        return Check(
            name, False, f"does not serve {', '.join(missing)} (it serves {', '.join(served)})"
        )
    return Check(name, True, f"serves {', '.join(wanted)}")


def _check_clock(url: str, date: str | None, received: float, tolerance: float) -> Check:
    name = f"clock {url}"
    if not date:
        return Check(name, None, "the server sent no Date header")
    try:
        server_time = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return Check(name, None, f"unreadable Date header {date!r}")
    # Date is truncated to the second: the server's clock read half a second later.
    skew = received - (server_time + 0.5)
    ok = abs(skew) <= tolerance
    where = "ahead of" if skew > 0 else "behind"
    detail = f"this host is {abs(skew):.0f} s {where} the server (limit {tolerance:.0f} s)"
    if not ok:
        detail += "; leases and rates depend on the clock: fix NTP"
    return Check(name, ok, detail)


def check_disk(config: DoctorConfig, facts: _DbFacts) -> Check:
    """Free space at the database against what the rest of the run will add to it.

    The projection is the remaining items times the bytes an answer takes (measured on
    the latest done items, or an estimate before any is done), plus room for the WAL.
    """
    path = _sqlite_file(config.db)
    if path is None:
        return Check("disk", None, "not a SQLite file")
    if not facts.readable and path.exists():
        return Check("disk", None, "database not readable")
    size = sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    remaining = facts.counts.get("pending", 0) + facts.counts.get("running", 0)
    if config.bytes_per_item is not None:
        per_item, how = float(config.bytes_per_item), "as given"
    elif facts.output_bytes:
        per_item, how = facts.output_bytes * STORAGE_OVERHEAD, "measured"
    else:
        per_item, how = float(DEFAULT_BYTES_PER_ITEM), "estimated"
    answers = remaining * per_item
    needed = answers + WAL_ALLOWANCE
    if not path.parent.is_dir():
        return Check("disk", False, f"directory {path.parent} does not exist")
    if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
        return Check(
            "disk",
            False,
            f"{path.parent} is on a read-only file system: workers cannot write the "
            "database there (status, export and report can read it)",
        )
    free = shutil.disk_usage(path.parent).free
    # Every figure adds up: size + answers = ends near; answers + WAL = needed.
    detail = (
        f"{_size(free)} free at {path.parent}; the database is {_size(size)}, and "
        f"{remaining:,} items to go at ~{_size(per_item)} each ({how}) add "
        f"{_size(answers)} (ends near {_size(size + answers)}); with {_size(WAL_ALLOWANCE)} "
        f"for the WAL that needs {_size(needed)} free"
    )
    return Check("disk", free >= needed, detail)


async def run_checks(config: DoctorConfig) -> list[Check]:
    """Every check, in the order a person would fix things."""
    facts = _DbFacts()
    checks = [await check_database(config, facts)]
    wanted = [config.model] if config.model else facts.models
    if not config.servers:
        checks.append(Check("servers", None, "none given (--server or ORCHESTRATOR_SERVERS)"))
    session = probes.plain_session("orchestrator-doctor", config.api_key, config.basic_auth)
    async with session:
        for server in config.servers:
            checks.extend(await check_server(session, server, wanted, config))
    checks.append(check_disk(config, facts))
    for check in checks:
        log.debug("doctor_check", check=check.name, ok=check.ok, detail=check.detail)
    return checks


async def run_checks_launched(config: DoctorConfig, supervisor: Any) -> list[Check]:
    """The checks with the servers ``supervisor`` launches for them: started, each a
    ``launch`` line (ready, or why not), checked as any server, then stopped."""

    session = probes.plain_session("orchestrator-doctor", config.api_key, config.basic_auth)
    checks: list[Check] = []
    async with session:
        try:
            with contextlib.suppress(ServersLost):  # each server's line below says why
                await supervisor.start(session, asyncio.Event())
            for server in supervisor.servers:
                ok = server.state == "up"
                detail = f"{server.name} ready at {server.url}" if ok else server.failure
                checks.append(Check("launch", ok, detail or "not started"))
            ready = tuple(s.url for s in supervisor.servers if s.state == "up")
            more = dataclasses.replace(config, servers=config.servers + ready)
            return checks + await run_checks(more)
        finally:
            await supervisor.stop()


def passed(checks: list[Check]) -> bool:
    return all(c.ok is not False for c in checks)


__all__ = ["Check", "DoctorConfig", "passed", "run_checks"]
