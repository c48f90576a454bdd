"""What each worker knows of its servers, so that status can say when none answers.

A worker writes with its heartbeat how many servers it has and how many it reaches,
each one down with why and since when, and since when it reaches none; and, at its
start, its lease, after which a worker not heard from is presumed dead.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_COLUMNS = (
    ("lease_seconds", sa.Float),
    ("servers", sa.Integer),
    ("servers_up", sa.Integer),
    ("servers_down", sa.Text),
    ("unreachable_since", sa.Float),
)


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("workers", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    # Native DROP COLUMN (SQLite 3.35+), as in 0005.
    for name, _ in reversed(_COLUMNS):
        op.execute(f"ALTER TABLE workers DROP COLUMN {name}")
