"""The names ``orchestrator`` exports are its stable Python API: this pins them, so that
one is added or removed on purpose (docs/API.md), never by a refactoring."""

from __future__ import annotations

import subprocess
import sys

import orchestrator

EXPORTED = {
    "ConfigError", "EnqueueReport", "ExportReport", "InputError", "ItemRecord", "ItemsFailed",
    "ItemsLeftPending", "OrchestratorError", "Queue", "RunOutcome", "RunStopped", "Status",
    "StorageError", "SyncQueue", "UndoReport", "WorkerStats", "__version__", "open", "open_sync",
}  # fmt: skip


def test_all_is_the_pinned_surface() -> None:
    assert set(orchestrator.__all__) == EXPORTED
    assert len(orchestrator.__all__) == len(EXPORTED)


def test_every_exported_name_resolves_to_a_public_object() -> None:
    for name in orchestrator.__all__:
        value = getattr(orchestrator, name)
        if name == "__version__":
            continue
        assert value.__module__.startswith("orchestrator."), name
        assert value.__doc__, f"{name} has no docstring"
        assert name in dir(orchestrator)


def test_errors_are_the_error_tree() -> None:
    from orchestrator import errors

    for name in ("ConfigError", "InputError", "StorageError", "RunStopped", "ItemsFailed"):
        assert getattr(orchestrator, name) is getattr(errors, name)
        assert issubclass(getattr(orchestrator, name), orchestrator.OrchestratorError)


def test_an_unknown_name_is_an_attribute_error() -> None:
    assert not hasattr(orchestrator, "enqueue_source")


def test_importing_the_package_loads_neither_sqlalchemy_nor_asyncio() -> None:
    """``orchestrator status`` on an SQLite file stays fast: the API's names load late."""
    code = (
        "import sys, orchestrator\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sqlalchemy', 'asyncio', 'aiohttp', 'structlog'))\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_py_typed_ships_with_the_package() -> None:
    import tomllib
    from pathlib import Path

    root = Path(orchestrator.__file__).parent
    assert (root / "py.typed").is_file()
    project = tomllib.loads((root.parent / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["orchestrator"]
