"""Servers the run launches itself (``run --launch``, ``--engine``), with the simulated
server behind them: a fake engine script takes SGLang's and vLLM's command lines and
becomes ``orchestrator sim``. The same runs against the real llama.cpp server are in
tests/test_launch_llamacpp.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import ConfigError
from orchestrator.inference.launch.process import group_members
from orchestrator.inference.launch.spec import (
    LaunchSpec,
    Preset,
    build_specs,
    detect_gpus,
    preset_command,
    replicate,
)
from orchestrator.inference.servers_file import read_servers_file
from tests.helpers import (
    REPO,
    cli,
    done_count,
    events,
    exported,
    prompts,
    query,
    start_cli,
    write_jsonl,
)

FAKE = REPO / "tests" / "fixtures" / "fake_engine.py"
SIM = f"{shlex.quote(sys.executable)} -m orchestrator.sim.server --port {{port}}"


# ---------------------------------------------------------------- command lines


def test_presets_spell_out_each_engines_flags() -> None:
    sglang = preset_command(Preset("sglang", "/m/Qwen3-8B", 2, "--mem-fraction-static 0.8"))
    assert sglang == (
        "python -m sglang.launch_server --model-path /m/Qwen3-8B --host 127.0.0.1 "
        "--port {port} --tp-size 2 --enable-metrics --mem-fraction-static 0.8"
    )
    vllm = preset_command(Preset("vllm", "/m/a b", 4, served_model_name="qwen"))
    assert vllm == (
        "vllm serve '/m/a b' --host 127.0.0.1 --port {port} --tensor-parallel-size 4 "
        "--served-model-name qwen"
    )
    llama = preset_command(Preset("llama.cpp", "m.gguf", program="/opt/llama-server"))
    assert llama == "/opt/llama-server -m m.gguf --host 127.0.0.1 --port {port} --metrics"
    with pytest.raises(ConfigError, match=r"--tp is not for llama\.cpp"):
        preset_command(Preset("llama.cpp", "m.gguf", tp=2))
    # The port goes where {port} is, in every word that holds it.
    assert LaunchSpec(llama).argv(4321)[-2:] == ["4321", "--metrics"]


def test_gpus_come_from_cuda_visible_devices_and_replicas_get_their_own() -> None:
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1", "2", "3"]
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "4,-1,5"}) == ["4"]  # CUDA stops at -1
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    spec = LaunchSpec("serve --port {port}")
    replicas = replicate([spec], gpus_per_server=2, gpus=["0", "1", "2", "3", "4"])
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in replicas] == ["0,1", "2,3"]
    assert len(replicate([spec], replicas=3)) == 3
    with pytest.raises(ConfigError, match="1 GPU\\(s\\) found"):
        replicate([spec], gpus_per_server=2, gpus=["0"])
    with pytest.raises(ConfigError, match="has no \\{port\\}"):
        build_specs([("llama-server -m m.gguf --port 8080", None, None)])


def test_servers_file_launch_lines(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    path.write_text(
        "http://gpu-1:30000\n"
        'launch = "llama-server -m /m/a.gguf --port {port}"  concurrency=8\n'
        "launch='vllm serve /m --port {port}' port=31000  # fixed\n"
    )
    servers, launches = read_servers_file(path)
    assert [s.url for s in servers] == ["http://gpu-1:30000"]
    assert [(ln.command, ln.concurrency, ln.port) for ln in launches] == [
        ("llama-server -m /m/a.gguf --port {port}", 8, None),
        ("vllm serve /m --port {port}", None, 31000),
    ]
    path.write_text('http://gpu-1:30000\nlaunch = "llama-server --port 8080"\n')
    with pytest.raises(ConfigError, match=r"servers.txt:2: the launch command .* has no \{port\}"):
        read_servers_file(path)


# ---------------------------------------------------------------- runs


def enqueue(db: Path, n: int, *extra: str) -> list[dict[str, Any]]:
    rows = prompts(n)
    data = write_jsonl(db.parent / "in.jsonl", rows)
    done = cli("enqueue", str(data), "-d", "t", "--db", str(db), "--model", "m", *extra)
    assert done.returncode == 0, done.stderr
    return rows


def wrapper(tmp_path: Path, name: str) -> Path:
    """An executable named like the engine's that runs the fake engine."""
    path = tmp_path / name
    path.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} "$@"\n'
    )
    path.chmod(0o755)
    return path


def states(db: Path) -> list[dict[str, Any]]:
    """Every launched server of every worker on this database, from servers.json."""
    found = []
    for path in sorted(Path(str(db) + ".servers").glob("*/servers.json")):
        found.extend(json.loads(path.read_text())["servers"])
    return found


def start_run(db: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return start_cli("run", "--db", str(db), *args, env=env)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (checked in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(check: Any, what: str, seconds: float = 60.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def check_done_once(db: Path, rows: list[dict[str, Any]]) -> None:
    """Every item done with one output, and no attempt charged to any of them."""
    exported(db, db.parent / "out.jsonl", [row["id"] for row in rows])
    assert query(db, "SELECT count(*) FROM outputs")[0][0] == len(rows)
    assert query(db, "SELECT max(attempts) FROM items")[0][0] == 1


def run_engine(
    db: Path,
    rows: list[dict[str, Any]],
    engine: str,
    model: str,
    program: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """``run --exit-when-done`` on servers it launches with ``program``: it succeeds and
    answers every item once. The launched servers' states."""
    cli_args = ["--engine", engine, "--model", model, "--engine-bin", str(program), *extra]
    result = cli("run", "--db", str(db), "--exit-when-done", *cli_args, env=env)
    assert result.returncode == 0, result.stderr
    check_done_once(db, rows)
    return states(db)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_engine_preset_is_launched_supervised_and_stopped(tmp_path: Path, engine: str) -> None:
    db = tmp_path / "q.db"
    rows = enqueue(db, 40)
    program = wrapper(tmp_path, "python" if engine == "sglang" else "vllm")
    extra = ("--served-model-name", "m", "--replicas", "2")
    launched = run_engine(db, rows, engine, "/models/m", program, *extra)
    assert [s["state"] for s in launched] == ["stopped", "stopped"]
    for server in launched:
        log = Path(server["log"]).read_text()
        # The fake engine took the preset's flags as the engine would (argparse).
        flag = "'enable_metrics': True" if engine == "sglang" else "'tensor_parallel_size': 1"
        assert flag in log and f"'port': {server['url'].rsplit(':', 1)[1]}" in log
        assert server["pid"] is None


def test_gpus_per_server_gives_each_replica_its_devices(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    rows = enqueue(db, 10)
    program = wrapper(tmp_path, "vllm")
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}
    launched = run_engine(db, rows, "vllm", "m", program, "--gpus-per-server", "2", env=env)
    assert [s["env"] for s in launched] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    assert "CUDA_VISIBLE_DEVICES=2,3" in Path(launched[1]["log"]).read_text()


def _held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("case", ["bad path", "exits at once", "never healthy", "port taken"])
def test_a_launch_that_fails_says_why_in_one_line_and_claims_nothing(
    tmp_path: Path, case: str
) -> None:
    db = tmp_path / "q.db"
    enqueue(db, 5)
    fake = f"{shlex.quote(sys.executable)} {FAKE} serve m --port {{port}}"
    args: list[str] = []
    env: dict[str, str] = {}
    held = None
    if case == "bad path":
        args = ["--launch", "/nonexistent/vllm serve m --port {port}"]
        expected = ["'/nonexistent/vllm serve m --port", "exit status 127", "cannot start"]
    elif case == "exits at once":
        args, env = ["--launch", fake], {"FAKE_ENGINE": "exit"}
        expected = ["exited (exit status 3) before it was ready", "CUDA out of memory"]
    elif case == "never healthy":
        args, env = ["--launch", fake, "--startup-timeout", "3"], {"FAKE_ENGINE": "never-healthy"}
        expected = ["was not ready within 3s", "answers 503", "fake engine: {"]
    else:
        held = _held_port()
        port = held.getsockname()[1]
        servers = tmp_path / "servers.txt"
        servers.write_text(f'launch = "{SIM}" port={port}\n')
        args = ["--servers-file", str(servers)]
        expected = [f"port {port} is already in use by another process"]
    try:
        result = cli("run", "--db", str(db), "--exit-when-done", *args, env=env, timeout=120)
    finally:
        if held is not None:
            held.close()
    assert result.returncode == 8, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no launched server started (1 tried): server-1: ")
    for text in expected:
        assert text in lines[0], lines[0]
    # Nothing was claimed: every item pending, no attempt made.
    assert query(db, "SELECT state, attempts, count(*) FROM items GROUP BY 1, 2") == [
        ("pending", 0, 5)
    ]


def test_a_killed_server_is_restarted_and_its_items_answered_once(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    rows = enqueue(db, 400, "--max-tokens", "400")
    sim = SIM + " --latency 0.2"
    proc = start_run(
        db,
        "--exit-when-done",
        "--launch",
        sim,
        "--replicas",
        "2",
        "--concurrency",
        "8",
        "--restart-backoff",
        "0.5",
    )
    wait_for(lambda: done_count(db) >= 40, "40 items done")
    victim = next(s for s in states(db) if s["name"] == "server-1")
    # status shows the worker's launched servers, their pids and logs.
    shown = cli("status", "--db", str(db), "--json")
    assert shown.returncode == 0, shown.stderr
    launched = json.loads(shown.stdout)["launched"]
    assert [(s["name"], s["state"], s["log"]) for s in launched] == [
        (s["name"], "up", s["log"]) for s in states(db)
    ]
    text = cli("status", "--db", str(db)).stdout
    assert f"server-1 {victim['url']}  up, pid {victim['pid']}, restarts 0" in text
    assert f"log: {victim['log']}" in text
    os.kill(victim["pid"], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    check_done_once(db, rows)
    logged = events(stderr)
    died = [e for e in logged if e["event"] == "server_died"]
    assert len(died) == 1 and died[0]["server"] == victim["url"], died
    assert "killed by SIGKILL" in died[0]["reason"]
    first, second = states(db)
    assert (first["restarts"], second["restarts"]) == (1, 0)
    # The items in flight there went back without an attempt charged (max(attempts) is
    # 1 above), and were released rather than retried.
    stopped = next(e for e in logged if e["event"] == "worker_stopped")
    assert stopped["released"] >= 1 and stopped["retried"] == 0


def test_a_killed_watchdog_takes_its_whole_server_with_it(tmp_path: Path) -> None:
    """The server under a shell that forks it (``bash -c '...; echo done'``): a SIGKILL of
    the watchdog reaches the shell alone (``PR_SET_PDEATHSIG``). Its group is stopped
    before the restart, which finds its port free; the run finishes, and nothing of the
    first server is left."""
    db = tmp_path / "q.db"
    rows = enqueue(db, 200, "--max-tokens", "200")
    wrapped = f"bash -c {shlex.quote(SIM + ' --latency 0.1; echo done')}"
    proc = start_run(
        db, "--exit-when-done", "--launch", wrapped, "--concurrency", "4",
        "--restart-backoff", "0.2",
    )  # fmt: skip
    wait_for(lambda: done_count(db) >= 20, "20 items done")
    (first,) = states(db)
    group = first["watchdog_pid"]
    members = wait_for(lambda: [p for p in group_members(group) if p != group], "the server")
    assert len(members) >= 2  # the shell and the server it forked
    os.kill(group, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    check_done_once(db, rows)
    assert [pid for pid in members if alive(pid)] == []
    assert group_members(group) == []
    died = [e for e in events(stderr) if e["event"] == "server_died"]
    assert len(died) == 1 and "killed by SIGKILL" in died[0]["reason"], died
    assert states(db)[0]["restarts"] == 1


def test_a_server_that_keeps_dying_is_given_up_on_and_the_run_stops(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    enqueue(db, 2000, "--max-tokens", "2000")
    fake = f"{shlex.quote(sys.executable)} {FAKE} serve m --port {{port}}"
    result = cli(
        "run",
        "--db",
        str(db),
        "--exit-when-done",
        "--launch",
        fake,
        "--concurrency",
        "4",
        "--restart-backoff",
        "0.1",
        "--max-server-deaths",
        "3",
        env={"FAKE_ENGINE": "die-after=1.5", "FAKE_ENGINE_SIM": "--latency 0.5"},
        timeout=180,
    )
    assert result.returncode == 8, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "given up on: it died 3 times within 3600s" in lines[0]
    # Items caught in each death went back with their attempt given back.
    assert query(db, "SELECT max(attempts) FROM items WHERE state != 'done'")[0][0] <= 1
    assert query(db, "SELECT count(*) FROM items WHERE state = 'failed'")[0][0] == 0
    assert [s["state"] for s in states(db)] == ["given_up"]


def test_queue_run_launches_as_the_command_does(tmp_path: Path) -> None:
    import orchestrator as orc

    db = tmp_path / "q.db"
    rows = enqueue(db, 30)
    with orc.open_sync(db) as q:
        outcome = q.run(launch=[SIM], replicas=2, until_done=True)
        assert outcome.stats.completed == 30
        with pytest.raises(orc.ConfigError, match=r"has no \{port\}"):
            q.run(launch=["llama-server --port 8080"])
    check_done_once(db, rows)
    assert [s["state"] for s in states(db)] == ["stopped", "stopped"]


def test_doctor_and_plan_start_a_launched_server_briefly(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    enqueue(db, 3)
    doctor = cli("doctor", "--db", str(db), "--launch", SIM + " --model m")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "PASS  launch: server-1 ready at http://127.0.0.1:" in doctor.stdout
    assert "serves m" in doctor.stdout
    bad = cli("doctor", "--db", str(db), "--launch", "/nonexistent/sglang --port {port}")
    assert bad.returncode == 1
    assert "FAIL  launch: '/nonexistent/sglang --port" in bad.stdout
    assert "exit status 127: command not found" in bad.stdout
    planned = cli("plan", "--db", str(db), "--json", "--launch", SIM + " --max-model-len 4096")
    assert planned.returncode == 0, planned.stderr
    looked = json.loads(planned.stdout)["launched"]
    assert (looked["context_length"], looked["metrics"]) == (4096, "sglang")
    # Each started and stopped again (doctor's, plan's; the failed one given up on).
    assert sorted(s["state"] for s in states(db)) == ["given_up", "stopped", "stopped"]


async def test_a_wedged_server_is_restarted_and_the_pool_hears_first(tmp_path: Path) -> None:
    """A server that stops answering /health (here SIGSTOPped: alive, silent) is taken
    out of the pool before it is killed, then restarted on the same port."""
    import asyncio

    import aiohttp

    from orchestrator.inference.launch.spec import SuperviseSettings
    from orchestrator.inference.launch.supervisor import Supervisor

    settings = SuperviseSettings(
        startup_timeout=30,
        health_every=0.3,
        health_timeout=0.5,
        health_misses=2,
        restart_backoff=0.1,
        stop_timeout=1,
    )
    supervisor = Supervisor([LaunchSpec(SIM)], settings, tmp_path)
    heard: list[tuple[str, str, str]] = []
    server = supervisor.servers[0]

    def down(url: str, reason: str) -> None:
        process = server.process
        assert process is not None
        heard.append((url, reason, "alive" if process.returncode is None else "dead"))

    supervisor.on_down = down
    async with aiohttp.ClientSession() as session:
        await supervisor.start(session, asyncio.Event())
        try:
            supervisor.watch()
            first = server.process.server_pid() if server.process else None
            assert first is not None
            os.kill(first, signal.SIGSTOP)
            for _ in range(400):
                if server.restarts == 1 and server.state == "up":
                    break
                await asyncio.sleep(0.05)
            assert (server.restarts, server.state) == (1, "up")
            assert heard == [(server.url, heard[0][1], "alive")]
            assert "stopped answering /health (2 looks in a row" in heard[0][1]
            assert not alive(first)  # SIGKILLed in the end, stopped as it was
            assert server.process is not None and server.process.server_pid() != first
        finally:
            await supervisor.stop()
    assert server.state == "stopped"


def test_old_stopped_launch_directories_are_forgotten(tmp_path: Path) -> None:
    from orchestrator.inference.launch.state import KEEP_STOPPED, STATE_FILE, forget_old

    now = time.time()
    cases = {
        "old": (True, now - KEEP_STOPPED - 60),
        "recent": (True, now - 60),
        "running": (False, now - KEEP_STOPPED - 60),
    }
    for name, (stopped, at) in cases.items():
        (tmp_path / name).mkdir()
        doc = {"stopped": stopped, "updated_at": at, "servers": []}
        (tmp_path / name / STATE_FILE).write_text(json.dumps(doc))
        (tmp_path / name / "server-1.log").write_text("log\n")
    forget_old(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recent", "running"]


def test_a_servers_log_is_rotated_by_its_watchdog(tmp_path: Path) -> None:
    """The watchdog copies the server's output to its log, renamed to .1, .2 when full,
    the oldest dropped; it exits as the server did."""
    log = tmp_path / "server-1.log"
    read, write = os.pipe()
    noisy = "import sys\nfor i in range(30000): print(f'line {i:05d}', flush=True)\nsys.exit(3)"
    argv = [
        sys.executable,
        "-m",
        "orchestrator.inference.launch.watchdog",
        str(read),
        str(log),
        str(tmp_path / "server-1.pid"),
        "10000",
        "2",
        "5",
        "--",
        sys.executable,
        "-c",
        noisy,
    ]
    try:
        done = subprocess.run(argv, pass_fds=(read,), cwd=REPO, timeout=60)
    finally:
        os.close(read)
        os.close(write)
    assert done.returncode == 3
    names = sorted(p.name for p in tmp_path.glob("server-1.log*"))
    assert names == ["server-1.log", "server-1.log.1", "server-1.log.2"]
    sizes = [(tmp_path / name).stat().st_size for name in names]
    assert all(size < 10000 + 65536 for size in sizes)
    # The three files, oldest first, are one stretch of the output, ending at its end.
    text = "".join((tmp_path / n).read_text() for n in reversed(names)).splitlines()
    numbers = [int(line.split()[1]) for line in text[1:]]  # the first may be cut
    assert numbers == list(range(numbers[0], 30000))
