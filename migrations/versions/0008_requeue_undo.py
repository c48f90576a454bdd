"""Requeues that can be taken back: what each requeue moved, and the answers it superseded.

A requeue of done items used to delete their answers. Now each requeue is a row, each
item it moved keeps its former state in ``requeued_items``, and the answers (and turns)
of done items move to ``superseded_outputs`` / ``superseded_turns``, from which
``requeue --undo`` puts them back. Nothing on the hot paths reads or writes these tables.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _output_columns() -> list[sa.Column]:
    return [
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("dataset_id", sa.Integer, nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("reasoning", sa.Text, nullable=True),
        sa.Column("finish_reason", sa.Text, nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("usage", sa.Text, nullable=True),
        sa.Column("latency", sa.Float, nullable=False),
        sa.Column("server", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("response_id", sa.Text, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
        sa.Column("params_hash", sa.String(64), nullable=True),
    ]


def _turn_columns() -> list[sa.Column]:
    return [
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("turn", sa.Integer, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("finish_reason", sa.Text, nullable=True),
        sa.Column("usage", sa.Text, nullable=True),
        sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
        sa.Column("latency", sa.Float, nullable=False),
        sa.Column("server", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=True),
        sa.Column("params_hash", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "requeues",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("selection", sa.Text, nullable=False, server_default="{}"),
        sa.Column("items", sa.Integer, nullable=False),
        sa.Column("undone_at", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_requeues"),
    )
    op.create_table(
        "requeued_items",
        sa.Column("requeue_id", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("item_id", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("error_class", sa.String(64), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("turn", sa.Integer, nullable=False),
        sa.Column("request", sa.Text, nullable=True),
        sa.ForeignKeyConstraint(
            ["item_id"],
            ["items.id"],
            name="fk_requeued_items_item_id_items",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("requeue_id", "item_id", name="pk_requeued_items"),
    )
    op.create_index("ix_requeued_items_item_id", "requeued_items", ["item_id"])
    op.create_table(
        "superseded_outputs",
        sa.Column("requeue_id", sa.Integer, nullable=False, autoincrement=False),
        *_output_columns(),
        sa.PrimaryKeyConstraint("requeue_id", "item_id", name="pk_superseded_outputs"),
    )
    op.create_table(
        "superseded_turns",
        sa.Column("requeue_id", sa.Integer, nullable=False, autoincrement=False),
        *_turn_columns(),
        sa.PrimaryKeyConstraint("requeue_id", "item_id", "turn", name="pk_superseded_turns"),
    )


def downgrade() -> None:
    op.drop_table("superseded_turns")
    op.drop_table("superseded_outputs")
    op.drop_index("ix_requeued_items_item_id", table_name="requeued_items")
    op.drop_table("requeued_items")
    op.drop_table("requeues")
