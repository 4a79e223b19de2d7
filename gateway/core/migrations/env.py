"""Alembic environment: runs migrations on the gateway's async engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from gateway.core.store import MIGRATION_LOCK, check_known, create_engine


def _run(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        # Gateway nodes sharing the database start together: one migrates at a time.
        # Held until this transaction (every revision of the run) commits or rolls back;
        # the next one then reads the versions it left, and has nothing to apply twice.
        # Taken before Alembic looks: the migrations then run in this transaction.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
    elif connection.dialect.name == "sqlite":
        # sqlite3 runs DDL outside any transaction: a revision failing half way (a crash,
        # a full disk) left its first tables created and its version row not, and every
        # start after failed on `table ... already exists`. One transaction, as above
        # (SQLite's DDL is transactional); IMMEDIATE takes the write lock now, waiting the
        # busy timeout for a running gateway's writes, instead of failing at once when
        # the first DDL follows Alembic's reads.
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    context.configure(connection=connection, render_as_batch=True)
    heads = context.config.attributes.get("heads")
    if heads is not None:  # an upgrade: the database must hold no revision beyond ours
        check_known(context.script, context.get_context().get_current_heads(), heads)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_engine(context.config.attributes["url"])
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:  # a failed revision too: a pooled connection must not outlive this loop
        await engine.dispose()


asyncio.run(_main())
