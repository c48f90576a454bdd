"""Structured output: what checking an answer costs the worker, per answer.

Each answer of a ``response_format`` dataset is parsed and validated
(``orchestrator.items.structured.check``) in the worker, after its reasoning is split off.
This measures that check on answers of about 1,000 tokens (4 KB of JSON), against
parsing alone, for a flat schema and a nested one (an array of 40 objects, each with an
enum, a pattern and a number range), valid answers and answers that miss the schema.

    .venv/bin/python benchmarks/bench_structured.py --answers 20000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import orjson
from common import print_machine, print_table

from orchestrator.items.structured import check, response_format_for

FLAT = {
    "type": "object",
    "properties": {"sim": {"type": "string"}, "text": {"type": "string"}},
    "required": ["sim", "text"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["think", "call", "answer"]},
                    "id": {"type": "string", "pattern": "^s[0-9]+$"},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "text": {"type": "string"},
                },
                "required": ["kind", "id", "score", "text"],
            },
        }
    },
    "required": ["steps"],
}


def answers(n: int) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Per case: the format, and ``n`` answers of about 4 KB (1,000 tokens)."""
    words = " ".join(f"w{i}" for i in range(1300))
    flat = [orjson.dumps({"sim": f"d{i}", "text": words}).decode() for i in range(n)]
    step = {"kind": "call", "score": 0.5, "text": " ".join(f"t{j}" for j in range(14))}
    nested = [
        orjson.dumps({"steps": [{**step, "id": f"s{i}{j}"} for j in range(40)]}).decode()
        for i in range(n)
    ]
    missing = [a.replace('"text"', '"words"') for a in flat]
    return {
        "flat schema, valid": (response_format_for(FLAT, source="bench"), flat),
        "flat schema, mismatch": (response_format_for(FLAT, source="bench"), missing),
        "nested schema, valid": (response_format_for(NESTED, source="bench"), nested),
        "json_object, valid": ({"type": "json_object"}, flat),
    }


def per_answer(fn: Callable[[str], object], texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        fn(text)
    return (time.perf_counter() - start) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answers", type=int, default=20000)
    args = parser.parse_args()
    print_machine()
    rows = []
    for name, (fmt, texts) in answers(args.answers).items():
        check(texts[0], fmt)  # the validator is compiled once per schema
        parse = per_answer(orjson.loads, texts)
        checked = per_answer(lambda t, f=fmt: check(t, f), texts)
        size = sum(map(len, texts)) / len(texts)
        rows.append(
            [name, f"{size / 1024:.1f} KB", f"{parse * 1e6:.0f} µs", f"{checked * 1e6:.0f} µs"]
        )
    print_table(["answers", "size", "orjson.loads", "check (parse + validate)"], rows)


if __name__ == "__main__":
    main()
