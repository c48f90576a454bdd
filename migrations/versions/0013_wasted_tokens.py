"""Tokens generated and thrown away, per dataset and cause.

A run that loses answers to kills, fenced-out late answers, truncated answers sampled
again, bad bodies retried and requeues pays for GPU time that left nothing behind. The
store adds each such attempt here, in the transaction of the transition that throws it
away: a small table (a row per dataset and cause) that ``status`` reads whole, however
many items the run holds.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    op.create_table(
        "wasted_tokens",
        sa.Column(
            "dataset_id",
            sa.Integer,
            sa.ForeignKey("datasets.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("cause", sa.String(32), primary_key=True),
        *(
            sa.Column(count, sa.BigInteger, nullable=False, server_default="0")
            for count in ("requests", "tokens", "unknown")
        ),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("wasted_tokens")
