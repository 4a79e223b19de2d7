"""Throw-away databases for tests: a fresh SQLite file or a fresh PostgreSQL database.

PostgreSQL is reached at `$PUSHGW_TEST_POSTGRES` (default
`postgresql+asyncpg://postgres@127.0.0.1:5432/test`, the CI service). When it is not
reachable, tests skip with the reason, unless `PUSHGW_REQUIRE_POSTGRES=1` (set by
`.ci/run`), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

POSTGRES_ENV = "PUSHGW_TEST_POSTGRES"
REQUIRE_ENV = "PUSHGW_REQUIRE_POSTGRES"
DEFAULT_POSTGRES = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


class PostgresUnavailable(Exception):
    """No PostgreSQL server answered at the configured URL."""


def postgres_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false")


@asynccontextmanager
async def temporary_postgres_database() -> AsyncIterator[str]:
    """Create a uniquely named database, yield its async URL, drop it afterwards."""
    admin_url = make_url(os.environ.get(POSTGRES_ENV, DEFAULT_POSTGRES))
    name = f"pushgw_test_{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(f'CREATE DATABASE "{name}"'))
    except (OSError, ConnectionError) as exc:
        await admin.dispose()
        raise PostgresUnavailable(
            f"PostgreSQL at {admin_url.host}:{admin_url.port}: {exc}"
        ) from None
    except Exception as exc:
        await admin.dispose()
        if "connect" in type(exc).__name__.lower() or "connect" in str(exc).lower():
            raise PostgresUnavailable(str(exc)) from None
        raise
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()
