"""Alembic environment.

The store runs migrations on its own connection (``config.attributes["connection"]``),
inside a write transaction, so that concurrent first uses serialise and a failed
upgrade leaves nothing behind. Run standalone (``alembic -x db=URL upgrade head``) it
opens the database itself through the same engine factory.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from orchestrator.store.schema import metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_standalone(url: str) -> None:
    from orchestrator.store.engine import create_database

    database = create_database(url)
    try:
        async with database.write() as conn:
            await conn.run_sync(_run)
    finally:
        await database.close()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    asyncio.run(_run_standalone(context.get_x_argument(as_dictionary=True).get("db", "")))
