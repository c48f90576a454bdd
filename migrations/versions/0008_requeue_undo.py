"""Requeues that can be taken back: what each requeue moved, and the answers it superseded.

A requeue of done items used to delete their answers. Now each requeue is a row, each
item it moved keeps its former state in ``requeued_items``, and the answers (and turns)
of done items move to ``superseded_outputs`` / ``superseded_turns``, from which
``requeue --undo`` puts them back. Nothing on the hot paths reads or writes these tables.

Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


# The columns of outputs and item_turns, by name: (type, nullable). flags defaults to 0.
_KINDS: dict[str, tuple[Any, bool]] = {
    "item_id": (sa.Integer, False),
    "dataset_id": (sa.Integer, False),
    "turn": (sa.Integer, False),
    "content": (sa.Text, True),
    "reasoning": (sa.Text, True),
    "finish_reason": (sa.Text, True),
    "prompt_tokens": (sa.Integer, True),
    "completion_tokens": (sa.Integer, True),
    "message": (sa.Text, False),
    "usage": (sa.Text, True),
    "latency": (sa.Float, False),
    "server": (sa.Text, True),
    "model": (sa.Text, True),
    "response_id": (sa.Text, True),
    "attempt": (sa.Integer, False),
    "created_at": (sa.Float, False),
    "flags": (sa.Integer, False),
    "params_hash": (sa.String(64), True),
}
_OUTPUT_COLUMNS = (
    "item_id dataset_id content reasoning finish_reason prompt_tokens completion_tokens"
    " message usage latency server model response_id attempt created_at flags params_hash"
)
_TURN_COLUMNS = (
    "item_id turn message finish_reason usage flags latency server model params_hash created_at"
)


def _columns(names: str) -> list[sa.Column[Any]]:
    """The columns ``names`` (space-separated), in that order."""
    return [
        sa.Column(
            name,
            _KINDS[name][0],
            nullable=_KINDS[name][1],
            server_default="0" if name == "flags" else None,
        )
        for name in names.split()
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
        *_columns(_OUTPUT_COLUMNS),
        sa.PrimaryKeyConstraint("requeue_id", "item_id", name="pk_superseded_outputs"),
    )
    op.create_table(
        "superseded_turns",
        sa.Column("requeue_id", sa.Integer, nullable=False, autoincrement=False),
        *_columns(_TURN_COLUMNS),
        sa.PrimaryKeyConstraint("requeue_id", "item_id", "turn", name="pk_superseded_turns"),
    )


def downgrade() -> None:
    op.drop_table("superseded_turns")
    op.drop_table("superseded_outputs")
    op.drop_index("ix_requeued_items_item_id", table_name="requeued_items")
    op.drop_table("requeued_items")
    op.drop_table("requeues")
