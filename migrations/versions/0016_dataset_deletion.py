"""Datasets that can be deleted and brought back: ``deletions`` and the rows kept aside.

``dataset delete`` moves every row of a dataset (the dataset, its items, their outputs,
turns, attempt errors, requeue records, superseded answers and wasted tokens) into a
``deleted_<table>`` copy of its table, under the deletion's id, in one transaction; its
undo moves them back as they were, and ``dataset purge`` drops them for good. The
copies have the columns of their tables as they are at this revision, and no keys: a
later migration that adds a column to one of these tables adds it to its copy too.

Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"

_MOVED = (
    "datasets",
    "items",
    "outputs",
    "item_turns",
    "attempt_errors",
    "requeued_items",
    "superseded_outputs",
    "superseded_turns",
    "wasted_tokens",
)


def upgrade() -> None:
    op.create_table(
        "deletions",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("counts", sa.Text, nullable=False, server_default="{}"),
        sa.Column("undone_at", sa.Float, nullable=True),
        sa.Column("purged_at", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_deletions"),
    )
    inspector = sa.inspect(op.get_bind())
    for name in _MOVED:
        op.create_table(
            f"deleted_{name}",
            sa.Column("deletion_id", sa.Integer, nullable=False),
            *[
                sa.Column(c["name"], c["type"], nullable=c["nullable"])
                for c in inspector.get_columns(name)
            ],
        )
        op.create_index(f"ix_deleted_{name}_deletion_id", f"deleted_{name}", ["deletion_id"])


def downgrade() -> None:
    for name in reversed(_MOVED):
        op.drop_index(f"ix_deleted_{name}_deletion_id", f"deleted_{name}")
        op.drop_table(f"deleted_{name}")
    op.drop_table("deletions")
