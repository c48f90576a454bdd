"""Figures of the reliability scenarios.

Each scenario fills a ``figures`` dict; it is printed, and appended as a JSON line to
the file named by ``ORCHESTRATOR_CHAOS_REPORT`` when that is set, which is how the table
in docs/RELIABILITY.md is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    found = {"scenario": request.node.name, **found}
    print(json.dumps(found))
    target = os.environ.get("ORCHESTRATOR_CHAOS_REPORT")
    if target:
        with open(target, "a") as fh:
            fh.write(json.dumps(found) + "\n")
