"""finish_reason as text of any length: servers send reasons longer than 32 characters.

A longer one used to fail the write of the whole round it was in. SQLite never enforced
the length, so only PostgreSQL's columns change (a catalogue change, no table rewrite).

Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"

_TABLES = ("outputs", "item_turns")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in _TABLES:
        op.alter_column(table, "finish_reason", type_=sa.Text, existing_nullable=True)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in _TABLES:
        op.alter_column(
            table,
            "finish_reason",
            type_=sa.String(32),
            existing_nullable=True,
            postgresql_using="left(finish_reason, 32)",
        )
