"""Each item's predicted answer length, and the index that claims the longest first.

A run ends when its last answer does: items whose answers are long must start early,
or the run ends on a few of them while the server runs a handful of requests. Enqueue
stores, per item, the length of the answer the input line already holds (the turns
the model writes again), in tokens estimated from its text; 0 when it holds none. The
claim takes pending items longest first along ``ix_items_longest``, which replaces
``ix_items_claimable`` (input order): a line without an answer of its own ranks at 0,
so a dataset of prompts is still claimed in input order. Rows written before keep 0.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_PENDING = sa.text("state = 'pending'")


def upgrade() -> None:
    # A constant default: no table rewrite on either backend.
    op.add_column(
        "items", sa.Column("predicted_tokens", sa.Integer, nullable=False, server_default="0")
    )
    op.create_index(
        "ix_items_longest",
        "items",
        ["dataset_id", sa.text("predicted_tokens DESC"), "position"],
        sqlite_where=_PENDING,
        postgresql_where=_PENDING,
    )
    op.drop_index("ix_items_claimable", table_name="items")


def downgrade() -> None:
    op.create_index(
        "ix_items_claimable",
        "items",
        ["dataset_id", "position"],
        sqlite_where=_PENDING,
        postgresql_where=_PENDING,
    )
    op.drop_index("ix_items_longest", table_name="items")
    # Native DROP COLUMN (SQLite 3.35+), as in 0003: a batch copy would lose the
    # expression index ix_outputs_started.
    op.execute("ALTER TABLE items DROP COLUMN predicted_tokens")
