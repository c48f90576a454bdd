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


def _cascading(name: str, parent: str, **keys: bool) -> sa.Column:
    """A reference to ``parent``'s id: a row goes when the row it belongs to does."""
    return sa.Column(name, sa.Integer, sa.ForeignKey(f"{parent}.id", ondelete="CASCADE"), **keys)


def _partial_index(name: str, *columns: object, where: sa.ColumnElement[bool]) -> sa.Index:
    """An index of the rows ``where`` holds for, the same on SQLite and PostgreSQL."""
    return sa.Index(name, *columns, sqlite_where=where, postgresql_where=where)


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
    # last: generate the final assistant turn; all: every assistant turn, in order, each
    # conditioned on the turns already generated (orchestrator.items.conversation).
    sa.Column("regenerate", sa.String(8), nullable=False, server_default="last"),
    # What a truncated answer (finish_reason "length") becomes: keep | retry | fail.
    sa.Column("on_truncated", sa.String(8), nullable=False, server_default="keep"),
    # What structured output that is not the JSON asked for becomes: keep | retry | fail.
    sa.Column("on_invalid", sa.String(8), nullable=False, server_default="keep"),
    # A request longer than the server's context: fail, or fit (max_tokens lowered).
    sa.Column("on_overflow", sa.String(8), nullable=False, server_default="fail"),
    # Earlier turns' reasoning in the history sent: keep | drop (for a server refusing it).
    sa.Column("history_reasoning", sa.String(8), nullable=False, server_default="keep"),
    # Rows already in the target model's format, stored as done (nothing is generated).
    sa.Column("passthrough", sa.Boolean, nullable=False, server_default=sa.false()),
    # Where items go: chat (/v1/chat/completions) | completions (/v1/completions, a plain
    # prompt, for base models and few-shot prompts).
    sa.Column("endpoint", sa.String(16), nullable=False, server_default="chat"),
    # Answers per prompt (items.sample), the seeds a user gave them (JSON list; NULL:
    # derived from each key), and how they are asked for: n (one request with n
    # choices) or seeds (a request per sample; what n becomes on a server ignoring it).
    sa.Column("samples", sa.Integer, nullable=False, server_default="1"),
    sa.Column("draw_seeds", sa.Text, nullable=True),
    sa.Column("draw_mode", sa.String(8), nullable=False, server_default="n"),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

items = sa.Table(
    "items",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    _cascading("dataset_id", "datasets", nullable=False),
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
    # Multi-turn regeneration: the next assistant turn to generate, of how many. Turns
    # already generated are in item_turns, so a conversation resumes where it stopped.
    sa.Column("turn", sa.Integer, nullable=False, server_default="0"),
    sa.Column("turns", sa.Integer, nullable=False, server_default="1"),
    # The answer's length in tokens as the input line predicts it: the original answer
    # it holds (the turns the model writes again), estimated from their text; 0: none.
    # Claims take the longest first (``store.claims``).
    sa.Column("predicted_tokens", sa.Integer, nullable=False, server_default="0"),
    # Several samples per prompt (migration 0015): each is its own row, numbered from 0,
    # sharing the prompt's key, position and request; 0 for a dataset of one sample.
    sa.Column("sample", sa.Integer, nullable=False, server_default="0"),
    # Deaths of its worker the item was in flight for (migration 0018, ``store.crashes``),
    # and those at which it was its worker's only item with two or more: the evidence
    # that tells an item that kills its worker from the bystanders of a crash.
    sa.Column("deaths", sa.Integer, nullable=False, server_default="0"),
    sa.Column("deaths_alone", sa.Integer, nullable=False, server_default="0"),
    sa.UniqueConstraint("dataset_id", "key", "sample"),
    sa.CheckConstraint("state IN ('pending', 'running', 'done', 'failed')", name="state_valid"),
    # A running row always carries its fence; no other state does.
    sa.CheckConstraint("(state = 'running') = (lease_token IS NOT NULL)", name="lease_iff_running"),
)

# "Next pending, longest first" stays an index range scan however many rows are done
# (migration 0009); a dataset of prompts (all 0) is read in input order.
_partial_index(
    "ix_items_longest",
    items.c.dataset_id,
    items.c.predicted_tokens.desc(),
    items.c.position,
    items.c.sample,
    where=items.c.state == "pending",
)
# Pending items that were in flight when a worker died: those that died twice or more
# are claimed in groups of one level (``store.crashes``), found without scanning every
# pending row; ``status`` counts them all from here.
_partial_index(
    "ix_items_suspect",
    items.c.dataset_id,
    items.c.deaths,
    items.c.position,
    where=sa.and_(items.c.state == "pending", items.c.deaths > 0),
)
# The reaper and the per-dataset running counts only look at running rows.
_partial_index(
    "ix_items_running",
    items.c.lease_expires_at,
    where=items.c.state == "running",
)
sa.Index("ix_items_dataset_state", items.c.dataset_id, items.c.state)
# Status counts failed items by class, and requeue picks them by class: both read only
# this small index. Enqueue never writes a failed row, so inserts do not maintain it.
_partial_index(
    "ix_items_failed",
    items.c.dataset_id,
    items.c.error_class,
    where=items.c.state == "failed",
)

outputs = sa.Table(
    "outputs",
    metadata,
    _cascading("item_id", "items", primary_key=True),
    sa.Column("dataset_id", sa.Integer, nullable=False),
    # Left empty since answers are stored once, in ``message``; rows written before keep
    # a copy of the text here.
    sa.Column("content", sa.Text, nullable=True),
    sa.Column("reasoning", sa.Text, nullable=True),
    sa.Column("finish_reason", sa.Text, nullable=True),
    sa.Column("prompt_tokens", sa.Integer, nullable=True),
    sa.Column("completion_tokens", sa.Integer, nullable=True),
    # Of the prompt tokens, those the server took from its prefix cache (None: not said).
    sa.Column("cached_tokens", sa.Integer, nullable=True),
    # The assistant message as the server sent it (tool_calls and all), JSON text.
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("usage", sa.Text, nullable=True),
    sa.Column("latency", sa.Float, nullable=False),
    sa.Column("server", sa.Text, nullable=True),
    sa.Column("model", sa.Text, nullable=True),
    sa.Column("response_id", sa.Text, nullable=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    # Quality flags, a bitmask (orchestrator.items.quality): truncated, empty, unclosed_think...
    sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
    # The request parameters the answer was made with (param_sets.hash).
    sa.Column("params_hash", sa.String(64), nullable=True),
    # The answer's token ids, logprobs and top-k as the server gave them, packed
    # (orchestrator.items.tokens); NULL when it gave none.
    sa.Column("tokens", sa.LargeBinary, nullable=True),
    # The server's own prompt and generated token ids, packed (orchestrator.items.token_ids);
    # NULL when none were asked for or given.
    sa.Column("ids", sa.LargeBinary, nullable=True),
)
# Status reads outputs through these two narrow indexes, never the wide rows (answer
# text, message JSON): per-dataset count and tokens, the recent window (a range) and the
# last answer (one seek) from the first; the first answer's start (one seek) from the
# second.
sa.Index(
    "ix_outputs_totals",
    outputs.c.dataset_id,
    outputs.c.created_at,
    outputs.c.completion_tokens,
)
# The cache share status shows, read from this narrow index like the totals above.
sa.Index("ix_outputs_cache", outputs.c.dataset_id, outputs.c.prompt_tokens, outputs.c.cached_tokens)
sa.Index("ix_outputs_started", outputs.c.dataset_id, outputs.c.created_at - outputs.c.latency)
# Flagged answers only (truncated, empty, ...): status counts them from here, and an
# unflagged answer, the usual kind, writes nothing to it.
_partial_index(
    "ix_outputs_flagged",
    outputs.c.dataset_id,
    outputs.c.flags,
    where=outputs.c.flags != 0,
)

# Each turn of a multi-turn regeneration, written as it is generated (the last one too).
item_turns = sa.Table(
    "item_turns",
    metadata,
    _cascading("item_id", "items", primary_key=True),
    sa.Column("turn", sa.Integer, primary_key=True),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("finish_reason", sa.Text, nullable=True),
    sa.Column("usage", sa.Text, nullable=True),
    sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
    sa.Column("latency", sa.Float, nullable=False),
    sa.Column("server", sa.Text, nullable=True),
    sa.Column("model", sa.Text, nullable=True),
    sa.Column("params_hash", sa.String(64), nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    # As ``outputs.ids``: this turn's prompt and generated token ids.
    sa.Column("ids", sa.LargeBinary, nullable=True),
)

# Request parameters by hash: every output names the set it was made with.
param_sets = sa.Table(
    "param_sets",
    metadata,
    sa.Column("hash", sa.String(64), primary_key=True),
    sa.Column("params", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

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
    # The server the attempt was sent to (masked as servers are everywhere); NULL when
    # none was (no server up, a lease lost, a shutdown) or for rows written before 0010.
    sa.Column("server", sa.Text, nullable=True),
)
sa.Index("ix_attempt_errors_created_at", attempt_errors.c.created_at)
# Errors by dataset, class and outcome (status) as an index-only count.
sa.Index(
    "ix_attempt_errors_class",
    attempt_errors.c.dataset_id,
    attempt_errors.c.error_class,
    attempt_errors.c.outcome,
)
# One item's attempts (inspect), without reading every attempt of the run.
sa.Index("ix_attempt_errors_item_id", attempt_errors.c.item_id)

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
    # When ``completed`` last moved: a worker that heartbeats but answers nothing for a
    # long while (a hung server, a stuck request) shows up as stalled.
    sa.Column("progress_at", sa.Float, nullable=True),
    # Its lease: a worker not heard from for longer has lost its items to the others.
    sa.Column("lease_seconds", sa.Float, nullable=True),
    # Its servers as of its latest heartbeat: how many, how many reachable, those down
    # (a JSON list of {server, reason, since}), and since when none is reachable.
    sa.Column("servers", sa.Integer, nullable=True),
    sa.Column("servers_up", sa.Integer, nullable=True),
    sa.Column("servers_down", sa.Text, nullable=True),
    sa.Column("unreachable_since", sa.Float, nullable=True),
)

# Requeues, so that one can be taken back (``requeue --undo``): each requeue, what every
# item it moved was before, and the answers of done items it moved, kept (never deleted)
# beside the live outputs. Written only by requeue and undo, never on the hot paths.
requeues = sa.Table(
    "requeues",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("selection", sa.Text, nullable=False, server_default="{}"),
    sa.Column("items", sa.Integer, nullable=False),
    sa.Column("undone_at", sa.Float, nullable=True),
)

requeued_items = sa.Table(
    "requeued_items",
    metadata,
    sa.Column("requeue_id", sa.Integer, primary_key=True),
    _cascading("item_id", "items", primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("error_class", sa.String(64), nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("turn", sa.Integer, nullable=False),
    # The request as it was, when the requeue changed it (--max-tokens), else NULL.
    sa.Column("request", sa.Text, nullable=True),
)
sa.Index("ix_requeued_items_item_id", requeued_items.c.item_id)

superseded_outputs = sa.Table(
    "superseded_outputs",
    metadata,
    sa.Column("requeue_id", sa.Integer, primary_key=True),
    *[
        sa.Column(c.name, c.type, primary_key=c.name == "item_id", nullable=c.nullable)
        for c in outputs.columns
    ],
)

superseded_turns = sa.Table(
    "superseded_turns",
    metadata,
    sa.Column("requeue_id", sa.Integer, primary_key=True),
    *[
        sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
        for c in item_turns.columns
    ],
)

# Tokens generated and thrown away, a row per dataset and cause (store.waste): added to
# in the transaction that throws them away, read whole by status.
wasted_tokens = sa.Table(
    "wasted_tokens",
    metadata,
    _cascading("dataset_id", "datasets", primary_key=True),
    sa.Column("cause", sa.String(32), primary_key=True),
    # Attempts thrown away; of them, those whose token count nobody knows (``unknown``,
    # counted in ``requests`` but not in ``tokens``).
    sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("unknown", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# What the providers billed (store.spend): a row per dataset, server, model, batched or
# not, and kind (``kept`` or the cause an answer was thrown away for), added to in the
# transaction that writes or throws away each answer; status prices it, a budget reads it.
spend = sa.Table(
    "spend",
    metadata,
    _cascading("dataset_id", "datasets", primary_key=True),
    sa.Column("server", sa.Text, primary_key=True),
    sa.Column("model", sa.Text, primary_key=True),
    sa.Column("batched", sa.Integer, primary_key=True),
    sa.Column("kind", sa.String(32), primary_key=True),
    sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# A provider's batches (``--batch-api``, store.batches): each step of each batch written
# before and after its call, and the lines it asks for, so that a worker that takes the
# items of a dead one adopts their live batch instead of paying for it again.
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    # The run's own id of the batch, sent in the provider's ``metadata``: found by it.
    sa.Column("key", sa.String(64), nullable=False, unique=True),
    sa.Column("server", sa.Text, nullable=False),
    sa.Column("endpoint", sa.String(32), nullable=False),
    # packing | uploaded | created | collected | closed | abandoned (store.batches)
    sa.Column("state", sa.String(16), nullable=False),
    # The provider's own status of the batch, as last seen.
    sa.Column("status", sa.String(16), nullable=True),
    *(
        sa.Column(name, sa.Text, nullable=True)
        for name in ("input_file_id", "provider_id", "output_file_id", "error_file_id")
    ),
    *(
        sa.Column(name, sa.Integer, nullable=False, server_default="0")
        for name in ("requests", "bytes", "completed", "failed")
    ),
    sa.Column("worker", sa.Text, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
)
sa.Index("ix_batches_state", batches.c.state)

# One line of a batch: the item and turn it asks for; ``settled`` once its answer (or
# error) was written for the item.
batch_entries = sa.Table(
    "batch_entries",
    metadata,
    _cascading("batch_id", "batches", primary_key=True),
    sa.Column("custom_id", sa.String(64), primary_key=True),
    _cascading("item_id", "items", nullable=False),
    sa.Column("turn", sa.Integer, nullable=False),
    sa.Column("settled", sa.Integer, nullable=False, server_default="0"),
)
sa.Index("ix_batch_entries_item_id", batch_entries.c.item_id)

# Deleted datasets, kept aside until purged (``dataset delete``, migration 0016): each
# deletion is a row, and every row it took from the tables below is kept as it was in
# ``deleted_<table>`` under the deletion's id, so that its undo puts them back as they
# were. Nothing on the hot paths reads or writes these tables.
deletions = sa.Table(
    "deletions",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("dataset_id", sa.Integer, nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    # Items by state and the rows kept of each table, JSON: what the deletion took.
    sa.Column("counts", sa.Text, nullable=False, server_default="{}"),
    sa.Column("undone_at", sa.Float, nullable=True),
    sa.Column("purged_at", sa.Float, nullable=True),
)

DELETED_FROM = (
    datasets,
    items,
    outputs,
    item_turns,
    attempt_errors,
    requeued_items,
    superseded_outputs,
    superseded_turns,
    wasted_tokens,
    spend,
)
"""The tables a dataset's rows are in, parents first (the order an undo inserts in)."""


def _kept(table: sa.Table) -> sa.Table:
    """``table``'s columns, with no key or constraint, under a deletion's id."""
    kept = sa.Table(
        f"deleted_{table.name}",
        metadata,
        sa.Column("deletion_id", sa.Integer, nullable=False),
        *[sa.Column(c.name, c.type, nullable=c.nullable) for c in table.columns],
    )
    sa.Index(f"ix_deleted_{table.name}_deletion_id", kept.c.deletion_id)
    return kept


KEPT = {table.name: _kept(table) for table in DELETED_FROM}
"""``deleted_<table>`` by the name of the table its rows came from."""
