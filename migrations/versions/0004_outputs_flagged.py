"""Index of flagged outputs, for the quality-flag counts of ``status``.

``flags`` lives on the wide ``outputs`` rows only; counting it there would read every
answer's text. This partial index holds just the flagged answers (dataset, mask), so the
count reads a few index entries, and an unflagged answer, the usual kind, writes nothing
to it.

Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from orchestrator.migrations.ops import partial_index

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    partial_index("ix_outputs_flagged", "outputs", ["dataset_id", "flags"], "flags != 0")


def downgrade() -> None:
    op.drop_index("ix_outputs_flagged", table_name="outputs")
