"""The project as a newcomer gets it: every package installed, lint clean."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_for_installation() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "orchestrator").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    on_disk |= {"orchestrator.migrations", "orchestrator.migrations.versions"}
    assert on_disk == listed


def test_ruff_is_clean() -> None:
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "orchestrator", "tests", "migrations"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert f"```sh\n{ci}\n```" in readme
    assert "scripts/llama_server.py" in ci  # the real-server tier is built when missing
