"""Whether earlier turns go back to the server with their reasoning.

Reasoning models that think inside a tool loop (Kimi-K2, DeepSeek-V3.2, GLM-4.5,
MiniMax-M2, gpt-oss) render the reasoning of earlier assistant turns from the history,
and some APIs refuse a tool-call turn without it: ``keep`` sends it, ``drop`` leaves it
out (for a server that refuses it).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


# A deleted dataset keeps the columns of ``datasets`` (migration 0016).
_TABLES = ("datasets", "deleted_datasets")


def upgrade() -> None:
    for table in _TABLES:
        column = sa.Column("history_reasoning", sa.String(8), nullable=False, server_default="keep")
        op.add_column(table, column)


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0005.
    for table in reversed(_TABLES):
        op.execute(f"ALTER TABLE {table} DROP COLUMN history_reasoning")
