"""Package names loaded on first use.

``orchestrator`` and ``orchestrator.store`` name functions whose modules pull in
SQLAlchemy's asyncio layer; a command that never calls them (``status``, ``export`` and
``--help`` on an SQLite file) must not pay for the import. PEP 562's module
``__getattr__`` gives that, written here once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, sources: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``name`` comes from ``package.sources[name]``,
    imported when first asked for and then bound on the package."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{source}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
