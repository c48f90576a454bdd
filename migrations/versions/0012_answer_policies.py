"""What a dataset does with an answer that is not the JSON it asked for, and with a
request that overflows the server's context.

Both are per-dataset operational settings beside ``on_truncated``: ``on_invalid`` (keep,
retry, fail) for structured output that does not parse or match its schema, and
``on_overflow`` (fail, fit) for a prompt and ``max_tokens`` longer than the context.

Create Date: 2026-12-02
"""

from __future__ import annotations

from orchestrator.migrations.ops import add_columns, drop_columns, setting

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    add_columns("datasets", setting("on_invalid", "keep"), setting("on_overflow", "fail"))


def downgrade() -> None:
    drop_columns("datasets", "on_invalid", "on_overflow")
