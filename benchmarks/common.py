"""Shared pieces of the benchmarks: subprocesses, peak RSS, timing, data, tables.

Every measured command runs as its own process, started here and reaped with ``wait4``,
so that its peak RSS and CPU time are its own and not this script's. The machine the
figures are meant for has two cores: by default the simulated server is pinned to one
core and the measured client (worker or bare loop) to the other, so that the figure is
the client's and not the scheduler's. ``--no-pin`` leaves placement to the kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import select
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts.llama_server import stop_process  # noqa: E402 (stdlib only)

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
ORCH: tuple[str, ...] = (PYTHON, "-m", "orchestrator")
DATASET = "bench"

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
    "chi", "psi", "omega", "river", "stone", "cloud", "field", "light", "shadow", "signal",
)  # fmt: skip


# ------------------------------------------------------------------------ machine


def machine_summary() -> dict[str, str]:
    """What the figures were measured on: they mean little without it."""
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "ram": f"{mem_gib:.1f} GiB",
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
    }


def print_machine() -> None:
    """Print the machine, and its load: another busy process on two cores skews everything."""
    m = machine_summary()
    print(
        f"machine: {m['nproc']} cores ({m['cpu']}), {m['ram']} RAM, "
        f"Python {m['python']}, SQLite {m['sqlite']}"
    )
    load = os.getloadavg()[0]
    note = "  WARNING: the machine is busy; figures will be low" if load > 0.5 else ""
    print(f"load average (1 min) at start: {load:.2f}{note}")


# ------------------------------------------------------------------------ cores


@dataclass(frozen=True, slots=True)
class Placement:
    """Which core the simulated server and the measured client run on (None: any)."""

    server: int | None
    client: int | None

    def describe(self) -> str:
        if self.server is None:
            return "no pinning: server, client and this script share all cores"
        return (
            f"sim server pinned to core {self.server}; measured client (worker / bare loop / "
            f"CLI) pinned to core {self.client}; this script idles on core {self.client}"
        )


def placement(pin: bool) -> Placement:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return Placement(None, None)
    return Placement(server=cpus[-1], client=cpus[0])


def _pinned(cpu: int | None) -> Callable[[], None] | None:
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


# ------------------------------------------------------------------------ processes


@dataclass(slots=True)
class Measured:
    """One finished subprocess: wall time, peak RSS and CPU time from its rusage."""

    argv: list[str]
    seconds: float
    peak_rss_mb: float
    user_s: float
    sys_s: float
    returncode: int
    stdout: str
    stderr: str

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def warn_if_failed(self, what: str) -> Measured:
        """Report a failed exit without stopping: the work it did can still be measured."""
        if self.returncode != 0:
            last = (self.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"WARNING: {what} exited {self.returncode}: {last[:300]}", flush=True)
        return self

    def check(self) -> Measured:
        if self.returncode != 0:
            tail = "\n".join(self.stderr.strip().splitlines()[-20:])
            raise SystemExit(f"command failed ({self.returncode}): {' '.join(self.argv)}\n{tail}")
        return self


def py_spy_wrap(argv: Sequence[str], out: Path, rate: int = 250) -> list[str]:
    """Run ``argv`` under ``py-spy record`` (collapsed stacks, active threads only).

    The RSS then measured includes py-spy itself, and timings carry its overhead: use a
    profiled run for where the time goes, not for the figure.
    """
    spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    return [
        spy,
        "record",
        "--rate",
        str(rate),
        "--threads",
        "--format",
        "raw",
        "-o",
        str(out),
        "--",
        *argv,
    ]


def run_measured(
    argv: Sequence[str],
    *,
    cpu: int | None = None,
    env: dict[str, str] | None = None,
    profile: Path | None = None,
    cwd: Path | None = None,
    stop_after: float | None = None,
) -> Measured:
    """Run a command to completion and measure its time, CPU and peak RSS.

    Peak RSS is the child's own ``VmHWM`` from ``/proc``, polled every 20 ms, not
    ``ru_maxrss`` from ``wait4``: Linux carries the parent's resident size at fork
    into the child's ``ru_maxrss``, so a benchmark script that just built a large
    database in memory would be charged to the command it measures.

    ``stop_after`` seconds: send SIGTERM then (a worker stops claiming, finishes what it
    holds and exits 0), for steps too long to run to the end.
    """
    argv = py_spy_wrap(argv, profile) if profile else list(argv)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd or REPO,
            preexec_fn=_pinned(cpu),
        )
        timer = threading.Timer(stop_after, proc.terminate) if stop_after else None
        if timer is not None:
            timer.start()
        peak_kb = [0]
        done = threading.Event()
        poller = threading.Thread(target=_poll_hwm, args=(proc.pid, peak_kb, done), daemon=True)
        poller.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            done.set()
            if timer is not None:
                timer.cancel()
        poller.join()
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            argv=argv,
            seconds=seconds,
            peak_rss_mb=(peak_kb[0] or usage.ru_maxrss) / 1024,
            user_s=usage.ru_utime,
            sys_s=usage.ru_stime,
            returncode=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
        )


def _poll_hwm(pid: int, peak_kb: list[int], done: threading.Event) -> None:
    """Keep the highest ``VmHWM`` (peak resident set, kB) the process reports."""
    path = f"/proc/{pid}/status"
    while not done.is_set():
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        peak_kb[0] = max(peak_kb[0], int(line.split()[1]))
                        break
        except (OSError, ValueError):
            pass
        done.wait(0.02)


def pg_row(url: str, sql: str) -> tuple:
    """One row of one statement on PostgreSQL (``url`` ``/postgres`` for admin statements)."""
    import asyncio

    import asyncpg

    async def run() -> tuple:
        conn = await asyncpg.connect(url)
        try:
            row = await conn.fetchrow(sql)
            return tuple(row) if row is not None else ()
        finally:
            await conn.close()

    return asyncio.run(run())


@contextlib.contextmanager
def fresh_database(work: Path, postgres: str | None, stem: str) -> Iterator[str]:
    """A fresh SQLite file ``work/<stem>.db``, or (``postgres``: a server URL) a fresh
    database ``<stem>`` on that server; the database is dropped afterwards."""
    if not postgres:
        for stale in work.glob(f"{stem}.db*"):
            stale.unlink()
        yield str(work / f"{stem}.db")
        return
    server = postgres.rstrip("/")
    pg_row(f"{server}/postgres", f"DROP DATABASE IF EXISTS {stem} WITH (FORCE)")
    pg_row(f"{server}/postgres", f"CREATE DATABASE {stem}")
    try:
        yield f"{server}/{stem}"
    finally:
        pg_row(f"{server}/postgres", f"DROP DATABASE IF EXISTS {stem} WITH (FORCE)")


def proc_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def postgres_cpu_seconds() -> float:
    """CPU seconds the local PostgreSQL server has used so far: every ``postgres``
    process's own, plus the postmaster's reaped children (backends that have exited)."""
    procs: dict[int, tuple[int, list[str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
        if name.startswith("postgres"):
            procs[int(entry.name)] = (int(rest[1]), rest)
    total = 0
    for ppid, fields in procs.values():
        total += int(fields[11]) + int(fields[12])
        if ppid not in procs:  # the postmaster: its exited backends' time too
            total += int(fields[13]) + int(fields[14])
    return total / _CLK_TCK


def python_startup_seconds(cpu: int | None = None) -> float:
    """What starting a command costs before any work: interpreter plus the store's imports
    (SQLAlchemy, alembic, aiohttp). Part of every subprocess figure."""
    imports = (
        "import orchestrator.cli, orchestrator.store, orchestrator.worker, "
        "orchestrator.formats.export"
    )
    return min(run_measured([PYTHON, "-c", imports], cpu=cpu).seconds for _ in range(3))


@dataclass
class SimServer:
    """The simulated server as a subprocess; a context manager that always kills it."""

    mean_tokens: int = 8
    latency: float = 0.0
    cpu: int | None = None
    extra: tuple[str, ...] = ()
    url: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log: Any = field(default=None, repr=False)

    def __enter__(self) -> SimServer:
        argv = [
            PYTHON,
            "-m",
            "orchestrator.sim.server",
            "--port",
            "0",
            "--latency",
            str(self.latency),
            "--mean-tokens",
            str(self.mean_tokens),
            *self.extra,
        ]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            preexec_fn=_pinned(self.cpu),
        )
        try:
            self.url = self._read_url()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _read_url(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            raise SystemExit(f"sim server did not start (said {line!r})")
        return match.group(1)

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return proc_cpu_seconds(self.proc.pid)

    def stats(self) -> dict[str, Any]:
        """The server's own counters (``/sim/stats``)."""
        with urllib.request.urlopen(self.url + "/sim/stats", timeout=10) as resp:
            return dict(orjson.loads(resp.read()))

    def check_alive(self) -> None:
        """A dead server turns every later figure into a wait: stop with its last words."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise SystemExit(
                f"sim server exited ({self.proc.returncode}): {self.stderr_tail() or '(silent)'}"
            )

    def stderr_tail(self, lines: int = 20) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-lines:])

    def __exit__(self, *exc: object) -> None:
        try:
            stop_process(self.proc)
        finally:
            if self.log is not None:
                self.log.close()
                self.log = None


# ------------------------------------------------------------------------ timing


@dataclass(slots=True)
class Stopwatch:
    seconds: float = 0.0


@contextlib.contextmanager
def timed() -> Iterator[Stopwatch]:
    watch = Stopwatch()
    start = time.perf_counter()
    try:
        yield watch
    finally:
        watch.seconds = time.perf_counter() - start


# ------------------------------------------------------------------------ data


def prompt_line(i: int) -> dict[str, Any]:
    """A short chat prompt: the shape of most real input lines, at its smallest."""
    a, b = _WORDS[i % len(_WORDS)], _WORDS[(i * 7 + 3) % len(_WORDS)]
    return {
        "id": f"p{i:07d}",
        "messages": [
            {"role": "user", "content": f"Prompt {i}: write one sentence about {a} and {b}."}
        ],
    }


def write_prompts(path: Path, n: int) -> Path:
    """Write ``n`` prompt lines (about 110 bytes each) to a JSONL file."""
    with open(path, "wb") as fh:
        for i in range(n):
            fh.write(orjson.dumps(prompt_line(i)))
            fh.write(b"\n")
    return path


def enqueue_argv(prompts: Path, db: Path, dataset: str = DATASET) -> list[str]:
    return [*ORCH, "enqueue", str(prompts), "--dataset", dataset, "--db", str(db)]


def run_argv(url: str, db: Path, concurrency: int) -> list[str]:
    return [
        *ORCH,
        "run",
        "--server",
        url,
        "--db",
        str(db),
        "--exit-when-done",
        "--concurrency",
        str(concurrency),
    ]


def export_argv(out: Path, db: Path) -> list[str]:
    return [*ORCH, "export", str(out), "--db", str(db)]


def connect(db: Path) -> sqlite3.Connection:
    """A plain sqlite3 connection with the same pragmas the store sets."""
    conn = sqlite3.connect(db, isolation_level=None)
    for pragma in (
        "PRAGMA journal_mode = WAL",
        "PRAGMA synchronous = NORMAL",
        "PRAGMA foreign_keys = ON",
        "PRAGMA temp_store = MEMORY",
        "PRAGMA cache_size = -65536",
    ):
        conn.execute(pragma)
    return conn


_ANSWER = " ".join(_WORDS[i % len(_WORDS)] for i in range(63))


def mark_done(db: Path, where: str = "1", *, now: float | None = None) -> int:
    """Mark items done and give each an output row, in one transaction of plain SQL.

    The answers are 64 words (about 400 bytes), the shape the simulated server returns;
    their commit times are spread one millisecond apart, so rate figures are plausible.
    """
    now = time.time() if now is None else now
    conn = connect(db)
    try:
        conn.execute("BEGIN IMMEDIATE")
        (top,) = conn.execute("SELECT coalesce(max(id), 0) FROM items").fetchone()
        conn.execute(
            f"UPDATE items SET state = 'done', attempts = 1, finished_at = :now - (:top - id)"
            f" * 0.001, updated_at = :now WHERE state = 'pending' AND ({where})",
            {"now": now, "top": top},
        )
        cur = conn.execute(
            """
            INSERT INTO outputs (item_id, dataset_id, content, reasoning, finish_reason,
                prompt_tokens, completion_tokens, message, usage, latency, server, model,
                response_id, attempt, created_at)
            SELECT id, dataset_id, printf('[sim:%016x] %s', id, :answer), NULL, 'stop',
                12, 64,
                json_object('role', 'assistant', 'content',
                    printf('[sim:%016x] %s', id, :answer)),
                json_object('prompt_tokens', 12, 'completion_tokens', 64,
                    'total_tokens', 76),
                0.5, 'http://127.0.0.1:1', 'sim-model', printf('chatcmpl-%d', id), 1,
                finished_at
            FROM items WHERE state = 'done'
                AND id NOT IN (SELECT item_id FROM outputs)
            """,
            {"answer": _ANSWER},
        )
        conn.execute("COMMIT")
        return cur.rowcount
    finally:
        conn.close()


def mix_states(db: Path, *, now: float | None = None) -> dict[str, int]:
    """Spread items over every state, as in the middle of a long run with some trouble.

    Of every 100 items by id: 60 done (with outputs), 4 failed, 1 running (with a lease),
    35 pending; one retried attempt is logged for every tenth item.
    """
    now = time.time() if now is None else now
    mark_done(db, "id % 100 < 60", now=now)
    conn = connect(db)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE items SET state = 'failed', attempts = 8, error_class = 'http_400',"
            " last_error = 'HTTP 400: context too long', finished_at = :now, updated_at = :now"
            " WHERE state = 'pending' AND id % 100 BETWEEN 60 AND 63",
            {"now": now},
        )
        conn.execute(
            "UPDATE items SET state = 'running', attempts = 1, lease_token = printf('%032x', id),"
            " lease_owner = 'bench-host:1:1', lease_expires_at = :now + 120, updated_at = :now"
            " WHERE state = 'pending' AND id % 100 = 64",
            {"now": now},
        )
        conn.execute(
            "INSERT INTO attempt_errors (item_id, dataset_id, attempt, error_class, message,"
            " outcome, created_at) SELECT id, dataset_id, 1,"
            " CASE WHEN id % 3 = 0 THEN 'http_500' ELSE 'timeout' END, 'simulated', 'retry',"
            " :now - (id % 600) FROM items WHERE id % 10 = 0",
            {"now": now},
        )
        conn.execute(
            "INSERT INTO attempt_errors (item_id, dataset_id, attempt, error_class, message,"
            " outcome, created_at) SELECT id, dataset_id, 8, 'http_400', 'context too long',"
            " 'failed', :now FROM items WHERE state = 'failed'",
            {"now": now},
        )
        conn.execute("COMMIT")
        return dict(conn.execute("SELECT state, count(*) FROM items GROUP BY state").fetchall())
    finally:
        conn.close()


# ------------------------------------------------------------------------ output


def fmt_mb(mb: float) -> str:
    return f"{mb:,.0f} MB"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table, the same in a terminal and pasted into Markdown."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(line(row))


def verdict(value: float, target: float, *, higher_is_better: bool = False) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "MISSED"


def print_against(
    line: str, value: float, target: float, shown: str, *, higher_is_better: bool = False
) -> None:
    """``line``, then the target (written ``shown``) and whether ``value`` met it."""
    sign = ">=" if higher_is_better else "<="
    met = verdict(value, target, higher_is_better=higher_is_better)
    print(f"{line} (target {sign} {shown}: {met})")


def print_profile(path: Path | None, note: str = "", *, what: str = "collapsed stacks") -> None:
    """Where the py-spy stacks went, when ``--profile`` asked for them."""
    if path:
        print(f"profile ({what}): {path}{note}")


def add_common_args(parser: argparse.ArgumentParser, *, pinning: bool = True) -> None:
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep files here instead of a temporary directory (deleted at the end)",
    )
    if pinning:
        parser.add_argument(
            "--pin",
            action="store_true",
            help="pin the sim server and the measured client to separate cores",
        )
    parser.add_argument(
        "--profile",
        type=Path,
        help="also run the measured command under py-spy; collapsed stacks go to this "
        "file (see benchmarks/profile_summary.py)",
    )


def items_args(
    argv: list[str] | None, doc: str, *, repeat: int, repeat_help: str
) -> argparse.Namespace:
    """``--items`` and ``--repeat`` over the common options, unpinned; prints the machine.

    For the benchmarks that read one prepared database rather than run a server.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=repeat, help=repeat_help)
    add_common_args(parser, pinning=False)
    args = parser.parse_args(argv)
    print_machine()
    return args


@contextlib.contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="orch-bench-") as tmp:
        yield Path(tmp)


def count_items(db: Path) -> int:
    """The items an SQLite queue holds."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT count(*) FROM items").fetchone()[0]
    finally:
        conn.close()


def against(measured: list[Measured], base: list[Measured]) -> list[str]:
    """Median wall and CPU seconds of ``measured``, each with its ratio to ``base``'s."""
    seconds = statistics.median(m.seconds for m in measured)
    cpu = statistics.median(m.cpu_s for m in measured)
    base_s = statistics.median(m.seconds for m in base)
    base_cpu = statistics.median(m.cpu_s for m in base)
    return [f"{seconds:.1f} ({seconds / base_s:.2f}x)", f"{cpu:.1f} ({cpu / base_cpu:.2f}x)"]


def print_passes(runs: dict[str, list[Measured]]) -> None:
    """Each run's passes: wall seconds with CPU seconds."""
    for name, measured in runs.items():
        shown = ", ".join(f"{m.seconds:.1f} ({m.cpu_s:.1f} CPU)" for m in measured)
        print(f"{name}: {shown} s")


def count(db: Path, sql: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(sql).fetchone()[0])
    except sqlite3.Error:
        return -1
    finally:
        conn.close()


def prepared_db(work: Path, n: int, kind: str) -> Path:
    """A database of ``n`` enqueued items, all done (``kind="done"``) or mixed (``"mixed"``).

    Built with the real ``enqueue`` command, then finished with plain SQL. Kept in
    ``work`` and reused when it is already there, so ``--workdir`` saves the build.
    """
    db = work / f"{kind}-{n}.db"
    if db.exists() and count(db, "SELECT count(*) FROM items") == n:
        print(f"reusing {db}")
        return db
    for stale in work.glob(f"{kind}-{n}.db*"):
        stale.unlink()
    with timed() as watch:
        prompts = write_prompts(work / f"prompts-{n}.jsonl", n)
        run_measured(enqueue_argv(prompts, db)).check()
        prompts.unlink()
        if kind == "done":
            mark_done(db)
        else:
            mix_states(db)
    print(f"built {db.name} ({n:,} items, {kind}) in {watch.seconds:.1f} s")
    return db


def upgraded_db(work: Path, n: int, kind: str) -> Path:
    """:func:`prepared_db`, brought to the current schema by ``db upgrade`` (not measured)."""
    db = prepared_db(work, n, kind)
    upgrade = run_measured([*ORCH, "db", "upgrade", "--db", str(db)]).check()
    print(f"{upgrade.stdout.strip()} ({upgrade.seconds:.1f} s, not measured below)")
    return db


def print_states(db: Path) -> None:
    """How many items stand in each state: the mix the figures were taken on."""
    conn = connect(db)
    try:
        states = dict(conn.execute("SELECT state, count(*) FROM items GROUP BY state"))
    finally:
        conn.close()
    print("items by state: " + ", ".join(f"{k} {v:,}" for k, v in sorted(states.items())))
