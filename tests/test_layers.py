"""The package's dependency order: each module imports only from its own layer or below.

The order is the README's layout read from the bottom up. Lazy imports inside functions
count as much as those at the top: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "orchestrator"

# Lowest first. A module may import what stands in its own layer or any layer before it.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset(
        {
            "__version__",
            "aio",
            "answer",
            "atomicfile",
            "autoconcurrency",
            "breaker",
            "conversation",
            "draws",
            "error_classes",
            "errors",
            "eta",
            "http1",
            "lazy",
            "lengths",
            "logs",
            "overflow",
            "params",
            "procinfo",
            "stopsignals",
            "quality",
            "structured",
            "tokens",
            "urls",
        }
    ),
    frozenset({"store", "client"}),
    frozenset({"server_metrics", "formats", "checks", "cost", "metrics", "sim"}),
    frozenset({"servers", "runfile", "guard", "launch"}),
    frozenset({"worker"}),
    frozenset({"monitor"}),
    frozenset({"ops", "running", "enqueueing"}),
    frozenset({"api", "api_datasets", "demo"}),
    frozenset({"cli", "__init__", "__main__"}),
)


def _rank(name: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if name in layer:
            return rank
    raise AssertionError(f"orchestrator.{name} is in no layer of tests/test_layers.py")


def _unit(path: Path) -> str:
    """The top-level name a file belongs to: ``store`` for store/queue.py."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported(tree: ast.AST) -> set[str]:
    """Top-level orchestrator names a module imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "orchestrator":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("orchestrator."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("orchestrator."):
                    found.add(alias.name.split(".")[1])
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    unit = _unit(path)
    rank = _rank(unit)
    upward = sorted(
        name
        for name in _imported(ast.parse(path.read_text(encoding="utf-8")))
        if name != unit and _rank(name) > rank
    )
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}, which stand above it"


def test_the_store_knows_nothing_of_http_or_run_files() -> None:
    """The named rules of the layout, spelled out so a reshuffle of LAYERS cannot drop them."""
    for unit, banned in {
        "store": {"client", "runfile", "eta", "monitor", "worker", "servers", "formats"},
        "servers": {"monitor", "worker"},
        "worker": {"monitor", "running", "api", "cli"},
        "client": {"store", "worker", "servers", "monitor"},
    }.items():
        files = [PACKAGE / f"{unit}.py"] if (PACKAGE / f"{unit}.py").exists() else []
        files += sorted((PACKAGE / unit).rglob("*.py")) if (PACKAGE / unit).is_dir() else []
        assert files, unit
        for path in files:
            wrong = _imported(ast.parse(path.read_text(encoding="utf-8"))) & banned
            assert not wrong, f"{path.relative_to(PACKAGE)} imports {sorted(wrong)}"


def test_only_the_inference_client_speaks_http1() -> None:
    """The lean HTTP/1.1 path is the client's transport, not a second client."""
    users = sorted(
        str(path.relative_to(PACKAGE))
        for path in _sources()
        if "http1" in _imported(ast.parse(path.read_text(encoding="utf-8")))
    )
    assert users == ["client.py"]
