"""The queue's tables, in SQLAlchemy Core.

Times are Unix epoch seconds (float) so that SQLite and PostgreSQL compare them the same
way and the hot queries need no date functions. JSON documents are stored as text
encoded by the store itself (orjson), which keeps both backends byte-identical.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

STATES = ("pending", "running", "done", "failed")

datasets = sa.Table(
    "datasets",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("source_path", sa.Text, nullable=True),
    sa.Column("source_sha256", sa.String(64), nullable=True),
    sa.Column("input_format", sa.String(32), nullable=True),
    # model, max_tokens, temperature, top_p and any extra body fields, as JSON text
    sa.Column("params", sa.Text, nullable=False, server_default="{}"),
    sa.Column("concurrency", sa.Integer, nullable=True),
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

items = sa.Table(
    "items",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column(
        "dataset_id",
        sa.Integer,
        sa.ForeignKey("datasets.id", ondelete="CASCADE"),
        nullable=False,
    ),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("lease_token", sa.String(32), nullable=True),
    sa.Column("lease_owner", sa.String(200), nullable=True),
    sa.Column("lease_expires_at", sa.Float, nullable=True),
    sa.Column("not_before", sa.Float, nullable=False, server_default="0"),
    sa.Column("error_class", sa.String(64), nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.UniqueConstraint("dataset_id", "key"),
    sa.CheckConstraint("state IN ('pending', 'running', 'done', 'failed')", name="state_valid"),
    # A running row always carries its fence; no other state does.
    sa.CheckConstraint("(state = 'running') = (lease_token IS NOT NULL)", name="lease_iff_running"),
)

# "Next pending" stays an index range scan however many rows are done.
sa.Index(
    "ix_items_claimable",
    items.c.dataset_id,
    items.c.position,
    sqlite_where=items.c.state == "pending",
    postgresql_where=items.c.state == "pending",
)
# Suspects (items taken back from a dead worker) are claimed one at a time: find them
# without scanning every pending row.
sa.Index(
    "ix_items_suspect",
    items.c.dataset_id,
    items.c.position,
    sqlite_where=sa.and_(items.c.state == "pending", items.c.error_class == "lease_lost"),
    postgresql_where=sa.and_(items.c.state == "pending", items.c.error_class == "lease_lost"),
)
# The reaper and the per-dataset running counts only look at running rows.
sa.Index(
    "ix_items_running",
    items.c.lease_expires_at,
    sqlite_where=items.c.state == "running",
    postgresql_where=items.c.state == "running",
)
sa.Index("ix_items_dataset_state", items.c.dataset_id, items.c.state)

outputs = sa.Table(
    "outputs",
    metadata,
    sa.Column(
        "item_id",
        sa.Integer,
        sa.ForeignKey("items.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    sa.Column("dataset_id", sa.Integer, nullable=False),
    sa.Column("content", sa.Text, nullable=True),
    sa.Column("reasoning", sa.Text, nullable=True),
    sa.Column("finish_reason", sa.String(32), nullable=True),
    sa.Column("prompt_tokens", sa.Integer, nullable=True),
    sa.Column("completion_tokens", sa.Integer, nullable=True),
    # The assistant message as the server sent it (tool_calls and all), JSON text.
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("usage", sa.Text, nullable=True),
    sa.Column("latency", sa.Float, nullable=False),
    sa.Column("server", sa.Text, nullable=True),
    sa.Column("model", sa.Text, nullable=True),
    sa.Column("response_id", sa.Text, nullable=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)
sa.Index("ix_outputs_created_at", outputs.c.created_at)

# One row per failed attempt: the history behind "errors by class" and retry reports.
attempt_errors = sa.Table(
    "attempt_errors",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("item_id", sa.Integer, nullable=False),
    sa.Column("dataset_id", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("error_class", sa.String(64), nullable=False),
    sa.Column("message", sa.Text, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=False),  # retry | failed | released
    sa.Column("created_at", sa.Float, nullable=False),
)
sa.Index("ix_attempt_errors_created_at", attempt_errors.c.created_at)

# Live workers, so that status can tell who is working and who went quiet.
workers = sa.Table(
    "workers",
    metadata,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("host", sa.String(200), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
    sa.Column("stopped_at", sa.Float, nullable=True),
    sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
    sa.Column("completed", sa.Integer, nullable=False, server_default="0"),
)
