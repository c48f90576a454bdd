"""Secrets, files and hostile answers, through the real commands: credentials in server
URLs, file modes and symlinks of exports and reports, the dashboard's Host check, request
parameters, redirects and oversized answers (docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from orchestrator.inference.pool import ServerPool
from tests.helpers import (
    REPO,
    STARTED,
    Hostile,
    SimProcess,
    cli,
    db_snapshot,
    enqueue_prompts,
    events,
    prompts,
    query,
    start_worker,
    write_jsonl,
)

SECRET = "s3cret-Pa55"


def enqueue(db: Path, n: int, *extra: str, prefix: str = "p") -> None:
    enqueue_prompts(db, db.parent / f"in-{prefix}.jsonl", n, *extra, prefix=prefix)


def wait_for(check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def all_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


# ------------------------------------------------------------ 4, 5: credentials in URLs


def test_credentials_in_a_server_url_appear_nowhere(
    tmp_path: Path, hostile: Callable[..., Hostile]
) -> None:
    server = hostile("--basic", f"user:{SECRET}")
    secret_url = f"http://user:{SECRET}@127.0.0.1:{server.port}"
    db = tmp_path / "q.db"
    enqueue(db, 3)
    worker = start_worker(db, secret_url, "--metrics-port", "0", log_level="debug")
    assert worker.stderr is not None
    seen: list[str] = []
    while not any("metrics_listening" in line for line in seen):
        seen.append(worker.stderr.readline())
        assert seen[-1], "".join(seen)
    metrics_url = json.loads(seen[-1])["url"]
    wait_for(lambda: query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0] == 3)
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        metrics = resp.read().decode()
    status = cli("status", "--json", "--server", secret_url, "--db", str(db))
    worker.send_signal(signal.SIGTERM)
    logs = "".join(seen) + worker.communicate(timeout=30)[1]
    assert f'orchestrator_server_up{{server="{server.url}"}} 1.0' in metrics
    assert query(db, "SELECT DISTINCT server FROM outputs") == [(server.url,)]
    export = cli("export", str(tmp_path / "out.jsonl"), "--provenance", "--db", str(db))
    assert export.returncode == 0, export.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["server"] == server.url
    unit = cli("deploy", "systemd", "--server", secret_url, "--db", str(db.resolve()))
    assert unit.returncode == 2 and "holds credentials" in unit.stderr
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["servers"][0]["server"] == server.url
    assert "credentials_in_server_url" in logs  # the advice to use a file
    for text in (logs, metrics, status.stdout + status.stderr, unit.stdout + unit.stderr):
        assert SECRET not in text
    assert SECRET.encode() not in all_bytes(tmp_path) + (tmp_path / "out.jsonl").read_bytes()

    # The same credentials from a file: nothing in the arguments either.
    auth = tmp_path / "auth"
    auth.write_text(f"user:{SECRET}\n")
    enqueue(db, 2, prefix="f")
    result = cli(
        "run", "--server", server.url, "--basic-auth-file", str(auth),
        "--exit-when-done", "--db", str(db),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert query(db, "SELECT count(*) FROM items WHERE state = 'done'") == [(5,)]
    assert server.stats().get("auth -", 0) == 0  # every request carried the credentials


def test_an_api_key_and_url_credentials_together_are_refused_at_start(
    tmp_path: Path, hostile: Callable[..., Hostile]
) -> None:
    server = hostile("--basic", f"user:{SECRET}")
    db = tmp_path / "q.db"
    enqueue(db, 1)
    auth = tmp_path / "auth"
    auth.write_text(f"user:{SECRET}")
    for extra in (
        ["--server", f"http://user:{SECRET}@127.0.0.1:{server.port}"],
        ["--server", server.url, "--basic-auth-file", str(auth)],
    ):
        result = cli(
            "run", *extra, "--exit-when-done", "--db", str(db),
            env={"ORCHESTRATOR_API_KEY": "key-1"}, timeout=30,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "both set the Authorization header" in result.stderr
        assert SECRET not in result.stderr
    doctor = cli(
        "doctor", "--server", f"http://user:{SECRET}@127.0.0.1:{server.port}", "--db", str(db),
        env={"ORCHESTRATOR_API_KEY": "key-1"}, timeout=30,
    )  # fmt: skip
    assert doctor.returncode == 2 and "both set the Authorization header" in doctor.stderr
    assert server.stats() == {}  # refused before any request
    doctor = cli(
        "doctor", "--server", f"http://user:{SECRET}@127.0.0.1:{server.port}", "--db", str(db)
    )
    assert f"PASS  server {server.url}: /health answered 200" in doctor.stdout, doctor.stdout
    assert SECRET not in doctor.stdout + doctor.stderr


async def test_a_prober_that_dies_says_so_and_probes_again() -> None:
    class Broken:
        """A client whose every look at a server raises what no probe expects."""

        calls = 0

        @property
        def session(self) -> Any:
            Broken.calls += 1
            raise ValueError("Cannot combine AUTHORIZATION header with AUTH argument")

        async def health(self, server: str) -> bool:
            return bool(self.session)

        config = type("C", (), {"health_timeout": 1.0})()

    class Settings:
        probe_min, probe_max, failure_limit = 0.01, 0.05, 3

    pool = ServerPool({"http://127.0.0.1:9": 1}, Broken(), Settings())  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logged:
        pool.start()
        await asyncio.sleep(0.5)
        await pool.close()
    crashed = [e for e in logged if e["event"] == "probe_crashed"]
    assert crashed and "Cannot combine" in crashed[0]["error"]
    assert Broken.calls >= 2  # probed again after the crash


# ------------------------------------------------------------ 6: file modes and links


@pytest.fixture
def done_db(tmp_path: Path, sim_process: Callable[..., SimProcess]) -> Path:
    sim = sim_process("--latency", "0")
    db = tmp_path / "q.db"
    enqueue(db, 3)
    result = cli("run", "--server", sim.url, "--exit-when-done", "--db", str(db))
    assert result.returncode == 0, result.stderr
    return db


def _with_umask(mask: int) -> Callable[[], None]:
    return lambda: os.umask(mask)  # type: ignore[return-value]


@pytest.mark.parametrize("command", ["export", "report"])
def test_written_files_respect_the_umask_the_old_mode_and_symlinks(
    tmp_path: Path, done_db: Path, command: str
) -> None:
    out = tmp_path / "private.out"
    args = (command, str(out), "--db", str(done_db))
    assert cli(*args, preexec_fn=_with_umask(0o077)).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o600  # the umask's, not 0644
    assert cli(*args, preexec_fn=_with_umask(0o022)).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o600  # written again: the mode it had

    target = tmp_path / "real" / "file.out"
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.out"
    link.symlink_to(target)
    result = cli(command, str(link), "--db", str(done_db), preexec_fn=_with_umask(0o022))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text() != "old" and target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in target.parent.iterdir()] == ["file.out"]  # no temporary left


# ------------------------------------------------------------ 7: the dashboard's Host check


def test_the_dashboard_refuses_foreign_host_names(done_db: Path) -> None:
    cmd = [sys.executable, "-m", "orchestrator", "--log-json", "dashboard", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--allow-host", "runs.internal", "--db", str(done_db)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    STARTED.append(proc)  # type: ignore[arg-type]
    assert proc.stderr is not None
    line = ""
    while "dashboard_listening" not in line:
        line = proc.stderr.readline()
        assert line
    url = json.loads(line)["url"]
    port = url.rstrip("/").rsplit(":", 1)[-1]

    def get(path: str, host: str | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(url.rstrip("/") + path)
        if host is not None:
            request.add_header("Host", host)
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    try:
        for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1.evil.com"):
            status, body = get("/api/status", host)
            assert status == 421 and b"done" not in body, host
        for host in (None, f"localhost:{port}", f"[::1]:{port}", "runs.internal", "10.1.2.3"):
            assert get("/api/status", host)[0] == 200, host
        for query_ in (
            "/api/samples?since=nan",
            "/api/samples?since=inf",
            "/api/status?window=nan",
        ):
            assert get(query_)[0] == 400, query_
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------ 8: request parameters


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--temperature", "nan"], "--temperature: must be a finite number, got nan"),
        (["--temperature", "inf"], "--temperature: must be a finite number, got inf"),
        (["--top-p", "nan"], "--top-p: must be a finite number"),
        (["--param", "temperature=-5"], "--param temperature: must be at least 0, got -5"),
        (["--param", "max_tokens=0"], "--param max_tokens: must be at least 1, got 0"),
        (["--param", "top_p=1.5"], "--param top_p: must be in (0, 1], got 1.5"),
        (["--param", 'messages=[{"role":"user","content":"x"}]'], "--param messages: cannot"),
        (["--param", "stream=true"], "--param stream: cannot be set"),
        (["--param", "n=3"], "--param n: must be 1"),
        (["--max-tokens", "99999999999"], "2147483647"),
    ],
)
def test_enqueue_options_are_checked_as_run_files_and_input_lines_are(
    tmp_path: Path, options: list[str], reason: str
) -> None:
    db = tmp_path / "q.db"
    enqueue(db, 1, prefix="a")
    before = db_snapshot(db)
    src = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    result = cli("enqueue", str(src), "--dataset", "d2", *options, "--db", str(db))
    assert result.returncode == 2, result.stdout + result.stderr
    assert reason in result.stderr
    assert db_snapshot(db) == before


def test_one_limit_for_max_tokens_everywhere(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    huge = 99999999999
    line = write_jsonl(
        tmp_path / "line.jsonl",
        [{"messages": [{"role": "user", "content": "q"}], "max_tokens": huge}],
    )
    by_line = cli("enqueue", str(line), "--dataset", "d", "--db", str(db))
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[[dataset]]\nname = "d"\nfile = "line.jsonl"\nmax_tokens = {huge}\n')
    by_file = cli("enqueue", "--config", str(run_file), "--db", str(db))
    by_option = cli("enqueue", str(line), "-d", "d", "--max-tokens", str(huge), "--db", str(db))
    for result in (by_line, by_file, by_option):
        assert result.returncode == 2, result.stderr
        assert "2147483647" in result.stderr, result.stderr


def test_several_samples_per_prompt_are_refused_everywhere(tmp_path: Path) -> None:
    """``n`` > 1 would make the server write answers that the client throws away: refused
    as an option, in a run file and in a batch line's body."""
    db = tmp_path / "q.db"
    user = [{"role": "user", "content": "q"}]
    batch = write_jsonl(
        tmp_path / "batch.jsonl",
        [{"custom_id": "a", "body": {"model": "m", "messages": user, "n": 4}}],
    )
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": user}])
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        '[[dataset]]\nname = "d"\nfile = "plain.jsonl"\nmax_tokens = 8\n'
        "[dataset.extra_body]\nn = 4\n"
    )
    results = {
        "batch": cli("enqueue", str(batch), "--dataset", "d", "--db", str(db)),
        "file": cli("enqueue", "--config", str(run_file), "--db", str(db)),
        "option": cli("enqueue", str(plain), "-d", "d", "--param", "n=4", "--db", str(db)),
    }
    for where, result in results.items():
        assert result.returncode == 2, (where, result.stderr)
        assert "must be 1 (one answer per request)" in result.stderr, (where, result.stderr)
    assert "batch.jsonl:1: body: n must be" in results["batch"].stderr
    assert cli("enqueue", str(plain), "-d", "d", "--param", "n=1", "--db", str(db)).returncode == 0


# ------------------------------------------------------------ 10: redirects


@pytest.mark.parametrize("status", [301, 307])
def test_a_redirect_is_a_configuration_error_naming_location(
    tmp_path: Path, hostile: Callable[..., Hostile], status: int
) -> None:
    target = hostile()  # answers GET too, as a misrouted proxy may
    server = hostile("--redirect", f"{status}={target.url}")
    db = tmp_path / "q.db"
    enqueue(db, 3)
    result = cli(
        "--log-json", "run", "--server", server.url, "--exit-when-done", "--max-attempts", "2",
        "--db", str(db), timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert query(db, "SELECT count(*) FROM outputs") == [(0,)]
    assert query(db, "SELECT count(*) FROM items WHERE state = 'done'") == [(0,)]
    assert "POST /v1/chat/completions" not in target.stats()
    assert "GET /v1/chat/completions" not in target.stats()
    location = f"{target.url}/v1/chat/completions"
    said = result.stderr + " ".join(str(r) for r in query(db, "SELECT last_error FROM items"))
    assert f"redirect to {location}" in said


def test_redirects_to_every_item_stop_the_run_with_a_plain_line(
    tmp_path: Path, hostile: Callable[..., Hostile]
) -> None:
    target = hostile()
    server = hostile("--redirect", f"301={target.url}")
    db = tmp_path / "q.db"
    enqueue(db, 8)
    result = cli(
        "run", "--server", server.url, "--exit-when-done", "--db", str(db), timeout=120
    )  # fmt: skip
    assert result.returncode == 5, result.stderr
    line = [s for s in result.stderr.splitlines() if s.startswith("error: ")][-1]
    assert line == (
        f"error: halted: server {server.url} answered HTTP 301 (a redirect to "
        f"{target.url}/v1/chat/completions) to 5 different items of dataset 'd' in a row, "
        "with no answer in between; check the server URL: redirects are not followed, give "
        "the URL the server answers at (the Location the redirect names, if it is the same "
        "server). No item was failed for it: fix the setting and run again."
    )
    assert query(db, "SELECT DISTINCT state, attempts FROM items") == [("pending", 0)]


# ------------------------------------------------------------ 16: oversized answers


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_over_the_cap_fails_its_item_and_is_not_stored(
    tmp_path: Path, hostile: Callable[..., Hostile], stream: bool
) -> None:
    server = hostile("--answer-bytes", str(3 * 2**20), "--stream-bytes", str(3 * 2**20))
    db = tmp_path / "q.db"
    enqueue(db, 2)
    result = cli(
        "--log-json", "run", "--server", server.url, "--exit-when-done", "--max-response-mb", "1",
        *(["--stream"] if stream else []), "--db", str(db), timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    rows = query(db, "SELECT state, error_class FROM items")
    assert rows == [("failed", "response_too_large")] * 2, (rows, result.stderr[-2000:])
    assert query(db, "SELECT count(*) FROM outputs") == [(0,)]
    assert sum(p.stat().st_size for p in tmp_path.glob("q.db*")) < 2**20
    assert any(e.get("error_class") == "response_too_large" for e in events(result.stderr))


def test_an_answer_is_stored_once(tmp_path: Path, hostile: Callable[..., Hostile]) -> None:
    """Twenty answers of 1 MiB: the database holds their text once (it held it twice, in
    ``outputs.content`` and in the message JSON), and the export has every byte."""
    size = 2**20
    server = hostile("--answer-bytes", str(size))
    db = tmp_path / "q.db"
    enqueue(db, 20)
    result = cli(
        "run", "--server", server.url, "--exit-when-done", "--db", str(db), timeout=120
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    stored = sum(p.stat().st_size for p in tmp_path.glob("q.db*"))
    assert 20 * size < stored < 1.25 * 20 * size, stored
    out = tmp_path / "out.jsonl"
    assert cli("export", str(out), "--db", str(db)).returncode == 0
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [len(line["messages"][-1]["content"]) for line in lines] == [size] * 20
