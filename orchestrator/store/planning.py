"""What a database holds, per dataset, in the terms the run planner counts: requests.

``orchestrator plan`` estimates the rest of a run from this (``runconfig.plan_stored``) or
takes the answers done so far into a run file's estimate (``runconfig.done_stats``). A
request is one assistant turn: one per item, or ``items.turns`` for a dataset that
regenerates every turn, whose items record in ``items.turn`` how many are done.
"""

from __future__ import annotations

from typing import Any

import orjson
import sqlalchemy as sa

from orchestrator.runconfig import StoredDataset
from orchestrator.store.engine import Database
from orchestrator.store.schema import datasets, items, outputs

_COUNTS = ("items", "requests", "done", "bytes", "running", "pending", "failed")


async def stored_datasets(database: Database) -> list[StoredDataset]:
    """Every dataset, by name: its requests by state, request bytes and answer tokens.

    Three grouped reads in one snapshot. The request bytes read every request (a few
    seconds for a million items): planning is occasional, and nothing cheaper tells how
    much of the file is requests.
    """
    left = items.c.turns - items.c.turn
    async with database.read() as conn:
        by_state = (
            await conn.execute(
                sa.select(
                    items.c.dataset_id,
                    items.c.state,
                    sa.func.count(),
                    sa.func.sum(items.c.turns),
                    sa.func.sum(items.c.turn),
                    sa.func.sum(left),
                    sa.func.sum(sa.func.length(items.c.request)),
                ).group_by(items.c.dataset_id, items.c.state)
            )
        ).all()
        answers = (
            await conn.execute(
                sa.select(
                    outputs.c.dataset_id,
                    sa.func.count(),
                    sa.func.sum(outputs.c.completion_tokens),
                    sa.func.sum(items.c.turns),
                )
                .select_from(outputs.join(items, items.c.id == outputs.c.item_id))
                .where(outputs.c.completion_tokens.is_not(None))
                .group_by(outputs.c.dataset_id)
            )
        ).all()
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
    tokens = {d: (n, int(t or 0), int(turns or 0)) for d, n, t, turns in answers}

    result = []
    for row in rows:
        c = counts.get(row.id) or dict.fromkeys(_COUNTS, 0)
        passthrough = bool(row.passthrough)
        n_answers, completion, answer_turns = tokens.get(row.id, (0, 0, 0))
        result.append(
            StoredDataset(
                name=row.name,
                format=row.input_format,
                mode="passthrough" if passthrough else row.regenerate,
                params=orjson.loads(row.params),
                items=c["items"],
                requests=0 if passthrough else c["requests"],
                done=0 if passthrough else c["done"],
                running=0 if passthrough else c["running"],
                pending=0 if passthrough else c["pending"],
                failed=0 if passthrough else c["failed"],
                request_bytes=c["bytes"],
                answers=0 if passthrough else n_answers,
                completion_tokens=0 if passthrough else completion,
                answer_turns=0 if passthrough else answer_turns,
            )
        )
    return result
