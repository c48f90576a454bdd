"""Periodic samples of the run, so that the dashboard's charts cover it all.

One row a minute per dataset (counts by state, answers and tokens so far, errors by
class) and one per server (its own gauges), written by a running worker. A 30-hour
run over 8 datasets makes about 14,000 rows: small enough to keep whole.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("taken_at", sa.Float, nullable=False),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("pending", sa.Integer, nullable=False),
        sa.Column("running", sa.Integer, nullable=False),
        sa.Column("done", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        # Answers committed and their tokens, counted as they arrive (requeued answers
        # stay counted: they were generated), through ``settled_at``.
        sa.Column("answers", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("settled_at", sa.Float, nullable=False),
        # Failed attempts so far, JSON text: {error_class: {retried, released, failed}}.
        sa.Column("errors", sa.Text, nullable=False, server_default="{}"),
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
    )
    op.create_index("ix_samples_taken_at", "samples", ["taken_at"])
    op.create_index("ix_samples_dataset_id_taken_at", "samples", ["dataset_id", "taken_at"])
    op.create_table(
        "server_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("taken_at", sa.Float, nullable=False),
        sa.Column("server", sa.Text, nullable=False),
        sa.Column("running", sa.Float, nullable=True),
        sa.Column("queued", sa.Float, nullable=True),
        sa.Column("kv_cache_usage", sa.Float, nullable=True),
        sa.Column("gen_throughput", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_server_samples"),
    )
    op.create_index("ix_server_samples_taken_at", "server_samples", ["taken_at"])


def downgrade() -> None:
    op.drop_index("ix_server_samples_taken_at", table_name="server_samples")
    op.drop_table("server_samples")
    op.drop_index("ix_samples_dataset_id_taken_at", table_name="samples")
    op.drop_index("ix_samples_taken_at", table_name="samples")
    op.drop_table("samples")
