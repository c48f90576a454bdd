"""Whether each worker is alive and working, from its row alone.

The ``workers`` table holds what each worker wrote at its latest heartbeat: its requests
in flight, answers and servers (how many it reaches, those down and why). A worker that
died without a word (``kill -9``) leaves its row as it was: on this host that is known
at once (its pid gone, or reused by a process that started later: ``procinfo``, as the
reaper tells); on another host it shows as silent once its heartbeat is older than
``SILENT_AFTER`` or its lease, and as presumed dead past its lease (its items are then
taken back by the others). Plain Python over the row, for the sqlite3 path of
``status`` as much as for the store's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from orchestrator._util import procinfo

# A worker that has not written a heartbeat for this long is reported as silent.
SILENT_AFTER = 120.0
# A live worker with requests in flight that has committed no answer for this long is
# reported as stalled (a hung server, requests stuck behind a full queue).
STALLED_AFTER = 900.0

COLUMNS = (
    "id, host, pid, started_at, heartbeat_at, stopped_at, in_flight, completed, progress_at,"
    " lease_seconds, servers, servers_up, servers_down, unreachable_since"
)


def worker(row: Sequence[Any], now: float) -> dict[str, Any]:
    """A worker's entry in the status document (``docs/STATUS.md``)."""
    (worker_id, host, pid, started, beat, stopped_at, in_flight, completed, progress_at) = row[:9]
    lease, servers, servers_up, servers_down, unreachable_since = row[9:]
    age = now - beat
    dead = stopped_at is None and procinfo.is_dead_local(worker_id)
    expired = age > (lease or SILENT_AFTER)
    silent = stopped_at is None and not dead and (age > SILENT_AFTER or expired)
    live = stopped_at is None and not dead and not silent
    return {
        "id": worker_id,
        "host": host,
        "pid": pid,
        "started_at": started,
        "heartbeat_age_s": round(age, 1),
        "stopped": stopped_at is not None,
        "dead": dead,
        "silent": silent,
        "in_flight": in_flight,
        "completed": completed,
        "progress_age_s": None if progress_at is None else round(now - progress_at, 1),
        "stalled": live
        and in_flight > 0
        and progress_at is not None
        and now - progress_at > STALLED_AFTER,
        "lease_seconds": lease,
        "presumed_dead": silent and expired,
        "servers": servers,
        "servers_up": servers_up,
        "servers_down": _down(servers_down),
        "unreachable_since": unreachable_since,
        "waiting_for_server": live and bool(servers) and servers_up == 0,
    }


def _down(text: str | None) -> list[dict[str, Any]]:
    """The servers a worker found down, as it wrote them ([] when it wrote none)."""
    try:
        found = json.loads(text) if text else []
    except ValueError:
        return []
    return [d for d in found if isinstance(d, dict)] if isinstance(found, list) else []


def is_live(entry: dict[str, Any]) -> bool:
    """Whether a worker's entry is of one running and heard from lately."""
    return not (entry["stopped"] or entry["dead"] or entry["silent"])


def outage(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's view of its servers, for the totals: whether every live worker waits
    for one, since when none is reachable (the last of the workers to lose theirs),
    and each server down with the freshest word on why and the earliest since when."""
    live = [w for w in workers if is_live(w)]
    waiting = bool(live) and all(w["waiting_for_server"] for w in live)
    down: dict[str, dict[str, Any]] = {}
    for w in sorted(live, key=lambda w: -w["heartbeat_age_s"]):  # the freshest word last
        for d in w["servers_down"]:
            seen = down.get(d.get("server")) or {}
            since = [t for t in (d.get("since"), seen.get("since")) if t]
            down[d.get("server")] = {**d, "since": min(since, default=None)}
    since = [w["unreachable_since"] for w in live if w["unreachable_since"]]
    return {
        "waiting_for_server": waiting,
        "unreachable_since": max(since, default=None) if waiting else None,
        "servers_down": sorted(down.values(), key=lambda d: str(d.get("server"))),
    }
