"""Against a real, unmodified third-party server: llama.cpp's ``llama-server``.

The binary and a tiny random-weight model come from ``scripts/llama_server.py`` (built
offline, cached outside the checkout). The model answers gibberish, usually up to
``max_tokens``; what is checked is what a client sees of a real server: its connection
handling, its ``usage`` and ``finish_reason``, its ``/metrics``. In CI (``CI=true``) a
missing build fails these tests; elsewhere they are skipped with the command to run.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from scripts import llama_server
from tests.helpers import (
    REPO,
    STARTED,
    cli,
    dialogue,
    kill_worker_once,
    query,
    start_worker,
    write_jsonl,
)

pytestmark = pytest.mark.llamacpp
MODEL = llama_server.MODEL_ALIAS


def require_llama_server() -> None:
    """Skip the test where llama-server or its model is not built (fail on CI)."""
    missing = [
        str(p) for p in (llama_server.binary_path(), llama_server.model_path()) if not p.exists()
    ]
    if missing:
        reason = f"llama-server not built ({', '.join(missing)}): python3 scripts/llama_server.py"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def llama() -> Iterator[str]:
    """One llama-server for the session: 8 slots of 4,096 tokens, ``/metrics`` on."""
    require_llama_server()
    server = llama_server.LlamaServer()
    server.start()
    yield server.url
    server.stop()


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return orjson.loads(resp.read())


def enqueue(db: Path, rows: list[dict[str, Any]], name: str, *extra: str) -> None:
    data = write_jsonl(db.parent / f"{name}.jsonl", rows)
    result = cli("enqueue", str(data), "-d", name, "--db", str(db), "--model", MODEL, *extra)
    assert result.returncode == 0, result.stderr


def export(db: Path) -> list[dict[str, Any]]:
    out = db.parent / "out.jsonl"
    result = cli("export", str(out), "--db", str(db))
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def done(db: Path) -> int:
    return query(db, "SELECT count(*) FROM items WHERE state = 'done'")[0][0]


def errors(db: Path) -> dict[str, int]:
    rows = query(db, "SELECT error_class, count(*) FROM attempt_errors GROUP BY error_class")
    return dict(rows)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_killed_run_resumes_and_exports_each_item_once(
    llama: str, tmp_path: Path, stream: bool
) -> None:
    n = 600
    db = tmp_path / "q.db"
    rows = [
        {"id": f"k{i:04d}", "messages": [{"role": "user", "content": f"Write about stone {i}."}]}
        for i in range(n)
    ]
    enqueue(db, rows, "kill", "--max-tokens", "12")
    flags = ["--concurrency", "8", *(["--stream"] if stream else [])]
    worker = start_worker(db, llama, *flags)
    kill_worker_once(worker, lambda: done(db) >= n // 4)
    killed_at = done(db)
    assert 0 < killed_at < n, "the kill must land mid-run"
    result = cli("run", "--server", llama, "--db", str(db), "--exit-when-done", *flags)
    assert result.returncode == 0, result.stderr

    lines = export(db)
    assert [line["id"] for line in lines] == [row["id"] for row in rows]
    for line in lines:
        usage, answer = line["usage"], line["messages"][-1]
        assert answer["role"] == "assistant" and isinstance(answer["content"], str)
        assert line["finish_reason"] in ("length", "stop"), line
        assert 0 < usage["completion_tokens"] <= 12 and usage["prompt_tokens"] > 5, line
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stored = query(db, "SELECT usage FROM outputs ORDER BY item_id")
    assert len(stored) == n  # one output per item, none written twice
    assert sorted(json.loads(u)["prompt_tokens"] for (u,) in stored) == sorted(
        line["usage"]["prompt_tokens"] for line in lines
    )
    # The killed worker's leases were reclaimed; and though the server closes the
    # connection after each streamed answer, a request that found its pooled connection
    # closed went again on a new one, never as a retry or an outage.
    # (A random model may say nothing at all: empty_content, retried, is the model's.)
    assert not set(errors(db)) - {"lease_lost", "empty_content"}, errors(db)


CONVERSATIONS = [
    dialogue(
        "Name a river.",
        "ORIGINAL ANSWER ONE about the river",
        "And a stone?",
        "ORIGINAL ANSWER TWO about the stone",
        "Now a cloud.",
        "ORIGINAL ANSWER THREE about the cloud",
        system="You are terse.",
    ),
    dialogue("Say something about light.", "ORIGINAL SINGLE ANSWER about light"),
    dialogue("Signal one?", "ORIGINAL FIRST about signals", "Signal two?"),
]


def expected_prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    """What the server counts for a chat request of ``messages``: its own template, then
    its own tokenizer."""
    prompt = post(url, "/apply-template", {"messages": messages})["prompt"]
    return len(post(url, "/tokenize", {"content": prompt, "add_special": True})["tokens"])


def test_regenerate_all_sends_each_turn_its_own_prefix(llama: str, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)]
    enqueue(db, rows, "multi", "--regenerate", "all", "--max-tokens", "8")
    result = cli("run", "--server", llama, "--db", str(db), "--exit-when-done", "--stream")
    assert result.returncode == 0, result.stderr
    lines = {line["id"]: line for line in export(db)}
    assert sorted(lines) == ["c0", "c1", "c2"]
    for i, original in enumerate(CONVERSATIONS):
        key = f"c{i}"
        (item_id,) = query(db, "SELECT id FROM items WHERE key = ?", key)[0]
        # Every turn of a multi-turn item is kept in item_turns; a single one in outputs.
        per_turn = [
            json.loads(u)
            for (u,) in query(
                db, "SELECT usage FROM item_turns WHERE item_id = ? ORDER BY turn", item_id
            )
        ] or [json.loads(query(db, "SELECT usage FROM outputs WHERE item_id = ?", item_id)[0][0])]
        exported = lines[key]["messages"]
        targets = [j for j, m in enumerate(exported) if m["role"] == "assistant"]
        assert len(targets) == len(per_turn), (key, exported)
        # Each original answer was replaced by the generated one.
        assert not any("ORIGINAL" in (m.get("content") or "") for m in exported), key
        assert all(a["role"] == b["role"] for a, b in zip(exported, original, strict=False))
        for turn, (position, usage) in enumerate(zip(targets, per_turn, strict=True)):
            # The prompt of turn k: the conversation before it, earlier targets being the
            # generated turns, and never the turn's own original answer.
            want = expected_prompt_tokens(llama, exported[:position])
            assert usage["prompt_tokens"] == want, (key, turn, usage, exported[:position])


def test_auto_concurrency_reads_llamacpp_metrics(llama: str, tmp_path: Path) -> None:
    """The tuner ramps past the server's slots and the deferred queue that /metrics shows
    pulls it back. A server of its own, with HTTP threads to spare: by default
    llama-server has slots + 2 of them, and requests beyond those wait in the socket's
    backlog, where no metric counts them. (``llama``: the build, checked once.)"""
    db = tmp_path / "q.db"
    rows = [
        {"id": f"a{i:04d}", "messages": [{"role": "user", "content": f"Tell of field {i}."}]}
        for i in range(4000)
    ]
    enqueue(db, rows, "auto", "--max-tokens", "64")
    with llama_server.LlamaServer("--threads-http", "64") as server:
        worker = start_worker(db, server.url, "--concurrency", "auto", "--exit-when-done")
        seen = _events_until(worker, lambda e: e.get("reason") == "queue", deadline=300)
        if worker.poll() is None:
            worker.send_signal(signal.SIGINT)
        worker.wait(timeout=120)
    names = {e["event"] for e in seen}
    assert "server_metrics_unavailable" not in names
    changes = [e for e in seen if e["event"] == "concurrency_changed"]
    # 8 slots: the cap ramps past them, then the server's deferred queue pulls it back,
    # a reason only /metrics can give.
    assert any(c["reason"] == "queue" for c in changes), changes


def _events_until(
    worker: subprocess.Popen[str], found: Any, *, deadline: float
) -> list[dict[str, Any]]:
    """The worker's JSON log events as they come, until one is ``found``, the worker
    exits, or ``deadline`` seconds pass (a busy machine's pace, not the expected one)."""
    assert worker.stderr is not None
    seen: list[dict[str, Any]] = []
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in worker.stderr:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith("{"):
            seen.append(json.loads(line))
            if found(seen[-1]):
                break
    return seen


def test_status_server_shows_llamacpp_view(llama: str, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    rows = [{"id": "s1", "messages": [{"role": "user", "content": "hello"}]}]
    enqueue(db, rows, "status", "--max-tokens", "4")
    assert cli("run", "--server", llama, "--db", str(db), "--exit-when-done").returncode == 0
    result = cli("status", "--json", "--db", str(db), "--server", llama)
    assert result.returncode == 0, result.stderr
    (view,) = json.loads(result.stdout)["servers"]
    assert view["kind"] == "llamacpp" and view["error"] is None, view
    assert view["running"] == 0 and view["queued"] == 0
    assert view["generation_tokens_total"] >= 1 and view["prompt_tokens_total"] >= 1
    assert view["gen_throughput"] is not None
    text = cli("status", "--db", str(db), "--server", llama).stdout
    assert "llamacpp" in text, text
    # The dashboard's status document carries the same view.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["dashboard", "--port", str(port), "--db", str(db), "--server", llama]
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *argv], cwd=REPO, stderr=subprocess.DEVNULL
    )
    STARTED.append(dashboard)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as r:
                status = orjson.loads(r.read())
            break
        except OSError:
            assert time.monotonic() < deadline, "the dashboard did not answer"
            time.sleep(0.2)
    dashboard.terminate()
    dashboard.wait(10)
    assert [s["kind"] for s in status["servers"]] == ["llamacpp"], status["servers"]


def test_doctor_passes(llama: str, tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    enqueue(db, [{"id": "d1", "messages": [{"role": "user", "content": "hi"}]}], "doc")
    result = cli("doctor", "--server", llama, "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout, result.stdout
    wrong = cli("doctor", "--server", llama, "--db", str(db), "--model", "another-model")
    assert wrong.returncode == 1 and "another-model" in wrong.stdout, wrong.stdout


ENUM_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_json_schema_answers_are_checked(llama: str, tmp_path: Path) -> None:
    """llama.cpp turns the schema into a grammar: its answers parse and match, and the
    check (reasoning split, parse, validate) agrees with jsonschema run here."""
    import jsonschema

    db = tmp_path / "q.db"
    schema = tmp_path / "yes-no.json"
    schema.write_bytes(orjson.dumps(ENUM_SCHEMA))
    rows = [
        {"id": f"j{i:03d}", "messages": [{"role": "user", "content": f"Is {i} a stone?"}]}
        for i in range(24)
    ]
    enqueue(db, rows, "json", "--max-tokens", "200", "--json-schema", str(schema))
    result = cli("run", "--server", llama, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out.jsonl"
    assert cli("export", str(out), "--db", str(db), "--parsed", "--provenance").returncode == 0
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines) == len(rows)
    valid = 0
    for line in lines:
        content = line["messages"][-1]["content"]
        try:
            value = json.loads(content)
        except ValueError:
            assert "invalid_json" in line["flags"] and line["parsed"] is None, line
            continue
        if jsonschema.Draft202012Validator(ENUM_SCHEMA).is_valid(value):
            valid += 1
            assert line["parsed"] == value and not {"invalid_json", "schema_mismatch"} & set(
                line["flags"]
            ), line
        else:
            assert "schema_mismatch" in line["flags"] and line["parsed"] is None, line
    assert valid > len(rows) // 2  # the grammar holds the model to the schema


def test_context_refusal_fails_as_context_overflow(tmp_path: Path) -> None:
    """A prompt longer than llama.cpp's context (``-c``) alone: its refusal names the
    numbers, and the item fails as ``context_overflow`` at once, even with ``fit``; a
    short prompt with a large max_tokens is answered (llama.cpp stops at the context
    instead of refusing), so nothing is lowered."""
    if not llama_server.binary_path().exists() or not llama_server.model_path().exists():
        pytest.skip("llama-server not built: python3 scripts/llama_server.py")
    db = tmp_path / "q.db"
    long = " ".join(f"word{i}" for i in range(400))
    rows = [
        {"id": f"c{i:03d}", "messages": [{"role": "user", "content": long if i % 2 else "hi"}]}
        for i in range(12)
    ]
    with llama_server.LlamaServer(slots=1, context=256) as server:
        enqueue(db, rows, "ctx", "--max-tokens", "10000", "--on-overflow", "fit")
        result = cli("run", "--server", server.url, "--db", str(db), "--exit-when-done")
    assert result.returncode == 6, result.stderr  # failed items, not a halted run
    items = query(db, "SELECT key, state, attempts, error_class, last_error FROM items")
    for key, state, attempts, error_class, error in items:
        if int(key[1:]) % 2:
            assert (state, attempts, error_class) == ("failed", 1, "context_overflow"), key
            assert "the prompt has" in error and "the server's context is 256 tokens" in error
        else:
            assert state == "done", (key, error)
    flags = query(db, "SELECT count(*) FROM outputs WHERE flags & 256 != 0")[0][0]
    assert flags == 0


@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [("completions", False), ("completions", True), ("chat", False)],
    ids=["completions", "completions-stream", "chat"],
)
def test_logprobs_and_token_ids_as_llama_cpp_gives_them(
    llama: str, tmp_path: Path, endpoint: str, stream: bool
) -> None:
    """llama.cpp names every token's id in its logprobs (``n_probs``, which its OAI
    routes take as ``logprobs``/``top_logprobs``): they are kept and exported, one per
    generated token, and its own ``/detokenize`` spells the stored answer from them.
    Greedy (temperature 0), so each token is the first of its alternatives."""
    db = tmp_path / "q.db"
    if endpoint == "completions":
        rows = [{"id": f"r{i}", "prompt": f"Once upon a time, stone {i}"} for i in range(6)]
    else:
        rows = [
            {"id": f"r{i}", "messages": [{"role": "user", "content": f"A stone {i}?"}]}
            for i in range(6)
        ]
    enqueue(
        db,
        rows,
        "lp",
        "--endpoint",
        endpoint,
        "--logprobs",
        "3",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    )
    result = cli(
        "run",
        "--server",
        llama,
        "--db",
        str(db),
        "--exit-when-done",
        *(["--stream"] if stream else []),
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out.jsonl"
    shape = ["--format", "completions"] if endpoint == "completions" else []
    result = cli("export", str(out), "--db", str(db), "--logprobs", "--token-ids", *shape)
    assert result.returncode == 0, result.stderr
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == [row["id"] for row in rows]
    for line in lines:
        n = line["usage"]["completion_tokens"]
        ids = line["token_ids"]
        assert len(line["token_logprobs"]) == len(ids), line
        assert "tokens" not in line  # ids given: no texts kept
        assert all(len(top) == 3 for top in line["top_token_ids"]), line
        assert [top[0] for top in line["top_token_ids"]] == ids
        assert [top[0] for top in line["top_logprobs"]] == line["token_logprobs"]
        assert all(top == sorted(top, reverse=True) for top in line["top_logprobs"])
        if endpoint == "chat":
            # llama.cpp's chat route may give fewer entries than tokens generated (a
            # token holding part of a UTF-8 character shares the next one's entry):
            # kept as it gives them.
            assert 0 < len(ids) <= n, line
            continue
        assert len(ids) == n, line
        assert post(llama, "/detokenize", {"tokens": ids})["content"] == line["completion"]


def test_llamacpp_honours_n_so_samples_go_out_in_one_request(llama: str, tmp_path: Path) -> None:
    """llama-server answers ``n`` choices (its ``n_cmpl``): a prompt's samples claimed
    together are asked in one request, each stored as its own sample, and the dataset
    never falls back to a request per sample."""
    answer = post(llama, "/v1/chat/completions", {
        "model": MODEL, "messages": dialogue("hello"), "n": 3, "max_tokens": 4, "seed": 1,
    })  # fmt: skip
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    db = tmp_path / "q.db"
    rows = [{"id": f"p{i}", "messages": dialogue(f"question {i}")} for i in range(6)]
    enqueue(db, rows, "s", "--max-tokens", "8", "--samples", "3")
    argv = ("--concurrency", "8", "--exit-when-done")
    result = cli("--log-json", "run", "--server", llama, "--db", str(db), *argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "n_ignored" not in result.stderr
    assert query(db, "SELECT draw_mode FROM datasets") == [("n",)]
    lines = export(db)
    assert [(line["id"], line["sample"]) for line in lines] == [
        (f"p{i}", s) for i in range(6) for s in range(3)
    ]
    # One request answered several samples: they share its response id.
    ids = query(db, "SELECT response_id, count(*) FROM outputs GROUP BY response_id")
    assert any(n > 1 for _, n in ids), ids


def test_llamacpp_more_samples_than_slots_are_asked_in_requests_it_takes(
    llama: str, tmp_path: Path
) -> None:
    """llama-server refuses an ``n`` above its slots (a 400 naming the field). Two
    servers of four slots each make a capacity of eight, yet ten samples of a prompt go
    out as requests of at most four, the most one of them takes."""
    with llama_server.LlamaServer(slots=4, context=2048) as small:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(small.url, "/v1/chat/completions", {
                "model": MODEL, "messages": dialogue("hello"), "n": 5, "max_tokens": 4,
            })  # fmt: skip
        assert refused.value.code == 400 and "'n'" in refused.value.read().decode()
        db = tmp_path / "q.db"
        rows = [{"id": f"p{i}", "messages": dialogue(f"question {i}")} for i in range(3)]
        enqueue(db, rows, "s", "--max-tokens", "8", "--samples", "10")
        servers = ("--server", llama, "--server", small.url, "--concurrency", "4")
        result = cli("--log-json", "run", *servers, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = export(db)
    assert [(line["id"], line["sample"]) for line in lines] == [
        (f"p{i}", s) for i in range(3) for s in range(10)
    ]
    sizes = [n for _, n in query(db, "SELECT response_id, count(*) FROM outputs GROUP BY 1")]
    assert max(sizes) == 4 and sum(sizes) == 30, sizes


def server_prompt_ids(url: str, messages: list[dict[str, Any]]) -> list[int]:
    """The ids the server makes of a chat's prompt: its template, then its tokenizer."""
    prompt = post(url, "/apply-template", {"messages": messages})["prompt"]
    return post(url, "/tokenize", {"content": prompt, "add_special": True})["tokens"]


def test_token_rows_are_the_ids_llamacpp_evaluated_and_generated(
    llama: str, tmp_path: Path
) -> None:
    """``--token-ids`` against llama.cpp, whose answers carry no prompt ids: each turn's
    prompt ids are its own template's and tokenizer's for exactly the turn's context,
    its generated ids are as many as it counted (``__verbose.tokens``), and its own
    ``/detokenize`` spells the stored answer from them where the text is whole."""
    db = tmp_path / "q.db"
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)]
    rows += [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Stone {i}?"}]}
             for i in range(12)]  # fmt: skip
    enqueue(db, rows, "ids", "--regenerate", "all", "--max-tokens", "10", "--token-ids")
    result = cli("run", "--server", llama, "--db", str(db), "--exit-when-done")
    assert result.returncode == 0, result.stderr
    conversations = {line["id"]: line["messages"] for line in export(db)}
    out = tmp_path / "tokens.jsonl"
    made = cli("export", str(out), "--db", str(db), "--format", "tokens", "--provenance")
    assert made.returncode == 0, made.stderr
    assert "left out" not in made.stderr, made.stderr
    token_rows = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    spelled = 0
    for key, messages in conversations.items():
        answered = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for k, position in enumerate(answered):
            row = token_rows.pop(f"{key}#turn{k}")
            prompt = server_prompt_ids(llama, messages[:position])
            n = sum(row["loss_mask"])
            assert row["input_ids"][: len(prompt)] == prompt, (key, k)
            assert len(row["input_ids"]) == len(prompt) + n and n > 0
            assert row["prompt_ids_from"] == "tokenize"
            text = messages[position]["content"] or ""
            generated = row["input_ids"][len(prompt) :]
            if "\ufffd" not in text:
                said = post(llama, "/detokenize", {"tokens": generated})["content"]
                assert said.startswith(text), (key, k, said, text)
                spelled += 1
    assert token_rows == {}  # no row that is not a generated turn
    assert spelled > 0


HISTORY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("history", ["keep", "drop"])
def test_llamacpp_renders_the_history_reasoning_it_is_sent(tmp_path: Path, history: str) -> None:
    """A real server whose template renders the reasoning of earlier turns: its prompt,
    counted by itself, is the history with that reasoning (kept) or without (dropped),
    so what the model saw depends on it and each exported row names the right one."""
    require_llama_server()
    template = tmp_path / "template.jinja"
    template.write_text(HISTORY_TEMPLATE)
    server = llama_server.LlamaServer("--jinja", "--chat-template-file", str(template), slots=2)
    url = server.start()
    try:
        db = tmp_path / "q.db"
        rows = []
        for i, messages in enumerate(CONVERSATIONS):
            thought = [
                {**m, "reasoning_content": f"thinking about turn {j} of {i} first"}
                if m["role"] == "assistant" else m
                for j, m in enumerate(messages)
            ]  # fmt: skip
            rows.append(
                {"id": f"h{i}", "messages": [*thought, {"role": "user", "content": "And?"}]}
            )
        enqueue(db, rows, "h", "--max-tokens", "6", "--token-ids", "--history-reasoning", history)
        result = cli("run", "--server", url, "--db", str(db), "--exit-when-done")
        assert result.returncode == 0, result.stderr
        out = tmp_path / "tokens.jsonl"
        made = cli("export", str(out), "--db", str(db), "--format", "tokens")
        assert made.returncode == 0, made.stderr
        token_rows = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
        for row in rows:
            sent = row["messages"] if history == "keep" else [
                {k: v for k, v in m.items() if k != "reasoning_content"} for m in row["messages"]
            ]  # fmt: skip
            prompt = server_prompt_ids(url, sent)
            other = server_prompt_ids(url, [{"role": m["role"], "content": m["content"]}
                                            for m in row["messages"]])  # fmt: skip
            assert (prompt != other) == (history == "keep")
            tokens = token_rows[row["id"]]
            assert tokens["input_ids"][: len(prompt)] == prompt
            assert tokens["loss_mask"][: len(prompt)] == [0] * len(prompt)
    finally:
        server.stop()
