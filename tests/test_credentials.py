"""Credentials in server URLs, API key files and Basic-auth files, through the real
commands (docs/RELIABILITY.md, "Credentials in URLs and key files").

A password with a character a URL cannot carry in its userinfo (``/ @ # ?``) makes URL
parsers disagree on where the host is; such a URL is refused before anything is sent,
with its credentials masked, by every command that takes servers. The checks look for
each piece of the password in every byte a command leaves: its output, its log lines,
the database, a unit file, a report.
"""

from __future__ import annotations

import re
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import orchestrator
from orchestrator.errors import ConfigError
from tests.helpers import (
    Hostile,
    SimProcess,
    cli,
    db_snapshot,
    is_postgres,
    prompts,
    query,
    write_jsonl,
)

#: Every character a raw password in a URL trips on, between pieces that are each
#: distinctive enough to be searched for in any output.
PASSWORD = "Zq9K/Wx7J@Vk3H:Yt5G#Rp2F?Lm4D"
ONE_EACH = ["Zq9K/Wx7J", "Zq9K@Wx7J", "Zq9K#Wx7J", "Zq9K?Wx7J"]


def pieces(password: str) -> list[str]:
    return [p for p in re.split(r"[/@:#?]", password) if p]


def leaked(password: str, *outputs: str | bytes) -> list[str]:
    """The pieces of ``password`` found in any of ``outputs``."""
    data = b"".join(o if isinstance(o, bytes) else o.encode() for o in outputs)
    return [p for p in pieces(password) if p.encode() in data]


def stored(db: str) -> bytes:
    """Every byte the database holds: its SQLite files (WAL and shared memory included),
    or every row of every table of a PostgreSQL database."""
    if not is_postgres(db):
        files = sorted(Path(db).parent.glob(Path(db).name + "*"))
        assert files, db
        return b"".join(p.read_bytes() for p in files)
    tables = query(
        db, "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
    )
    return repr([query(db, f'SELECT * FROM "{t}"') for (t,) in tables]).encode()


def last_line(stderr: str) -> str:
    """The command's own closing line (JSON log lines may follow it)."""
    lines = [line for line in stderr.splitlines() if line and not line.startswith("{")]
    return lines[-1] if lines else ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def enqueue(db: str, n: int, name: str, folder: Path) -> None:
    src = write_jsonl(folder / f"{name}.jsonl", prompts(n, prefix=name))
    result = cli("enqueue", str(src), "-d", name, "--max-tokens", "16", "--db", db)
    assert result.returncode == 0, result.stderr


DEBUG = {"ORCHESTRATOR_LOG_LEVEL": "debug"}


def entry_points(url: str, db: str, folder: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """Every way a server URL reaches the orchestrator from a command line."""
    servers_file = folder / "servers.txt"
    servers_file.write_text(f"# the GPU boxes\nhttp://127.0.0.1:9\n{url}  concurrency=2  # gpu\n")
    unit_db = str(folder / "svc" / "orchestrator.db")
    return [
        ("--server", ["--log-json", "run", "--server", url, "--db", db, "--exit-when-done"], {}),
        (
            "ORCHESTRATOR_SERVERS",
            ["--log-json", "run", "--db", db, "--exit-when-done"],
            {"ORCHESTRATOR_SERVERS": f"http://127.0.0.1:9 {url}"},
        ),
        (
            f"{servers_file}:3",
            ["--log-json", "run", "--servers-file", str(servers_file), "--db", db],
            {},
        ),
        ("--server", ["doctor", "--server", url, "--db", db], {}),
        ("--server", ["deploy", "systemd", "--server", url, "--db", unit_db], {}),
        ("--server", ["status", "--server", url, "--db", db], {}),
        ("--server", ["status", "--json", "--db", db], {"ORCHESTRATOR_SERVERS": url}),
        ("--server", ["watch", "--count", "1", "--server", url, "--db", db], {}),
        ("--server", ["report", str(folder / "r.html"), "--server", url, "--db", db], {}),
        ("--server", ["dashboard", "--port", "0", "--server", url, "--db", db], {}),
    ]


def test_a_password_a_url_cannot_carry_is_refused_masked_by_every_command(
    tmp_path: Path, db_url: str, hostile: Callable[..., Hostile]
) -> None:
    folder = tmp_path
    db = db_url
    enqueue(db, 3, "d", tmp_path)
    server = hostile("--basic", f"alice:{PASSWORD}")
    url = f"http://alice:{PASSWORD}@127.0.0.1:{server.port}"
    before = db_snapshot(db)
    for source, args, env in entry_points(url, db, folder):
        if "ORCHESTRATOR_SERVERS" in env:
            source = "ORCHESTRATOR_SERVERS"
        result = cli(*args, env={**DEBUG, **env}, timeout=60)
        said = result.stdout + result.stderr
        assert result.returncode == 2, (args, said)
        assert said.startswith(f"error: {source}: 'http://***@127.0.0.1:{server.port}'"), said
        assert "%2F" in said and "%40" in said and "--basic-auth-file" in said, said
        assert leaked(PASSWORD, said) == [], (args, said)
        assert result.stdout == "", args  # no unit file, no status, no half a view
    assert not (folder / "r.html").exists()
    assert db_snapshot(db) == before
    assert leaked(PASSWORD, stored(db)) == []
    assert server.stats() == {}  # refused before any request


async def test_the_python_api_refuses_it_the_same_way(tmp_path: Path) -> None:
    db = str(tmp_path / "queue.db")
    enqueue(db, 2, "d", tmp_path)
    before = db_snapshot(db)
    async with orchestrator.open(db) as q:
        for password in [PASSWORD, *ONE_EACH]:
            url = f"http://alice:{password}@127.0.0.1:{free_port()}"
            with pytest.raises(ConfigError) as refused:
                await q.run(servers=[url], give_up_after=5)
            message = str(refused.value)
            assert message.startswith("servers: 'http://***@127.0.0.1:"), message
            assert "%2F" in message and leaked(password, message) == []
    assert db_snapshot(db) == before


@pytest.mark.parametrize("password", ONE_EACH, ids=["slash", "at", "hash", "question"])
def test_each_character_alone_is_refused_masked(tmp_path: Path, password: str) -> None:
    db = str(tmp_path / "queue.db")
    enqueue(db, 2, "d", tmp_path)
    url = f"http://alice:{password}@127.0.0.1:{free_port()}"
    for source, args, env in entry_points(url, db, tmp_path)[:3]:
        if "ORCHESTRATOR_SERVERS" in env:
            source = "ORCHESTRATOR_SERVERS"
        result = cli(*args, "--give-up-after", "5", env={**DEBUG, **env}, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        said = result.stderr
        assert said.startswith(f"error: {source}: 'http://***@127.0.0.1:"), said
        assert "percent-encode" in said and "--basic-auth-file" in said, said
        assert leaked(password, result.stdout + said) == [], said
    assert leaked(password, stored(db)) == []


def test_white_space_inside_credentials_is_refused_masked(tmp_path: Path) -> None:
    """``--server 'http://alice:Zq9K Wx7J@host'`` splits into two pieces at the space: the
    first must not be shown as a URL of its own, with half of the password."""
    db = str(tmp_path / "queue.db")
    enqueue(db, 2, "d", tmp_path)
    url = f"http://alice:Zq9K Wx7J@127.0.0.1:{free_port()}"
    (tmp_path / "servers.txt").write_text(f"{url}\n")
    for args, env in (
        (["run", "--server", url], {}),
        (["run"], {"ORCHESTRATOR_SERVERS": url}),
        (["run", "--servers-file", str(tmp_path / "servers.txt")], {}),
    ):
        result = cli(*args, "--db", db, "--give-up-after", "5", env={**DEBUG, **env}, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert "'http://***@127.0.0.1:" in result.stderr, result.stderr
        assert "%20" in result.stderr
        assert leaked("Zq9K:Wx7J", result.stdout + result.stderr) == [], result.stderr


def test_a_colon_or_percent_encoding_in_the_password_works_and_shows_nowhere(
    tmp_path: Path, db_url: str, hostile: Callable[..., Hostile]
) -> None:
    """The way the refusal says to write it works: each character percent-encoded; a raw
    ':' in the password (after the user name's) is legal and taken as it is."""
    encoded = hostile("--basic", f"alice:{PASSWORD}")
    colon = hostile("--basic", "bob:Ab1Q:Cd2R")
    urls = [
        f"http://alice:{urllib.parse.quote(PASSWORD, safe='')}@127.0.0.1:{encoded.port}",
        f"http://bob:Ab1Q:Cd2R@127.0.0.1:{colon.port}",
    ]
    db = db_url
    logs = []
    for n, (url, server) in enumerate(zip(urls, (encoded, colon), strict=True)):
        enqueue(db, 5, f"d{n}", tmp_path)
        result = cli(
            "--log-json", "run", "--server", url, "--dataset", f"d{n}", "--db", db,
            "--exit-when-done", env=DEBUG, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        logs.append(result.stderr)
        stats = server.stats()
        assert stats.get("auth -", 0) == 0 and stats.get("POST /v1/chat/completions") == 5, stats
    assert query(db, "SELECT count(*) FROM items WHERE state = 'done'") == [(10,)]
    assert {server for (server,) in query(db, "SELECT DISTINCT server FROM outputs")} == {
        encoded.url,
        colon.url,
    }
    servers = [a for url in urls for a in ("--server", url)]
    out = tmp_path / "out.jsonl"
    export = cli("export", str(out), "--provenance", "--db", db)
    doctor = cli("doctor", *servers, "--db", db)
    status = cli("status", "--json", *servers, "--db", db)
    assert f"PASS  server {encoded.url}" in doctor.stdout, doctor.stdout
    assert f"PASS  server {colon.url}" in doctor.stdout, doctor.stdout
    outputs = [*logs, export.stdout, export.stderr, out.read_bytes()]
    outputs += [doctor.stdout, doctor.stderr, status.stdout, status.stderr]
    outputs.append(stored(db))
    assert leaked(PASSWORD, *outputs) == []
    assert leaked("Ab1Q:Cd2R", *outputs) == []


# ------------------------------------------------------------ API keys and Basic-auth files

KEY = "sk-Tq8Vn2Lr5"


@pytest.fixture
def keyed_sim() -> Iterator[SimProcess]:
    server = SimProcess("--latency", "0", env={"SIM_API_KEY": KEY})
    server.start()
    yield server
    server.stop()


def test_a_key_with_a_trailing_newline_is_used_as_the_key(
    tmp_path: Path, db_url: str, keyed_sim: SimProcess
) -> None:
    """``echo KEY > file``, or a variable set from such a file: the newline is not the
    key's. Before, the HTTP library refused the header and no server ever answered."""
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\r\n")
    for n, (args, env) in enumerate(
        (
            (["--api-key-file", str(key_file)], {}),
            ([], {"ORCHESTRATOR_API_KEY": f"{KEY}\n"}),
            ([], {"ORCHESTRATOR_API_KEY": f"  {KEY}\t"}),
        )
    ):
        enqueue(db_url, 3, f"d{n}", tmp_path)
        result = cli(
            "run", "--server", keyed_sim.url, *args, "--db", db_url,
            "--exit-when-done", "--give-up-after", "30", env=env, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, (args, env, result.stderr)
    assert query(db_url, "SELECT count(*) FROM items WHERE state = 'done'") == [(9,)]


@pytest.mark.parametrize("bad", ["sk-Tq8V n2Lr5", "sk-Tq8V\x01n2Lr5", "sk-Tq8V\nn2Lr5"])
def test_a_key_with_white_space_or_control_characters_inside_is_refused(
    tmp_path: Path, db_url: str, keyed_sim: SimProcess, bad: str
) -> None:
    enqueue(db_url, 3, "d", tmp_path)
    key_file = tmp_path / "key"
    key_file.write_text(bad + "\n")
    before = db_snapshot(db_url)
    for args, env, source in (
        (["--api-key-file", str(key_file)], {}, f"--api-key-file {key_file}"),
        ([], {"ORCHESTRATOR_API_KEY": bad}, "ORCHESTRATOR_API_KEY"),
    ):
        for command in (["run", "--exit-when-done", "--give-up-after", "30"], ["doctor"]):
            result = cli(
                *command, "--server", keyed_sim.url, *args, "--db", db_url, env=env, timeout=60
            )
            assert result.returncode == 2, (command, args, result.stderr)
            assert result.stderr.startswith(f"error: {source}: the API key holds white space"), (
                result.stderr
            )
            assert "n2Lr5" not in result.stderr
    assert db_snapshot(db_url) == before
    assert keyed_sim.stats()["chat_requests"] == 0


def test_a_wrong_basic_auth_file_gets_advice_about_that_file(
    tmp_path: Path, db_url: str, hostile: Callable[..., Hostile]
) -> None:
    server = hostile("--basic", "alice:Rq4Nm7Kp2")
    enqueue(db_url, 3, "d", tmp_path)
    before = db_snapshot(db_url)
    no_colon = tmp_path / "no-colon"
    no_colon.write_text("Rq4Nm7Kp2\n")
    not_text = tmp_path / "not-text"
    not_text.write_bytes(b"alice:\xff\xfe\n")
    two_lines = tmp_path / "two-lines"
    two_lines.write_text("alice:Rq4N\nm7Kp2\n")
    missing = tmp_path / "missing"
    cases = [
        (missing, "No such file or directory"),
        (no_colon, "no USER:PASSWORD in it"),
        (not_text, "not UTF-8 text"),
        (two_lines, "a line break or control character inside USER:PASSWORD"),
    ]
    for path, why in cases:
        for command in (["run", "--exit-when-done", "--give-up-after", "30"], ["doctor"]):
            for args, env, source in (
                (["--basic-auth-file", str(path)], {}, "--basic-auth-file"),
                ([], {"ORCHESTRATOR_BASIC_AUTH_FILE": str(path)}, "ORCHESTRATOR_BASIC_AUTH_FILE"),
            ):
                result = cli(
                    *command, "--server", server.url, *args, "--db", db_url, env=env, timeout=60
                )
                said = result.stderr
                assert result.returncode == 2, (command, args, said)
                assert said.startswith(f"error: {source} {path}: {why}: "), said
                assert "one line USER:PASSWORD" in said and "HTTP Basic" in said, said
                assert "Rq4N" not in said and "m7Kp2" not in said
    assert db_snapshot(db_url) == before
    assert server.stats() == {}


def test_refused_basic_credentials_get_basic_advice_not_api_key_advice(
    tmp_path: Path, db_url: str, hostile: Callable[..., Hostile]
) -> None:
    server = hostile("--basic", "alice:Rq4Nm7Kp2")
    enqueue(db_url, 5, "d", tmp_path)
    wrong = tmp_path / "auth"
    wrong.write_text("alice:not-it\n")
    for args in (
        ["--server", server.url, "--basic-auth-file", str(wrong)],
        ["--server", f"http://alice:not-it@127.0.0.1:{server.port}"],
    ):
        result = cli("run", *args, "--db", db_url, "--exit-when-done", timeout=120)
        assert result.returncode == 5, result.stderr
        line = last_line(result.stderr)
        assert f"server {server.url} answered HTTP 401 on /v1/models" in line, line
        assert "check the HTTP Basic credentials" in line and "--basic-auth-file" in line, line
        assert "API key" not in line, line
        doctor = cli("doctor", *args, "--db", db_url, timeout=60)
        assert "/v1/models answered 401 (check the HTTP Basic credentials" in doctor.stdout, (
            doctor.stdout
        )
    assert {s for (s,) in query(db_url, "SELECT DISTINCT state FROM items")} == {"pending"}


def test_a_missing_key_gets_advice_naming_both_kinds_of_credentials(
    tmp_path: Path, keyed_sim: SimProcess
) -> None:
    db = str(tmp_path / "queue.db")
    enqueue(db, 3, "d", tmp_path)
    result = cli("run", "--server", keyed_sim.url, "--db", db, "--exit-when-done", timeout=120)
    assert result.returncode == 5, result.stderr
    line = last_line(result.stderr)
    assert "no credentials were sent" in line and "--api-key-file" in line, line
    assert "--basic-auth-file" in line, line


def test_unit_rendering_refuses_credentials_it_cannot_tell_apart(tmp_path: Path) -> None:
    """The unit is also made from Python (``render_unit``): the same refusal there."""
    from orchestrator.ops.deploy import UnitSpec, render_unit

    spec = UnitSpec(
        executable="/usr/bin/orchestrator",
        db=str(tmp_path / "q.db"),
        servers=(f"http://alice:{PASSWORD}@127.0.0.1:1",),
    )
    with pytest.raises(ConfigError) as refused:
        render_unit(spec)
    message = str(refused.value)
    assert message.startswith("--server: 'http://***@127.0.0.1:1'"), message
    assert leaked(PASSWORD, message) == []
