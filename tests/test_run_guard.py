"""One wrong setting must not fail a whole queue, and a wrong URL must not wait in silence:
each mistake through the real ``orchestrator run``, against the simulated server or a
real closed port."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from orchestrator.inference import pool as servers
from orchestrator.inference.client import ClientConfig, InferenceClient
from orchestrator.inference.pool import ServerPool
from tests.helpers import REPO, SimProcess, cli, events, item_rows, prompts, query, write_jsonl

SimFactory = Callable[..., SimProcess]


def closed_port() -> int:
    """A port nothing listens on: bound, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def queue(
    tmp_path: Path, n: int = 200, *options: str, name: str = "d", db: Path | str | None = None
) -> Path | str:
    db = db or tmp_path / "q.db"
    src = write_jsonl(tmp_path / f"{name}.jsonl", prompts(n, prefix=name))
    result = cli("enqueue", str(src), "-d", name, "--db", str(db), *options)
    assert result.returncode == 0, result.stderr
    return db


def run(db: Path | str, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return cli(
        "--log-json", "run", "--db", str(db), "--exit-when-done", *args, env=env, timeout=timeout
    )


def last_line(stderr: str) -> str:
    """The command's own closing line (log lines, JSON here, may follow it)."""
    lines = [line for line in stderr.splitlines() if line and not line.startswith("{")]
    return lines[-1] if lines else ""


def untouched(db: Path | str) -> bool:
    """Every item pending with no attempt spent."""
    return {(state, attempts) for _, state, attempts in item_rows(db)} == {("pending", 0)}


# ---------------------------------------------------------------------------- settings


def test_the_example_runs_against_the_simulated_server_as_it_is(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    db = tmp_path / "q.db"
    config = REPO / "examples" / "eagle3" / "run.toml"
    assert cli("enqueue", "--config", str(config), "--db", str(db)).returncode == 0
    server = sim_process()  # no --model: it answers to Qwen/Qwen3-8B too
    result = run(db, "--server", server.url)
    assert result.returncode == 0, last_line(result.stderr)
    assert {state for _, state, _ in item_rows(db)} == {"done"}


def test_a_model_the_server_does_not_serve_stops_the_run_and_fails_nothing(
    tmp_path: Path, db_url: str, sim_process: SimFactory
) -> None:
    db = queue(tmp_path, 200, "--model", "Qwen/Qwen3-8B", db=db_url)
    server = sim_process("--model", "sim-model")
    result = run(db, "--server", server.url)
    assert result.returncode == 5, result.stderr
    line = last_line(result.stderr)
    assert line.startswith(f"error: halted: server {server.url} answered HTTP 404")
    assert "Qwen/Qwen3-8B" in line and "model name" in line and "sim-model" in line
    assert untouched(db)  # every attempt given back
    # One trial item at a time until the breaker tripped: a handful of requests.
    assert server.stats()["chat_requests"] <= 8
    # Run again without a fix: the trial takes items not held before, and stops again.
    again = run(db, "--server", server.url)
    assert again.returncode == 5, last_line(again.stderr)
    assert untouched(db)
    assert server.stats()["chat_requests"] <= 16


@pytest.mark.parametrize("key", [None, "wrong"], ids=["missing", "wrong"])
def test_a_refused_api_key_stops_the_run_before_any_item(
    tmp_path: Path, sim_process: SimFactory, key: str | None
) -> None:
    db = queue(tmp_path, 50)
    server = SimProcess(env={"SIM_API_KEY": "right"})
    server.start()
    try:
        result = run(db, "--server", server.url, env={"ORCHESTRATOR_API_KEY": key or ""})
        assert result.returncode == 5, result.stderr
        line = last_line(result.stderr)
        assert "HTTP 401 on /v1/models" in line and "API key" in line, line
        assert server.stats()["chat_requests"] == 0
    finally:
        server.stop()
    assert untouched(db)


def test_a_parameter_the_server_refuses_stops_the_run(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    db = queue(tmp_path, 200, "--param", "chat_template_kwargs=1")
    server = sim_process()
    result = run(db, "--server", server.url)
    assert result.returncode == 5, result.stderr
    line = last_line(result.stderr)
    assert "HTTP 400 \"'chat_template_kwargs' must be an object\"" in line, line
    assert "parameters" in line
    assert untouched(db)


def test_a_422_that_echoes_each_request_stops_the_run(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    """FastAPI's 422 quotes each request back (``input``): no two texts match, yet it is
    the same refusal."""
    db = queue(tmp_path, 30)  # no --model: the server wants one
    server = sim_process("--require-field", "model")
    result = run(db, "--server", server.url)
    assert result.returncode == 5, last_line(result.stderr)
    assert last_line(result.stderr) == (
        f"error: halted: server {server.url} answered HTTP 422 'body.model: Field required' "
        "to 5 different items of dataset 'd' in a row, with no answer in between; check the "
        "dataset's parameters (--param, [defaults] and [[dataset]] keys). No item was failed "
        "for it: fix the setting and run again."
    )
    assert untouched(db)


def test_a_wrong_model_in_many_small_datasets_stops_the_run(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    """Ten datasets of four items, each refused 404: a server's refusal counts across
    datasets, so none is too small to stop the run."""
    db = tmp_path / "q.db"
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        '[defaults]\nmodel = "Qwen/Qwen3-8B"\nmax_tokens = 16\n'
        + "".join(f'[[dataset]]\nname = "d{n}"\nfile = "d{n}.jsonl"\n' for n in range(10))
    )
    for n in range(10):
        write_jsonl(tmp_path / f"d{n}.jsonl", prompts(4, prefix=f"d{n}-"))
    assert cli("enqueue", "--config", str(run_file), "--db", str(db)).returncode == 0
    server = sim_process("--model", "sim-model")
    result = run(db, "--server", server.url)
    assert result.returncode == 5, last_line(result.stderr)
    line = last_line(result.stderr)
    found = re.fullmatch(
        rf"error: halted: server {re.escape(server.url)} answered HTTP 404 'The model "
        r"`Qwen/Qwen3-8B` does not exist.' to (\d+) different items of datasets "
        r"((?:'d\d', )+'d\d') in a row, with no answer in between; check the dataset's model "
        r"name and the server URL's path \(the server lists: sim-model\)\. No item was "
        r"failed for it: fix the setting and run again\.",
        line,
    )
    assert found, line
    # However many were refused before it stopped (at least the five that trip it), no
    # dataset had five items of its own to give.
    assert 5 <= int(found[1]) <= 40
    assert len(found[2].split(", ")) >= 2
    assert untouched(db), query(db, "SELECT key, state, attempts, last_error FROM items")


def test_a_400_only_some_items_get_fails_those_items_alone(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    """Long prompts exceed the context, one in four, even several in a row: they fail,
    the rest is done, and the run says so with its own exit code."""
    db = tmp_path / "q.db"
    rows = prompts(60)
    for i in range(0, 60, 4):
        rows[i]["messages"][0]["content"] = "word " * (4000 + i)
    rows[1]["messages"][0]["content"] = "word " * 5000  # two in a row
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert (
        cli("enqueue", str(src), "-d", "d", "--max-tokens", "64", "--db", str(db)).returncode == 0
    )
    server = sim_process("--max-model-len", "4000")
    result = run(db, "--server", server.url)
    assert result.returncode == 6, result.stderr
    states = {key: state for key, state, _ in item_rows(db)}
    failed = {key for key, state in states.items() if state == "failed"}
    assert failed == {f"p{i:06d}" for i in [*range(0, 60, 4), 1]}
    assert sum(state == "done" for state in states.values()) == 60 - len(failed)
    assert last_line(result.stderr).startswith("incomplete: finished with 44 done, 16 failed")


# ------------------------------------------------------------------- bad items

BAD = "[bad-item]"
ALTERNATE = "messages must alternate between user and assistant"


def marked(n: int, bad: set[int]) -> list[dict[str, object]]:
    """``n`` prompts, those at the positions in ``bad`` carrying the marker the
    simulated server refuses (``--refuse``)."""
    rows = prompts(n)
    for i in bad:
        rows[i]["messages"][0]["content"] += f" {BAD}"  # type: ignore[index]
    return rows


def enqueue_rows(db: str | Path, rows: list[dict[str, object]], tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    result = cli("enqueue", str(src), "-d", "d", "--max-tokens", "16", "--db", str(db))
    assert result.returncode == 0, result.stderr


def states(db: str | Path) -> dict[str, tuple[str, str | None, str | None]]:
    rows = query(db, "SELECT key, state, error_class, last_error FROM items ORDER BY position")
    return {key: (state, error_class, last_error) for key, state, error_class, last_error in rows}


def test_a_few_bad_items_in_the_first_burst_fail_alone(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    """Five items the server refuses with the same 400, among 300, all in the first
    burst of 256 (sent once the trial has been in flight 2 s unrefused): refused
    seconds before the first answer is in, they fail alone once it comes, and the rest
    is done."""
    bad = {10, 70, 130, 190, 250}
    db = tmp_path / "q.db"
    enqueue_rows(db, marked(300, bad), tmp_path)
    server = sim_process("--latency", "5", "--refuse", f"{BAD}={ALTERNATE}")
    result = run(db, "--server", server.url, "--concurrency", "256")
    assert result.returncode == 6, last_line(result.stderr)
    assert last_line(result.stderr).startswith("incomplete: finished with 295 done, 5 failed")
    found = states(db)
    failed = {key for key, (state, *_) in found.items() if state == "failed"}
    assert failed == {f"p{i:06d}" for i in bad}
    assert {found[key][1:] for key in failed} == {("http_400", f"HTTP 400: {ALTERNATE}")}


@pytest.mark.parametrize("good", [20, 0], ids=["among-good-items", "alone"])
def test_items_held_when_the_breaker_tripped_fail_alone_on_the_next_run(
    tmp_path: Path, db_url: str, sim_process: SimFactory, good: int
) -> None:
    """The first five items all refused the same way: the run stops (a setting, for all
    it can tell). Run again: the trial takes an item not held before; the held ones,
    refused the same way again, fail alone, and the rest is done."""
    enqueue_rows(db_url, marked(5 + good, set(range(5))), tmp_path)
    server = sim_process("--refuse", f"{BAD}={ALTERNATE}")
    first = run(db_url, "--server", server.url)
    assert first.returncode == 5, last_line(first.stderr)
    assert f"answered HTTP 400 '{ALTERNATE}' to 5 different items" in last_line(first.stderr)
    assert {(state, attempts) for _, state, attempts in item_rows(db_url)} == {("pending", 0)}

    again = run(db_url, "--server", server.url)
    assert again.returncode == 6, last_line(again.stderr)
    found = states(db_url)
    assert [found[f"p{i:06d}"] for i in range(5)] == [
        ("failed", "http_400", f"HTTP 400: {ALTERNATE}")
    ] * 5
    assert all(found[f"p{i:06d}"][0] == "done" for i in range(5, 5 + good))


def test_exit_when_done_with_a_paused_dataset_is_not_success(
    tmp_path: Path, sim_process: SimFactory
) -> None:
    db = queue(tmp_path, 10, name="a")
    queue(tmp_path, 10, name="b")
    assert cli("pause", "a", "--db", str(db)).returncode == 0
    server = sim_process()
    result = run(db, "--server", server.url)
    assert result.returncode == 7, result.stderr
    line = last_line(result.stderr)
    assert line == (
        "incomplete: finished with 10 done, 10 pending in paused datasets (a): "
        "`orchestrator resume NAME`, then run again"
    )
    assert cli("resume", "a", "--db", str(db)).returncode == 0
    assert run(db, "--server", server.url).returncode == 0


# ---------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:notaport", "the port must be a whole number from 1 to 65535"),
        ("http://127.0.0.1:99999", "the port must be a whole number from 1 to 65535"),
        ("ftp://127.0.0.1:8000", "the scheme must be http:// or https://"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:8000/v1/chat/completions", "without the endpoint path"),
    ],
)
@pytest.mark.parametrize("source", ["--server", "ORCHESTRATOR_SERVERS", "--servers-file"])
def test_a_url_that_can_never_work_is_refused_at_start(
    tmp_path: Path, url: str, why: str, source: str
) -> None:
    db = queue(tmp_path, 1)
    if source == "--server":
        args, env, where = ["--server", url], None, "--server"
    elif source == "ORCHESTRATOR_SERVERS":
        args, env, where = [], {"ORCHESTRATOR_SERVERS": f"http://127.0.0.1:1 {url}"}, source
    else:
        listed = tmp_path / "servers.txt"
        listed.write_text(f"http://127.0.0.1:1\n{url}  concurrency=4\n")
        args, env, where = ["--servers-file", str(listed)], None, f"{listed}:2"
    result = run(db, *args, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert last_line(result.stderr).startswith(f"error: {where}: '{url}' is not a server URL")
    assert why in result.stderr
    assert untouched(db)


def test_a_closed_port_is_named_at_once_and_give_up_after_ends_the_wait(tmp_path: Path) -> None:
    db = queue(tmp_path, 5)
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    result = run(db, "--server", url, "--give-up-after", "3")
    assert result.returncode == 4, result.stderr
    assert time.monotonic() - started < 30
    said = [e for e in events(result.stderr) if e["event"] == "server_unreachable"]
    assert said and said[0]["server"] == url and said[0]["waited_s"] <= 2
    assert "connection refused" in said[0]["reason"] and said[0]["since"]
    assert last_line(result.stderr).startswith(
        f"error: no server answered within 3s: {url}: connection refused"
    )
    assert untouched(db)


def test_https_to_a_plain_http_port_says_tls(tmp_path: Path, sim_process: SimFactory) -> None:
    db = queue(tmp_path, 5)
    server = sim_process()
    url = server.url.replace("http://", "https://")
    result = run(db, "--server", url, "--give-up-after", "2")
    assert result.returncode == 4, result.stderr
    line = last_line(result.stderr)
    assert "TLS handshake" in line and "try http://" in line, line


def test_a_wrong_path_says_404(tmp_path: Path, sim_process: SimFactory) -> None:
    db = queue(tmp_path, 5)
    server = sim_process()
    result = run(db, "--server", server.url + "/openai", "--give-up-after", "2")
    assert result.returncode == 4, result.stderr
    assert f"HTTP 404 on {server.url}/openai/health" in last_line(result.stderr)


@pytest.mark.parametrize("suffix", ["/", "/v1", "/v1/"])
def test_a_v1_suffix_or_trailing_slash_is_corrected_with_a_note(
    tmp_path: Path, sim_process: SimFactory, suffix: str
) -> None:
    db = queue(tmp_path, 20)
    server = sim_process()
    result = run(db, "--server", server.url + suffix, env={"ORCHESTRATOR_LOG_LEVEL": "info"})
    assert result.returncode == 0, result.stderr
    notes = [e for e in events(result.stderr) if e["event"] == "server_url_corrected"]
    assert notes and f"taken as {server.url} " in notes[0]["note"]
    assert {state for _, state, _ in item_rows(db)} == {"done"}


async def test_an_unreachable_server_is_reported_again_while_it_stays_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Said at once, then every REPORT_EVERY seconds (a minute in service), since when."""
    monkeypatch.setattr(servers, "REPORT_EVERY", 0.3)

    class Settings:
        probe_min = 0.05
        probe_max = 0.1
        failure_limit = 3

    url = f"http://127.0.0.1:{closed_port()}"
    async with InferenceClient(ClientConfig(health_timeout=1)) as client:
        pool = ServerPool({url: 1}, client, Settings())
        with capture_logs() as logs:
            pool.start()
            await asyncio.sleep(1.2)
            await pool.close()
    said = [e for e in logs if e["event"] == "server_unreachable"]
    assert len(said) >= 3
    assert {e["since"] for e in said} == {said[0]["since"]}
    assert all("connection refused" in e["reason"] for e in said)
    assert pool.unreachable()[0][:2] == (url, said[-1]["reason"])
