"""Prompt tokens a server took from its prefix cache, per answer.

Routing a conversation's turns and items sharing a prompt prefix to the server holding
it is worth what it saves: ``status`` shows the cached share of the prompt tokens, which
needs the count kept beside ``prompt_tokens`` rather than read out of every usage JSON.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import drop_columns

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    # superseded_outputs keeps outputs' columns (a requeue moves rows there and back).
    for table in ("outputs", "superseded_outputs"):
        op.add_column(table, sa.Column("cached_tokens", sa.Integer, nullable=True))
    op.create_index("ix_outputs_cache", "outputs", ["dataset_id", "prompt_tokens", "cached_tokens"])


def downgrade() -> None:
    op.drop_index("ix_outputs_cache", table_name="outputs")
    for table in ("outputs", "superseded_outputs"):
        drop_columns(table, "cached_tokens")
