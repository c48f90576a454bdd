"""The durable queue: datasets, items, outputs, attempt errors, workers.

Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import partial_index

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source_path", sa.Text, nullable=True),
        sa.Column("source_sha256", sa.String(64), nullable=True),
        sa.Column("input_format", sa.String(32), nullable=True),
        sa.Column("params", sa.Text, nullable=False, server_default="{}"),
        sa.Column("concurrency", sa.Integer, nullable=True),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_datasets"),
        sa.UniqueConstraint("name", name="uq_datasets_name"),
    )
    op.create_table(
        "items",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_token", sa.String(32), nullable=True),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.Float, nullable=True),
        sa.Column("not_before", sa.Float, nullable=False, server_default="0"),
        sa.Column("error_class", sa.String(64), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_items"),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["datasets.id"],
            name="fk_items_dataset_id_datasets",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("dataset_id", "key", name="uq_items_dataset_id_key"),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'done', 'failed')", name="ck_items_state_valid"
        ),
        sa.CheckConstraint(
            "(state = 'running') = (lease_token IS NOT NULL)", name="ck_items_lease_iff_running"
        ),
    )
    partial_index("ix_items_claimable", "items", ["dataset_id", "position"], "state = 'pending'")
    partial_index(
        "ix_items_suspect",
        "items",
        ["dataset_id", "position"],
        "state = 'pending' AND error_class = 'lease_lost'",
    )
    partial_index("ix_items_running", "items", ["lease_expires_at"], "state = 'running'")
    op.create_index("ix_items_dataset_state", "items", ["dataset_id", "state"])
    op.create_table(
        "outputs",
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("reasoning", sa.Text, nullable=True),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("usage", sa.Text, nullable=True),
        sa.Column("latency", sa.Float, nullable=False),
        sa.Column("server", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("response_id", sa.Text, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("item_id", name="pk_outputs"),
        sa.ForeignKeyConstraint(
            ["item_id"], ["items.id"], name="fk_outputs_item_id_items", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_outputs_created_at", "outputs", ["created_at"])
    op.create_table(
        "attempt_errors",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("error_class", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_attempt_errors"),
    )
    op.create_index("ix_attempt_errors_created_at", "attempt_errors", ["created_at"])
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("stopped_at", sa.Float, nullable=True),
        sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completed", sa.Integer, nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("attempt_errors")
    op.drop_index("ix_outputs_created_at", table_name="outputs")
    op.drop_table("outputs")
    op.drop_index("ix_items_dataset_state", table_name="items")
    op.drop_index("ix_items_running", table_name="items")
    op.drop_index("ix_items_suspect", table_name="items")
    op.drop_index("ix_items_claimable", table_name="items")
    op.drop_table("items")
    op.drop_table("datasets")
