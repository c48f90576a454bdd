"""What the providers billed: a ledger of every answer's tokens, kept or thrown away.

Hosted providers bill prompt, cached prompt and completion tokens, a Batch API's lines
at a discount, and every answer that came back whether it was kept or not. The store
adds each answer's tokens to ``spend`` (a row per dataset, server, model, batched or
not, and kind: ``kept`` or the cause it was thrown away for) in the transaction that
writes it or throws it away, so that the run's cost is read, exactly, from a handful of
rows, and a budget can be checked before each claim.

The answers already stored are entered as kept, online, from their usage; the answers
thrown away before this revision are not known well enough to be billed (the
``wasted_tokens`` table keeps their completion tokens). ``deleted_spend`` keeps a
deleted dataset's rows, as for the tables of 0016.

Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"

_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _columns(keyed: bool) -> list[sa.Column]:
    """The ledger's columns: keyed in ``spend``, plain in its ``deleted_spend`` copy."""
    key = {"primary_key": True} if keyed else {"nullable": False}
    dataset = (sa.ForeignKey("datasets.id", ondelete="CASCADE"),) if keyed else ()
    counts = {"server_default": "0"} if keyed else {}
    return [
        sa.Column("dataset_id", sa.Integer, *dataset, **key),
        sa.Column("server", sa.Text, **key),
        sa.Column("model", sa.Text, **key),
        sa.Column("batched", sa.Integer, **key),
        sa.Column("kind", sa.String(32), **key),
        *(sa.Column(c, sa.BigInteger, nullable=False, **counts) for c in _COUNTS),
        sa.Column("updated_at", sa.Float, nullable=False),
    ]


def upgrade() -> None:
    op.create_table("spend", *_columns(keyed=True))
    op.create_table(
        "deleted_spend",
        sa.Column("deletion_id", sa.Integer, nullable=False),
        *_columns(keyed=False),
    )
    op.create_index("ix_deleted_spend_deletion_id", "deleted_spend", ["deletion_id"])
    op.execute(
        "INSERT INTO spend (dataset_id, server, model, batched, kind, requests,"
        " prompt_tokens, cached_tokens, completion_tokens, updated_at)"
        " SELECT dataset_id, coalesce(server, ''), coalesce(model, ''), 0, 'kept', count(*),"
        " coalesce(sum(prompt_tokens), 0), coalesce(sum(cached_tokens), 0),"
        " coalesce(sum(completion_tokens), 0), max(created_at)"
        " FROM outputs WHERE prompt_tokens IS NOT NULL OR completion_tokens IS NOT NULL"
        " GROUP BY dataset_id, coalesce(server, ''), coalesce(model, '')"
    )


def downgrade() -> None:
    op.drop_index("ix_deleted_spend_deletion_id", "deleted_spend")
    op.drop_table("deleted_spend")
    op.drop_table("spend")
