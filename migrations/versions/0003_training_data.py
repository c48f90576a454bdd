"""Training-data fidelity: regeneration mode, truncation policy, pass-through datasets,
per-turn progress of multi-turn regeneration, quality flags and parameter provenance.

``ix_outputs_created_at`` goes: status reads recent answers through ``ix_outputs_totals``
(dataset, created_at, ...), so the older index only cost a write per answer.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "datasets", sa.Column("regenerate", sa.String(8), nullable=False, server_default="last")
    )
    op.add_column(
        "datasets",
        sa.Column("on_truncated", sa.String(8), nullable=False, server_default="keep"),
    )
    op.add_column(
        "datasets",
        sa.Column("passthrough", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.add_column("items", sa.Column("turn", sa.Integer, nullable=False, server_default="0"))
    op.add_column("items", sa.Column("turns", sa.Integer, nullable=False, server_default="1"))
    op.add_column("outputs", sa.Column("flags", sa.Integer, nullable=False, server_default="0"))
    op.add_column("outputs", sa.Column("params_hash", sa.String(64), nullable=True))
    op.drop_index("ix_outputs_created_at", table_name="outputs")
    op.create_table(
        "item_turns",
        sa.Column(
            "item_id",
            sa.Integer,
            sa.ForeignKey("items.id", ondelete="CASCADE", name="fk_item_turns_item_id_items"),
            nullable=False,
        ),
        sa.Column("turn", sa.Integer, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("usage", sa.Text, nullable=True),
        sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
        sa.Column("latency", sa.Float, nullable=False),
        sa.Column("server", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("params_hash", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("item_id", "turn", name="pk_item_turns"),
    )
    op.create_table(
        "param_sets",
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("hash", name="pk_param_sets"),
    )


def downgrade() -> None:
    op.drop_table("param_sets")
    op.drop_table("item_turns")
    op.create_index("ix_outputs_created_at", "outputs", ["created_at"])
    # Native DROP COLUMN (SQLite 3.35+): a batch copy of the table would lose the
    # expression index ix_outputs_started, which SQLAlchemy cannot reflect.
    for table, column in (
        ("outputs", "params_hash"),
        ("outputs", "flags"),
        ("items", "turns"),
        ("items", "turn"),
        ("datasets", "passthrough"),
        ("datasets", "on_truncated"),
        ("datasets", "regenerate"),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
