"""Simulated agentic traces: software-engineering trajectories of tool calls, results and
a final answer, as an agent framework records them.

The simulated server calls the first tool offered (``bash``) on a fraction of requests
(``tool_call_rate``) and answers in words otherwise, so a regenerated turn rarely makes
the calls the recorded one made: what ``regenerate = "all"`` stops at and ``"each"``
does not. Every trace is fixed by its index and seed, for tests and benchmarks alike.
"""

from __future__ import annotations

import random
from typing import Any

TOOLS: tuple[str, ...] = ("bash", "read_file", "edit_file", "run_tests")
"""The tools a trace offers, in order: the simulated server calls the first."""


def swe_trace(index: int, seed: int = 0, steps: tuple[int, int] = (2, 6)) -> dict[str, Any]:
    """A trace keyed ``swe<index>``: a task, ``steps`` (a range) assistant turns that call
    one or two tools, each call answered by its result, then a final answer in words."""
    rng = random.Random(f"{seed}:{index}")
    key = f"swe{index:04d}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a software engineer. Use the tools."},
        {"role": "user", "content": f"{key}: the test suite fails on issue {index}; fix it."},
    ]
    calls = 0
    for step in range(rng.randint(*steps)):
        names = [rng.choice(TOOLS) for _ in range(1 if rng.random() < 0.8 else 2)]
        ids = [f"call_{key}_{calls + n}" for n in range(len(names))]
        calls += len(names)
        messages.append(
            {
                "role": "assistant",
                "content": f"Step {step}: looking into it." if rng.random() < 0.5 else None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": f'{{"step": {step}}}'},
                    }
                    for call_id, name in zip(ids, names, strict=True)
                ],
            }
        )
        for call_id, name in zip(ids, names, strict=True):
            result = f"{name} output for {key} step {step}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    messages.append({"role": "assistant", "content": f"Fixed {key}: the tests pass."})
    return {
        "id": key,
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {"name": name, "parameters": {"type": "object"}},
            }
            for name in TOOLS
        ],
    }


def swe_traces(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` traces, ``swe_trace(0 .. count - 1)``."""
    return [swe_trace(index, seed) for index in range(count)]
