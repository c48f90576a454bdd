"""Raw completions, logprobs and token ids: packed, stored once, exported as the server
gave them.

The packing round trip is checked over every shape of answer (hypothesis); the servers'
own shapes are read as SGLang, vLLM and llama.cpp write them; and whole runs go through
the real commands with worker subprocesses, a SIGKILL mid-run, on both backends, with
every exported token checked against the simulator's rule (``tests/oracle.py``).
"""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.items.tokens import Collector, Tokens, pack, row_fields, stored, unpack
from orchestrator.sim import answer_matches
from tests.helpers import (
    SimProcess,
    cli,
    db_snapshot,
    export_lines,
    kill_worker_after,
    query,
    write_jsonl,
)
from tests.oracle import Verdict, check_tokens

# ------------------------------------------------------------------ packing

_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
_id = st.integers(-(2**31), 2**31 - 1)
_text = st.text(max_size=12)


@st.composite
def token_sets(draw: st.DrawFn) -> Tokens:
    n = draw(st.integers(0, 40))
    ids = tuple(draw(st.lists(_id, min_size=n, max_size=n))) if draw(st.booleans()) else None
    texts = tuple(draw(st.lists(_text, min_size=n, max_size=n)))
    logprobs = tuple(draw(st.lists(_f32, min_size=n, max_size=n))) if draw(st.booleans()) else None
    top_ids = top_texts = top_logprobs = None
    if draw(st.booleans()):
        counts = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
        top_logprobs = tuple(tuple(draw(st.lists(_f32, min_size=c, max_size=c))) for c in counts)
        if draw(st.booleans()):
            top_ids = tuple(tuple(draw(st.lists(_id, min_size=c, max_size=c))) for c in counts)
        else:
            top_texts = tuple(tuple(draw(st.lists(_text, min_size=c, max_size=c))) for c in counts)
    return Tokens(ids, None if ids else texts, logprobs, top_ids, top_texts, top_logprobs)


def _same(a: Tokens, b: Tokens) -> bool:
    """Equal, NaN equal to NaN (bit for bit, as float32 holds it)."""

    def bits(values: Any) -> Any:
        if values is None:
            return None
        return tuple(
            bits(v) if isinstance(v, tuple) else struct.pack("<f", v) if isinstance(v, float) else v
            for v in values
        )

    return all(
        bits(getattr(a, name)) == bits(getattr(b, name))
        for name in ("ids", "texts", "logprobs", "top_ids", "top_texts", "top_logprobs")
    )


@settings(max_examples=300, deadline=None)
@given(token_sets())
def test_packing_round_trips_every_shape(tokens: Tokens) -> None:
    assert _same(unpack(pack(tokens)), stored(tokens))


@settings(max_examples=100, deadline=None)
@given(token_sets(), st.data())
def test_a_cut_value_is_refused_not_misread(tokens: Tokens, data: st.DataObject) -> None:
    packed = pack(tokens)
    cut = data.draw(st.integers(0, len(packed) - 1))
    with pytest.raises(ValueError):
        unpack(packed[:cut])
    with pytest.raises(ValueError):
        unpack(b"XXXX" + packed[4:])


def test_a_thousand_tokens_with_top5_fit_in_40_kb() -> None:
    """Ids over a 150k vocabulary, logprobs of every mantissa: the worst a real answer
    gives the compressor. (The stored column's size after a real run: below.)"""
    rng = random.Random(7)
    n = 1000
    ids = tuple(rng.randrange(151_936) for _ in range(n))
    tops = tuple(
        tuple(sorted((math.log(rng.random()) for _ in range(5)), reverse=True)) for _ in range(n)
    )
    by_id = Tokens(
        ids=ids,
        logprobs=tuple(t[0] for t in tops),
        top_ids=tuple(tuple(rng.randrange(151_936) for _ in range(5)) for _ in range(n)),
        top_logprobs=tops,
    )
    assert len(pack(by_id)) <= 40_000
    words = [f" w{i}" for i in range(3000)]
    by_text = Tokens(
        texts=tuple(rng.choice(words) for _ in range(n)),
        logprobs=by_id.logprobs,
        top_texts=tuple(tuple(rng.choice(words) for _ in range(5)) for _ in range(n)),
        top_logprobs=tops,
    )
    assert len(pack(by_text)) <= 40_000
    # JSON per token, for scale: what the column saves.
    assert len(orjson.dumps(row_fields(by_id, logprobs=True, token_ids=True))) > 3 * len(
        pack(by_id)
    )


# ------------------------------------------------------------------ servers' shapes


def _collect(*choices: dict[str, Any]) -> Tokens | None:
    got = Collector()
    for choice in choices:
        got.add(choice)
    return got.result()


def test_llama_cpp_entries_carry_their_ids() -> None:
    entry = {
        "id": 42,
        "token": " a",
        "bytes": [32, 97],
        "logprob": -0.5,
        "top_logprobs": [
            {"id": 42, "token": " a", "bytes": [32, 97], "logprob": -0.5},
            {"id": 7, "token": " b", "bytes": [32, 98], "logprob": -1.5},
        ],
    }
    got = _collect({"text": " a", "logprobs": {"content": [entry]}})
    assert got == Tokens(
        ids=(42,), logprobs=(-0.5,), top_ids=((42, 7),), top_logprobs=((-0.5, -1.5),)
    )


def test_vllm_token_id_strings_and_choice_ids() -> None:
    content = [
        {
            "token": "token_id:5",
            "logprob": -1.0,
            "top_logprobs": [{"token": "token_id:5", "logprob": -1.0}],
        }
    ]
    assert _collect({"logprobs": {"content": content}}).ids == (5,)
    # return_token_ids: the choice's token_ids (vLLM), response_token_ids (SGLang)
    texts = [
        {"token": "x", "logprob": -2.0, "top_logprobs": []},
        {"token": "y", "logprob": -3.0, "top_logprobs": []},
    ]
    for name in ("token_ids", "response_token_ids"):
        got = _collect({"logprobs": {"content": texts}, name: [10, 11]})
        assert got is not None and got.ids == (10, 11) and got.texts is None


def test_completions_logprobs_streamed_in_pieces() -> None:
    first = {
        "text": "a b",
        "logprobs": {
            "tokens": ["a", " b"],
            "token_logprobs": [None, -1.0],
            "top_logprobs": [{"a": -0.1}, {" b": -1.0, " c": -2.0}],
        },
    }
    last = {
        "text": " d",
        "logprobs": {"tokens": [" d"], "token_logprobs": [-0.25], "top_logprobs": [{" d": -0.25}]},
    }
    got = _collect(first, last)
    assert got is not None
    assert got.texts == ("a", " b", " d") and got.ids is None
    assert math.isnan(got.logprobs[0]) and got.logprobs[1:] == (-1.0, -0.25)
    assert got.top_texts == (("a",), (" b", " c"), (" d",))
    assert (
        row_fields(unpack(pack(got)), logprobs=True, token_ids=False)["token_logprobs"][0] is None
    )


@pytest.mark.parametrize(
    "choice",
    [
        {"logprobs": "yes"},
        {"logprobs": {"content": [{"token": 3, "logprob": -1.0}]}},
        {"logprobs": {"tokens": ["a"], "token_logprobs": []}},
        {"logprobs": {"content": [{"token": "a", "logprob": "low"}]}},
        {"token_ids": [1.5]},
    ],
)
def test_malformed_logprobs_are_refused(choice: dict[str, Any]) -> None:
    from orchestrator.items.tokens import BadTokens

    with pytest.raises(BadTokens):
        _collect(choice)


# ------------------------------------------------------------------ whole runs

N = 160


def _rows(tmp_path: Path) -> tuple[Path, Path, list[dict[str, Any]], list[dict[str, Any]]]:
    raw = [
        {"id": f"r{i:04d}", "prompt": f"Continue the list: {i}, {i + 1}, {i + 2},"}
        for i in range(N)
    ]
    chat = [
        {"id": f"c{i:04d}", "messages": [{"role": "user", "content": f"Name a river, {i}."}]}
        for i in range(N)
    ]
    return (
        write_jsonl(tmp_path / "raw.jsonl", raw),
        write_jsonl(tmp_path / "chat.jsonl", chat),
        raw,
        chat,
    )


def _enqueue(db: str, *args: str) -> None:
    result = cli("enqueue", *args, "--db", db, "--max-tokens", "32")
    assert result.returncode == 0, result.stderr


def _export(db: str, out: Path, *args: str) -> list[dict[str, Any]]:
    return export_lines(db, out, "--logprobs", "--token-ids", *args)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_killed_run_keeps_every_answers_tokens_once(
    db_url: str, tmp_path: Path, stream: bool
) -> None:
    """Raw completions (token texts: no ids asked) and chat answers (ids asked with
    return_token_ids), a worker SIGKILLed mid-run, then a run to the end: every answer is
    stored once with its tokens, and every exported token is the simulator's."""
    raw_file, chat_file, raw, chat = _rows(tmp_path)
    sim = SimProcess("--per-token", "0.002", "--mean-tokens", "24")
    url = sim.start()
    try:
        _enqueue(db_url, str(raw_file), "-d", "raw", "--endpoint", "completions", "--logprobs", "4")
        _enqueue(
            db_url,
            str(chat_file),
            "-d",
            "chat",
            "--logprobs",
            "3",
            "--param",
            "return_token_ids=true",
        )
        flags = ["--concurrency", "8", *(["--stream"] if stream else [])]
        killed_at = kill_worker_after(db_url, url, N // 2, *flags, pause=0.02)
        assert 0 < killed_at < 2 * N, "the kill must land mid-run"
        result = cli("run", "--server", url, "--db", db_url, "--exit-when-done", *flags)
        assert result.returncode == 0, result.stderr
    finally:
        sim.stop()

    assert query(db_url, "SELECT count(*), count(tokens) FROM outputs") == [(2 * N, 2 * N)]
    verdict = Verdict()
    raw_lines = _export(
        db_url, tmp_path / "raw.out.jsonl", "--dataset", "raw", "--format", "completions"
    )
    assert [line["id"] for line in raw_lines] == [row["id"] for row in raw]
    for line, row in zip(raw_lines, raw, strict=True):
        assert line["prompt"] == row["prompt"]
        assert answer_matches(row["prompt"], line["completion"]), line["id"]
        assert line["token_ids"] is None  # none asked: the texts are kept instead
        check_tokens(line["id"], line, row["prompt"], 4, verdict)
    chat_lines = _export(db_url, tmp_path / "chat.out.jsonl", "--dataset", "chat")
    assert [line["id"] for line in chat_lines] == [row["id"] for row in chat]
    for line, row in zip(chat_lines, chat, strict=True):
        assert answer_matches(row["messages"], line["messages"][-1]["content"]), line["id"]
        check_tokens(line["id"], line, row["messages"], 3, verdict)
    assert verdict.faults == [] and verdict.answers == 2 * N


def test_a_thousand_token_answer_with_top5_is_stored_in_40_kb(db_url: str, tmp_path: Path) -> None:
    rows = [{"id": "long", "prompt": "Once upon a time"}]
    sim = SimProcess("--mean-tokens", "4000")
    url = sim.start()
    try:
        result = cli(
            "enqueue", str(write_jsonl(tmp_path / "p.jsonl", rows)), "-d", "long", "--db", db_url,
            "--endpoint", "completions", "--logprobs", "5", "--max-tokens", "1000",
            "--param", "return_tokens_as_token_ids=true",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        result = cli("run", "--server", url, "--db", db_url, "--exit-when-done")
        assert result.returncode == 0, result.stderr
    finally:
        sim.stop()
    [(size, tokens)] = query(db_url, "SELECT length(tokens), completion_tokens FROM outputs")
    assert tokens == 1000
    assert size <= 40_000, size
    [line] = _export(db_url, tmp_path / "out.jsonl", "--format", "completions")
    verdict = Verdict()
    check_tokens("long", line, "Once upon a time", 5, verdict)
    assert verdict.faults == [] and len(line["top_token_ids"]) == 1000


# ------------------------------------------------------------------ what users get wrong


def test_a_conversation_under_the_completions_endpoint_is_refused(
    db_url: str, tmp_path: Path
) -> None:
    _enqueue(db_url, str(write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "fine"}])), "-d", "ok")
    before = db_snapshot(db_url)
    rows = [
        {"prompt": "fine"},
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "hi"},
            ]
        },
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    result = cli("enqueue", str(data), "-d", "raw", "--endpoint", "completions", "--db", db_url)
    assert result.returncode != 0
    assert f"{data}:2" in result.stderr and "plain prompt" in result.stderr, result.stderr
    assert db_snapshot(db_url) == before  # nothing half-written


def test_logprobs_with_every_turn_regenerated_is_refused(db_url: str, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    result = cli(
        "enqueue", str(data), "-d", "all", "--regenerate", "all", "--logprobs", "2", "--db", db_url
    )
    assert result.returncode != 0 and "regenerate all" in result.stderr, result.stderr
    result = cli(
        "enqueue",
        str(data),
        "-d",
        "raw",
        "--endpoint",
        "completions",
        "--regenerate",
        "all",
        "--db",
        db_url,
    )
    assert result.returncode != 0 and "regenerate all" in result.stderr, result.stderr


def test_raw_completions_export_only_as_completions(db_url: str, tmp_path: Path) -> None:
    _enqueue(
        db_url,
        str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])),
        "-d",
        "raw",
        "--endpoint",
        "completions",
    )
    _enqueue(db_url, str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "b"}])), "-d", "chat")
    out = tmp_path / "out.jsonl"
    for args, said in (
        (("--dataset", "raw"), "export it with --format completions"),
        (("--dataset", "raw", "--format", "sharegpt"), "export it with --format completions"),
        (("--dataset", "chat", "--format", "completions"), "holds chat answers"),
        (("--dataset", "chat", "--format", "openai-batch", "--logprobs"), "no place"),
    ):
        result = cli("export", str(out), "--db", db_url, *args)
        assert result.returncode != 0 and said in result.stderr, (args, result.stderr)
        assert not out.exists()


def test_requeue_sets_tokens_aside_and_undo_brings_them_back(db_url: str, tmp_path: Path) -> None:
    """superseded_outputs keeps outputs' columns: a requeued answer's tokens go aside with
    it, and come back byte for byte with ``requeue --undo``."""
    rows = [{"id": f"r{i}", "prompt": f"Count to {i}"} for i in range(4)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    _enqueue(db_url, str(data), "-d", "raw", "--endpoint", "completions", "--logprobs", "2")
    sim = SimProcess()
    url = sim.start()
    try:
        result = cli("run", "--server", url, "--db", db_url, "--exit-when-done")
        assert result.returncode == 0, result.stderr
    finally:
        sim.stop()
    before = query(db_url, "SELECT item_id, tokens FROM outputs ORDER BY item_id")
    assert len(before) == 4 and all(tokens for _, tokens in before)
    result = cli("requeue", "--state", "done", "--dataset", "raw", "--db", db_url)
    assert result.returncode == 0, result.stderr
    assert query(db_url, "SELECT count(*) FROM outputs") == [(0,)]
    aside = query(db_url, "SELECT item_id, tokens FROM superseded_outputs ORDER BY item_id")
    assert [(i, bytes(t)) for i, t in aside] == [(i, bytes(t)) for i, t in before]
    result = cli("requeue", "--undo", "--db", db_url)
    assert result.returncode == 0, result.stderr
    after = query(db_url, "SELECT item_id, tokens FROM outputs ORDER BY item_id")
    assert [(i, bytes(t)) for i, t in after] == [(i, bytes(t)) for i, t in before]


def test_a_run_file_declares_the_endpoint_and_logprobs(db_url: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "b"}]}])
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        "[defaults]\nmax_tokens = 16\n\n"
        '[[dataset]]\nname = "raw"\nfile = "p.jsonl"\nendpoint = "completions"\nlogprobs = 3\n\n'
        '[[dataset]]\nname = "chat"\nfile = "c.jsonl"\nlogprobs = 2\n'
    )
    result = cli("enqueue", "--config", str(run_file), "--db", db_url)
    assert result.returncode == 0, result.stderr
    found = query(db_url, "SELECT name, endpoint, params FROM datasets ORDER BY name")
    assert [(name, endpoint, orjson.loads(params)) for name, endpoint, params in found] == [
        ("chat", "chat", {"max_tokens": 16, "logprobs": True, "top_logprobs": 2}),
        ("raw", "completions", {"max_tokens": 16, "logprobs": 3}),
    ]
    assert query(db_url, "SELECT request FROM items ORDER BY id")[0] == ('{"prompt":"a"}',)


async def test_the_python_api_asks_and_gives_the_same(db_url: str) -> None:
    """``Queue.enqueue(endpoint=, logprobs=)`` and ``Queue.results(logprobs=, token_ids=)``:
    the command's options by their Python names, the same lines."""
    import orchestrator as orc

    rows = [{"id": f"r{i}", "prompt": f"Tell of stone {i}"} for i in range(5)]
    sim = SimProcess()
    url = sim.start()
    try:
        async with orc.open(db_url) as q:
            await q.enqueue(
                rows,
                dataset="raw",
                endpoint="completions",
                logprobs=2,
                max_tokens=16,
                params={"return_token_ids": True},
            )
            await q.run(servers=[url])
            lines = [
                line
                async for line in q.results(format="completions", logprobs=True, token_ids=True)
            ]
            with pytest.raises(orc.ConfigError, match="logprobs"):
                await q.enqueue(rows, dataset="bad", logprobs=-1)
    finally:
        sim.stop()
    verdict = Verdict()
    for line, row in zip(lines, rows, strict=True):
        assert line["id"] == row["id"] and line["prompt"] == row["prompt"]
        check_tokens(line["id"], line, row["prompt"], 2, verdict)
    assert verdict.faults == [] and verdict.answers == 5
