"""Which server each failed attempt went to, and an attempt's history by item.

``inspect`` shows every attempt of an item: the failed ones need the server they were
sent to (with several servers, the one giving the 500s is the question), and reading
them for one item must not scan every attempt of the run.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import drop_columns

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.add_column("attempt_errors", sa.Column("server", sa.Text, nullable=True))
    op.create_index("ix_attempt_errors_item_id", "attempt_errors", ["item_id"])


def downgrade() -> None:
    op.drop_index("ix_attempt_errors_item_id", table_name="attempt_errors")
    drop_columns("attempt_errors", "server")
