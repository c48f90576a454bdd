"""The worker: claims items, calls inference servers, and writes what became of each.

* ``loop``: the ``Worker`` — claim, call, classify, hand to the committer;
* ``claim``: the held leases, the prefetch, how much to claim and when to start it;
* ``call``: one item's call, turn by turn, and what its answer or error means;
* ``gate``: the run guard between the calls and the committer;
* ``stop``: the drain at the end of a run;
* ``committer``: the one writer, a single fenced transaction per round;
* ``outcomes``: what became of an attempt, one type per kind;
* ``classify``: from an answer or an error to an outcome (pure);
* ``keeper``: lease renewal, heartbeats, reaping, samples;
* ``config``: ``WorkerConfig``, ``WorkerStats``.

It composes the queue (``orchestrator.store``) and the inference client
(``orchestrator.inference.client``) and owns neither's details.
"""

from __future__ import annotations

from orchestrator.worker.config import WorkerConfig, WorkerStats, backoff_delay
from orchestrator.worker.loop import Worker

__all__ = ["Worker", "WorkerConfig", "WorkerStats", "backoff_delay"]
