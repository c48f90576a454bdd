"""Where launched servers' logs and state files are, and what those files say: read by
``status`` without loading the supervisor (nor asyncio)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from orchestrator._util import procinfo

#: Each worker's launched servers, in its own directory under the launch directory.
STATE_FILE = "servers.json"


def default_dir(db_path: str | None) -> Path:
    """Where launched servers' logs go: ``ORCHESTRATOR_LAUNCH_DIR``, else beside an
    SQLite database (``DB.servers/``), else ``~/.local/state/orchestrator/servers``."""
    env = os.environ.get("ORCHESTRATOR_LAUNCH_DIR")
    if env:
        return Path(env).expanduser()
    if db_path:
        return Path(db_path + ".servers")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "orchestrator" / "servers"


def read_states(base: Path) -> list[dict[str, Any]]:
    """The launched servers of the workers still running that wrote under ``base`` (a
    worker on another host counts as running until it says it stopped)."""
    found: list[dict[str, Any]] = []
    for path in sorted(base.glob(f"*/{STATE_FILE}")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("stopped"):
            continue
        if doc.get("host") == procinfo.hostname():
            owner = f"{doc['host']}:{doc.get('worker_pid')}:0"
            if procinfo.is_dead_local(owner):
                continue
        for server in doc.get("servers", []):
            found.append({**server, "host": doc.get("host"), "worker_pid": doc.get("worker_pid")})
    return found


#: Seconds a stopped worker's launch directory (its servers' logs) is kept.
KEEP_STOPPED = 7 * 86400


def forget_old(base: Path) -> None:
    """Remove the directories of workers that stopped over a week ago: a run started
    every day must not fill the disk with old servers' logs."""
    now = time.time()
    for path in base.glob(f"*/{STATE_FILE}"):
        try:
            doc = json.loads(path.read_text())
            old = doc.get("stopped") and now - float(doc.get("updated_at", now)) > KEEP_STOPPED
        except (OSError, ValueError, TypeError):
            continue
        if old:
            shutil.rmtree(path.parent, ignore_errors=True)
