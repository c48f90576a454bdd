"""``orchestrator doctor`` against a real simulated server and real SQLite files."""

from __future__ import annotations

import email.utils
import socket
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from orchestrator.ops.doctor import DoctorConfig, _check_clock, passed, run_checks
from orchestrator.store.migrate import SCHEMA_REVISION
from tests.helpers import SimProcess, cli, prompts, write_jsonl

SimFactory = Callable[..., SimProcess]


def enqueue(tmp_path: Path, db: Path, n: int = 5, model: str = "sim-model") -> None:
    src = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    result = cli("enqueue", str(src), "-d", "ds", "--model", model, "--db", str(db))
    assert result.returncode == 0, result.stderr


def doctor(db: Path, *args: str) -> tuple[int, dict[str, str]]:
    """Exit code, and each check's line by the check's name."""
    result = cli("doctor", "--db", str(db), *args)
    lines = {}
    for line in result.stdout.splitlines():
        label, _, rest = line.partition("  ")
        name = rest.split(": ", 1)[0]
        lines[name] = line
        assert label in ("PASS", "FAIL", "SKIP"), line
    assert result.stderr == "", result.stderr
    return result.returncode, lines


async def doctor_in_process(db: Path, **options: object) -> tuple[int, dict[str, str]]:
    """The same checks without a process start, where the exit code is not the point."""
    checks = await run_checks(DoctorConfig(db=str(db), **options))  # type: ignore[arg-type]
    return (0 if passed(checks) else 1), {c.name: c.line for c in checks}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_all_pass(tmp_path: Path, sim_process: SimFactory) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db)
    sim = sim_process()
    code, lines = doctor(db, "--server", sim.url)
    assert code == 0, lines
    assert list(lines) == [
        "database",
        f"server {sim.url}",
        f"models {sim.url}",
        f"clock {sim.url}",
        "disk",
    ]
    assert all(line.startswith("PASS") for line in lines.values()), lines
    assert f"schema {SCHEMA_REVISION}, 5 items (0 done)" in lines["database"]
    assert "serves sim-model" in lines[f"models {sim.url}"]
    # Answers measured once some are done.
    result = cli("run", "--server", sim.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    code, lines = doctor(db, "--server", sim.url)
    assert code == 0 and "(measured)" in lines["disk"], lines


async def test_server_down_and_wrong_model(tmp_path: Path, sim_process: SimFactory) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db, model="Qwen/Qwen3-8B")
    sim = sim_process()
    down = f"http://127.0.0.1:{free_port()}"
    code, lines = doctor(db, "--server", sim.url, "--server", down)
    assert code == 1
    # The datasets ask for a model the server does not serve.
    assert lines[f"models {sim.url}"].startswith(
        f"FAIL  models {sim.url}: does not serve Qwen/Qwen3-8B (it serves sim-model)"
    )
    assert lines[f"server {sim.url}"].startswith("PASS")
    assert lines[f"server {down}"].startswith(f"FAIL  server {down}: /health: ")
    assert lines[f"models {down}"].startswith("SKIP")
    # --model overrides what the datasets ask for.
    code, lines = await doctor_in_process(db, servers=(sim.url,), model="sim-model")
    assert code == 0, lines


async def test_schema_newer_or_missing_is_reported_not_changed(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db)
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    before = db.read_bytes()
    code, lines = doctor(db)
    assert code == 1
    assert lines["database"].startswith("FAIL  database: ")
    assert (
        f"schema version '9999' is newer than this orchestrator knows "
        f"(it knows up to '{SCHEMA_REVISION}')" in lines["database"]
    )
    assert lines["disk"].startswith("SKIP")
    assert db.read_bytes() == before

    empty = tmp_path / "empty.db"
    empty.touch()
    code, lines = await doctor_in_process(empty)
    # Nothing enqueued yet, as for a missing file: said, not failed, and not touched.
    assert code == 0 and lines["database"].startswith("INFO  database: ")
    assert "empty database" in lines["database"]
    assert "`orchestrator enqueue` creates the schema" in lines["database"]
    assert empty.read_bytes() == b"", "doctor must not write to the file"

    missing = tmp_path / "missing.db"
    code, lines = await doctor_in_process(missing)
    # Before the first enqueue there is nothing wrong yet: said, not failed.
    assert code == 0 and lines["database"].startswith("INFO  database: ")
    assert "not created yet" in lines["database"]
    assert not missing.exists()


async def test_no_disk_headroom_for_the_projection(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db, n=10)
    code, lines = doctor(db, "--bytes-per-item", str(10**17))
    assert code == 1
    assert lines["disk"].startswith("FAIL  disk: ")
    assert "10 items to go" in lines["disk"] and "(as given)" in lines["disk"]
    code, lines = await doctor_in_process(db, bytes_per_item=1000)
    assert code == 0 and lines["disk"].startswith("PASS"), lines


@pytest.fixture
def small_disk(mounted: Callable[..., Path]) -> Path:
    return mounted("-t", "tmpfs", "-o", "size=4m")


async def test_no_disk_headroom_on_a_small_disk(tmp_path: Path, small_disk: Path) -> None:
    db = small_disk / "q.db"
    enqueue(tmp_path, db, n=50)
    code, lines = await doctor_in_process(db)
    assert code == 1
    assert lines["disk"].startswith("FAIL  disk: ")
    assert f"free at {small_disk}" in lines["disk"] and "(estimated)" in lines["disk"]


def test_clock_skew() -> None:
    now = time.time()
    ok = _check_clock("http://s", email.utils.formatdate(now, usegmt=True), now, 60)
    assert ok.ok is True
    behind = _check_clock("http://s", email.utils.formatdate(now + 300, usegmt=True), now, 60)
    assert behind.ok is False and "behind the server" in behind.line and "NTP" in behind.line
    assert _check_clock("http://s", None, now, 60).ok is None


def test_the_batch_api_offered_or_not(tmp_path: Path, sim_process: SimFactory) -> None:
    db = tmp_path / "q.db"
    enqueue(tmp_path, db)
    offers, lacks = sim_process(), sim_process("--no-batch-api")
    code, lines = doctor(db, "--server", offers.url, "--batch-api")
    assert code == 0, lines
    assert "PASS  batch API" in lines[f"batch API {offers.url}"]
    code, lines = doctor(db, "--server", lacks.url, "--batch-api")
    assert code == 1
    said = lines[f"batch API {lacks.url}"]
    assert said.startswith("FAIL") and "answered 404" in said and "without --batch-api" in said
    code, lines = doctor(db, "--server", lacks.url)  # not asked: not checked
    assert code == 0 and f"batch API {lacks.url}" not in lines
