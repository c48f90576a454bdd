"""A provider's batches (the Batch API), each step recorded before and after its call.

A batch is written down with its requests (``batch_entries``: one line each, naming the
item and turn it asks for) before its input file is uploaded, and each provider id as
soon as the provider gives it: a worker killed at any step leaves enough behind for the
next one to find the live batch and adopt it rather than pay for it again.

Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("server", sa.Text, nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=True),
        *(
            sa.Column(name, sa.Text, nullable=True)
            for name in ("input_file_id", "provider_id", "output_file_id", "error_file_id")
        ),
        *(
            sa.Column(name, sa.Integer, nullable=False, server_default="0")
            for name in ("requests", "bytes", "completed", "failed")
        ),
        sa.Column("worker", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.UniqueConstraint("key", name="uq_batches_key"),
    )
    op.create_index("ix_batches_state", "batches", ["state"])
    op.create_table(
        "batch_entries",
        sa.Column(
            "batch_id",
            sa.Integer,
            sa.ForeignKey("batches.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("custom_id", sa.String(64), primary_key=True),
        sa.Column(
            "item_id", sa.Integer, sa.ForeignKey("items.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("turn", sa.Integer, nullable=False),
        sa.Column("settled", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_batch_entries_item_id", "batch_entries", ["item_id"])


def downgrade() -> None:
    op.drop_table("batch_entries")
    op.drop_table("batches")
