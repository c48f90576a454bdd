"""Periodic samples of the run, so that the dashboard's charts cover it all.

One row a minute per dataset (counts by state, answers and tokens so far, errors by
class) and one per server (its own gauges), written by a running worker. A 30-hour
run over 8 datasets makes about 14,000 rows: small enough to keep whole.

Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def _samples_table(name: str, *columns: sa.Column[Any]) -> None:
    """A table of samples: an id, when it was taken (indexed), then ``columns``."""
    op.create_table(
        name,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("taken_at", sa.Float, nullable=False),
        *columns,
        sa.PrimaryKeyConstraint("id", name=f"pk_{name}"),
    )
    op.create_index(f"ix_{name}_taken_at", name, ["taken_at"])


def upgrade() -> None:
    _samples_table(
        "samples",
        sa.Column("dataset_id", sa.Integer, nullable=False),
        *(
            sa.Column(state, sa.Integer, nullable=False)
            for state in ("pending", "running", "done", "failed")
        ),
        # Answers committed and their tokens, counted as they arrive (requeued answers
        # stay counted: they were generated), through ``settled_at``.
        *(
            sa.Column(count, sa.BigInteger, nullable=False)
            for count in ("answers", "completion_tokens", "prompt_tokens")
        ),
        sa.Column("settled_at", sa.Float, nullable=False),
        # Failed attempts so far, JSON text: {error_class: {retried, released, failed}}.
        sa.Column("errors", sa.Text, nullable=False, server_default="{}"),
    )
    op.create_index("ix_samples_dataset_id_taken_at", "samples", ["dataset_id", "taken_at"])
    _samples_table(
        "server_samples",
        sa.Column("server", sa.Text, nullable=False),
        *(
            sa.Column(gauge, sa.Float, nullable=True)
            for gauge in ("running", "queued", "kv_cache_usage", "gen_throughput")
        ),
    )


def downgrade() -> None:
    op.drop_index("ix_server_samples_taken_at", table_name="server_samples")
    op.drop_table("server_samples")
    op.drop_index("ix_samples_dataset_id_taken_at", table_name="samples")
    op.drop_index("ix_samples_taken_at", table_name="samples")
    op.drop_table("samples")
