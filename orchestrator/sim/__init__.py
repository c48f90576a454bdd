"""Simulated OpenAI-compatible inference server and sample data, for tests and rehearsals.

Names are imported on first use: that keeps ``import orchestrator.sim`` cheap and lets
``python -m orchestrator.sim.server`` run without the module being imported twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.sim.config import (
        REASONING_FIELDS,
        REASONING_MODES,
        SimConfig,
        parse_fault,
        parse_outage,
        parse_refusal,
    )
    from orchestrator.sim.generation import answer_matches, json_answer_kind, request_digest
    from orchestrator.sim.sample import write_sample
    from orchestrator.sim.server import build_app, run_forever, serve

__all__ = [
    "REASONING_FIELDS",
    "REASONING_MODES",
    "SimConfig",
    "answer_matches",
    "build_app",
    "json_answer_kind",
    "parse_fault",
    "parse_outage",
    "parse_refusal",
    "request_digest",
    "run_forever",
    "serve",
    "write_sample",
]

_HOMES = {name: "orchestrator.sim.server" for name in __all__}
_HOMES["write_sample"] = "orchestrator.sim.sample"
_GENERATION = ("answer_matches", "json_answer_kind", "request_digest")
_HOMES.update(dict.fromkeys(_GENERATION, "orchestrator.sim.generation"))
_CONFIG = (
    "REASONING_FIELDS",
    "REASONING_MODES",
    "SimConfig",
    "parse_fault",
    "parse_outage",
    "parse_refusal",
)
_HOMES.update(dict.fromkeys(_CONFIG, "orchestrator.sim.config"))


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
