"""The Python API (docs/API.md) against real databases and the simulated server: the
same datasets, figures and lines as the command, and a run that stops cleanly when
embedded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import orchestrator as orc
from tests.conftest import StartSim
from tests.helpers import REPO, SimProcess, cli, prompts, query, write_jsonl

ROWS = [
    {"id": "a", "prompt": "first"},
    {"messages": [{"role": "user", "content": "second"}], "id": "b"},
    {"conversations": [{"from": "human", "value": "third"}], "id": "c"},
]


def _example() -> str:
    """The first Python block of docs/API.md, as written."""
    text = (REPO / "docs" / "API.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match is not None
    return match.group(1)


def test_the_documented_example_runs_as_written(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process("--fault", "500=0.1")
    env = {**os.environ, "ORCHESTRATOR_SERVERS": server.url, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "enqueued 50 items into 'chat'" in done.stdout
    lines = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 50
    assert lines[0]["conversations"][-1]["from"] == "gpt"
    assert query(tmp_path / "run.db", "SELECT count(*) FROM items WHERE state = 'done'") == [(50,)]


async def test_dicts_make_the_dataset_a_file_makes(tmp_path: Path, db_url: str) -> None:
    """Rows given as dicts and the same rows enqueued from a file by the command: the
    same items, requests and settings."""
    file = write_jsonl(tmp_path / "in.jsonl", ROWS)
    args = ["--model", "m", "--max-tokens", "32", "--temperature", "0.5"]
    done = cli("enqueue", str(file), "-d", "cli", *args, "--db", db_url)
    assert done.returncode == 0, done.stderr
    async with orc.open(db_url) as q:
        report = await q.enqueue(ROWS, dataset="api", model="m", max_tokens=32, temperature=0.5)
        again = await q.enqueue(
            iter(ROWS), dataset="api", model="m", max_tokens=32, temperature=0.5
        )
    assert (report.added, report.created, report.formats) == (3, True, {
        "prompt": 1, "messages": 1, "sharegpt": 1
    })  # fmt: skip
    assert (again.added, again.already_present) == (0, 3)
    sql = (
        "SELECT i.key, i.request, d.params FROM items i JOIN datasets d ON d.id = i.dataset_id "
        "WHERE d.name = ? ORDER BY i.position"
    )
    assert query(db_url, sql, "api") == query(db_url, sql, "cli")


async def test_a_bad_row_is_named_by_its_position(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    rows = [{"prompt": "fine"}, {"messages": "not a list"}, {"prompt": "fine too"}]
    async with orc.open(db) as q:
        with pytest.raises(orc.InputError) as caught:
            await q.enqueue(rows, dataset="d", model="m")
        assert (caught.value.path, caught.value.line) == ("<records>", 2)
        assert str(caught.value).startswith("<records>:2: ")
        report = await q.enqueue(rows, dataset="d", model="m", skip_invalid=True)
        assert report.added == 2 and [e.line for e in report.invalid] == [2]
        with pytest.raises(orc.InputError, match=r"^<records>:2: not a JSON object"):
            await q.enqueue([{"prompt": "ok"}, {"prompt": object()}], dataset="f", model="m")
        with pytest.raises(orc.InputError, match=r"^<records>: no records"):
            await q.enqueue([], dataset="g", model="m")
        with pytest.raises(orc.InputError, match=r"missing\.jsonl: no such file"):
            await q.enqueue(tmp_path / "missing.jsonl", dataset="e", model="m")


async def test_options_are_checked_as_the_command_checks_them(tmp_path: Path) -> None:
    async with orc.open(str(tmp_path / "q.db")) as q:
        with pytest.raises(orc.ConfigError, match="temperature"):
            await q.enqueue(ROWS, dataset="d", model="m", temperature=-1.0)
        passed = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                     "content": "a"}]}]  # fmt: skip
        await q.enqueue(passed, dataset="kept", passthrough=True)
        with pytest.raises(orc.ConfigError, match=r"pass-through.*max_tokens"):
            await q.enqueue(passed, dataset="kept", max_tokens=5)
        with pytest.raises(orc.ConfigError, match="name which"):
            await q.requeue(state="done")
        with pytest.raises(orc.ConfigError, match="no such dataset: nope"):
            await q.pause("nope")
        with pytest.raises(orc.ConfigError, match="at least one server"):
            await q.run(servers=[])


async def test_run_status_results_and_export_agree_with_the_command(
    tmp_path: Path, db_url: str, sim: StartSim
) -> None:
    url = await sim(faults={"500": 0.2})
    async with orc.open(db_url) as q:
        await q.enqueue(prompts(30), dataset="one", model="m", max_tokens=16)
        await q.enqueue(prompts(20, "x"), dataset="two", model="m", max_tokens=16)
        outcome = await q.run(servers=[url], concurrency=8, retry_backoff=0.01)
        assert outcome.stats.completed == 50 and outcome.stopped == []
        status = await q.status()
        rows = [row async for row in q.results(format="sharegpt")]
        only_two = [row async for row in q.results(dataset="two")]
        await q.export(tmp_path / "api.jsonl", format="sharegpt")
    assert status.finished and status.counts["done"] == 50
    assert status.datasets["two"]["counts"]["done"] == 20
    shown = json.loads(cli("status", "--json", "--db", db_url).stdout)
    assert shown["totals"]["counts"] == status.totals["counts"]
    assert shown["totals"]["errors"] == status.totals["errors"]
    out = tmp_path / "cli.jsonl"
    assert cli("export", str(out), "--format", "sharegpt", "--db", db_url).returncode == 0
    expected = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows == expected
    assert (tmp_path / "api.jsonl").read_bytes() == out.read_bytes()
    plain = tmp_path / "two.jsonl"
    assert cli("export", str(plain), "--dataset", "two", "--db", db_url).returncode == 0
    assert only_two == [json.loads(x) for x in plain.read_text().splitlines()]


async def _running(db: str, at_least: int) -> None:
    for _ in range(400):
        if query(db, "SELECT count(*) FROM items WHERE state = 'running'")[0][0] >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the run never claimed anything")


async def test_cancelling_a_run_releases_its_leases(db_url: str, sim: StartSim) -> None:
    url = await sim(latency=30.0)  # nothing answers before the cancel
    async with orc.open(db_url) as q:
        await q.enqueue(prompts(10), dataset="d", model="m")
        task = asyncio.create_task(q.run(servers=[url], concurrency=4, grace=60.0))
        await _running(db_url, 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        states = dict(query(db_url, "SELECT state, count(*) FROM items GROUP BY state"))
        assert states == {"pending": 10}
        # Released, not lost: the attempts are given back and the leases cleared.
        assert query(db_url, "SELECT count(*) FROM items WHERE lease_owner IS NOT NULL") == [(0,)]


async def test_leaving_the_block_stops_a_run_in_the_background(db_url: str, sim: StartSim) -> None:
    url = await sim(latency=30.0)
    async with orc.open(db_url) as q:
        await q.enqueue(prompts(6), dataset="d", model="m")
        task = asyncio.create_task(q.run(servers=[url], concurrency=3))
        await _running(db_url, 3)
    assert task.cancelled()
    assert dict(query(db_url, "SELECT state, count(*) FROM items GROUP BY state")) == {"pending": 6}


async def test_a_run_that_cannot_go_on_raises(tmp_path: Path) -> None:
    async with orc.open(str(tmp_path / "q.db")) as q:
        await q.enqueue(prompts(2), dataset="d", model="m")
        with pytest.raises(orc.RunStopped, match="no server answered"):
            await q.run(servers=["http://127.0.0.1:9"], give_up_after=0.5)


async def test_failed_items_are_in_the_outcome_and_requeue_sends_them_back(
    tmp_path: Path, sim: StartSim
) -> None:
    url = await sim(faults={"400": 1.0})
    async with orc.open(str(tmp_path / "q.db")) as q:
        await q.enqueue(prompts(4), dataset="d", model="m")
        outcome = await q.run(servers=[url])
        assert outcome.stats.failed == 4
        assert [type(r) for r in outcome.stopped] == [orc.ItemsFailed]
        assert await q.requeue(dry_run=True) == {("d", "failed"): 4}
        assert await q.requeue(state="failed", error_class="http_400") == 4
        assert (await q.status()).counts["pending"] == 4


def test_the_sync_facade_works_inside_a_running_loop(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """As in a Jupyter cell: a loop is running in this thread while the calls block."""
    server = sim_process()
    db = str(tmp_path / "q.db")

    async def cell() -> list[dict[str, object]]:
        with orc.open_sync(db) as q:
            q.enqueue(prompts(5), dataset="d", model="m")
            q.pause("d")
            q.resume("d")
            assert q.run(servers=[server.url]).stats.completed == 5
            assert q.status().finished
            q.export(tmp_path / "out.jsonl")
            return list(q.results(dataset="d"))

    rows = asyncio.run(cell())
    assert [r["id"] for r in rows] == [p["id"] for p in prompts(5)]
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == rows


async def test_a_run_file_enqueues_as_the_command_enqueues_it(tmp_path: Path) -> None:
    config = REPO / "examples" / "eagle3" / "run.toml"
    by_cli, by_api = str(tmp_path / "cli.db"), str(tmp_path / "api.db")
    done = cli("enqueue", "--config", str(config), "--db", by_cli)
    assert done.returncode == 0, done.stderr
    async with orc.open(by_api) as q:
        reports = await q.enqueue_config(config)
        assert sum(r.added for r in await q.enqueue_config(config)) == 0
    total = re.search(r"total: ([\d,]+) items added to (\d+) datasets", done.stdout)
    assert total is not None
    assert sum(r.added for r in reports) == int(total.group(1).replace(",", ""))
    assert len(reports) == int(total.group(2))
    sql = (
        "SELECT d.name, i.key, i.state, i.request FROM items i "
        "JOIN datasets d ON d.id = i.dataset_id ORDER BY d.name, i.position"
    )
    assert query(by_api, sql) == query(by_cli, sql)


async def test_a_refused_run_file_enqueues_nothing(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", prompts(3))
    config = tmp_path / "run.toml"
    config.write_text(f'[[dataset]]\nname = "a"\nfile = "{data}"\nmodel = "m"\nmax_tokens = 8\n')
    db = str(tmp_path / "q.db")
    async with orc.open(db) as q:
        await q.enqueue(prompts(3), dataset="a", model="other", max_tokens=8)
        with pytest.raises(orc.ConfigError, match="nothing enqueued"):
            await q.enqueue_config(config)
        assert len(await q.enqueue_config(config, update=True)) == 1


async def test_undo_requeue_puts_back_what_requeue_took(tmp_path: Path, sim: StartSim) -> None:
    """``requeue --undo`` from the API: a dry run says what would come back, then the done
    items get their answers back; with nothing left to undo the report says so."""
    url = await sim()
    async with orc.open(str(tmp_path / "q.db")) as q:
        assert (await q.undo_requeue()).requeue_id is None
        await q.enqueue(prompts(3), dataset="d", model="m")
        await q.run(servers=[url])
        before = [row async for row in q.results(dataset="d")]
        assert await q.requeue(state="done", datasets="d") == 3
        assert (await q.status()).counts["pending"] == 3
        preview = await q.undo_requeue(dry_run=True)
        assert isinstance(preview, orc.UndoReport)
        assert (preview.restored, preview.kept) == (3, 0)
        assert (await q.status()).counts["pending"] == 3
        undone = await q.undo_requeue()
        assert (undone.requeue_id, undone.restored, undone.kept) == (preview.requeue_id, 3, 0)
        assert (await q.status()).counts["done"] == 3
        assert [row async for row in q.results(dataset="d")] == before
        assert (await q.undo_requeue()).requeue_id is None


def test_the_sync_facade_undoes_a_requeue(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    server = sim_process()
    with orc.open_sync(str(tmp_path / "q.db")) as q:
        q.enqueue(prompts(2), dataset="d", model="m")
        q.run(servers=[server.url])
        assert q.requeue(state="done", all=True) == 2
        assert q.undo_requeue(dry_run=True).restored == 2
        assert q.undo_requeue().restored == 2
        assert q.status().counts["done"] == 2


def _program(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A program of its own using the API, as a user's script runs it: its own interpreter,
    every warning shown (ResourceWarning included), so that what it prints is all it does."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-W", "always::ResourceWarning", "-c", code, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


AFTER_CLOSE = """
import asyncio, sys
import orchestrator as orc

def calls(q):
    return {
        "enqueue": lambda: q.enqueue([{"prompt": "y"}], dataset="d", model="m"),
        "enqueue_config": lambda: q.enqueue_config("run.toml"),
        "run": lambda: q.run(servers=["http://127.0.0.1:9"]),
        "status": lambda: q.status(),
        "results": lambda: q.results(),
        "export": lambda: q.export("out.jsonl"),
        "requeue": lambda: q.requeue(),
        "undo_requeue": lambda: q.undo_requeue(),
        "pause": lambda: q.pause("d"),
        "resume": lambda: q.resume("d"),
    }

q = orc.open_sync(sys.argv[1])
q.enqueue([{"id": "a", "prompt": "x"}], dataset="d", model="m")
made = q.results()
q.close()
q.close()
for name, call in {**calls(q), "results made before": lambda: next(iter(made))}.items():
    try:
        list(call()) if name == "results" else call()
    except orc.ConfigError as exc:
        print("sync", name, "ConfigError:", exc)

async def main():
    async with orc.open(sys.argv[1]) as q:
        pass
    for name, call in calls(q).items():
        try:
            if name == "results":
                [row async for row in call()]
            else:
                await call()
        except orc.ConfigError as exc:
            print("async", name, "ConfigError:", exc)

asyncio.run(main())
"""


def test_calls_after_close_raise_the_documented_error(tmp_path: Path, db_url: str) -> None:
    """Every call of a closed queue, blocking or not, is a ConfigError that says so; no
    coroutine is left unawaited, nothing is printed."""
    done = _program(AFTER_CLOSE, db_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    names = ["enqueue", "enqueue_config", "run", "status", "results", "export", "requeue"]
    names += ["undo_requeue", "pause", "resume"]
    expected = [f"sync {n}" for n in [*names, "results made before"]]
    expected += [f"async {n}" for n in names]
    assert [line.split(" ConfigError:")[0] for line in lines] == expected
    assert all("the queue is closed" in line for line in lines), lines
    assert not (tmp_path / "out.jsonl").exists()


LEFT_EARLY = """
import asyncio, gc, sqlite3, sys, time
import orchestrator as orc
from tests.helpers import is_postgres, query

db = sys.argv[1]


def bump(conn):
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE datasets SET priority = priority + 1")
    conn.execute("UPDATE datasets SET priority = priority - 1")
    conn.execute("COMMIT")


def held():
    \"\"\"Does a read transaction stay open? PostgreSQL lists it; on SQLite a reader keeps
    the WAL from being checkpointed past the frames of its snapshot.\"\"\"
    if is_postgres(db):
        sql = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
               " AND state LIKE 'idle in transaction%'")
        return query(db, sql)[0][0] > 0
    conn = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        bump(conn)
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        bump(conn)  # frames in the WAL for the next reader's snapshot
        return busy == 1
    finally:
        conn.close()


def released(case):
    gc.collect()
    deadline = time.monotonic() + 60
    while held():
        if time.monotonic() > deadline:
            print("HELD", case, flush=True)
            sys.exit(1)
        time.sleep(0.05)
    print("released", case, flush=True)


async def released_async(case):
    await asyncio.to_thread(released, case)


rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}]} for i in range(50)]
with orc.open_sync(db) as q:
    q.enqueue(rows, dataset="d", passthrough=True)
    held()
    next(iter(q.results()))
    released("sync next")
    for row in q.results():
        break
    released("sync break")
    kept = q.results()
    next(kept)
    assert held()
released("sync kept past close")
del kept


async def main():
    async with orc.open(db) as q:
        await anext(aiter(q.results()))
        await released_async("async next")
        async for row in q.results():
            break
        await released_async("async break")
        kept = q.results()
        await anext(kept)
        async for row in q.results():
            break
    await released_async("async at the end of the block")
    return kept


kept = asyncio.run(main())
del kept
gc.collect()
print("end", flush=True)
"""


def test_results_left_early_are_closed_quietly(tmp_path: Path, db_url: str) -> None:
    """A results iterator given up before its end (dropped after one row, a loop left with
    ``break``, one still open when the queue closes), blocking or not: its read
    transaction ends, and nothing is printed."""
    done = _program(LEFT_EARLY, db_url, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    cases = ["sync next", "sync break", "sync kept past close", "async next", "async break"]
    assert done.stdout.splitlines() == [
        *(f"released {case}" for case in [*cases, "async at the end of the block"]),
        "end",
    ]
    assert done.stderr == ""


def test_the_run_settings_are_one_list() -> None:
    """``Queue.run``'s arguments and ``orchestrator run``'s options are the settings of
    ``orchestrator.settings.run``, by name and default (the command's --exit-when-done
    excepted: a service runs until it is stopped; the API's ``until_done`` is its name)."""
    import inspect

    import click

    from orchestrator.api import Queue
    from orchestrator.cli.run import run
    from orchestrator.settings.run import RUN, settings

    parameters = inspect.signature(Queue.run).parameters
    options = {p.name: p for p in run.params if isinstance(p, click.Option)}
    for spec, setting in settings():
        api_name = "until_done" if spec.name == "exit_when_done" else spec.name
        assert parameters[api_name].default == spec.default, spec.name
        option = options[spec.name]
        assert option.help == setting.help, spec.name
        if spec.name not in ("exit_when_done", "datasets") and spec.default is not None:
            assert option.default == spec.default, spec.name
    assert set(RUN) <= set(options)
