"""The run guard between the calls and the committer (``orchestrator.worker.guard``).

A rejection that may be run-level (a bad model name, a wrong request shape) is held
until an answer or a run of rejections decides: failed alone, or released when the
breaker trips and the run halts. Each server's ``/v1/models`` is checked once, before its
first request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.errors import RunStopped
from orchestrator.inference import probes
from orchestrator.inference.client import InferenceClient
from orchestrator.store import Lease, Output
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker.claim import Catalog
from orchestrator.worker.committer import Committer
from orchestrator.worker.guard import Held, RunGuard
from orchestrator.worker.outcomes import Done, Failed, Outcome, Rejected, Release


@dataclass(slots=True)
class Gate:
    """Lets outcomes through to the committer, holding rejections the breaker decides;
    ``halt`` stops the run for a reason the operator must act on."""

    guard: RunGuard
    committer: Committer
    catalog: Catalog
    client: InferenceClient
    halt: Callable[[RunStopped], None]

    def started(self, lease: Lease, info: DatasetInfo) -> None:
        """An item's request goes out with these settings: evidence on its way."""
        self.guard.sent(lease.item_id, lease.dataset_id, info.params_hash)

    def passes(self, item_id: int, outcome: Outcome | None) -> bool:
        """Whether an item's outcome goes to the committer now (a rejection is the
        gate's; None: the item ended without one). Its request is back after this."""
        if isinstance(outcome, Rejected):
            self._rejected(outcome)
        elif isinstance(outcome, Done):
            self.answered(outcome.output.server, outcome.lease.dataset_id, outcome.output)
        elif outcome is not None:
            self.guard.settled(outcome.lease.dataset_id, outcome.kind)
        self.guard.returned(item_id)
        self._halt_if_tripped()
        return outcome is not None and not isinstance(outcome, Rejected)

    def answered(self, server: str, dataset_id: int, output: Output) -> None:
        """An answer: what was held for its dataset and settings there fails on its own."""
        for entry in self.guard.answered(server, dataset_id, output.params_hash):
            self.committer.submit(Failed(entry.lease, entry.failure))

    def quiet(self, busy: bool) -> None:
        """Nothing in flight for a while: held rejections are the items' own."""
        for entry in self.guard.quiet(busy, time.monotonic()):
            self.committer.submit(Failed(entry.lease, entry.failure))

    def release_held(self, *extra: Held) -> None:
        """Give the attempts back of every held rejection (tripped, or stopping)."""
        for entry in [*self.guard.breaker.take_all(), *extra]:
            self.committer.submit(Release(entry.lease, entry.failure, time.time()))

    async def vet(self, server: str) -> bool:
        """A server's ``/v1/models``, once, before its first request."""
        found = await probes.models(self.client.session, server, self.client.config.health_timeout)
        halted = self.guard.check_models(server, found, self.catalog.scope())
        if halted is not None:
            self.halt(halted)
            return False
        return True

    def _rejected(self, outcome: Rejected) -> None:
        """Held until the breaker decides: failed alone, or released when it trips."""
        entry = Held(outcome.lease, outcome.failure)
        was_tripped = self.guard.breaker.tripped is not None
        if not self.guard.rejected(outcome.server, entry, outcome.message, outcome.settings):
            self.committer.submit(Failed(outcome.lease, outcome.failure))
        elif was_tripped:
            self.release_held(entry)
        self.committer.poke()  # the slot is free: the next trial item may go

    def _halt_if_tripped(self) -> None:
        """The breaker has just tripped: the run halts, what it held goes back."""
        if self.guard.breaker.tripped is None or self.guard.halted is not None:
            return
        halted = self.guard.trip({d.id: d.name for d in self.catalog.infos.values()})
        if halted is not None:
            self.halt(halted)
        self.release_held()
