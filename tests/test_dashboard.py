"""``orchestrator dashboard``: its JSON endpoints, and its page in a real headless Chromium
showing what the database holds, and following it as workers change it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from orchestrator.monitor.dashboard import SqliteSource, make_app
from orchestrator.store import Database, samples
from tests.browser import Browser
from tests.conftest import StartSim
from tests.helpers import REPO, STARTED, cli, query
from tests.test_samples import fill, truth

ROWS = """Object.fromEntries([...document.querySelectorAll('#datasets tbody tr')].map(tr =>
  [tr.dataset.dataset, Object.fromEntries([...tr.querySelectorAll('[data-field]')].map(
    td => [td.dataset.field, td.textContent]))]))"""
LENGTHS = """Object.fromEntries([...document.querySelectorAll('[data-lengths]')].map(
  el => [el.dataset.lengths, Number(el.dataset.count)]))"""


async def report_rows(out: Path, db: str) -> dict[str, dict[str, str]]:
    """The dataset rows of ``orchestrator report OUT`` as a browser shows them, by field."""
    assert cli("report", str(out), "--db", db).returncode == 0
    async with Browser() as browser:
        await browser.open(out.as_uri())
        await browser.wait_for("document.querySelectorAll('#datasets tbody tr').length >= 1")
        rows = await browser.evaluate(ROWS)
        assert browser.errors == []
    return rows


async def start_dashboard(db: Path, servers: tuple[str, ...] = ()) -> tuple[web.AppRunner, str]:
    source = SqliteSource(str(db))
    source.check()
    runner = web.AppRunner(make_app(source, servers=servers))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/"


@pytest.fixture
async def dashboard(db_path: Path) -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(*servers: str) -> str:
        runner, url = await start_dashboard(db_path, servers)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def settled_samples(database: Database) -> None:
    """Two more samples, as the worker would write them a minute and two later: every
    answer is then settled, and the charts have something to draw."""
    later = time.time() + samples.SETTLE_SECONDS
    for minute in (1, 2):
        assert await samples.record(database, interval=60, now=later + 60 * minute) > 0


def shown(rows: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    return {
        name: {k: int(row[k].replace(",", "")) for k in ("pending", "running", "done", "failed")}
        for name, row in rows.items()
        if name != "TOTAL"
    }


def query_latest(db: Path) -> dict[str, str]:
    """Each error class's newest attempt message."""
    rows = query(
        db,
        "SELECT error_class, message FROM attempt_errors AS e WHERE id ="
        " (SELECT max(id) FROM attempt_errors WHERE error_class = e.error_class)",
    )
    return dict(rows)


def held(db: Path) -> dict[str, dict[str, int]]:
    return {
        name: {k: v[k] for k in ("pending", "running", "done", "failed")}
        for name, v in truth(db).items()
    }


async def test_api_endpoints(
    database: Database, db_path: Path, tmp_path: Path, sim: StartSim, dashboard: Any
) -> None:
    server = await sim(faults={"400": 0.2}, seed=5, latency=0.2)
    await fill(database, tmp_path, server, {"short": 8, "long": 300}, sample_every=0.3)
    url = await dashboard(server)
    facts = truth(db_path)
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "api/status") as resp:
            assert resp.status == 200
            status = await resp.json()
        async with http.get(url + "api/samples") as resp:
            history = await resp.json()
        async with http.get(url + "api/lengths") as resp:
            lengths = await resp.json()
        async with http.get(url + "api/samples?since=abc") as resp:
            assert resp.status == 400
        async with http.get(url) as resp:
            page = await resp.text()
            assert resp.headers["Content-Type"].startswith("text/html")
    # The status document (docs/STATUS.md), with the server's own view added.
    assert {d["name"]: {k: d["counts"][k] for k in ("pending", "running", "done", "failed")}
            for d in status["datasets"]} == held(db_path)  # fmt: skip
    assert {"totals", "datasets", "workers", "generated_at", "window_seconds"} <= set(status)
    assert all("eta_seconds" in d for d in [status["totals"], *status["datasets"]])
    assert [s["server"] for s in status["servers"]] == [server]
    assert status["servers"][0]["error"] is None
    # The history the worker wrote, and its server gauges.
    assert {s["dataset"] for s in history["samples"]} == {"short", "long"}
    assert set(history["samples"][0]) == {
        "taken_at", "dataset", "pending", "running", "done", "failed", "answers",
        "completion_tokens", "prompt_tokens", "errors",
    }  # fmt: skip
    assert {s["server"] for s in history["servers"]} == {server}
    assert {d["name"]: d["count"] for d in lengths["datasets"]} == {
        k: v["answers"] for k, v in facts.items()
    }
    for d in lengths["datasets"]:
        assert sum(n for _, _, n in d["buckets"]) == d["count"]
    assert "http://" not in page and "https://" not in page  # self-contained


async def test_page_shows_the_database_and_follows_it(
    database: Database, db_path: Path, tmp_path: Path, sim: StartSim, dashboard: Any
) -> None:
    server = await sim(faults={"400": 0.2, "500": 0.1}, seed=7, latency=0.2)
    await fill(database, tmp_path, server, {"short": 8, "long": 300}, sample_every=0.3)
    await settled_samples(database)
    url = await dashboard()
    async with Browser() as browser:
        await browser.open(url + "?every=0.3")
        await browser.wait_for("document.querySelectorAll('#datasets tbody tr').length >= 3")
        assert shown(await browser.evaluate(ROWS)) == held(db_path)
        await browser.wait_for("document.querySelectorAll('[data-lengths]').length == 2")
        answers = {k: v["answers"] for k, v in truth(db_path).items()}
        assert await browser.evaluate(LENGTHS) == answers
        failed_now = await browser.evaluate(
            "[...document.querySelectorAll('#errors [data-field=\"failed-now\"]')]"
            ".reduce((n, td) => n + Number(td.textContent), 0)"
        )
        assert failed_now == sum(v["failed"] for v in truth(db_path).values()) > 0
        # Why: each class's latest message, as the attempts table holds it.
        latest = await browser.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#errors tr[data-class]')]"
            ".map(tr => [tr.dataset.class,"
            " tr.querySelector('[data-field=\"last-message\"] div').textContent]))"
        )
        for cls, message in query_latest(db_path).items():
            assert latest[cls].endswith(message), (cls, latest[cls])
        assert await browser.evaluate("document.querySelector('#chart-rps path') !== null")

        # Workers go on: another dataset arrives and is done; the page follows, no reload.
        await browser.evaluate("window.__same_page = true")
        await fill(database, tmp_path, server, {"extra": 50}, sample_every=0)
        expected = held(db_path)
        await browser.wait_for(
            f"JSON.stringify(Object.keys({ROWS}).sort()) == "
            f"'{json.dumps(sorted([*expected, 'TOTAL']), separators=(',', ':'))}'"
        )
        # Every count of the new row, not only done: a refresh may fall between an
        # answer and the last failure's write.
        extra = " && ".join(
            f"({ROWS}).extra.{k}.replace(',', '') == '{v}'" for k, v in expected["extra"].items()
        )
        await browser.wait_for(extra)
        assert shown(await browser.evaluate(ROWS)) == expected
        assert await browser.evaluate("window.__same_page") is True
        assert browser.errors == []


async def test_dashboard_refuses_a_missing_database(tmp_path: Path) -> None:
    result = cli("dashboard", "--db", str(tmp_path / "nothing.db"), "--port", "0")
    assert result.returncode == 3  # as for every command that reads a missing database
    assert f"no database at {tmp_path / 'nothing.db'}" in result.stderr
    assert not (tmp_path / "nothing.db").exists()


def _dashboard_process(db: str) -> tuple[subprocess.Popen[str], str]:
    """``orchestrator dashboard`` as a process on a free port, and its URL."""
    cmd = [sys.executable, "-m", "orchestrator", "--log-json", "dashboard", "--port", "0"]
    proc = subprocess.Popen([*cmd, "--db", db], stderr=subprocess.PIPE, text=True, cwd=REPO)
    STARTED.append(proc)  # type: ignore[arg-type]
    assert proc.stderr is not None
    line = ""
    while "dashboard_listening" not in line:
        line = proc.stderr.readline()
        assert line, "the dashboard exited before it listened"
    return proc, json.loads(line)["url"]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_window_of_no_seconds_is_refused_alike_everywhere(tmp_path: Path, db_url: str) -> None:
    """``--window`` of status, watch, report and dashboard, the dashboard's ``?window=`` and
    ``Queue.status(window=)``: one rule (a finite number of seconds, at least 1), one
    wording, and nothing read with a window of -5."""
    import orchestrator as orc

    with orc.open_sync(db_url) as q:
        q.enqueue([{"id": "a", "prompt": "x"}], dataset="d", model="m")
        for window, words in (
            (-5, "must be at least 1, got -5"),
            (0, "must be at least 1, got 0"),
            (math.nan, "must be a finite number, got nan"),
        ):
            with pytest.raises(orc.ConfigError, match=f"^window: {words}"):
                q.status(window=window)
        assert q.status(window=60).counts["pending"] == 1
    report = tmp_path / "report.html"
    commands = {"status": [], "watch": ["--count", "1"], "report": [str(report)]}
    commands["dashboard"] = ["--port", "0"]
    bad = {"-5": "must be at least 1, got -5", "0": "must be at least 1, got 0"}
    bad |= {"nan": "must be a finite number, got nan", "inf": "must be a finite number, got inf"}
    for command, extra in commands.items():
        for value, words in bad.items():
            done = cli(command, *extra, "--window", value, "--db", db_url)
            assert done.returncode == 2, (command, value, done.stderr)
            assert f"Invalid value for '--window': {words}" in done.stderr, done.stderr
    assert not report.exists()
    proc, url = _dashboard_process(db_url)
    try:
        for value, words in {
            **bad,
            "x": "must be a number, got x",
            "": "must be a number",
        }.items():
            status, body = _get(f"{url}api/status?window={value}")
            assert (status, f"window {words}" in body) == (400, True), (value, status, body)
        status, body = _get(f"{url}api/status?window=60")
        assert status == 200 and json.loads(body)["window_seconds"] == 60
    finally:
        proc.terminate()
        proc.wait(30)
