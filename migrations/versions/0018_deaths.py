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

Create Date: 2026-12-08
"""

from __future__ import annotations

from alembic import op
from orchestrator.migrations.ops import add_columns, counter, drop_columns, partial_index

revision = "0018"
down_revision = "0017"


def upgrade() -> None:
    # A deleted dataset's items keep the columns of ``items`` (migration 0016).
    for table in ("items", "deleted_items"):
        add_columns(table, counter("deaths"), counter("deaths_alone"))
    op.execute("UPDATE items SET deaths = 1 WHERE state = 'pending' AND error_class = 'lease_lost'")
    op.drop_index("ix_items_suspect", table_name="items")
    partial_index(
        "ix_items_suspect",
        "items",
        ["dataset_id", "deaths", "position"],
        "state = 'pending' AND deaths > 0",
    )


def downgrade() -> None:
    op.drop_index("ix_items_suspect", table_name="items")
    partial_index(
        "ix_items_suspect",
        "items",
        ["dataset_id", "position"],
        "state = 'pending' AND error_class = 'lease_lost'",
    )
    for table in ("deleted_items", "items"):
        drop_columns(table, "deaths_alone", "deaths")
