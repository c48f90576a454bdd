"""The server's own token ids of each generated turn: the prompt it evaluated and the ids
it generated, packed (``orchestrator.items.token_ids``), on the answer and on each turn
of a multi-turn item, and on their superseded and deleted copies (migrations 0009, 0016).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_TABLES = (
    "outputs",
    "item_turns",
    "superseded_outputs",
    "superseded_turns",
    "deleted_outputs",
    "deleted_item_turns",
    "deleted_superseded_outputs",
    "deleted_superseded_turns",
)


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("ids", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0005.
    for table in reversed(_TABLES):
        op.execute(f"ALTER TABLE {table} DROP COLUMN ids")
