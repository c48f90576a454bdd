"""The server's own token ids of each generated turn: the prompt it evaluated and the ids
it generated, packed (``orchestrator.items.token_ids``), on the answer and on each turn
of a multi-turn item, and on their superseded and deleted copies (migrations 0009, 0016).

Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from orchestrator.migrations.ops import add_columns, drop_columns

revision = "0020"
down_revision = "0019"

_TABLES = (
    "outputs",
    "item_turns",
    "superseded_outputs",
    "superseded_turns",
    "deleted_outputs",
    "deleted_item_turns",
    "deleted_superseded_outputs",
    "deleted_superseded_turns",
)


def upgrade() -> None:
    for table in _TABLES:
        add_columns(table, sa.Column("ids", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    for table in reversed(_TABLES):
        drop_columns(table, "ids")
