"""Raw completions, and each answer's tokens: ids, logprobs and the top-k.

A dataset says which endpoint its items go to (``chat``: ``/v1/chat/completions``,
``completions``: ``/v1/completions`` with a plain prompt). An answer keeps the tokens
the server said it produced, packed (``orchestrator.items.tokens``) in a column of its own:
JSON per token would cost ten times the bytes.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import drop_columns, setting

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    op.add_column("datasets", setting("endpoint", "chat", 16))
    # superseded_outputs keeps outputs' columns (a requeue moves rows there and back).
    for table in ("outputs", "superseded_outputs"):
        op.add_column(table, sa.Column("tokens", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    for table in ("outputs", "superseded_outputs"):
        drop_columns(table, "tokens")
    drop_columns("datasets", "endpoint")
