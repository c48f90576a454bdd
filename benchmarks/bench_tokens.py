"""What an answer's tokens cost in the database: 1,000-token answers with top-K logprobs.

Raw completions of the simulated server, ``--max-tokens 1000 --logprobs K``, run through
``orchestrator run``; then the mean stored size of ``outputs.tokens`` (packed:
``orchestrator.items.tokens``), against the same columns as JSON (what ``export --logprobs
--token-ids`` writes), with token ids (``return_tokens_as_token_ids``) and with token
texts only (no ids asked). The simulator's logprobs are multiples of 1/64 and its ids
uniform over 32,000: the figures for real logprobs (every mantissa bit used) are in the
test ``test_a_thousand_tokens_with_top5_fit_in_40_kb``'s worst case, about 34.6 KB with
ids. Target: about 40 KB for a 1,000-token answer with top-5.

    python benchmarks/bench_tokens.py [--items 20] [--top 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import orjson
from common import PYTHON, REPO, SimServer, connect, print_machine, print_table, verdict, workdir

TARGET_BYTES = 40_000


def _run(argv: list[str]) -> None:
    subprocess.run([PYTHON, "-m", "orchestrator", *argv], check=True, cwd=REPO)


def measure(work: Path, items: int, top: int, ids: bool) -> tuple[float, float, float]:
    """Mean stored bytes, mean JSON bytes, and seconds to unpack one answer."""
    from orchestrator.items.tokens import row_fields, unpack

    db = work / f"tokens-{ids}.db"
    rows = work / "prompts.jsonl"
    rows.write_bytes(
        b"".join(orjson.dumps({"prompt": f"Once upon a time {i}"}) + b"\n" for i in range(items))
    )
    asks = ["--param", "return_tokens_as_token_ids=true"] if ids else []
    _run(["enqueue", str(rows), "-d", "raw", "--db", str(db), "--endpoint", "completions",
          "--logprobs", str(top), "--max-tokens", "1000", *asks])  # fmt: skip
    with SimServer(mean_tokens=4000) as sim:
        _run(
            ["run", "--server", sim.url, "--db", str(db), "--exit-when-done", "--concurrency", "8"]
        )
    with connect(db) as conn:
        stored = [bytes(b) for (b,) in conn.execute("SELECT tokens FROM outputs")]
    started = time.perf_counter()
    fields = [row_fields(unpack(b), logprobs=True, token_ids=True) for b in stored]
    seconds = (time.perf_counter() - started) / len(stored)
    json_bytes = sum(len(orjson.dumps(f)) for f in fields) / len(fields)
    return sum(map(len, stored)) / len(stored), json_bytes, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    print_machine()
    table = []
    with workdir(args.workdir) as work:
        for ids in (True, False):
            packed, as_json, seconds = measure(work, args.items, args.top, ids)
            table.append(
                [
                    "ids" if ids else "texts",
                    f"{packed:,.0f}",
                    f"{as_json:,.0f}",
                    f"{as_json / packed:.1f}x",
                    f"{seconds * 1000:.1f} ms",
                    verdict(packed, TARGET_BYTES),
                ]
            )
    print(f"{args.items} answers of 1,000 tokens, top-{args.top}")
    print_table(["tokens by", "stored B", "JSON B", "JSON / stored", "unpack+row", ""], table)


if __name__ == "__main__":
    sys.exit(main())
