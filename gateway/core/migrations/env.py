"""Alembic environment: runs migrations on the gateway's async engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from gateway.core.store import create_engine


def _run(connection: Connection) -> None:
    context.configure(connection=connection, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_engine(context.config.attributes["url"])
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


asyncio.run(_main())
