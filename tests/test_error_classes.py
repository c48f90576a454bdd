"""The error classes users type into ``requeue --error-class``: the code's list and the
runbook's are the same, and every class the code assigns is on it."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.items import error_classes
from orchestrator.items.error_classes import ERROR_CLASSES
from orchestrator.store.leases import LEASE_LOST

ROOT = Path(__file__).resolve().parent.parent


def documented() -> list[str]:
    """The classes in docs/OPERATIONS.md's table, in its order."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text(encoding="utf-8")
    start = text.index("The error classes (")
    table = text[start:].split("\n\n", 2)[1]
    return re.findall(r"^\| `([a-zA-Z_]+)` \|", table, flags=re.MULTILINE)


def test_the_docs_list_is_the_code_list() -> None:
    assert documented() == list(ERROR_CLASSES)


def test_every_constant_is_listed_once() -> None:
    constants = [
        value
        for name, value in vars(error_classes).items()
        if name.isupper() and isinstance(value, str)
    ]
    assert sorted(constants) == sorted(ERROR_CLASSES)


def test_classes_assigned_in_the_code_are_listed() -> None:
    assert LEASE_LOST in ERROR_CLASSES
    assigned: set[str] = set()
    for path in (ROOT / "orchestrator").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        assigned.update(re.findall(r'error_class="([a-z_]+)"', source))
        assigned.update(re.findall(r'Failure\("([a-z_]+)"', source))
    assert assigned <= set(ERROR_CLASSES), assigned - set(ERROR_CLASSES)
