"""Indexes for status: output totals and first start, failed items and errors by class.

``status`` on a million items scanned the wide ``outputs`` rows and every ``items``
entry; these narrow indexes let its aggregates read index entries only, and its first
and last answer times one index seek each. None of them is written by enqueue:
``ix_items_failed`` only holds failed rows.

Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import partial_index

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    partial_index("ix_items_failed", "items", ["dataset_id", "error_class"], "state = 'failed'")
    op.create_index(
        "ix_outputs_totals", "outputs", ["dataset_id", "created_at", "completion_tokens"]
    )
    op.create_index(
        "ix_outputs_started", "outputs", ["dataset_id", sa.text("(created_at - latency)")]
    )
    op.create_index(
        "ix_attempt_errors_class",
        "attempt_errors",
        ["dataset_id", "error_class", "outcome"],
    )


def downgrade() -> None:
    op.drop_index("ix_attempt_errors_class", table_name="attempt_errors")
    op.drop_index("ix_outputs_started", table_name="outputs")
    op.drop_index("ix_outputs_totals", table_name="outputs")
    op.drop_index("ix_items_failed", table_name="items")
