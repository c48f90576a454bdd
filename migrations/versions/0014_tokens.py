"""Raw completions, and each answer's tokens: ids, logprobs and the top-k.

A dataset says which endpoint its items go to (``chat``: ``/v1/chat/completions``,
``completions``: ``/v1/completions`` with a plain prompt). An answer keeps the tokens
the server said it produced, packed (``orchestrator.items.tokens``) in a column of its own:
JSON per token would cost ten times the bytes.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "datasets", sa.Column("endpoint", sa.String(16), nullable=False, server_default="chat")
    )
    # superseded_outputs keeps outputs' columns (a requeue moves rows there and back).
    for table in ("outputs", "superseded_outputs"):
        op.add_column(table, sa.Column("tokens", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0003.
    for table in ("outputs", "superseded_outputs"):
        op.execute(f"ALTER TABLE {table} DROP COLUMN tokens")
    op.execute("ALTER TABLE datasets DROP COLUMN endpoint")
