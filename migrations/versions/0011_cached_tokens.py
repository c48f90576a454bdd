"""Prompt tokens a server took from its prefix cache, per answer.

Routing a conversation's turns and items sharing a prompt prefix to the server holding
it is worth what it saves: ``status`` shows the cached share of the prompt tokens, which
needs the count kept beside ``prompt_tokens`` rather than read out of every usage JSON.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # superseded_outputs keeps outputs' columns (a requeue moves rows there and back).
    for table in ("outputs", "superseded_outputs"):
        op.add_column(table, sa.Column("cached_tokens", sa.Integer, nullable=True))
    op.create_index("ix_outputs_cache", "outputs", ["dataset_id", "prompt_tokens", "cached_tokens"])


def downgrade() -> None:
    op.drop_index("ix_outputs_cache", table_name="outputs")
    # Native DROP COLUMN (SQLite 3.35+), as in 0003.
    for table in ("outputs", "superseded_outputs"):
        op.execute(f"ALTER TABLE {table} DROP COLUMN cached_tokens")
