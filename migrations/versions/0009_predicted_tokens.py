"""Each item's predicted answer length, and the index that claims the longest first.

A run ends when its last answer does: items whose answers are long must start early,
or the run ends on a few of them while the server runs a handful of requests. Enqueue
stores, per item, the length of the answer the input line already holds (the turns
the model writes again), in tokens estimated from its text; 0 when it holds none. The
claim takes pending items longest first along ``ix_items_longest``, which replaces
``ix_items_claimable`` (input order): a line without an answer of its own ranks at 0,
so a dataset of prompts is still claimed in input order. Rows written before keep 0.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import counter, drop_columns, partial_index

revision = "0009"
down_revision = "0008"

_PENDING = "state = 'pending'"


def upgrade() -> None:
    # A constant default: no table rewrite on either backend.
    op.add_column("items", counter("predicted_tokens"))
    partial_index(
        "ix_items_longest",
        "items",
        ["dataset_id", sa.text("predicted_tokens DESC"), "position"],
        _PENDING,
    )
    op.drop_index("ix_items_claimable", table_name="items")


def downgrade() -> None:
    partial_index("ix_items_claimable", "items", ["dataset_id", "position"], _PENDING)
    op.drop_index("ix_items_longest", table_name="items")
    drop_columns("items", "predicted_tokens")
