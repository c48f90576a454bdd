"""Training-data fidelity: regeneration mode, truncation policy, pass-through datasets,
per-turn progress of multi-turn regeneration, quality flags and parameter provenance.

``ix_outputs_created_at`` goes: status reads recent answers through ``ix_outputs_totals``
(dataset, created_at, ...), so the older index only cost a write per answer.

Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import add_columns, counter, drop_columns, setting

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    add_columns(
        "datasets",
        setting("regenerate", "last"),
        setting("on_truncated", "keep"),
        sa.Column("passthrough", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    add_columns("items", counter("turn"), counter("turns", "1"))
    add_columns("outputs", counter("flags"), sa.Column("params_hash", sa.String(64), nullable=True))
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
    drop_columns("outputs", "params_hash", "flags")
    drop_columns("items", "turns", "turn")
    drop_columns("datasets", "passthrough", "on_truncated", "regenerate")
