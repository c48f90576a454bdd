"""The package's architecture, read from its imports: layers that point down, no circles.

Every import counts: at the top of a module, inside a function (kept there for start-up
time or an optional dependency), and under ``TYPE_CHECKING`` for the direction of the
layers; an import inside a function says why it is not at the top (the end of this file).
An import names the module it reaches, so ``from orchestrator.store import queue`` is an
edge to ``store/queue.py`` and ``from orchestrator.store import Queue`` an edge to
``store/__init__.py``. The failures name the importing line.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "orchestrator"

# The units of the package, lowest first: a module may import its own unit and any unit
# before it. docs/ARCHITECTURE.md draws the same picture.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_util", "errors", "logs"),  # no domain knowledge
    ("items",),  # what an item is made of: request, samples, answer, tokens, flags
    ("settings",),  # what an option may be, once; the choices; prices
    ("store",),  # the durable queue: schema, claims, write rounds, reads
    ("formats",),  # readers (file -> rows) and writers (rows -> file)
    ("runfile",),  # run files: datasets and settings in one TOML
    ("inference",),  # everything that talks to servers; launch/ beneath it
    ("sim",),  # the simulated server
    ("worker",),  # the loop composing store and inference, and its policies
    ("monitor",),  # status, ETA, live line, dashboard, report
    ("ops",),  # doctor, systemd, Slurm
    ("api",),  # the Python API: the one composition of the above
    ("cli", "__init__", "__main__"),  # the command line and the package's names
)


def _rank(unit: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if unit in layer:
            return rank
    raise AssertionError(f"orchestrator/{unit} is in no layer of tests/test_layers.py")


@dataclass(frozen=True)
class Edge:
    source: str  # dotted module names
    target: str
    line: int
    typing_only: bool

    def where(self) -> str:
        path = module_path(self.source).relative_to(PACKAGE.parent)
        return f"{path}:{self.line} imports {self.target}"


def module_path(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    package = PACKAGE / rel / "__init__.py"
    return package if package.exists() else (PACKAGE / rel).with_suffix(".py")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()


def unit(name: str) -> str:
    """``store`` for ``orchestrator.store.queue``; ``api`` for ``orchestrator.api``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _typing_blocks(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:``."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return ids


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "orchestrator":
                yield _known(alias.name)
        return
    base = node.module or ""
    if node.level:
        here = name.split(".")
        if MODULES[name].name != "__init__.py":
            here = here[:-1]
        base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "orchestrator":
        return
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else _known(base)


def _known(name: str) -> str:
    parts = name.split(".")
    while ".".join(parts) not in MODULES:
        parts.pop()
        assert parts, name
    return ".".join(parts)


def edges() -> list[Edge]:
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing = _typing_blocks(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(name, node):
                    if target != name:
                        found.append(Edge(name, target, node.lineno, id(node) in typing))
    return found


EDGES = edges()


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: n.removeprefix("orchestrator."))
def test_imports_point_down(name: str) -> None:
    rank = _rank(unit(name))
    upward = sorted({e.where() for e in EDGES if e.source == name and _rank(unit(e.target)) > rank})
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_files() -> None:
    """Imports made at run time (also inside functions) form no circle: each file can
    be read knowing only what it imports."""
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        if not e.typing_only:
            graph.setdefault(e.source, set()).add(e.target)
    report = []
    for component in _circles(graph):
        inside = set(component)
        report.append(
            " <-> ".join(c.removeprefix("orchestrator.") for c in component)
            + "".join(
                sorted(
                    {
                        f"\n    {e.where()}"
                        for e in EDGES
                        if e.source in inside and e.target in inside and not e.typing_only
                    }
                )
            )
        )
    assert not report, "import circles:\n" + "\n".join(report)


def test_the_test_sees_imports_inside_functions() -> None:
    """The reader of imports is itself checked: an import inside a function is an edge."""
    lazy = [e for e in EDGES if e.source == "orchestrator.api" and not e.typing_only]
    assert lazy, "no edge read from orchestrator/api/__init__.py"
    tree = ast.parse("def f():\n    from orchestrator.store import queue\n")
    node = tree.body[0].body[0]  # type: ignore[attr-defined]
    assert list(_targets("orchestrator.api", node)) == ["orchestrator.store.queue"]


def test_the_store_knows_nothing_of_http_or_run_files() -> None:
    """The named rules of the layout, spelled out so a reshuffle of LAYERS cannot drop them."""
    banned = {
        "store": {"inference", "runfile", "monitor", "worker", "formats"},
        "inference": {"monitor", "worker", "store", "api", "cli"},
        "worker": {"monitor", "api", "cli", "ops"},
        "formats": {"inference", "worker", "monitor", "runfile"},
    }
    wrong = [e.where() for e in EDGES if unit(e.target) in banned.get(unit(e.source), ())]
    assert not wrong, "\n".join(wrong)


def test_only_the_inference_client_speaks_http1() -> None:
    """The lean HTTP/1.1 path is the client's transport, not a second client."""
    users = sorted({e.source for e in EDGES if e.target == "orchestrator.inference.http1"})
    assert all(u.startswith("orchestrator.inference.client") for u in users), users


def test_the_top_of_the_package_is_its_public_surface() -> None:
    """Few loose modules: the rest lives in the package named for its concern."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "logs.py"], loose


# Third-party modules an import inside a function may name without saying why: slow to
# load, or not always installed. Anything else imported inside a function is either in
# the command line's start-up code or carries "# lazy: <reason>" on its line: the heavy
# module it keeps off a fast path (sqlalchemy, asyncio, aiohttp, pyarrow), or start-up.
LAZY_MODULES = {
    "alembic": "heavy",
    "datasets": "optional",
    "jsonschema": "heavy",
    "jsonschema_specifications": "heavy",
    "prometheus_client": "heavy",
    "pyarrow": "heavy",
    "referencing": "heavy",
    "sqlalchemy": "heavy",
    "structlog": "heavy",
    "uvloop": "optional",
}
# The command line imports what a command needs inside the command: --help stays fast.
START_UP = ("orchestrator/cli/", "orchestrator/__init__.py", "orchestrator/__main__.py")
_LAZY = re.compile(r"#\s*lazy:(.*)")


@functools.cache
def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _imported_top(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        return {"orchestrator" if node.level else (node.module or "").split(".")[0]}
    return {alias.name.split(".")[0] for alias in node.names}


def unexplained_lazy_imports(source: str, path: str) -> list[str]:
    """``path:line`` of each import inside a function in ``source`` that names a module
    outside LAZY_MODULES, outside START_UP, without a non-empty ``# lazy: <reason>``."""
    if path.startswith(START_UP):
        return []
    lines = source.splitlines()  # an import statement holds no string: a "#" opens a comment
    wrong = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if _imported_top(node) <= LAZY_MODULES.keys():
                continue
            reasons = [
                match.group(1).strip()
                for line in range(node.lineno, node.end_lineno + 1)
                if (match := _LAZY.search(lines[line - 1]))
            ]
            if not any(reasons):
                what = "empty '# lazy:' reason" if reasons else "no '# lazy: <reason>'"
                wrong.append(f"{path}:{node.lineno} {ast.unparse(node)} ({what})")
    return sorted(set(wrong), key=lambda w: int(w.split(":")[1].split()[0]))


def test_imports_inside_functions_say_why() -> None:
    """An import belongs at the top of its module. Inside a function only for start-up
    time (the command line; a fast path that must not load a heavy module) or for a
    heavy or optional third-party module (LAZY_MODULES)."""
    wrong = []
    for path in MODULES.values():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        wrong += unexplained_lazy_imports(_source(path), rel)
    assert not wrong, (
        "imports inside functions: move to the top of the module, or end the line with "
        "'# lazy: <reason>':\n" + "\n".join(wrong)
    )


def test_the_lazy_import_check_catches_what_it_should() -> None:
    """The check is itself checked, so that it cannot pass by seeing nothing."""
    source = (
        "import os\n"
        "def f():\n"
        "    import pyarrow.csv as pcsv\n"
        "    from sqlalchemy import text\n"
        "    from orchestrator.store import engine  # lazy: sqlalchemy\n"
        "    from orchestrator.store import queue\n"
        "    import json  # lazy:\n"
        "    if os.environ:\n"
        "        from . import sibling\n"
        "async def g():\n"
        "    from orchestrator.store.reader import (  # lazy: start-up\n"
        "        connect,\n"
        "    )\n"
        "    import pyarrow, shlex\n"
    )
    assert unexplained_lazy_imports(source, "orchestrator/store/x.py") == [
        "orchestrator/store/x.py:6 from orchestrator.store import queue (no '# lazy: <reason>')",
        "orchestrator/store/x.py:7 import json (empty '# lazy:' reason)",
        "orchestrator/store/x.py:9 from . import sibling (no '# lazy: <reason>')",
        "orchestrator/store/x.py:14 import pyarrow, shlex (no '# lazy: <reason>')",
    ]
    assert unexplained_lazy_imports(source, "orchestrator/cli/x.py") == []


def test_the_lazy_modules_are_all_still_imported_lazily() -> None:
    """The list stays short: a module no function imports any more leaves it."""
    named: set[str] = set()
    for path in MODULES.values():
        for func in ast.walk(ast.parse(_source(path))):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(func):
                    if isinstance(node, ast.Import | ast.ImportFrom):
                        named |= _imported_top(node)
    assert sorted(LAZY_MODULES.keys() - named) == []
