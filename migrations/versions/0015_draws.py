"""Several samples per prompt: one item per sample, unique on (dataset, key, sample).

Each sample of a prompt is its own unit of exactly-once work, so it is its own row:
``items.sample`` numbers them (0 for every row written before), and the key that made
enqueue idempotent, (dataset, key), becomes (dataset, key, sample). ``datasets.samples``
is how many each prompt of the dataset has, ``draw_seeds`` the seeds a user gave
(JSON list; NULL: derived from each key), and ``draw_mode`` how they are asked for:
``n`` (one request with ``n`` choices, where the server honours it) or ``seeds`` (one
request per sample); a server found to ignore ``n`` turns ``n`` into ``seeds``.

On SQLite a table constraint can only go with the table: items is rebuilt. Its child
tables' foreign keys are pointed at the new table (a text edit of their definitions,
which the SQLite documentation allows for constraints that change nothing on disk)
before the old one is dropped, so that dropping it cascades to none of their rows.

Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from orchestrator.migrations.ops import add_columns, counter, drop_columns, partial_index, setting

revision = "0015"
down_revision = "0014"

_CHILDREN = ("outputs", "item_turns", "requeued_items")


def upgrade() -> None:
    add_columns(
        "datasets",
        counter("samples", "1"),
        sa.Column("draw_seeds", sa.Text, nullable=True),
        setting("draw_mode", "n"),
    )
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_sqlite(with_sample=True)
    else:
        op.add_column("items", counter("sample"))
        op.drop_constraint("uq_items_dataset_id_key", "items", type_="unique")
        op.create_unique_constraint(
            "uq_items_dataset_id_key_sample", "items", ["dataset_id", "key", "sample"]
        )
        op.drop_index("ix_items_longest", table_name="items")
        _longest_index(with_sample=True)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT count(*) FROM items WHERE sample > 0")).scalar_one():
        raise RuntimeError("the database holds several samples per prompt: cannot downgrade")
    if bind.dialect.name == "sqlite":
        _rebuild_sqlite(with_sample=False)
    else:
        op.drop_constraint("uq_items_dataset_id_key_sample", "items", type_="unique")
        op.create_unique_constraint("uq_items_dataset_id_key", "items", ["dataset_id", "key"])
        op.drop_index("ix_items_longest", table_name="items")
        drop_columns("items", "sample")
        _longest_index(with_sample=False)
    drop_columns("datasets", "draw_mode", "draw_seeds", "samples")


def _longest_index(*, with_sample: bool) -> None:
    columns = ["dataset_id", sa.text("predicted_tokens DESC"), "position"]
    if with_sample:
        columns.append("sample")
    partial_index("ix_items_longest", "items", columns, "state = 'pending'")


_COLUMNS = (
    'id, dataset_id, "key", position, request, digest, state, attempts, lease_token,'
    " lease_owner, lease_expires_at, not_before, error_class, last_error, created_at,"
    " updated_at, finished_at, turn, turns, predicted_tokens"
)


def _items_ddl(name: str, *, with_sample: bool) -> str:
    unique = 'dataset_id, "key", sample' if with_sample else 'dataset_id, "key"'
    suffix = "_sample" if with_sample else ""
    return f"""CREATE TABLE {name} (
    id INTEGER NOT NULL,
    dataset_id INTEGER NOT NULL,
    "key" TEXT NOT NULL,
    position INTEGER NOT NULL,
    request TEXT NOT NULL,
    digest VARCHAR(64) NOT NULL,
    state VARCHAR(16) DEFAULT 'pending' NOT NULL,
    attempts INTEGER DEFAULT '0' NOT NULL,
    lease_token VARCHAR(32),
    lease_owner VARCHAR(200),
    lease_expires_at FLOAT,
    not_before FLOAT DEFAULT '0' NOT NULL,
    error_class VARCHAR(64),
    last_error TEXT,
    created_at FLOAT NOT NULL,
    updated_at FLOAT NOT NULL,
    finished_at FLOAT,
    turn INTEGER DEFAULT '0' NOT NULL,
    turns INTEGER DEFAULT '1' NOT NULL,
    predicted_tokens INTEGER DEFAULT '0' NOT NULL,
    {"sample INTEGER DEFAULT '0' NOT NULL," if with_sample else ""}
    CONSTRAINT pk_items PRIMARY KEY (id),
    CONSTRAINT fk_items_dataset_id_datasets FOREIGN KEY(dataset_id)
        REFERENCES datasets (id) ON DELETE CASCADE,
    CONSTRAINT uq_items_dataset_id_key{suffix} UNIQUE ({unique}),
    CONSTRAINT ck_items_ck_items_state_valid
        CHECK (state IN ('pending', 'running', 'done', 'failed')),
    CONSTRAINT ck_items_ck_items_lease_iff_running
        CHECK ((state = 'running') = (lease_token IS NOT NULL))
)"""


def _rebuild_sqlite(*, with_sample: bool) -> None:
    """items copied into a table of the new shape that then takes its name; the rows
    that reference items (outputs, turns, requeues) keep referencing the same ids."""
    bind = op.get_bind()
    op.execute("PRAGMA defer_foreign_keys = ON")
    op.execute(_items_ddl("items_rebuilt", with_sample=with_sample))
    op.execute(f"INSERT INTO items_rebuilt ({_COLUMNS}) SELECT {_COLUMNS} FROM items")
    version = bind.execute(sa.text("PRAGMA schema_version")).scalar_one()
    op.execute("PRAGMA writable_schema = ON")
    for child in _CHILDREN:
        # As first created, or as a rename wrote it (quoted).
        for name in ("items", '"items"'):
            op.execute(
                sa.text(
                    "UPDATE sqlite_master SET sql = replace(sql, :old, :new)"
                    " WHERE type = 'table' AND name = :name"
                ).bindparams(
                    old=f"REFERENCES {name} (id)", new="REFERENCES items_rebuilt (id)", name=child
                )
            )
    op.execute(f"PRAGMA schema_version = {version + 1}")
    op.execute("PRAGMA writable_schema = OFF")
    kept = {t: bind.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in _CHILDREN}
    op.execute("DROP TABLE items")  # its indexes go with it; no row references it now
    op.execute("ALTER TABLE items_rebuilt RENAME TO items")
    for table, count in kept.items():
        if bind.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one() != count:
            raise RuntimeError(f"rebuilding items would have lost rows of {table}")
    lost = "state = 'pending' AND error_class = 'lease_lost'"
    partial_index("ix_items_suspect", "items", ["dataset_id", "position"], lost)
    partial_index("ix_items_running", "items", ["lease_expires_at"], "state = 'running'")
    op.create_index("ix_items_dataset_state", "items", ["dataset_id", "state"])
    partial_index("ix_items_failed", "items", ["dataset_id", "error_class"], "state = 'failed'")
    _longest_index(with_sample=with_sample)
