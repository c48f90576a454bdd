"""Token-exact rows on a real server: llama.cpp's ``llama-server`` with the tiny model.

300 prompts (chats and three-turn dialogues regenerated whole), ``enqueue --token-ids``,
answers of up to 24 tokens, then ``export --format tokens``. Reported:

- the share of generated turns whose text, rendered again through the server's own
  template and ``/tokenize`` (what a trainer re-tokenizing the exported messages would
  train on), differs from the ids the server evaluated and generated;
- bytes stored per 1,000 tokens (prompt and generated) for the ids (``outputs.ids`` and
  ``item_turns.ids``);
- the turns left out of the token rows, by reason.

    python benchmarks/bench_token_ids.py [--items 300] [--stream]

Needs ``python scripts/llama_server.py`` (the build the tests use).
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from common import ORCH, print_machine, print_table

from scripts import llama_server


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return orjson.loads(resp.read())


def rows(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        if i % 2:
            messages = [{"role": "user", "content": f"Tell me of stone {i}."}]
        else:
            messages = [
                {"role": "user", "content": f"Name river {i}."},
                {"role": "assistant", "content": "The river."},
                {"role": "user", "content": "And a cloud?"},
            ]
        out.append({"id": f"r{i:04d}", "messages": messages})
    return out


def cli(*args: str) -> str:
    done = subprocess.run([*ORCH, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed: {done.stderr[-2000:]}")
    return done.stderr


def retokenized(url: str, context: list[dict[str, Any]], row: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the turn, rendered again with its answer and tokenized, differs from the
    ids the server evaluated and generated: anywhere, and in the prompt's part."""
    answer = {"role": "assistant", "content": context[-1]["content"]}
    text = post(url, "/apply-template", {"messages": [*context[:-1], answer]})["prompt"]
    again = post(url, "/tokenize", {"content": text, "add_special": True})["tokens"]
    ids, prompt = row["input_ids"], row["loss_mask"].count(0)
    # The template closes the turn after the answer; the model's own end token, if it
    # generated one, is compared as the template's.
    return again[: len(ids)] != ids, again[:prompt] != ids[:prompt]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    print_machine()
    server = llama_server.LlamaServer()
    url = server.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            db, data = work / "q.db", work / "in.jsonl"
            data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows(args.items)))
            model = llama_server.MODEL_ALIAS
            options = ["--regenerate", "all", "--token-ids", "--max-tokens", "24"]
            cli("enqueue", str(data), "-d", "ids", "--db", str(db), "--model", model, *options)
            stream = ["--stream"] if args.stream else []
            cli("run", "--server", url, "--db", str(db), "--exit-when-done", *stream)
            cli("export", str(work / "m.jsonl"), "--db", str(db))
            said = cli("export", str(work / "t.jsonl"), "--db", str(db), "--format", "tokens")
            report(url, db, work, said)
    finally:
        server.stop()
    return 0


def report(url: str, db: Path, work: Path, said: str) -> None:
    lines = {r["id"]: r for r in map(orjson.loads, (work / "m.jsonl").read_bytes().splitlines())}
    tokens = {r["id"]: r for r in map(orjson.loads, (work / "t.jsonl").read_bytes().splitlines())}
    turns = differs = in_prompt = 0
    for key, line in lines.items():
        messages = line["messages"]
        answered = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for k, position in enumerate(answered):
            row = tokens.get(f"{key}#turn{k}")
            if row is None:
                continue
            turns += 1
            anywhere, prompt = retokenized(url, messages[: position + 1], row)
            differs += anywhere
            in_prompt += prompt
    with sqlite3.connect(db) as conn:
        # Each turn's ids once: a multi-turn item's in item_turns, a single turn's with
        # its answer.
        found = conn.execute(
            "SELECT ids, usage FROM item_turns UNION ALL SELECT ids, usage FROM outputs"
            " WHERE ids IS NOT NULL"
        ).fetchall()
    stored = sum(len(blob) for blob, _ in found if blob is not None)
    counted = sum(
        (u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or 0)
        for _, text in found
        for u in [orjson.loads(text or "{}")]
    )
    share = f"{differs:,} of {turns:,} ({100 * differs / max(turns, 1):.1f} %)"
    per_thousand = f"{1000 * stored / max(counted, 1):,.0f}"
    left = said.strip().splitlines()[-1] if "left out" in said else "none"
    print_table(
        ["figure", "value"],
        [
            ["generated turns exported as token rows", f"{len(tokens):,}"],
            ["re-tokenized text differs from the server's ids", share],
            ["... of those, in the prompt's ids", f"{in_prompt:,}"],
            ["bytes of ids per 1,000 tokens (prompt + generated)", per_thousand],
            ["left out", left],
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
