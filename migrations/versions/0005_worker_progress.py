"""When each worker last made progress, so status can tell a stalled worker.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("progress_at", sa.Float, nullable=True))


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0003.
    op.execute("ALTER TABLE workers DROP COLUMN progress_at")
