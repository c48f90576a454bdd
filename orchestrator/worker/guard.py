"""What keeps one wrong setting from failing a whole queue: the worker's run guard.

Three checks, before and while items are spent:

* each server's ``/v1/models`` when it first answers: a 401 or 403 there is a wrong key,
  and the run stops before any item is claimed; the list names what the server serves;
* one *trial* item per dataset: until a dataset has had an answer in this run, only one
  of its items is in flight at a time, so a model name or parameter the server refuses
  costs a few requests, not thousands. The trial takes an item never put back before
  when there is one, not one the breaker held in an earlier run. A trial request in
  flight ``trial_seconds`` without a refusal opens its dataset too: servers refuse a
  request before they queue it, and one long answer must not hold the run back;
* the circuit breaker (``orchestrator.worker.breaker``): rejections that may be run-level are
  held until an answer or a run of them decides; when it trips, the run stops, the held
  items get their attempts back, and one line says which server, which status, the
  server's words and what to check. An item held when an earlier run stopped (its last
  error, kept by the store, says so) that is refused the same way again fails alone:
  the refusal is its own, or the trial's fresh items would have tripped the breaker
  first.

The worker owns the leases and the writes; this module only decides.
"""

from __future__ import annotations

import re
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from orchestrator._util.urls import refused_advice
from orchestrator.errors import RunHalted
from orchestrator.inference.probes import Models
from orchestrator.store import Failure, Lease
from orchestrator.store.datasets import DatasetInfo
from orchestrator.worker.breaker import Breaker, Trip, cause

log = structlog.get_logger("orchestrator.worker.guard")

#: Seconds with nothing in flight (and no claim being written) after which held
#: rejections are decided as the items' own: no more evidence is coming.
QUIET_SECONDS = 1.0


@dataclass(slots=True)
class Held:
    """A rejection waiting for the breaker: the lease (still ours) and its failure."""

    lease: Lease
    failure: Failure


@dataclass(slots=True)
class RunGuard:
    """Trial items per dataset, served models per server, and the circuit breaker."""

    threshold: int = 5
    #: Seconds a trial request in flight without a refusal counts as accepted.
    trial_seconds: float = 2.0
    #: The credentials each server is sent (``urls.credentials_sent``): what a 401 or
    #: 403 tells to check.
    credentials: Mapping[str, str] = field(default_factory=dict)
    breaker: Breaker[Held] = field(init=False)
    halted: RunHalted | None = None
    served: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Server -> model -> its context length, as its ``/v1/models`` says.
    contexts: dict[str, dict[str, int]] = field(default_factory=dict)
    _vetted: set[int] = field(default_factory=set)
    _trying: dict[int, tuple[int, float]] = field(default_factory=dict)  # dataset -> item, since
    _retry_at: dict[int, float] = field(default_factory=dict)  # dataset -> next look
    _quiet_since: float | None = None

    def __post_init__(self) -> None:
        self.breaker = Breaker(self.threshold)

    # ------------------------------------------------------------------ servers

    def check_models(
        self, server: str, found: Models, datasets: Iterable[DatasetInfo]
    ) -> RunHalted | None:
        """Judge a server's ``/v1/models``: a refused key stops the run; a model it does
        not list is noted (some servers answer to any name: the trial item tells)."""
        if found.status in (401, 403):
            advice = refused_advice(self.credentials.get(server, "api_key"), found.status)
            return RunHalted(
                f"server {server} answered HTTP {found.status} on /v1/models: "
                f"{found.reason or 'no reason given'}; {advice}"
            )
        if found.status != 200:
            log.info(
                "server_models_unknown", server=server, status=found.status, reason=found.reason
            )
            return None
        self.served[server] = found.names
        self.contexts[server] = found.contexts
        unlisted: dict[str, list[str]] = {}
        for info in datasets:
            model = info.params.get("model")
            if model is not None and model not in found.names:
                unlisted.setdefault(model, []).append(info.name)
        for model, names in unlisted.items():
            log.info(
                "model_not_listed",
                server=server,
                model=model,
                datasets=names,
                served=list(found.names),
                note="the first request of each dataset tells whether the server answers to it",
            )
        return None

    def context_of(self, server: str, model: Any) -> int | None:
        """The context length ``server`` said ``model`` has (its only model's, when
        the request names none it lists), or None: unknown."""
        known = self.contexts.get(server) or {}
        if isinstance(model, str) and model in known:
            return known[model]
        return next(iter(known.values())) if len(known) == 1 else None

    # ------------------------------------------------------------------ trials

    def trial(
        self, scope: Sequence[DatasetInfo], held: Container[int], now: float
    ) -> DatasetInfo | None:
        """The next dataset that needs a trial item claimed, if any; a trial in flight
        long enough without a refusal opens its dataset."""
        for info in scope:
            if info.id in self._vetted or now < self._retry_at.get(info.id, 0.0):
                continue
            trying = self._trying.get(info.id)
            if trying is not None and trying[0] in held:
                if now - trying[1] >= self.trial_seconds:
                    self._vetted.add(info.id)
                continue
            return info
        return None

    def trial_claimed(
        self, dataset_id: int, leases: Sequence[Lease], now: float, retry_at: float
    ) -> None:
        if leases:
            self._trying[dataset_id] = (leases[0].item_id, now)
        else:
            self._trying.pop(dataset_id, None)
            self._retry_at[dataset_id] = retry_at

    def open_names(self, scope: Sequence[DatasetInfo]) -> tuple[str, ...] | None:
        """Datasets claimed in full: those with an answer in this run. None: all of
        ``scope`` is open (claim as the worker's options say)."""
        if all(info.id in self._vetted for info in scope):
            return None
        return tuple(info.name for info in scope if info.id in self._vetted)

    def answered(self, server: str, dataset_id: int, settings: str | None) -> list[Held]:
        """An answer: the dataset is open, and what was held for it and its settings
        there failed on its own (the returned items are to be failed)."""
        self._vetted.add(dataset_id)
        self._trying.pop(dataset_id, None)
        return self.breaker.answered(server, (dataset_id, settings))

    def settled(self, dataset_id: int, kind: str) -> None:
        """Another outcome of an item: an error the item earned alone (fail, retry) also
        says the dataset's setting is accepted; a release (an outage) says nothing."""
        if kind in ("fail", "retry"):
            self._vetted.add(dataset_id)
        self._trying.pop(dataset_id, None)

    # ------------------------------------------------------------------ breaker

    def sent(self, item_id: int, dataset_id: int, settings: str) -> None:
        """An item's request is out, asked with these settings (the params' hash)."""
        self.breaker.sent(item_id, (dataset_id, settings))

    def returned(self, item_id: int) -> None:
        """An item's request came back, its outcome already offered."""
        self.breaker.back(item_id)

    def rejected(self, server: str, entry: Held, message: str, settings: str) -> bool:
        """A rejection that may be run-level. True: hold it (or, tripped, release it)."""
        lease, failure = entry.lease, entry.failure
        self._trying.pop(lease.dataset_id, None)
        if self.breaker.tripped is not None:
            return True
        if _refused_again(lease.last_failure, failure):
            log.info(
                "refused_again",
                **lease.log_fields,
                error_class=failure.error_class,
                note="held when an earlier run stopped, refused the same way again: its own",
            )
            return False
        return self.breaker.rejected(
            server,
            (lease.dataset_id, settings),
            lease.item_id,
            failure.error_class,
            message,
            entry,
        )

    def trip(self, dataset_names: dict[int, str]) -> RunHalted | None:
        """The breaker's one line, once, when it has just tripped."""
        trip = self.breaker.tripped
        if trip is None or self.halted is not None:
            return None
        self.halted = RunHalted(_trip_line(trip, dataset_names, self.served, self.credentials))
        return self.halted

    def quiet(self, busy: bool, now: float) -> list[Held]:
        """Held rejections to fail because nothing else is in flight to decide them."""
        if busy or not len(self.breaker) or self.breaker.tripped is not None:
            self._quiet_since = None
            return []
        if self._quiet_since is None:
            self._quiet_since = now
            return []
        if now - self._quiet_since < QUIET_SECONDS:
            return []
        self._quiet_since = None
        return self.breaker.take_all()


def _refused_again(before: Failure | None, now: Failure) -> bool:
    """Whether a refusal is the one the item was put back with (held when an earlier
    run stopped): both are compared as the store keeps them, with the item's turn."""
    if before is None or before.error_class != now.error_class:
        return False
    found = cause(before.error_class, before.message)
    return found is not None and found == cause(now.error_class, now.message)


#: The client's words for a redirect: ``HTTP 301 redirect to LOCATION: ...``.
_REDIRECT = re.compile(r"HTTP (\d{3}) redirect to (\S+?):? redirects are not followed")


def _answered(trip: Trip) -> str:
    """What the server answered, as the line says it: ``HTTP 400 'its words'``, or
    ``HTTP 301 (a redirect to LOCATION)``."""
    if trip.error_class == "redirect":
        found = _REDIRECT.match(trip.message)
        if found is None:
            return f"a redirect ({trip.message})"
        return f"HTTP {found[1]} (a redirect to {found[2]})"
    status = trip.error_class.removeprefix("http_")
    said = trip.message.removeprefix(f"HTTP {status}").removeprefix(":").strip()
    return f"HTTP {status} {said!r}" if said else f"HTTP {status}"


def _trip_line(
    trip: Trip,
    dataset_names: dict[int, str],
    served: dict[str, tuple[str, ...]],
    sent: Mapping[str, str],
) -> str:
    names = list(dict.fromkeys(_name(d, dataset_names) for d in trip.datasets))
    which = (
        f"dataset {names[0]!r}"
        if len(names) == 1
        else "datasets " + ", ".join(repr(name) for name in names)
    )
    advice = trip.advice
    if trip.error_class in ("http_401", "http_403"):
        status = int(trip.error_class.removeprefix("http_"))
        advice = refused_advice(sent.get(trip.server, "api_key"), status)
    if trip.error_class == "http_404" and served.get(trip.server):
        advice += f" (the server lists: {', '.join(served[trip.server])})"
    return (
        f"halted: server {trip.server} answered {_answered(trip)} to {trip.items} different "
        f"items of {which} in a row, with no answer in between; {advice}. No item was failed "
        "for it: fix the setting and run again."
    )


def _name(dataset: Hashable, dataset_names: dict[int, str]) -> str:
    dataset_id = dataset[0] if isinstance(dataset, tuple) else dataset
    return dataset_names.get(dataset_id, str(dataset_id))  # type: ignore[arg-type]
