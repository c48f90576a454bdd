"""Samples of one prompt asked together with ``n``, through the real command: a request
shared only by identical requests, each sample's tokens counted, each failed sample
named in every export, and ``inspect`` showing the request as it went."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from orchestrator.draws import seed_of
from orchestrator.sim import answer_matches
from tests.helpers import SimProcess, cli, prompts, write_jsonl


def _ok(*args: str) -> str:
    result = cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _run(db: str, server: SimProcess, *extra: str) -> None:
    _ok("run", "--server", server.url, "--db", db, "--exit-when-done", *extra)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_sample_requeued_with_other_settings_is_asked_with_its_own(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Requeued with a larger max_tokens next to a sibling requeued as it was, a sample
    goes in a request of its own with its own max_tokens, not in its sibling's n."""
    server = sim_process()
    db = str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    _ok("enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "2", "--samples", "2")
    _run(db, server)
    _ok("requeue", "--state", "done", "--key", "p000001", "--sample", "1",
        "--max-tokens", "60", "--db", db)  # fmt: skip
    _ok("requeue", "--state", "done", "--key", "p000001", "--sample", "0", "--db", db)
    _run(db, server)
    _ok("export", str(tmp_path / "out.jsonl"), "--db", db)
    by = {(line["id"], line["sample"]): line for line in _lines(tmp_path / "out.jsonl")}
    longer, kept = by[("p000001", 1)], by[("p000001", 0)]
    assert len(longer["messages"][-1]["content"].split()) > 2, longer
    assert len(kept["messages"][-1]["content"].split()) <= 2, kept
    for line in (longer, kept):
        *prompt, answer = line["messages"]
        assert answer_matches(prompt, answer, seed_of(line["id"], line["sample"]))
    shown = _ok("inspect", "--dataset", "d", "--id", "p000001", "--json", "--db", db)
    records = [json.loads(line) for line in shown.splitlines()]
    assert [r["request"]["max_tokens"] for r in records] == [2, 60]


def test_every_failed_sample_is_named_in_every_export(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Each answer cut at max_tokens fails (--on-truncated fail): every failed-sample line
    says its sample, and SpecForge's error ids are the ids its rows have."""
    server = sim_process()
    db = str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    _ok("enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "4", "--samples", "2",
        "--on-truncated", "fail")  # fmt: skip
    result = cli("run", "--server", server.url, "--db", db, "--exit-when-done")
    assert result.returncode == 6, result.stderr[-3000:]
    want = [(f"p00000{i}", s) for i in range(2) for s in range(2)]
    _ok("export", str(tmp_path / "m.jsonl"), "--db", db, "--include-failed",
        str(tmp_path / "failed.jsonl"))  # fmt: skip
    failed = _lines(tmp_path / "failed.jsonl")
    assert [(line["id"], line["sample"]) for line in failed] == want
    assert all(line["error_class"] == "truncated" for line in failed)
    _ok("export", str(tmp_path / "b.jsonl"), "--db", db, "--format", "openai-batch")
    errors = _lines(tmp_path / "b.errors.jsonl")
    assert [(line["custom_id"], line["sample"]) for line in errors] == want
    assert len({line["id"] for line in errors}) == 4
    _ok("export", str(tmp_path / "sf.jsonl"), "--db", db, "--format", "specforge")
    sf_errors = _lines(tmp_path / "sf_error.jsonl")
    assert [(line["id"], line["sample"]) for line in sf_errors] == [
        (f"{key}#sample{s}", s) for key, s in want
    ]
