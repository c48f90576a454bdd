"""Which server each failed attempt went to, and an attempt's history by item.

``inspect`` shows every attempt of an item: the failed ones need the server they were
sent to (with several servers, the one giving the 500s is the question), and reading
them for one item must not scan every attempt of the run.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempt_errors", sa.Column("server", sa.Text, nullable=True))
    op.create_index("ix_attempt_errors_item_id", "attempt_errors", ["item_id"])


def downgrade() -> None:
    op.drop_index("ix_attempt_errors_item_id", table_name="attempt_errors")
    # Native DROP COLUMN (SQLite 3.35+), as in 0003.
    op.execute("ALTER TABLE attempt_errors DROP COLUMN server")
