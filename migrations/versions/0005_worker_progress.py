"""When each worker last made progress, so status can tell a stalled worker.

Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import drop_columns

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.add_column("workers", sa.Column("progress_at", sa.Float, nullable=True))


def downgrade() -> None:
    drop_columns("workers", "progress_at")
