"""What each worker knows of its servers, so that status can say when none answers.

A worker writes with its heartbeat how many servers it has and how many it reaches,
each one down with why and since when, and since when it reaches none; and, at its
start, its lease, after which a worker not heard from is presumed dead.

Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from orchestrator.migrations.ops import add_columns, drop_columns

revision = "0017"
down_revision = "0016"

_COLUMNS = {
    "lease_seconds": sa.Float,
    "servers": sa.Integer,
    "servers_up": sa.Integer,
    "servers_down": sa.Text,
    "unreachable_since": sa.Float,
}


def upgrade() -> None:
    add_columns(
        "workers", *(sa.Column(name, kind, nullable=True) for name, kind in _COLUMNS.items())
    )


def downgrade() -> None:
    drop_columns("workers", *reversed(_COLUMNS))
