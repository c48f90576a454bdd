"""Samples of one prompt asked together with ``n``, through the real command: a request
shared only by identical requests, each sample's tokens counted, each failed sample
named in every export, and ``inspect`` showing the request as it went."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.items.samples import USAGE_SPLIT, choice_usages, seed_of
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


@pytest.mark.parametrize(
    ("run_args", "exact"),
    [((), False), (("--stream",), False), (("--stream", "--stream-usage"), True)],
    ids=["json", "stream", "stream-usage"],
)
def test_each_sample_asked_with_n_keeps_its_completion_tokens(
    tmp_path: Path,
    sim_process: Callable[..., SimProcess],
    run_args: tuple[str, ...],
    exact: bool,
) -> None:
    """A server counts an n request's completion tokens for all its choices: each sample
    still says its own (its share of the total, marked, unless the server counted it
    alone), they add up to what the server generated, and status, exports and the card
    count them all."""
    server = sim_process("--mean-tokens", "12")
    db = str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    _ok("enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "40", "--samples", "4")
    _run(db, server, *run_args)
    generated = server.stats()["generation_tokens"]
    assert server.stats()["chat_requests"] < 40 and generated > 0
    status = json.loads(_ok("status", "--json", "--db", db))["datasets"][0]
    assert status["completion_tokens"]["total"] == generated, status["completion_tokens"]
    assert status["completion_tokens"]["mean"] == round(generated / 40, 1)
    header, row = _ok("status", "--db", db).splitlines()[1:3]
    assert header.split()[-4:] == ["tok", "p90", "tok", "ETA"], header  # mean, p50, p90
    assert int(row.split()[-4]) == round(generated / 40), row
    _ok("export", str(tmp_path / "out.jsonl"), "--db", db, "--provenance", "--card",
        str(tmp_path / "README.md"))  # fmt: skip
    lines = _lines(tmp_path / "out.jsonl")
    counts = [line["usage"]["completion_tokens"] for line in lines]
    assert sum(counts) == generated and all(c >= 1 for c in counts), counts
    split = [line["usage"].get("usage_split", False) for line in lines]
    assert split == [not exact] * 40
    card = (tmp_path / "README.md").read_text()
    figures = next(line for line in card.splitlines() if "completion tokens p50" in line)
    assert "n/a" not in figures and any(c.isdigit() for c in figures), figures


@given(
    total=st.one_of(st.none(), st.integers(0, 10_000)),
    choices=st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 500)), st.integers(0, 2_000)),
        min_size=2,
        max_size=8,
    ),
)
def test_a_requests_total_is_shared_by_its_choices(
    total: int | None, choices: list[tuple[int | None, int]]
) -> None:
    counted, sizes = [c for c, _ in choices], [s for _, s in choices]
    usage = (
        {"prompt_tokens": 7} if total is None else {"prompt_tokens": 7, "completion_tokens": total}
    )
    out = choice_usages(usage, counted, sizes)
    assert len(out) == len(choices) and all(u["prompt_tokens"] == 7 for u in out)
    got = [u.get("completion_tokens") for u in out]
    trusted = None not in counted and (total is None or sum(counted) == total)  # type: ignore[arg-type]
    if trusted:
        assert got == counted and not any(USAGE_SPLIT in u for u in out)
        return
    if total is None:
        assert got == counted  # what was said alone; nothing made up
        return
    assert all(g is not None for g in got)
    shared = [(g, s) for g, s, u in zip(got, sizes, out, strict=True) if USAGE_SPLIT in u]
    assert all(g >= 1 for g, s in shared if s > 0)  # type: ignore[operator]
    # The total, and at most one more token for each text whose share rounded to 0.
    ones = sum(1 for g, s in shared if s and g == 1)
    assert total <= sum(got) <= total + ones  # type: ignore[arg-type]


def test_inspect_shows_the_request_a_sample_went_in(
    tmp_path: Path, sim_process: Callable[..., SimProcess]
) -> None:
    """Samples asked together went as the choices of one request (the first sample's
    seed, n): inspect shows that request and each sample's choice; a sample requeued and
    asked alone shows its own seed and no n."""
    server = sim_process()
    db = str(tmp_path / "q.db")
    data = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    _ok("enqueue", str(data), "-d", "d", "--db", db, "--max-tokens", "8", "--samples", "3")
    _run(db, server)
    assert server.stats()["chat_requests"] == 2
    _ok("requeue", "--state", "done", "--key", "p000001", "--sample", "1", "--db", db)
    _run(db, server)
    for key, alone in (("p000000", None), ("p000001", 1)):
        shown = _ok("inspect", "--dataset", "d", "--id", key, "--json", "--db", db)
        records = [json.loads(line) for line in shown.splitlines()]
        sent = [
            (r["draw"], r["choice"], r["request"]["seed"], r["request"].get("n")) for r in records
        ]
        first = seed_of(key, 0)
        assert sent == [
            (s, None, seed_of(key, s), None) if s == alone else (s, s, first, 3) for s in range(3)
        ], key
    text = _ok("inspect", "--dataset", "d", "--id", "p000000", "--db", db)
    assert "choice" in text and "2 of n=3" in text, text
