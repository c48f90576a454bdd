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

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("items", sa.Column("deaths", sa.Integer, nullable=False, server_default="0"))
    op.add_column(
        "items", sa.Column("deaths_alone", sa.Integer, nullable=False, server_default="0")
    )
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
    for column in ("deaths_alone", "deaths"):
        op.execute(f"ALTER TABLE items DROP COLUMN {column}")
