"""Shared fixtures: real databases (SQLite files and PostgreSQL), the simulated server over
loopback, subprocesses.

The storage conformance suite: every test that takes ``database`` (or ``db_url``) runs
once per backend, as ``[sqlite]`` and ``[postgresql]`` (``pytest -k postgresql`` picks the
PostgreSQL runs). The PostgreSQL variant gets a database of its own, created for the test
on the server at ``ORCHESTRATOR_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432``,
trust auth) and dropped after it. PostgreSQL is on every dev and CI machine: when it
cannot be reached the PostgreSQL variants fail, they are never skipped.

A test about the SQLite file itself (WAL, pragmas, the file's bytes, a lock held by
another process) runs on SQLite only: mark it ``sqlite_only``, or take ``db_path`` beside
``database`` (the database is then the file at ``db_path``).
"""

from __future__ import annotations

import asyncio
import compileall
import concurrent.futures
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from orchestrator.sim import SimConfig, serve
from orchestrator.store import Database, open_database
from tests.helpers import REPO, STARTED, Hostile, SimProcess

BACKENDS = ("sqlite", "postgresql")
PG_SERVER = os.environ.get("ORCHESTRATOR_TEST_PG", "postgresql://postgres@127.0.0.1:5432")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite_only: a test about the SQLite file itself")
    config.addinivalue_line("markers", "postgresql: runs against a PostgreSQL database")
    if not hasattr(config, "workerinput"):  # once, in the process that starts the others
        _compile_sources()


def _compile_sources() -> None:
    """Byte-compile the package once, before the thousands of processes the tests start
    import it: with ``PYTHONDONTWRITEBYTECODE`` set (as on many CI machines) and an
    editable install, each of them would otherwise compile every module it imports."""
    for folder in ("orchestrator", "migrations", "tests", "scripts"):
        compileall.compile_dir(REPO / folder, quiet=1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that reaches the ``backend`` fixture runs once per backend."""
    if "backend" not in metafunc.fixturenames:
        return
    if any(
        "backend" in (getattr(m, "args", None) or ())
        for m in metafunc.definition.iter_markers("parametrize")
    ):
        return  # the test chose its backends itself
    only_sqlite = (
        metafunc.definition.get_closest_marker("sqlite_only") is not None
        or "db_path" in metafunc.fixturenames
    )
    chosen = ("sqlite",) if only_sqlite else BACKENDS
    metafunc.parametrize(
        "backend",
        [
            pytest.param(b, id=b, marks=[pytest.mark.postgresql] if b == "postgresql" else [])
            for b in chosen
        ],
        indirect=True,
    )


#: Modules whose tests share one daemon set up per module (a Slurm cluster): run by one
#: process when the suite is spread over several (``pytest -n``, ``--dist loadgroup``).
SERIAL_GROUPS = {"test_slurm.py": "slurm", "test_launch_slurm.py": "slurm"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = SERIAL_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return getattr(request, "param", "sqlite")


def _pg_admin(sql: str) -> None:
    """One statement on the server's ``postgres`` database (from a thread of its own: the
    caller may be inside a running event loop)."""

    async def run() -> None:
        import asyncpg

        conn = await asyncpg.connect(f"{PG_SERVER}/postgres", timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


def create_pg_database() -> str:
    """A new, empty PostgreSQL database; its URL. Fails loudly when the server is down."""
    name = f"orch_test_{secrets.token_hex(6)}"
    try:
        _pg_admin(f"CREATE DATABASE {name}")
    except OSError as exc:
        raise RuntimeError(
            f"PostgreSQL at {PG_SERVER} is unreachable ({exc}): the PostgreSQL tests need it"
        ) from exc
    return f"{PG_SERVER}/{name}"


def drop_pg_database(url: str) -> None:
    name = url.rsplit("/", 1)[-1]
    _pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pg_database() -> Iterator[Callable[[], str]]:
    """Make fresh PostgreSQL databases (URLs); all are dropped after the test."""
    made: list[str] = []

    def make() -> str:
        made.append(create_pg_database())
        return made[-1]

    yield make
    for url in made:
        drop_pg_database(url)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, pg_database: Callable[[], str]) -> str:
    """What ``--db`` names for this backend: an SQLite file, or a fresh PostgreSQL database."""
    if backend == "postgresql":
        return pg_database()
    return str(tmp_path / "queue.db")


@pytest.fixture(autouse=True)
def _fresh_logging() -> None:
    """Each test starts with structlog's defaults: a command run in-process by an earlier
    test may have set a level that filters out the events a later test captures."""
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _no_stray_workers() -> Iterator[None]:
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


StartSim = Callable[..., Awaitable[str]]
Mount = Callable[..., Path]


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Mount]:
    """Mount small tmpfs or bind mounts under ``tmp_path``; unmounted afterwards.

    Root only: the test is skipped where mounting is refused. ``mounted("-t", "tmpfs",
    "-o", "size=4m")`` is a 4 MiB disk to fill; ``source`` names what else to mount.
    """
    mounts: list[Path] = []

    def mount(*options: str, source: str = "tmpfs", name: str = "mnt") -> Path:
        target = tmp_path / name
        target.mkdir(exist_ok=True)
        result = subprocess.run(["mount", *options, source, str(target)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount here: {result.stderr.decode().strip()}")
        mounts.append(target)
        return target

    yield mount
    for target in reversed(mounts):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
async def database(db_url: str) -> AsyncIterator[Database]:
    db = await open_database(db_url)
    yield db
    await db.close()


@pytest.fixture
async def sim() -> AsyncIterator[StartSim]:
    """Start in-process simulated servers on free ports; stopped after the test."""
    runners = []

    async def start(**options: Any) -> str:
        runner, port = await serve(SimConfig(**options), "127.0.0.1", 0)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def sim_process() -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def start(*args: str, port: int = 0) -> SimProcess:
        proc = SimProcess(*args, port=port)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def hostile() -> Iterator[Callable[..., Hostile]]:
    """Start ``tests.hostile_server`` processes; stopped after the test."""
    started: list[Hostile] = []

    def start(*args: str) -> Hostile:
        started.append(Hostile(*args))
        return started[-1]

    yield start
    for server in started:
        server.stop()
