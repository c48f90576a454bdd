"""``status`` and ``export`` read paths: plain sqlite3 and SQLAlchemy give the same bytes.

The read-only commands read an up-to-date SQLite file through ``store.reader`` (no
SQLAlchemy, no alembic) and fall back to the full store otherwise. Both paths must give
what the documented formats promise: export lines byte for byte as
``orjson.dumps(messages_line(item))``, and the same status document.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from orchestrator import cli, logs
from orchestrator.cli import inspect as cli_inspect
from orchestrator.formats.export import export_jsonl
from orchestrator.formats.writers.lines import messages_line
from orchestrator.monitor import status as status_view
from orchestrator.monitor.status import snapshot
from orchestrator.store import (
    Database,
    Failure,
    Output,
    Queue,
    create_database,
    engine,
    item_detail,
    iter_done,
    open_database,
    reader,
    schema,
    stats,
)
from orchestrator.store.migrate import SCHEMA_REVISION, alembic_config, head_revision
from orchestrator.store.reader import EngineRows, open_reader, sqlite_path
from tests.helpers import cli as run_cli
from tests.helpers import cli_loading, run_python, write_jsonl

T0 = 1_800_000_000.0

# Input lines that exercise the encoder: non-ASCII and escapes, multi-part content,
# tools carried into the export line, extra request fields, a line without "id".
LINES: list[dict[str, Any]] = [
    {"id": "plain", "messages": [{"role": "user", "content": "hello"}]},
    {
        "id": "unicode",
        "messages": [
            {"role": "system", "content": "Réponds en français \u00e9\u2028 \U0001f600"},
            {"role": "user", "content": 'quote " backslash \\ tab \t nul-ish \u0001 </script>'},
        ],
    },
    {
        "id": "tools",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "temperature": 0.7,
        "max_tokens": 2147483647,  # the most a request may ask for
    },
    {
        "id": "parts",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
    },
    {"messages": [{"role": "user", "content": "no id: the line number is the key"}]},
]


def _answer(i: int) -> Output:
    message: dict[str, Any] = {"role": "assistant", "content": f"answer {i} — ✓ \U0001f680"}
    if i == 2:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        }
    usage = None if i == 3 else {"prompt_tokens": 5, "completion_tokens": i + 1, "x": 1.5e-7}
    return Output(
        message=message,
        content=message["content"],
        reasoning=None,
        finish_reason=None if i == 4 else "stop",
        usage=usage,
        latency=0.25 * (i + 1),
        server="http://sim",
        model="sim-model",
        response_id=f"r{i}",
    )


def _enqueue(tmp_path: Path, db: Path | str, name: str, rows: list[dict[str, Any]]) -> None:
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    result = run_cli("enqueue", str(data), "--dataset", name, "--db", str(db))
    assert result.returncode == 0, result.stderr


@asynccontextmanager
async def _built(
    tmp_path: Path,
    db: Path | str,
    datasets: dict[str, list[dict[str, Any]]],
    fill: Callable[[Database], Awaitable[None]],
) -> AsyncIterator[Database]:
    """The datasets enqueued into ``db`` by the real command, then ``fill`` on it; open."""
    for name, rows in datasets.items():
        _enqueue(tmp_path, db, name, rows)
    database = await open_database(str(db))
    try:
        await fill(database)
        yield database
    finally:
        await database.close()


# Two datasets; _done finishes every line of "mixed" and half of "zeta".
DONE_SETS = {"mixed": LINES, "zeta": [{"id": f"z{i}", "prompt": f"z {i}"} for i in range(6)]}


async def _done(database: Database) -> None:
    """Every line of "mixed" done with a varied answer, half of "zeta"."""
    queue = Queue(database)
    leases = await queue.claim("w", 10, lease_seconds=600, dataset_names=["mixed"])
    assert await queue.complete([(lease, _answer(i)) for i, lease in enumerate(leases)])
    leases = await queue.claim("w", 3, lease_seconds=600, dataset_names=["zeta"])
    assert await queue.complete([(lease, _answer(i)) for i, lease in enumerate(leases)])


@pytest.fixture
async def done_db(tmp_path: Path) -> AsyncIterator[tuple[Path, Database]]:
    db = tmp_path / "q.db"
    async with _built(tmp_path, db, DONE_SETS, _done) as database:
        yield db, database


async def _reference(database: Database, names: list[str] | None = None) -> bytes:
    """What export promises: each line exactly ``orjson.dumps(messages_line(item))``."""
    return b"".join(
        [orjson.dumps(messages_line(item)) + b"\n" async for item in iter_done(database, names)]
    )


async def test_export_paths_are_byte_identical(
    done_db: tuple[Path, Database], tmp_path: Path
) -> None:
    db, database = done_db
    expected = await _reference(database)
    assert expected.count(b"\n") == len(LINES) + 3

    out = tmp_path / "cli.jsonl"
    result = run_cli("export", str(out), "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == expected

    # In-process on SQLite: plain sqlite3 in a worker thread.
    threaded = tmp_path / "threaded.jsonl"
    assert await export_jsonl(database, threaded) == len(LINES) + 3
    assert threaded.read_bytes() == expected

    # The SQLAlchemy stream, as on PostgreSQL.
    database.is_sqlite = False
    try:
        streamed = tmp_path / "streamed.jsonl"
        assert await export_jsonl(database, streamed) == len(LINES) + 3
    finally:
        database.is_sqlite = True
    assert streamed.read_bytes() == expected

    lines = [orjson.loads(line) for line in expected.splitlines()]
    assert [line["id"] for line in lines[:5]] == ["plain", "unicode", "tools", "parts", "5"]
    assert lines[2]["tools"][0]["function"]["name"] == "get_weather"
    assert lines[3]["usage"] is None and lines[4]["finish_reason"] is None
    assert {line["dataset"] for line in lines[5:]} == {"zeta"}


async def test_export_one_dataset_and_unknown_names(
    done_db: tuple[Path, Database], tmp_path: Path
) -> None:
    db, database = done_db
    out = tmp_path / "zeta.jsonl"
    result = run_cli("export", str(out), "--dataset", "zeta", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == await _reference(database, ["zeta"])
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [
        "z0",
        "z1",
        "z2",
    ]

    before = out.read_bytes()
    result = run_cli("export", str(out), "--dataset", "nope", "--db", str(db))
    assert result.returncode == 2
    assert "no such dataset: nope" in result.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


async def _mixed(database: Database) -> None:
    """Items in every state, with known times, tokens and errors.

    Dataset "a" (20 items): 10 done (5 at T0 + 10, 5 at T0 + 500), 3 failed (http_400),
    2 retried (timeout) and 1 released (connect) back to pending, 4 running, no other
    pending. Dataset "b" (6 items): 2 done at T0 + 20, 4 pending.
    """
    queue = Queue(database)
    a = await queue.claim("w", 20, lease_seconds=3600, dataset_names=["a"], now=T0)
    b = await queue.claim("w", 2, lease_seconds=3600, dataset_names=["b"], now=T0)
    done = [(lease, _answer(i % 4)) for i, lease in enumerate(a[:10])]
    assert len(await queue.complete(done[:5], now=T0 + 10)) == 5
    assert len(await queue.complete(done[5:], now=T0 + 500)) == 5
    assert len(await queue.fail([(x, Failure("http_400", "bad")) for x in a[10:13]])) == 3
    retry = [(x, Failure("timeout", "slow"), 0.0) for x in a[13:15]]
    assert len(await queue.retry(retry, now=T0 + 30)) == 2
    assert len(await queue.release([(a[15], Failure("connect", "refused"), 0.0)])) == 1
    assert len(await queue.complete([(x, _answer(0)) for x in b], now=T0 + 20)) == 2


MIXED_SETS = {
    "a": [{"id": f"a{i:02d}", "prompt": f"a {i}"} for i in range(20)],
    "b": [{"id": f"b{i:02d}", "prompt": f"b {i}"} for i in range(6)],
}


@pytest.fixture
async def mixed_db(tmp_path: Path) -> AsyncIterator[tuple[Path, Database]]:
    db = tmp_path / "mixed.db"
    async with _built(tmp_path, db, MIXED_SETS, _mixed) as database:
        yield db, database


async def test_status_numbers_on_mixed_states(mixed_db: tuple[Path, Database]) -> None:
    db, database = mixed_db
    now = T0 + 600
    via_engine = await _via_engine(database, now)
    with open_reader(str(db)) as read:  # type: ignore[union-attr]
        via_sqlite = status_view.read(read, now=now)
    assert via_sqlite == via_engine

    a, b = via_engine["datasets"]
    assert (a["name"], b["name"]) == ("a", "b")
    assert a["counts"] == {"pending": 3, "running": 4, "done": 10, "failed": 3, "total": 20}
    assert b["counts"] == {"pending": 4, "running": 0, "done": 2, "failed": 0, "total": 6}
    assert a["progress"] == 0.65
    # Answers 0..3 carry 1, 2, 3 and no completion tokens and latencies 0.25..1.0 s.
    # p50/p90 by nearest rank over the 8 answers that report tokens: 1 1 1 2 2 2 3 3.
    assert a["completion_tokens"] == {
        "total": 1 + 2 + 3 + 0 + 1 + 2 + 3 + 0 + 1 + 2,
        "mean": 1.5,
        "p50": 2,
        "p90": 3,
        "sample": 8,
    }
    assert a["overall"]["done"] == 10
    assert a["overall"]["started_at"] == T0 + 10 - 1.0
    assert a["overall"]["last_done_at"] == T0 + 500
    assert a["recent"]["done"] == 5  # the window is [T0 + 300, T0 + 600]
    assert a["recent"]["seconds"] == 300.0
    assert a["errors"] == {
        "http_400": {"retried": 0, "released": 0, "failed": 3},
        "timeout": {"retried": 2, "released": 0, "failed": 0},
        "connect": {"retried": 0, "released": 1, "failed": 0},
    }
    assert a["failed_by_class"] == {"http_400": 3}
    assert b["overall"]["started_at"] == T0 + 20 - 0.25
    assert b["recent"]["done"] == 0
    # The ETA replays the claim order: "a" and "b", of one priority, are claimed from
    # together and share the slots by their work left, so they end together.
    assert 0 < a["eta_seconds"] == pytest.approx(b["eta_seconds"], abs=0.1)
    totals = via_engine["totals"]
    assert totals["eta_seconds"] == b["eta_seconds"]
    assert totals["counts"] == {"pending": 7, "running": 4, "done": 12, "failed": 3, "total": 26}
    assert totals["failed_by_class"] == {"http_400": 3}
    assert totals["overall"]["started_at"] == T0 + 9.0
    assert via_engine["database"] == database.where == str(db)


# --- PostgreSQL: the same status document and the same export bytes -------------------


@pytest.mark.postgresql
async def test_postgresql_export_is_byte_identical_to_sqlite(
    done_db: tuple[Path, Database], pg_database: Callable[[], str], tmp_path: Path
) -> None:
    db, _ = done_db
    url = pg_database()
    async with _built(tmp_path, url, DONE_SETS, _done) as database:
        expected = await _reference(database)
    # (openai-batch lines carry the time each answer was made: not comparable here.)
    for fmt in ("messages", "sharegpt"):
        outs = []
        for where in (db, url):
            out = tmp_path / f"{fmt}-{'pg' if where == url else 'sqlite'}.jsonl"
            result = run_cli("export", str(out), "--format", fmt, "--db", str(where))
            assert result.returncode == 0, result.stderr
            outs.append(out.read_bytes())
        assert outs[0] == outs[1], fmt
        if fmt == "messages":
            assert outs[1] == expected
    result = run_cli("export", str(tmp_path / "x.jsonl"), "--dataset", "nope", "--db", url)
    assert result.returncode == 2 and "no such dataset: nope" in result.stderr


def _without_attempt_times(document: dict[str, Any]) -> dict[str, Any]:
    """The status document less the wall-clock times its attempts were logged at: the
    two databases are built one after the other, and a failed attempt is logged when
    it happens."""
    for entry in [document["totals"], *document["datasets"]]:
        for messages in entry["error_messages"].values():
            messages.pop("last_at")
            for message in messages["latest"]:
                message.pop("at")
    return document


@pytest.mark.postgresql
async def test_postgresql_status_matches_sqlite(
    mixed_db: tuple[Path, Database], pg_database: Callable[[], str], tmp_path: Path
) -> None:
    _, lite = mixed_db
    url = pg_database()
    async with _built(tmp_path, url, MIXED_SETS, _mixed) as database:
        now = T0 + 600
        on_pg = await snapshot(database, now=now)
        on_sqlite = await snapshot(lite, now=now)
        assert on_pg.pop("database") == database.where
        on_sqlite.pop("database")
        assert _without_attempt_times(on_pg) == _without_attempt_times(on_sqlite)
    result = run_cli("status", "--json", "--db", url)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["totals"]["counts"] == {
        "pending": 7,
        "running": 4,
        "done": 12,
        "failed": 3,
        "total": 26,
    }
    assert document["database"] == database.where


async def test_status_cli_reads_without_sqlalchemy(mixed_db: tuple[Path, Database]) -> None:
    db, database = mixed_db
    args = ["status", "--json", "--db", str(db)]
    packages = ("sqlalchemy", "alembic", "aiosqlite", "structlog", "jsonschema")
    result, heavy = cli_loading(args, packages, fail_on_exit=False)
    assert heavy == []
    status = json.loads(result.stdout)
    expected = await snapshot(database, now=status["generated_at"])
    assert status == json.loads(orjson.dumps(expected))
    text = run_cli("status", "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert "10/20" in text.stdout and "2/6" in text.stdout


async def _alembic(db: Path, step: str, revision: str) -> None:
    """Run alembic's upgrade or downgrade to ``revision`` the way the store does."""
    from alembic import command

    database = create_database(str(db))

    def run(connection: sa.Connection) -> None:
        getattr(command, step)(alembic_config(connection), revision)

    try:
        async with database.write() as conn:
            await conn.run_sync(run)
    finally:
        await database.close()


async def test_0001_database_is_not_upgraded_by_status(mixed_db: tuple[Path, Database]) -> None:
    """status only reads: an older schema is named, left as it is, and upgraded on request."""
    db, database = mixed_db
    now = T0 + 600
    expected = await snapshot(database, now=now)
    await database.close()
    await _alembic(db, "downgrade", "0001")
    assert open_reader(str(db)) is None  # behind: the fast path steps aside
    before = db.read_bytes()

    result = run_cli("status", "--json", "--db", str(db))
    assert result.returncode == 3
    assert "schema 0001" in result.stderr and "orchestrator db upgrade" in result.stderr
    assert db.read_bytes() == before
    assert run_cli("db", "upgrade", "--db", str(db)).returncode == 0
    result = run_cli("status", "--json", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["totals"]["counts"]["total"] == 26
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (SCHEMA_REVISION,)
        ]
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"ix_items_failed", "ix_outputs_totals", "ix_outputs_started"} <= names
    assert {"ix_attempt_errors_class", "ix_outputs_flagged"} <= names
    with open_reader(str(db)) as read:  # type: ignore[union-attr]
        assert status_view.read(read, now=now) == expected


async def test_fresh_0001_database_upgrades_to_head(tmp_path: Path) -> None:
    """A database made by migration 0001 alone takes the later ones, and they go back down."""
    db = tmp_path / "old.db"
    await _alembic(db, "upgrade", "0001")
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0001",)
    result = run_cli("db", "upgrade", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert f"upgraded from 0001 to {SCHEMA_REVISION}" in result.stdout
    with closing(sqlite3.connect(db)) as conn:
        indexes = dict(
            conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index'").fetchall()
        )
        # The same definitions as orchestrator/store/schema.py declares.
        for table in schema.metadata.tables.values():
            for index in table.indexes:
                assert index.name in indexes, index.name
                info = conn.execute(f"PRAGMA index_xinfo({index.name})").fetchall()
                columns = [(r[2], bool(r[3])) for r in info if r[5]]  # key columns, DESC
                # A DESC column is declared as an expression around the column.
                declared = [
                    (
                        getattr(getattr(e, "element", e), "name", None),
                        e is not getattr(e, "element", e),
                    )
                    for e in index.expressions
                ]
                assert columns == declared, index.name
    assert "WHERE state = 'failed'" in indexes["ix_items_failed"]
    assert "(created_at - latency)" in indexes["ix_outputs_started"]
    assert "WHERE flags != 0" in indexes["ix_outputs_flagged"]

    await _alembic(db, "downgrade", "0001")
    with closing(sqlite3.connect(db)) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0001",)
    assert names.isdisjoint(
        {
            "ix_items_failed",
            "ix_outputs_totals",
            "ix_outputs_started",
            "ix_attempt_errors_class",
            "ix_outputs_flagged",
        }
    )
    assert "ix_items_dataset_state" in names


def test_status_plans_use_the_new_indexes(tmp_path: Path) -> None:
    """No status query reads the wide output rows or sorts; failed and flags read only the
    failed items and the flagged outputs."""
    db = tmp_path / "plans.db"
    _enqueue(tmp_path, db, "a", [{"id": "x", "prompt": "x"}])
    with closing(sqlite3.connect(db)) as conn:
        plans = {
            name: " | ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", {"since": 0}))
            for name, sql in stats._QUERIES.items()
        }
    assert "ix_outputs_totals" in plans["overall"] and "COVERING" in plans["overall"]
    assert "ix_outputs_totals (dataset_id=? AND created_at>?)" in plans["recent"]
    assert "ix_outputs_started" in plans["span"]
    assert "ix_items_failed" in plans["failed"]
    assert "COVERING INDEX ix_attempt_errors_class" in plans["errors"]
    assert "COVERING INDEX ix_items_dataset_state" in plans["counts"]
    assert "COVERING INDEX ix_outputs_flagged" in plans["flags"]
    for name in ("counts", "overall", "recent", "errors", "failed", "flags"):
        assert "TEMP B-TREE" not in plans[name], (name, plans[name])


def test_reader_leaves_what_it_cannot_vouch_for(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    assert open_reader(str(missing)) is None
    assert not missing.exists()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database\n" * 300)
    assert open_reader(str(junk)) is None
    empty = tmp_path / "empty.db"
    empty.touch()
    assert open_reader(str(empty)) is None
    newer = tmp_path / "newer.db"
    _enqueue(tmp_path, newer, "a", [{"id": "x", "prompt": "x"}])
    with open_reader(str(newer)) as read:  # type: ignore[union-attr]
        assert read.conn.execute("SELECT count(*) FROM items").fetchone() == (1,)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            read.conn.execute("DELETE FROM items")
    with closing(sqlite3.connect(newer)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    assert open_reader(str(newer)) is None


@pytest.mark.parametrize(
    "db",
    [
        None,
        "q.db",
        "./q.db",
        "a//b.db",
        "~/q.db",
        "/tmp/x y.db",
        "sqlite:///x.db",
        "sqlite:////tmp/a//b.db",
        "sqlite+aiosqlite:///~/q.db",
    ],
)
def test_sqlite_path_names_what_the_store_shows(db: str | None) -> None:
    assert sqlite_path(db) == engine.describe(engine.resolve_url(db))


@pytest.mark.parametrize(
    "db", ["sqlite://", "sqlite:///:memory:", "sqlite:///a%20b.db", "postgresql://u@h/db"]
)
def test_sqlite_path_leaves_urls_to_sqlalchemy(db: str) -> None:
    assert sqlite_path(db) is None


def test_constants_kept_in_step() -> None:
    """Values spelled out to keep heavy imports away, checked against their sources."""
    assert head_revision() == SCHEMA_REVISION
    assert reader.DEFAULT_DB == engine.DEFAULT_DB
    assert reader.BUSY_TIMEOUT_MS == engine.BUSY_TIMEOUT_MS
    assert stats.STATES == schema.STATES
    assert item_detail.STATES == cli_inspect._STATES == schema.STATES
    assert cli.LOG_LEVELS == logs.LEVELS


def test_store_exports_survive_lazy_loading() -> None:
    """``enqueue`` stays the function even when its module is imported first."""
    code = (
        "import orchestrator.store.loading, orchestrator.store.queue\n"
        "from orchestrator.store import enqueue, Queue, iter_done\n"
        "import orchestrator.store as store\n"
        "assert callable(enqueue) and not isinstance(enqueue, type(store)), enqueue\n"
        "assert store.enqueue is enqueue and Queue.__name__ == 'Queue'\n"
        "from orchestrator.store import queue\n"
        "assert queue.__name__ == 'orchestrator.store.queue'\n"
    )
    run_python(code)


async def _via_engine(database: Database, now: float) -> dict[str, Any]:
    """The status document through the SQLAlchemy adapter, on SQLite too."""
    async with database.read() as conn:
        return await conn.run_sync(
            lambda c: status_view.read(EngineRows(c, database.where), now=now)
        )


def test_read_seam_loads_neither_sqlalchemy_nor_asyncio_nor_the_forecast() -> None:
    """The sqlite3 adapter and its chooser stay light, and the store stays below the ETA."""
    code = (
        "import sys\n"
        "import orchestrator.store.access, orchestrator.store.outputs, orchestrator.store.stats\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'asyncio')"
        " or m == 'orchestrator.monitor.eta'))\n"
    )
    assert run_python(code).stdout.strip() == "[]"
