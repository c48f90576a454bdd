"""Whether earlier turns go back to the server with their reasoning.

Reasoning models that think inside a tool loop (Kimi-K2, DeepSeek-V3.2, GLM-4.5,
MiniMax-M2, gpt-oss) render the reasoning of earlier assistant turns from the history,
and some APIs refuse a tool-call turn without it: ``keep`` sends it, ``drop`` leaves it
out (for a server that refuses it). A deleted dataset keeps the columns of ``datasets``
(migration 0016).

Create Date: 2026-12-07
"""

from __future__ import annotations

from orchestrator.migrations.ops import add_columns, drop_columns, setting

revision = "0019"
down_revision = "0018"

_TABLES = ("datasets", "deleted_datasets")


def upgrade() -> None:
    for table in _TABLES:
        add_columns(table, setting("history_reasoning", "keep"))


def downgrade() -> None:
    for table in reversed(_TABLES):
        drop_columns(table, "history_reasoning")
