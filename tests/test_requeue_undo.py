"""Requeue and its undo against a live queue, through the real command: a worker claiming
and completing while items are sent back and taken back, an undo after a failed re-run,
undo by dataset, and the options that must be refused before anything moves.

The invariant every test here ends on (:func:`check_whole`): an item is done with exactly
one output, or pending or failed with no output (failed with a reason); the export holds
each done key once; no worker met a leftover output row.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from orchestrator.errors import ConfigError
from tests.helpers import (
    REPO,
    Heard,
    SimProcess,
    cli,
    db_snapshot,
    enqueue_prompts,
    events,
    query,
    start_worker,
    write_jsonl,
)
from tests.helpers import wait_for as _wait_for

# What a worker logs when a completion meets a row it should not (a leftover output).
_BROKEN = ("pk_outputs", "outputs.item_id", "pk_item_turns", "outcome_unstorable", "duplicate key")

ORPHANS = (
    "SELECT count(*) FROM outputs JOIN items ON items.id = outputs.item_id"
    " WHERE items.state != 'done'"
)


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    """:func:`tests.helpers.wait_for` with the longer deadline a live requeue needs."""
    return _wait_for(condition, what, deadline=240.0)


def counts(db: str) -> dict[str, int]:
    return dict(query(db, "SELECT state, count(*) FROM items GROUP BY state"))  # type: ignore[arg-type]


class Worker:
    """``orchestrator run`` in the background, its JSON log read as it goes (a full pipe
    would stall it)."""

    def __init__(self, db: str, url: str, *extra: str):
        self.proc = start_worker(db, url, *extra)
        self.heard = Heard(self.proc)

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM, wait, and the events it logged."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return events(self.heard.text())

    def broken(self) -> list[str]:
        return [line for line in self.heard.lines if any(word in line for word in _BROKEN)]


def enqueue(tmp_path: Path, db: str, n: int, *extra: str, dataset: str = "d") -> list[str]:
    path = tmp_path / f"{dataset}.jsonl"
    return enqueue_prompts(db, path, n, *extra, dataset=dataset, prefix=f"{dataset}-")


def run_to_end(db: str, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("run", "--server", url, "--db", db, "--exit-when-done", *extra)


def check_whole(db: str, tmp_path: Path, keys: list[str]) -> dict[str, int]:
    """The queue's invariant between items and outputs, and the export it gives."""
    assert query(db, ORPHANS) == [(0,)], "outputs rows of items that are not done"
    done, with_output = query(
        db,
        "SELECT count(*), count(outputs.item_id) FROM items"
        " LEFT JOIN outputs ON outputs.item_id = items.id WHERE items.state = 'done'",
    )[0]
    assert done == with_output, "done items without an output"
    unexplained = query(
        db, "SELECT count(*) FROM items WHERE state = 'failed' AND error_class IS NULL"
    )
    assert unexplained == [(0,)]
    out = tmp_path / f"export-{time.monotonic_ns()}.jsonl"
    result = cli("export", str(out), "--db", db)
    assert result.returncode == 0, result.stderr
    exported = [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()]
    assert len(exported) == len(set(exported)) == done
    assert set(exported) <= set(keys)
    return counts(db)


# ------------------------------------------------------------------ undo racing claims


def test_undo_while_a_worker_claims_moves_only_what_is_still_pending(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """3,000 answers requeued, a worker at 128 taking them, then ``requeue --undo``: the
    items it had claimed keep going and end done, the others get their answer back; no
    item is left running with an output row, none fails on a duplicate key."""
    server = sim_process("--latency", "0.02")
    keys = enqueue(tmp_path, db_url, 3000)
    assert run_to_end(db_url, server.url, "--concurrency", "256").returncode == 0
    moved = cli("requeue", "--state", "done", "--all", "--db", db_url)
    assert moved.stdout.startswith("requeued 3,000 done items"), moved.stderr
    worker = Worker(db_url, server.url, "--concurrency", "128")
    try:
        wait_for(lambda: counts(db_url).get("pending", 0) < 2900, "the worker to claim items")
        undone = cli("requeue", "--undo", "--db", db_url)
        assert undone.returncode == 0, undone.stderr
        assert "put back" in undone.stdout
        # At once, whatever the worker does next: no output of an item not done.
        assert query(db_url, ORPHANS) == [(0,)]
        wait_for(lambda: counts(db_url) == {"done": 3000}, "every item done")
    finally:
        worker.stop()
    assert worker.broken() == []
    check_whole(db_url, tmp_path, keys)


def test_two_undos_at_once_take_the_requeue_back_once(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """Two ``requeue --undo`` started together: one puts the answers back, the other says
    plainly why it did nothing; neither meets a duplicate key. Three tries."""
    server = sim_process("--latency", "0.001")
    keys = enqueue(tmp_path, db_url, 2000)
    assert run_to_end(db_url, server.url, "--concurrency", "256").returncode == 0
    before = cli("export", "-", "--db", db_url).stdout
    for _ in range(3):
        assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
        results = at_once(db_url, ("requeue", "--undo"), ("requeue", "--undo"))
        put_back = [r for r in results if r[0] == 0 and "put back 2,000 items" in r[1]]
        assert len(put_back) == 1, results
        (other,) = [r for r in results if r is not put_back[0]]
        code, out, err = other
        assert "pk_outputs" not in err and "duplicate" not in err, err
        assert ("nothing to undo" in out and code == 0) or (
            code == 1 and "taken back by another undo" in err
        ), other
        assert cli("export", "-", "--db", db_url).stdout == before
    check_whole(db_url, tmp_path, keys)


# ------------------------------------------------------------------ a failed re-run


@pytest.mark.parametrize("fault", ["context_overflow", "http_500"])
def test_undo_brings_back_the_answers_of_a_failed_rerun(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess], fault: str
) -> None:
    """``requeue --flag truncated --max-tokens 40960`` against a 4,096-token server (every
    request refused as longer than its context), or a re-run against a server answering
    500: the items fail, their answers leave the export, and ``requeue --undo`` brings
    every one of them back."""
    server = sim_process("--latency", "0.001", "--max-model-len", "4096")
    keys = enqueue(tmp_path, db_url, 30)
    assert run_to_end(db_url, server.url).returncode == 0
    before = cli("export", "-", "--db", db_url, "--provenance").stdout
    assert len(before.splitlines()) == 30

    dry = cli(
        "requeue", "--flag", "truncated", "--max-tokens", "40960", "--dry-run", "--db", db_url
    )
    assert dry.returncode == 0, dry.stderr
    assert "would requeue 30 done items" in dry.stdout
    assert "30 answers leave the export" in dry.stdout
    assert "`orchestrator requeue --undo` brings them back" in dry.stdout

    requeue = ["requeue", "--flag", "truncated", "--db", db_url]
    if fault == "context_overflow":
        assert cli(*requeue, "--max-tokens", "40960").returncode == 0
        rerun = run_to_end(db_url, server.url)
    else:
        assert cli(*requeue).returncode == 0
        broken = sim_process("--latency", "0.001", "--fault", "500=1")
        rerun = run_to_end(db_url, broken.url, "--max-attempts", "1")
    assert rerun.returncode == 6, rerun.stderr
    assert query(db_url, "SELECT state, error_class, count(*) FROM items GROUP BY 1, 2") == [
        ("failed", fault, 30)
    ]
    assert cli("export", "-", "--db", db_url).stdout == ""

    undone = cli("requeue", "--undo", "--db", db_url)
    assert undone.returncode == 0, undone.stderr
    assert "put back 30 items of requeue #1" in undone.stdout
    assert "30 of them had failed when run again" in undone.stdout
    assert cli("export", "-", "--db", db_url, "--provenance").stdout == before
    assert query(db_url, "SELECT count(*) FROM superseded_outputs") == [(0,)]
    # The request is the one answered: --max-tokens is taken back with the rest.
    assert query(db_url, "SELECT DISTINCT request LIKE '%40960%' FROM items") == [(False,)]
    assert check_whole(db_url, tmp_path, keys) == {"done": 30}


def test_a_multi_turn_rerun_that_failed_midway_is_put_back_whole(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """A regenerated conversation requeued, run again until its second turn fails, and
    undone: its old turns come back, the failed run's first turn goes, and a later run
    generates every turn again without meeting a leftover turn."""
    conversation = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "b"},
    ]
    rows = [{"id": f"c{i}", "messages": conversation} for i in range(4)]
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    flags = ("--regenerate", "all", "--max-tokens", "16")
    assert cli("enqueue", str(data), "-d", "c", "--db", db_url, *flags).returncode == 0
    server = sim_process("--latency", "0.001", "--max-model-len", "4096")
    assert run_to_end(db_url, server.url).returncode == 0
    before = cli("export", "-", "--db", db_url, "--provenance").stdout
    turns_before = query(db_url, "SELECT item_id, turn, message FROM item_turns ORDER BY 1, 2")
    assert len(turns_before) == 8

    assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
    # The first turn (1 prompt word and 16 tokens) fits in 20 tokens of context; the
    # second (its prompt holds the first answer) does not.
    small = sim_process("--latency", "0.001", "--max-model-len", "20")
    assert run_to_end(db_url, small.url).returncode == 6
    assert query(db_url, "SELECT DISTINCT state, turn FROM items") == [("failed", 1)]
    assert query(db_url, "SELECT count(*) FROM item_turns") == [(4,)]

    assert "put back 4 items" in cli("requeue", "--undo", "--db", db_url).stdout
    assert cli("export", "-", "--db", db_url, "--provenance").stdout == before
    assert query(db_url, "SELECT item_id, turn, message FROM item_turns ORDER BY 1, 2") == (
        turns_before
    )
    assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
    worker = Worker(db_url, server.url, "--exit-when-done")
    assert worker.proc.wait(240) == 0
    assert worker.broken() == []
    assert check_whole(db_url, tmp_path, [r["id"] for r in rows]) == {"done": 4}


# ------------------------------------------------------------------ undo by dataset


def test_undo_by_dataset_takes_back_that_datasets_latest_requeue(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """``requeue --undo --dataset a`` takes back the latest requeue that moved items of a,
    and only those; with none, it says which requeue is the latest and what it moved."""
    server = sim_process("--latency", "0.001")
    sizes = {"a": 10, "b": 6, "c": 2}
    keys = [key for name, n in sizes.items() for key in enqueue(tmp_path, db_url, n, dataset=name)]
    assert run_to_end(db_url, server.url).returncode == 0
    undo = ("requeue", "--undo", "--db", db_url)

    # Requeue 1 moves all three; b's part is taken back alone, then the rest.
    assert cli("requeue", "--state", "done", "--all", "--db", db_url).returncode == 0
    first = cli(*undo, "--dataset", "b")
    assert "put back 6 items of requeue #1" in first.stdout, first.stdout
    assert "its 12 items of other datasets stay requeued" in first.stdout
    assert counts(db_url) == {"done": 6, "pending": 12}
    assert "put back 12 items of requeue #1" in cli(*undo).stdout

    assert cli("requeue", "--dataset", "a", "--state", "done", "--db", db_url).returncode == 0
    assert cli("requeue", "--dataset", "b", "--state", "done", "--db", db_url).returncode == 0
    none = cli(*undo, "--dataset", "c")
    assert none.returncode == 0, none.stderr
    assert "nothing to undo for dataset c: the latest requeue, #3, moved items of b" in none.stdout
    unknown = cli(*undo, "--dataset", "nope")
    assert unknown.returncode == 2 and "no such dataset: nope" in unknown.stderr
    mixed = cli(*undo, "--state", "done", "--max-tokens", "9")
    assert mixed.returncode == 2
    assert "--undo takes only --dataset and --dry-run, not --state, --max-tokens" in mixed.stderr

    dry = cli(*undo, "--dataset", "a", "--dry-run")
    assert "would put back 10 items of requeue #2" in dry.stdout, dry.stdout
    assert "put back 10 items of requeue #2" in cli(*undo, "--dataset", "a").stdout
    assert counts(db_url) == {"done": 12, "pending": 6}
    assert "put back 6 items of requeue #3" in cli(*undo).stdout
    assert "nothing to undo" in cli(*undo).stdout
    assert check_whole(db_url, tmp_path, keys) == {"done": 18}


# ------------------------------------------------------------------ refused options


def test_requeue_refuses_what_no_item_or_server_can_take(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    """A ``--max-tokens`` out of range, and an error class no item can have: exit 2, the
    reason and the classes there are, dry run or not; nothing written."""
    enqueue(tmp_path, db_url, 3)
    assert run_to_end(db_url, sim_process("--latency", "0.001").url).returncode == 0
    before = db_snapshot(db_url)
    for value, why in [
        ("99999999999", "must be at most 2147483647, got 99999999999"),
        ("0", "must be at least 1, got 0"),
        ("-5", "must be at least 1, got -5"),
    ]:
        for extra in ((), ("--dry-run",)):
            args = ("requeue", "--state", "done", "--all", f"--max-tokens={value}", *extra)
            result = cli(*args, "--db", db_url)
            assert result.returncode == 2, result.stderr
            assert f"--max-tokens: {why}" in result.stderr
    for extra in ((), ("--dry-run",), ("--state", "done")):
        result = cli("requeue", "--error-class", "bogus", *extra, "--db", db_url)
        assert result.returncode == 2, result.stderr
        assert "unknown error class 'bogus'" in result.stderr
        assert "connect, http_NNN (http_500, http_400, ...), rate_limited" in result.stderr
    assert db_snapshot(db_url) == before
    teapot = cli("requeue", "--error-class", "http_418", "--db", db_url)
    assert teapot.returncode == 0 and teapot.stdout.strip() == "requeued 0 failed items"


async def test_the_api_checks_requeue_as_the_command_does(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess]
) -> None:
    import orchestrator

    enqueue(tmp_path, db_url, 3)
    assert run_to_end(db_url, sim_process("--latency", "0.001").url).returncode == 0
    before = db_snapshot(db_url)
    async with orchestrator.open(db_url) as q:
        for bad, why in [
            ({"max_tokens": -5}, "max_tokens: must be at least 1, got -5"),
            ({"max_tokens": 2**31}, "max_tokens: must be at most 2147483647, got 2147483648"),
            ({"max_tokens": True}, "max_tokens: must be an integer, got True"),
            ({"error_class": "bogus"}, "unknown error class 'bogus'"),
        ]:
            for dry_run in (False, True):
                with pytest.raises(ConfigError, match=why):
                    await q.requeue(state="done", all=True, dry_run=dry_run, **bad)
        with pytest.raises(ConfigError, match="no such dataset: nope"):
            await q.undo_requeue(datasets="nope")
        assert (await q.undo_requeue(datasets="d")).requeue_id is None
    assert db_snapshot(db_url) == before


# ------------------------------------------------------------------ requeue, undo, claims


def at_once(db: str, *commands: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """Start every command together; their exit codes and outputs."""
    base = [sys.executable, "-m", "orchestrator"]
    procs = [
        subprocess.Popen(
            [*base, *args, "--db", db], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for args in commands
    ]
    done = [p.communicate(timeout=240) for p in procs]
    return [
        (p.returncode, out.decode(), err.decode())
        for p, (out, err) in zip(procs, done, strict=True)
    ]


def check_answers(results: list[tuple[int, str, str]]) -> None:
    """Each command worked, or said plainly that another undo was first."""
    for code, out, err in results:
        assert code == 0 or (code == 1 and "taken back by another undo" in err), (out, err)
        assert not any(word in err for word in ("pk_", "duplicate", "constraint")), err


ALL_DONE = ("requeue", "--state", "done", "--all")
UNDO = ("requeue", "--undo")


def requeue_and_undo_under_a_worker(
    tmp_path: Path, db: str, server: SimProcess, *, items: int, rounds: int
) -> dict[str, int]:
    """A worker answers while requeues and undos, two at a time, go on under it; after each
    step and at the end the queue holds its invariant."""
    keys = enqueue(tmp_path, db, items)
    worker = Worker(db, server.url, "--concurrency", "64")
    try:
        for turn in range(rounds):
            wait_for(lambda: counts(db).get("done", 0) >= items // 3, "answers to requeue")
            second = ALL_DONE if turn % 2 == 0 else ("requeue",)
            check_answers(at_once(db, ALL_DONE, second))
            assert query(db, ORPHANS) == [(0,)]
            left = counts(db).get("pending", 0)
            wait_for(lambda left=left: counts(db).get("pending", 0) < left or not left, "claims")
            check_answers(at_once(db, UNDO, UNDO))
            assert query(db, ORPHANS) == [(0,)]
        wait_for(lambda: not {"pending", "running"} & counts(db).keys(), "the queue to drain")
    finally:
        worker.stop()
    assert worker.broken() == []
    return check_whole(db, tmp_path, keys)


@pytest.mark.parametrize(
    ("items", "rounds"),
    [(1500, 2), pytest.param(3000, 10, marks=pytest.mark.slow, id="at-length")],
)
def test_requeue_and_undo_racing_a_worker_keep_every_answer_once(
    tmp_path: Path, db_url: str, sim_process: Callable[..., SimProcess], items: int, rounds: int
) -> None:
    # One request in twenty fails at once (a 400): failed re-runs are undone too.
    server = sim_process("--latency", "0.05", "--fault", "400=0.05")
    final = requeue_and_undo_under_a_worker(tmp_path, db_url, server, items=items, rounds=rounds)
    assert sum(final.values()) == items
