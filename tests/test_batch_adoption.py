"""A worker that dies between two steps of a batch, deterministically: the next one
adopts what the provider holds and pays for nothing twice (``worker.batches`` with a real
database and the simulated provider in process).

The death is a ``BaseException`` raised right after a call to the provider returned and
before its answer was written down: the window a SIGKILL would have to hit by luck.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import BatchUnanswered
from orchestrator.formats import iter_records
from orchestrator.inference.batchapi import BatchApi, BatchLimits
from orchestrator.inference.client import InferenceClient
from orchestrator.store import Database, DatasetSpec, Lease, Queue, enqueue
from orchestrator.store import batches as records
from orchestrator.worker.batches import Batches
from tests.conftest import StartSim
from tests.helpers import prompts, write_jsonl

LIMITS = BatchLimits(linger=0.1, poll_first=0.05, poll_max=0.2)


class Died(BaseException):
    """The worker's death, as far as the batch's task can tell."""


class DyingApi(BatchApi):
    """The provider's API, through which the worker dies just after ``step`` returned."""

    def __init__(self, client: InferenceClient, step: str) -> None:
        super().__init__(client)
        self.step = step
        self.died = asyncio.Event()

    def _die(self) -> None:
        self.died.set()
        raise Died

    async def upload(self, server: str, name: str, data: bytes) -> dict[str, Any]:
        done = await super().upload(server, name, data)
        if self.step == "upload":
            self._die()
        return done

    async def create(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        done = await super().create(*args, **kwargs)
        if self.step == "create":
            self._die()
        return done

    async def content(self, server: str, file_id: str) -> bytes:
        done = await super().content(server, file_id)
        if self.step == "download":
            self._die()
        return done


async def _stats(client: InferenceClient, url: str) -> dict[str, int]:
    async with client.session.get(url + "/sim/stats") as resp:
        return json.loads(await resp.read())["batch_api"]


async def _leases(database: Database, tmp_path: Path, n: int) -> list[Lease]:
    path = write_jsonl(tmp_path / "in.jsonl", prompts(n))
    await enqueue(database, DatasetSpec("d"), iter_records(path), path=str(path))  # type: ignore[arg-type]
    return await Queue(database).claim("w1", n, lease_seconds=60)


def _body(lease: Lease) -> dict[str, Any]:
    return {**lease.request, "model": "sim-model", "max_tokens": 8}


async def _started(database: Database, api: BatchApi, url: str, owner: str) -> Batches:
    """A worker's batches, for the server at ``url``, started as a run starts them."""
    batches = Batches(database, api, LIMITS, frozenset({url}), owner)
    await batches.start()
    return batches


async def _ask(batches: Batches, url: str, lease: Lease) -> Any:
    """As the worker asks: a request its batch did not answer goes again (released)."""
    while True:
        try:
            return await batches.ask(url, lease, _body(lease), "chat")
        except BatchUnanswered as exc:
            assert exc.released, exc
            batches.written(lease.item_id, True)


async def _ask_all(batches: Batches, url: str, leases: list[Lease]) -> list[Any]:
    return await asyncio.gather(*(_ask(batches, url, lease) for lease in leases))


@pytest.mark.parametrize("step", ["upload", "create", "download"])
async def test_a_worker_dead_after_a_step_leaves_its_batch_to_the_next(
    database: Database, tmp_path: Path, sim: StartSim, step: str
) -> None:
    url = await sim(batch_delay=0.3)
    leases = await _leases(database, tmp_path, 5)
    async with InferenceClient() as client:
        api = DyingApi(client, step)
        dying = await _started(database, api, url, "w1")
        asking = asyncio.ensure_future(_ask_all(dying, url, leases))
        await asyncio.wait_for(api.died.wait(), 60)
        await asyncio.sleep(0.1)
        assert not asking.done()
        asking.cancel()
        await dying.close()
        row = (await records.listing(database))[0]
        assert row.provider_id is None if step in ("upload", "create") else row.provider_id
        # The next life of the worker asks the same items.
        # A create whose answer w1 never wrote down is waited out for as long as the
        # call could take (here 1 s, plus a margin) before w2 looks for it.
        alive = await _started(database, BatchApi(client, request_seconds=1), url, "w2")
        answers = await _ask_all(alive, url, leases)
        await alive.close()
        stats = await _stats(client, url)
    assert [len(a) for a in answers] == [1] * 5
    assert stats["requests_submitted"] == 5, stats
    assert stats["duplicate_requests"] == 0, stats
    states = sorted(r.state for r in await records.listing(database, live=False))
    if step == "upload":  # never created: given up, and asked in a batch of its own
        assert states == ["abandoned", "collected"]
    else:  # adopted: the one batch the provider made
        assert states == ["collected"]


class StallingApi(BatchApi):
    """The provider's API, through which a live worker stalls: after its upload returned,
    or with its create asked but not yet at the provider, until ``go`` is set."""

    def __init__(self, client: InferenceClient, step: str) -> None:
        super().__init__(client)
        self.step = step
        self.stalled = asyncio.Event()
        self.go = asyncio.Event()

    async def _stall(self) -> None:
        self.stalled.set()
        await self.go.wait()

    async def upload(self, server: str, name: str, data: bytes) -> dict[str, Any]:
        done = await super().upload(server, name, data)
        if self.step == "upload":
            await self._stall()
        return done

    async def create(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.step == "create":
            await self._stall()
        return await super().create(*args, **kwargs)


@pytest.mark.parametrize("step", ["upload", "create"])
async def test_a_live_worker_that_lost_its_items_mid_batch_never_makes_it_twice(
    database: Database, tmp_path: Path, sim: StartSim, step: str
) -> None:
    """w1 stalls with its batch uploaded (or its create on the way) while w2 takes its
    items. Uploaded: w2 takes the batch over and asks anew; w1, going on, creates nothing.
    Creating: w2 waits the create out, then adopts the batch it made."""
    url = await sim(batch_delay=0.3)
    leases = await _leases(database, tmp_path, 5)
    async with InferenceClient() as client:
        api = StallingApi(client, step)
        stalled = await _started(database, api, url, "w1")
        first = asyncio.gather(
            *(stalled.ask(url, lease, _body(lease), "chat") for lease in leases),
            return_exceptions=True,
        )
        await asyncio.wait_for(api.stalled.wait(), 60)
        alive = await _started(database, BatchApi(client, request_seconds=2), url, "w2")
        second = asyncio.ensure_future(_ask_all(alive, url, leases))
        await asyncio.sleep(1.0)  # w2 has looked at the batch meanwhile
        api.go.set()
        answers = await asyncio.wait_for(second, 60)
        said = await asyncio.wait_for(first, 60)
        await alive.close()
        await stalled.close()
        stats = await _stats(client, url)
    assert [len(a) for a in answers] == [1] * 5
    assert stats["requests_submitted"] == 5, stats
    assert stats["duplicate_requests"] == 0, stats
    rows = await records.listing(database, live=False)
    if step == "upload":  # w2's own batch answered; w1's was given up, by w2
        assert all(isinstance(s, BatchUnanswered) for s in said), said
        assert sorted((r.state, r.worker) for r in rows) == [
            ("abandoned", "w2"), ("collected", "w2"),
        ]  # fmt: skip
    else:  # the one batch w1 made, followed to the end by w2
        assert [(r.state, r.worker) for r in rows] == [("collected", "w2")]
