"""What each dataset's latest answers say about answer lengths
(``orchestrator.items.answer_length``).

The claim ranks items by their predicted length, scaled by how the dataset's new answers
compare with its predictions, and the status ETA counts the work left the same way. Both
read the dataset's newest answers, a bounded range of ``ix_outputs_totals`` newest first,
each with its item's prediction (a primary-key lookup): milliseconds per dataset however
large the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.items.answer_length import LengthStats

if TYPE_CHECKING:
    from orchestrator.store.engine import Database

#: Answers read per dataset: enough for a stable scale and 90th percentile.
SAMPLE = 200

LATEST = (
    "SELECT o.completion_tokens, i.predicted_tokens FROM outputs AS o"
    " JOIN items AS i ON i.id = o.item_id WHERE o.dataset_id = :dataset"
    " AND o.completion_tokens IS NOT NULL ORDER BY o.created_at DESC LIMIT :limit"
)


def stats_of(rows: Sequence[Sequence[Any]]) -> LengthStats:
    """The figures of one dataset's rows of ``LATEST`` (completion tokens, prediction)."""
    if not rows:
        return LengthStats()
    lengths = sorted(int(r[0]) for r in rows)
    predicted = [(int(r[0]), int(r[1])) for r in rows if r[1]]
    return LengthStats(
        answers=len(lengths),
        tokens=sum(lengths),
        high=float(lengths[min(len(lengths) - 1, math.ceil(0.9 * len(lengths)) - 1)]),
        predicted_answers=len(predicted),
        predicted_tokens=sum(p for _, p in predicted),
        actual_tokens=sum(a for a, _ in predicted),
    )


async def length_stats(database: Database, dataset_ids: Sequence[int]) -> dict[int, LengthStats]:
    """Each dataset's figures, from its latest ``SAMPLE`` answers."""
    import sqlalchemy as sa

    statement = sa.text(LATEST)
    found: dict[int, LengthStats] = {}
    async with database.read() as conn:
        for dataset_id in dataset_ids:
            result = await conn.execute(statement, {"dataset": dataset_id, "limit": SAMPLE})
            found[dataset_id] = stats_of(result.all())
    return found
