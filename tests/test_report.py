"""``orchestrator report``: one static HTML file with the dashboard's numbers, readable in
a browser with nothing else (no server, no network), written all or nothing."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.store import Database
from tests.browser import Browser
from tests.conftest import StartSim
from tests.helpers import cli
from tests.test_dashboard import LENGTHS, ROWS, held, settled_samples, shown
from tests.test_samples import fill, truth


async def test_report_renders_the_same_numbers_offline(
    database: Database, db_path: Path, tmp_path: Path, sim: StartSim
) -> None:
    server = await sim(faults={"400": 0.2}, seed=11, latency=0.2)
    await fill(database, tmp_path, server, {"short": 8, "long": 300}, sample_every=0.3)
    await settled_samples(database)
    out = tmp_path / "run report.html"
    result = cli("report", str(out), "--db", str(db_path))
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    # Nothing to fetch: no remote script, style, image or font (server URLs may appear
    # in the data, as text).
    assert re.findall(r"(?:src|href)\s*=|url\(|@import", html) == []
    assert list(tmp_path.glob(".run report.html.*")) == []  # no temporary file left

    async with Browser() as browser:
        await browser.send("Network.enable")
        await browser.open(out.as_uri())
        await browser.wait_for("document.querySelectorAll('#datasets tbody tr').length >= 3")
        assert shown(await browser.evaluate(ROWS)) == held(db_path)
        answers = {k: v["answers"] for k, v in truth(db_path).items()}
        assert await browser.evaluate(LENGTHS) == answers
        assert await browser.evaluate("document.querySelector('#chart-rps path') !== null")
        assert browser.requests() == [out.as_uri()]
        assert browser.errors == []


def test_report_refuses_a_path_it_cannot_write(tmp_path: Path, db_path: Path) -> None:
    assert cli("db", "upgrade", "--db", str(db_path)).returncode == 0
    missing = tmp_path / "no" / "such" / "dir" / "r.html"
    result = cli("report", str(missing), "--db", str(db_path))
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    (tmp_path / "taken").mkdir()
    result = cli("report", str(tmp_path / "taken"), "--db", str(db_path))
    assert result.returncode != 0
    assert "taken" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["queue.db", "taken"]
