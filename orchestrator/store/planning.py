"""What a database holds, per dataset, in the terms the run planner counts: requests.

``orchestrator plan`` estimates the rest of a run from this (``runfile.plan_stored``) or
takes the answers done so far into a run file's estimate (``runfile.done_stats``). A
request is one assistant turn: one per item, or ``items.turns`` for a dataset that
regenerates every turn, whose items record in ``items.turn`` how many are done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets, items, outputs

_COUNTS = ("items", "requests", "done", "bytes", "running", "pending", "failed")


@dataclass(frozen=True, slots=True)
class StoredDataset:
    """What a database holds of one dataset, in requests (a turn each), for planning.

    ``stored_datasets`` reads it. Requests add up:
    ``requests == done + running + pending + failed``.
    """

    name: str
    format: str | None
    """The dataset's input format (``mixed`` for several); None when unknown."""
    mode: str
    """``last``, ``all`` or ``passthrough``."""
    params: dict[str, Any]
    items: int
    requests: int
    """Turns to generate over all items (0 for pass-through)."""
    done: int
    """Turns generated: every turn of a done item, the turns done so far of the others."""
    running: int
    pending: int
    failed: int
    """Turns still to generate of running, pending and failed items."""
    request_bytes: int
    answers: int
    """Outputs that report their completion tokens."""
    completion_tokens: int
    """Their sum: every turn of the item each."""
    answer_turns: int
    """The turns those outputs cover (one each for ``last``)."""
    predicted_left: int = 0
    """Running and pending items whose line held an answer (``items.predicted_tokens``)..."""
    predicted_left_tokens: int = 0
    """...the sum of those predictions..."""
    predicted_left_requests: int = 0
    """...and the requests (turns) they still have."""
    predicted_answers: int = 0
    """Outputs of items with a prediction, their completion tokens, and the predictions."""
    predicted_answer_tokens: int = 0
    predicted_tokens: int = 0
    samples: int = 1
    """Per prompt: every item is one, and counts as one request."""
    sample_requests: str = "n"
    """How they are asked for (``datasets.draw_mode``)."""

    @property
    def mean_completion_tokens(self) -> float:
        """Per request (turn)."""
        return self.completion_tokens / self.answer_turns if self.answer_turns else 0.0


_LEFT = items.c.turns - items.c.turn
_HAS_PREDICTION = items.c.predicted_tokens > 0

#: Per dataset and state: items, their turns, the turns done and left, request bytes.
_BY_STATE = sa.select(
    items.c.dataset_id,
    items.c.state,
    sa.func.count(),
    sa.func.sum(items.c.turns),
    sa.func.sum(items.c.turn),
    sa.func.sum(_LEFT),
    sa.func.sum(sa.func.length(items.c.request)),
).group_by(items.c.dataset_id, items.c.state)

#: Per dataset, of the answers with a token count: how many, their tokens, their items'
#: turns; of those whose item had a prediction, how many, their tokens, the predictions.
_ANSWERS = (
    sa.select(
        outputs.c.dataset_id,
        sa.func.count(),
        sa.func.sum(outputs.c.completion_tokens),
        sa.func.sum(items.c.turns),
        sa.func.count(sa.case((_HAS_PREDICTION, 1))),
        sa.func.sum(sa.case((_HAS_PREDICTION, outputs.c.completion_tokens))),
        sa.func.sum(sa.case((_HAS_PREDICTION, items.c.predicted_tokens))),
    )
    .select_from(outputs.join(items, items.c.id == outputs.c.item_id))
    .where(outputs.c.completion_tokens.is_not(None))
    .group_by(outputs.c.dataset_id)
)

#: Per dataset, of the items left with a prediction: how many, the predicted tokens, and
#: the turns they still have.
_PREDICTED = (
    sa.select(
        items.c.dataset_id,
        sa.func.count(),
        sa.func.sum(items.c.predicted_tokens),
        sa.func.sum(_LEFT),
    )
    .where(items.c.state.in_(("pending", "running")), _HAS_PREDICTION)
    .group_by(items.c.dataset_id)
)


async def stored_datasets(database: Database) -> list[StoredDataset]:
    """Every dataset, by name: its requests by state, request bytes and answer tokens.

    Three grouped reads in one snapshot. The request bytes read every request (a few
    seconds for a million items): planning is occasional, and nothing cheaper tells how
    much of the file is requests.
    """
    async with database.read() as conn:
        by_state = (await conn.execute(_BY_STATE)).all()
        answers = (await conn.execute(_ANSWERS)).all()
        predicted = (await conn.execute(_PREDICTED)).all()
        rows = (await conn.execute(sa.select(datasets).order_by(datasets.c.name))).all()

    counts: dict[int, dict[str, Any]] = {}
    for dataset_id, state, n, turns, turn, todo, size in by_state:
        c = counts.setdefault(dataset_id, dict.fromkeys(_COUNTS, 0))
        c["items"] += n
        c["requests"] += int(turns or 0)
        c["bytes"] += int(size or 0)
        if state == "done":
            c["done"] += int(turns or 0)
        else:
            c["done"] += int(turn or 0)
            c[state] += int(todo or 0)
    tokens = {a[0]: tuple(int(v or 0) for v in a[1:]) for a in answers}
    ahead = {p[0]: tuple(int(v or 0) for v in p[1:]) for p in predicted}
    return [_stored(row, counts.get(row.id), tokens.get(row.id), ahead.get(row.id)) for row in rows]


def _stored(
    row: sa.Row[Any],
    counts: dict[str, Any] | None,
    tokens: tuple[int, ...] | None,
    ahead: tuple[int, ...] | None,
) -> StoredDataset:
    """A pass-through dataset has items and their bytes, but no requests and no answers."""
    c = dict.fromkeys(_COUNTS, 0) | (counts or {})
    answers = tokens or (0,) * 6
    passthrough = bool(row.passthrough)
    if passthrough:
        c = dict.fromkeys(_COUNTS, 0) | {"items": c["items"], "bytes": c["bytes"]}
        answers, ahead = (0,) * 6, None
    n_answers, completion, answer_turns, predicted_n, predicted_actual, predicted = answers
    left_n, left_tokens, left_requests = ahead or (0, 0, 0)
    return StoredDataset(
        name=row.name,
        format=row.input_format,
        mode="passthrough" if passthrough else row.regenerate,
        params=orjson.loads(row.params),
        items=c["items"],
        requests=c["requests"],
        done=c["done"],
        running=c["running"],
        pending=c["pending"],
        failed=c["failed"],
        request_bytes=c["bytes"],
        answers=n_answers,
        completion_tokens=completion,
        answer_turns=answer_turns,
        predicted_left=left_n,
        predicted_left_tokens=left_tokens,
        predicted_left_requests=left_requests,
        predicted_answers=predicted_n,
        predicted_answer_tokens=predicted_actual,
        predicted_tokens=predicted,
        samples=row.samples or 1,
        sample_requests=row.draw_mode or "n",
    )


async def scan_open_requests(
    database: Database, each: Callable[[str, dict[str, Any], int], None]
) -> None:
    """``each(dataset, request, requests left)`` for every item not done or failed of a
    dataset that sends requests: what ``plan`` checks against a server's context, the
    request as stored (its dataset's parameters apply under it)."""
    left = items.c.turns - items.c.turn
    query = (
        sa.select(datasets.c.name, items.c.request, left)
        .select_from(items.join(datasets, datasets.c.id == items.c.dataset_id))
        .where(items.c.state.in_(("pending", "running")), datasets.c.passthrough == sa.false())
    )
    async with database.read() as conn:
        async for name, request, todo in await conn.stream(query):
            each(name, orjson.loads(request), int(todo))
