"""Alembic operations that several migrations repeat, each written once.

Each is only a sequence of ``op`` calls: a migration that uses one does what it did when
it spelled the calls out. Nothing here reads the current schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op


def partial_index(name: str, table: str, columns: Sequence[Any], where: str) -> None:
    """An index of the rows matching ``where``, on either backend."""
    clause = sa.text(where)
    op.create_index(name, table, list(columns), sqlite_where=clause, postgresql_where=clause)


def add_columns(table: str, *columns: sa.Column[Any]) -> None:
    """``columns`` added to ``table``, in order."""
    for column in columns:
        op.add_column(table, column)


def drop_columns(table: str, *names: str) -> None:
    """``names`` dropped from ``table`` in order, by native DROP COLUMN (SQLite 3.35+): a
    batch copy of the table would lose the expression index ix_outputs_started, which
    SQLAlchemy cannot reflect."""
    for name in names:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")


def counter(name: str, default: str = "0") -> sa.Column[Any]:
    """A NOT NULL integer column with a constant default."""
    return sa.Column(name, sa.Integer, nullable=False, server_default=default)


def setting(name: str, default: str, length: int = 8) -> sa.Column[Any]:
    """A NOT NULL short string column with a constant default."""
    return sa.Column(name, sa.String(length), nullable=False, server_default=default)
