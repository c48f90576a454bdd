"""Periodic samples of the run: the history behind the dashboard's and report's charts.

``status`` tells how the run stands now; a 30-hour run also needs how it went: the
throughput, the errors and the servers' load over the whole run, across restarts of
every worker. A running worker writes one row per dataset (and one per server it
talks to) every minute; any number of workers may try, the first one past the
interval writes and the rest skip, decided inside the write transaction.

A sample is cheap however large the run: the counts by state read the covering
index ``ix_items_dataset_state``; answers, tokens and errors are carried forward from
the previous sample plus what arrived since, an index range on ``created_at``. Those
running sums stop ``SETTLE_SECONDS`` short of the sample's time, so that an answer
whose transaction was still waiting for the write lock when the sample was taken is
counted by the next one rather than never. The table stays small (30 hours × 60 an
hour × 8 datasets is about 14,000 rows), so it is kept whole.

The SQL is plain text that SQLite and PostgreSQL read alike, run over either of the
store's adapters (``store.reader.Rows``): SQLAlchemy for the worker's writes, whichever
``store.access`` chooses for reading.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.store import access
from orchestrator.store.reader import EngineRows

if TYPE_CHECKING:
    import sqlalchemy as sa

    from orchestrator.store.engine import Database
    from orchestrator.store.reader import Rows

DEFAULT_INTERVAL = 60.0
# Answers and errors younger than this are left to the next sample (see above). An
# answer's created_at is read once its transaction holds the write lock (write_round),
# so this covers the transaction itself and the clocks of workers on other hosts.
SETTLE_SECONDS = 10.0
# The keeper's ticks do not line up with the interval: a sample is due once the newest
# one is this share of the interval old, so that a 60 s interval does not become 90 s.
_DUE_SHARE = 0.9
# Completion lengths are counted in SQL in buckets this wide, then merged into at most
# _MAX_BUCKETS buckets per dataset whose width is this times a power of two.
_FINE_WIDTH = 8
_MAX_BUCKETS = 32
SERVER_GAUGES = ("running", "queued", "kv_cache_usage", "gen_throughput")

Fetch = Callable[[str, Mapping[str, Any]], Sequence[Sequence[Any]]]

_SQL: dict[str, str] = {
    # Either table: a run with no dataset yet still samples its servers once a minute.
    "newest": (
        "SELECT max(t) FROM (SELECT max(taken_at) AS t FROM samples"
        " UNION ALL SELECT max(taken_at) AS t FROM server_samples) AS newest"
    ),
    "datasets": "SELECT id, name FROM datasets ORDER BY name",
    "counts": "SELECT dataset_id, state, count(*) FROM items GROUP BY dataset_id, state",
    # One index seek per dataset (ix_samples_dataset_id_taken_at).
    "previous": (
        "SELECT answers, completion_tokens, prompt_tokens, settled_at, errors FROM samples"
        " WHERE dataset_id = :dataset ORDER BY taken_at DESC LIMIT 1"
    ),
    # An index range of ix_outputs_totals: the answers of the last minute or so.
    "arrived": (
        "SELECT count(*), coalesce(sum(completion_tokens), 0), coalesce(sum(prompt_tokens), 0)"
        " FROM outputs WHERE dataset_id = :dataset AND created_at > :lo AND created_at <= :hi"
    ),
    # The range of ix_attempt_errors_created_at; "+ 0" keeps SQLite from choosing
    # ix_attempt_errors_class instead, which holds every error of the dataset.
    "errors": (
        "SELECT error_class, outcome, count(*) FROM attempt_errors"
        " WHERE created_at > :lo AND created_at <= :hi AND dataset_id + 0 = :dataset"
        " GROUP BY error_class, outcome"
    ),
    "insert": (
        "INSERT INTO samples (taken_at, dataset_id, pending, running, done, failed, answers,"
        " completion_tokens, prompt_tokens, settled_at, errors) VALUES (:taken_at, :dataset,"
        " :pending, :running, :done, :failed, :answers, :completion_tokens, :prompt_tokens,"
        " :settled_at, :errors)"
    ),
    "insert_server": (
        "INSERT INTO server_samples (taken_at, server, running, queued, kv_cache_usage,"
        " gen_throughput) VALUES (:taken_at, :server, :running, :queued, :kv_cache_usage,"
        " :gen_throughput)"
    ),
    "history": (
        "SELECT taken_at, dataset_id, pending, running, done, failed, answers,"
        " completion_tokens, prompt_tokens, errors FROM samples WHERE taken_at > :since"
        " ORDER BY taken_at, dataset_id"
    ),
    "server_history": (
        "SELECT taken_at, server, running, queued, kv_cache_usage, gen_throughput"
        " FROM server_samples WHERE taken_at > :since ORDER BY taken_at, server"
    ),
    # Reads ix_outputs_totals only (dataset_id, created_at, completion_tokens).
    "lengths": (
        f"SELECT dataset_id, completion_tokens / {_FINE_WIDTH}, count(*) FROM outputs"
        " WHERE completion_tokens IS NOT NULL"
        f" GROUP BY dataset_id, completion_tokens / {_FINE_WIDTH}"
    ),
}
_OUTCOMES = {"retry": "retried", "released": "released", "failed": "failed"}


# ------------------------------------------------------------------------ recording


async def due(database: Database, interval: float, *, now: float | None = None) -> bool:
    """Whether a sample is due: a cheap read, so that a worker that would skip anyway
    does not gather the servers' gauges for nothing."""
    now = time.time() if now is None else now
    async with database.read() as conn:
        newest = await conn.run_sync(lambda c: _sa_fetch(c)(_SQL["newest"], {})[0][0])
    return _is_due(newest, now, interval)


async def record(
    database: Database,
    *,
    interval: float = DEFAULT_INTERVAL,
    servers: Iterable[Mapping[str, Any]] = (),
    now: float | None = None,
) -> int:
    """Write a sample unless one younger than ``interval`` exists; the rows written.

    The counts by state, the costly part, are read first in a read transaction (WAL
    readers block no one); the write transaction only checks that the sample is still
    due, carries the running sums forward and inserts, so it holds the write lock for
    a few milliseconds. ``servers`` are the servers' own views
    (``server_metrics.scrape``); those that could not be read are left out.
    """
    taken_at = time.time() if now is None else now
    gauges = [dict(s) for s in servers if not s.get("error")]
    async with database.read() as conn:
        counts = await conn.run_sync(lambda c: _counts(_sa_fetch(c), taken_at, interval))
    if counts is None:
        return 0

    def write(conn: sa.Connection) -> int:
        if conn.dialect.name == "postgresql":
            # SQLite's write transactions take turns; PostgreSQL's run side by side, and
            # two could both find the sample due. Readers are not blocked by this lock.
            from sqlalchemy import text

            conn.execute(text("LOCK TABLE samples IN EXCLUSIVE MODE"))
        return _record(_sa_fetch(conn), taken_at, interval, counts, gauges)

    return await database.run_write(write)


def _is_due(newest: float | None, now: float, interval: float) -> bool:
    return newest is None or now - newest >= interval * _DUE_SHARE


def _counts(fetch: Fetch, now: float, interval: float) -> dict[int, dict[str, int]] | None:
    """Items by dataset and state (None: no sample is due)."""
    if not _is_due(fetch(_SQL["newest"], {})[0][0], now, interval):
        return None
    counts: dict[int, dict[str, int]] = {}
    for dataset_id, state, n in fetch(_SQL["counts"], {}):
        counts.setdefault(dataset_id, {})[state] = n
    return counts


def _record(
    fetch: Fetch,
    now: float,
    interval: float,
    counts: dict[int, dict[str, int]],
    servers: list[dict[str, Any]],
) -> int:
    if not _is_due(fetch(_SQL["newest"], {})[0][0], now, interval):
        return 0  # another worker wrote it meanwhile
    settled = now - SETTLE_SECONDS
    rows = []
    for dataset_id, _name in fetch(_SQL["datasets"], {}):
        previous = fetch(_SQL["previous"], {"dataset": dataset_id})
        if previous:
            answers, completion, prompt, lo, errors_text = previous[0]
            errors = orjson.loads(errors_text)
        else:
            answers, completion, prompt, lo, errors = 0, 0, 0, float("-inf"), {}
        hi = max(settled, lo)
        window = {"dataset": dataset_id, "lo": lo, "hi": hi}
        if hi > lo:
            n, c, p = fetch(_SQL["arrived"], window)[0]
            answers, completion, prompt = answers + n, completion + c, prompt + p
            for error_class, outcome, n in fetch(_SQL["errors"], window):
                slot = errors.setdefault(error_class, dict.fromkeys(_OUTCOMES.values(), 0))
                key = _OUTCOMES.get(outcome, outcome)
                slot[key] = slot.get(key, 0) + n
        by_state = counts.get(dataset_id, {})
        rows.append(
            {
                "taken_at": now,
                "dataset": dataset_id,
                **{s: by_state.get(s, 0) for s in ("pending", "running", "done", "failed")},
                "answers": int(answers),
                "completion_tokens": int(completion),
                "prompt_tokens": int(prompt),
                "settled_at": hi,
                "errors": orjson.dumps(errors, option=orjson.OPT_SORT_KEYS).decode(),
            }
        )
    for row in rows:
        fetch(_SQL["insert"], row)
    for server in servers:
        fetch(
            _SQL["insert_server"],
            {
                "taken_at": now,
                "server": server["server"],
                **{k: server.get(k) for k in SERVER_GAUGES},
            },
        )
    return len(rows) + len(servers)


# ------------------------------------------------------------------------ reading


async def history(database: Database, *, since: float = 0.0) -> dict[str, Any]:
    """The samples taken after ``since`` (see :func:`read_history`)."""
    return await access.read(database, lambda rows: read_history(rows, since=since))


async def lengths(database: Database) -> dict[str, Any]:
    """Completion lengths of every answer, bucketed per dataset."""
    return await access.read(database, read_lengths)


def read_history(rows: Rows, *, since: float = 0.0) -> dict[str, Any]:
    """The samples taken after ``since``, from one read transaction (either adapter)."""
    return _history(rows.fetch, since)


def read_lengths(rows: Rows) -> dict[str, Any]:
    """:func:`lengths` from one read transaction (either adapter)."""
    return _lengths(rows.fetch)


def _history(fetch: Fetch, since: float) -> dict[str, Any]:
    names = dict(fetch(_SQL["datasets"], {}))
    samples = [
        {
            "taken_at": taken_at,
            "dataset": names.get(dataset_id, str(dataset_id)),
            "pending": pending,
            "running": running,
            "done": done,
            "failed": failed,
            "answers": answers,
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "errors": orjson.loads(errors),
        }
        for (
            taken_at,
            dataset_id,
            pending,
            running,
            done,
            failed,
            answers,
            completion,
            prompt,
            errors,
        ) in fetch(_SQL["history"], {"since": since})
    ]
    servers = [
        {"taken_at": row[0], "server": row[1], **dict(zip(SERVER_GAUGES, row[2:], strict=True))}
        for row in fetch(_SQL["server_history"], {"since": since})
    ]
    return {"since": since, "samples": samples, "servers": servers}


def _lengths(fetch: Fetch) -> dict[str, Any]:
    fine: dict[int, dict[int, int]] = {}
    for dataset_id, bucket, n in fetch(_SQL["lengths"], {}):
        fine.setdefault(dataset_id, {})[int(bucket)] = n
    out = []
    for dataset_id, name in fetch(_SQL["datasets"], {}):
        buckets = fine.get(dataset_id, {})
        out.append({"name": name, **_merge(buckets)})
    return {"datasets": out}


def _merge(fine: dict[int, int]) -> dict[str, Any]:
    """Fine buckets into at most _MAX_BUCKETS of a width that nests them exactly."""
    if not fine:
        return {"count": 0, "width": _FINE_WIDTH, "buckets": []}
    top = max(fine) + 1
    factor = 1
    while -(-top // factor) > _MAX_BUCKETS:
        factor *= 2
    width = _FINE_WIDTH * factor
    merged = [0] * -(-top // factor)
    for bucket, n in fine.items():
        merged[bucket // factor] += n
    return {
        "count": sum(merged),
        "width": width,
        "buckets": [[i * width, (i + 1) * width, n] for i, n in enumerate(merged)],
    }


# ------------------------------------------------------------------------ plumbing


def _sa_fetch(conn: sa.Connection) -> Fetch:
    return EngineRows(conn, "").fetch
