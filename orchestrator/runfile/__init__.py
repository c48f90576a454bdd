"""A whole run declared in one TOML file, checked as a whole before anything is queued.

A 30-hour run usually mixes a dozen prompt sets with their own limits and sampling; typed
out as a dozen ``enqueue`` commands, one typo is found only when its dataset is reached.
``load_run`` (``load``) reads the file, reports every problem at once (the config file,
the key path, the reason), and only then returns one ``DatasetPlan`` per dataset.
``plan_run`` (``plan``) then estimates requests, tokens, duration and database size from
the data files, without touching the database; ``render_plan`` and ``plan_json``
(``render``) show the estimate. docs/CONFIG.md has an annotated example.
"""

from __future__ import annotations

from orchestrator.runfile.load import (
    FORMATS,
    DatasetPlan,
    Problem,
    RunConfigError,
    load_prices,
    load_run,
)
from orchestrator.runfile.plan import (
    BYTES_PER_TOKEN,
    COMPLETION_FRACTION,
    ITEM_OVERHEAD_BYTES,
    OUTPUT_OVERHEAD_BYTES,
    DatasetEstimate,
    RunPlan,
    done_stats,
    overflow_counter,
    plan_run,
    plan_stored,
)
from orchestrator.runfile.render import plan_json, render_plan

__all__ = [
    "BYTES_PER_TOKEN",
    "COMPLETION_FRACTION",
    "FORMATS",
    "ITEM_OVERHEAD_BYTES",
    "OUTPUT_OVERHEAD_BYTES",
    "DatasetEstimate",
    "DatasetPlan",
    "Problem",
    "RunConfigError",
    "RunPlan",
    "done_stats",
    "load_prices",
    "load_run",
    "overflow_counter",
    "plan_json",
    "plan_run",
    "plan_stored",
    "render_plan",
]
