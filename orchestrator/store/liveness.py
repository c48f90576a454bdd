"""Whether each worker is alive and working, from its row alone.

The ``workers`` table holds what each worker wrote at its latest heartbeat: its requests
in flight and answers. A worker that died without a word (``kill -9``) leaves its row as
it was: on this host that is known at once (its pid gone, or reused by a process that
started later: ``procinfo``, as the reaper tells); on another host it shows as silent
once its heartbeat is older than ``SILENT_AFTER``. Plain Python over the row, for the
sqlite3 path of ``status`` as much as for the store's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator._util import procinfo

# A worker that has not written a heartbeat for this long is reported as silent.
SILENT_AFTER = 120.0
# A live worker with requests in flight that has committed no answer for this long is
# reported as stalled (a hung server, requests stuck behind a full queue).
STALLED_AFTER = 900.0

COLUMNS = "id, host, pid, started_at, heartbeat_at, stopped_at, in_flight, completed, progress_at"


def worker(row: Sequence[Any], now: float) -> dict[str, Any]:
    """A worker's entry in the status document (``docs/STATUS.md``)."""
    (worker_id, host, pid, started, beat, stopped_at, in_flight, completed, progress_at) = row
    age = now - beat
    dead = stopped_at is None and procinfo.is_dead_local(worker_id)
    silent = stopped_at is None and not dead and age > SILENT_AFTER
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
    }


def is_live(entry: dict[str, Any]) -> bool:
    """Whether a worker's entry is of one running and heard from lately."""
    return not (entry["stopped"] or entry["dead"] or entry["silent"])
