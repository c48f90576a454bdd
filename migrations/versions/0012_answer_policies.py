"""What a dataset does with an answer that is not the JSON it asked for, and with a
request that overflows the server's context.

Both are per-dataset operational settings beside ``on_truncated``: ``on_invalid`` (keep,
retry, fail) for structured output that does not parse or match its schema, and
``on_overflow`` (fail, fit) for a prompt and ``max_tokens`` longer than the context.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "datasets", sa.Column("on_invalid", sa.String(8), nullable=False, server_default="keep")
    )
    op.add_column(
        "datasets", sa.Column("on_overflow", sa.String(8), nullable=False, server_default="fail")
    )


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0003.
    for column in ("on_invalid", "on_overflow"):
        op.execute(f"ALTER TABLE datasets DROP COLUMN {column}")
