"""The reliability scenarios that matter most for a shared queue, on PostgreSQL.

Worker processes (real ``orchestrator run`` subprocesses) share one PostgreSQL database:
SIGKILLed again and again (every item still exported exactly once), and several at once
(no item claimed twice: one attempt each, every answer exported once). Sized for CI, a
few seconds each; ``pytest -m slow`` runs larger ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.test_scenarios import SimFactory, kill_repeatedly, share, sizes
from tests.helpers import (
    check_export,
    cli,
    item_rows,
    prompts,
    query,
    start_worker,
    write_jsonl,
)

pytestmark = pytest.mark.postgresql


def enqueue(tmp_path: Path, url: str, n: int) -> list[str]:
    data = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    result = cli("enqueue", str(data), "--dataset", "d", "--db", url)
    assert result.returncode == 0, result.stderr
    return [f"p{i:06d}" for i in range(n)]


def verify(tmp_path: Path, url: str, keys: list[str], figures: dict[str, Any]) -> None:
    rows = item_rows(url)
    assert {s for _, s, _ in rows} == {"done"}
    check_export(url, tmp_path / "out.jsonl", keys)
    assert query(url, "SELECT count(*) FROM outputs") == [(len(keys),)]
    # Exactly once, from the database's side too: one output per item, none orphaned.
    assert query(url, "SELECT count(DISTINCT item_id) FROM outputs") == [(len(keys),)]
    figures.update(items=len(keys), lost=0, duplicated=0, mismatched=0)


@pytest.mark.parametrize(("n", "kills"), sizes((1000, 3), (5000, 15)))
def test_crash_loop_postgresql(
    tmp_path: Path,
    sim_process: SimFactory,
    pg_database: Callable[[], str],
    figures: dict[str, Any],
    n: int,
    kills: int,
) -> None:
    rng = random.Random(n + kills)
    url = pg_database()
    server = sim_process("--latency", "0.05", "--per-token", "0.001", "--mean-tokens", "40")
    keys = enqueue(tmp_path, url, n)
    # Items in flight at several kills run in groups (they may be what killed it): a
    # modest concurrency keeps the CI variant to a few seconds.
    concurrency = "16" if kills < 10 else "48"
    reclaimed = kill_repeatedly(
        lambda: start_worker(url, server.url, "--concurrency", concurrency, "--exit-when-done"),
        kills,
        rng,
        lambda: query(url, "SELECT count(*) FROM items WHERE state = 'running'")[0][0],
        awake=(0.8, 2.0),
    )
    worker = start_worker(url, server.url, "--concurrency", concurrency, "--exit-when-done")
    _, stderr = worker.communicate(timeout=300)
    assert worker.returncode == 0, stderr[-3000:]
    figures.update(kills=kills, reclaimed=reclaimed)
    verify(tmp_path, url, keys, figures)


@pytest.mark.parametrize(("workers", "n"), sizes((3, 3000), (6, 20000)))
def test_many_workers_postgresql(
    tmp_path: Path,
    sim_process: SimFactory,
    pg_database: Callable[[], str],
    figures: dict[str, Any],
    workers: int,
    n: int,
) -> None:
    url = pg_database()
    server = sim_process("--latency", "0.02")
    keys = enqueue(tmp_path, url, n)
    done_by = share(url, server.url, workers, n)
    assert server.stats()["chat_requests"] == n
    owners = query(url, "SELECT count(DISTINCT id) FROM workers")
    assert owners == [(workers,)]
    figures.update(workers=workers, done_by_worker=done_by)
    verify(tmp_path, url, keys, figures)
