"""Deaths: how many times an item was in flight when its worker died.

A worker that dies (SIGKILL, OOM) or stops renewing takes its in-flight items down with
it; one of them may be what killed it. ``items.deaths`` counts the deaths an item was
present at, and ``items.deaths_alone`` those at which it was the only item of its worker
with two or more (``store.crashes``): items that died once run at full concurrency again,
those that died more often in groups that halve with each further death, and an item
that died alone twice is failed as poison.

``ix_items_suspect`` now holds the pending items that died, by dataset and deaths; items
a reaper had taken back before this version (``error_class = 'lease_lost'``, pending)
count one death.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A deleted dataset's items keep the columns of ``items`` (migration 0016).
    for table in ("items", "deleted_items"):
        for column in ("deaths", "deaths_alone"):
            op.add_column(table, sa.Column(column, sa.Integer, nullable=False, server_default="0"))
    op.execute("UPDATE items SET deaths = 1 WHERE state = 'pending' AND error_class = 'lease_lost'")
    op.drop_index("ix_items_suspect", table_name="items")
    died = sa.text("state = 'pending' AND deaths > 0")
    op.create_index(
        "ix_items_suspect",
        "items",
        ["dataset_id", "deaths", "position"],
        sqlite_where=died,
        postgresql_where=died,
    )


def downgrade() -> None:
    op.drop_index("ix_items_suspect", table_name="items")
    lost = sa.text("state = 'pending' AND error_class = 'lease_lost'")
    op.create_index(
        "ix_items_suspect",
        "items",
        ["dataset_id", "position"],
        sqlite_where=lost,
        postgresql_where=lost,
    )
    for table in ("deleted_items", "items"):
        for column in ("deaths_alone", "deaths"):
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
