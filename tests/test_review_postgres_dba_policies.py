"""The policies a production PostgreSQL enforces on its clients, set for real on a
database and roles of the test's own: a least-privileged role (no CREATE) whose tables
live in a schema other than `public` (search_path), `statement_timeout`, a missing
grant, `default_transaction_read_only` during a switchover.

Each request that fails on one answers in Zulip's envelope (a 5xx the server retries),
logs one line that says what the error is and what to check (never the driver's text,
which may quote a token), and the gateway recovers by itself once the DBA is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.core.store import database_problem
from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.databases import DEFAULT_POSTGRES, POSTGRES_ENV, postgres_required
from gateway.testing.harness import GatewayHarness
from plugins.zulip import gc
from plugins.zulip.crypto import generate_push_key
from tests.conftest import LOG_CAPTURE
from tests.zulip.conftest import Env, ZulipServer, apns_token, zulip_config
from tests.zulip.test_e2ee import _apns_request

GUARD = 30.0  # far above what the gateway should take, far below the hangs caught
SCHEMA = "pushgw"


@dataclass
class Cluster:
    """A database of the test's own, its owner (who migrates) and the gateway's role."""

    server: str  # superuser URL of another database (ALTER DATABASE: not while read-only)
    admin: str  # superuser URL of the database
    owner: str  # URL as the owner (CREATE on the schema)
    app: str  # URL as the gateway's role (SELECT, INSERT, UPDATE, DELETE only)
    database: str
    app_role: str

    async def sql(self, url: str, *statements: str) -> None:
        engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                for statement in statements:
                    await conn.execute(text(statement))
        finally:
            await engine.dispose()

    async def end_sessions(self) -> None:
        """pg_terminate_backend on the gateway's connections (settings apply to new ones)."""
        await self.sql(
            self.server,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{self.database}' AND pid <> pg_backend_pid()",
        )

    async def read_only(self, on: bool) -> None:
        setting = "on" if on else "off"
        await self.sql(
            self.server,
            f'ALTER DATABASE "{self.database}" SET default_transaction_read_only = {setting}',
        )
        await self.end_sessions()

    async def grant_app(self) -> None:
        role = f'"{self.app_role}"'
        await self.sql(
            self.owner,
            f"GRANT USAGE ON SCHEMA {SCHEMA} TO {role}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {SCHEMA} TO {role}",
            f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {SCHEMA} TO {role}",
        )


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    base = make_url(os.environ.get(POSTGRES_ENV, DEFAULT_POSTGRES))
    tag = uuid.uuid4().hex[:10]
    database, owner, app = f"review_dba_{tag}", f"review_dba_owner_{tag}", f"review_dba_app_{tag}"
    admin = base.render_as_string(hide_password=False)
    here = Cluster(
        server=admin,
        admin=base.set(database=database).render_as_string(hide_password=False),
        owner=base.set(database=database, username=owner, password=None).render_as_string(),
        app=base.set(database=database, username=app, password=None).render_as_string(),
        database=database,
        app_role=app,
    )
    try:
        await here.sql(
            admin,
            f'CREATE ROLE "{owner}" LOGIN',
            f'CREATE ROLE "{app}" LOGIN',
            f'CREATE DATABASE "{database}" OWNER "{owner}"',
        )
    except (OSError, ConnectionError, DBAPIError) as exc:
        if postgres_required():
            pytest.fail(f"PostgreSQL is required here: {type(exc).__name__}")
        pytest.skip(f"no PostgreSQL to create roles in: {type(exc).__name__}")
    try:
        await here.sql(
            here.admin,
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
            f'CREATE SCHEMA {SCHEMA} AUTHORIZATION "{owner}"',
            f'ALTER ROLE "{owner}" IN DATABASE "{database}" SET search_path = {SCHEMA}',
            f'ALTER ROLE "{app}" IN DATABASE "{database}" SET search_path = {SCHEMA}',
        )
        yield here
    finally:
        await here.sql(
            admin,
            f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)',
            f'DROP ROLE IF EXISTS "{app}"',
            f'DROP ROLE IF EXISTS "{owner}"',
        )


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, cluster: Cluster, *, migrate: bool = True) -> AsyncIterator[Env]:
    """Migrated by the owner (`migrate`), then served as the least-privileged role (whose
    `store.auto_upgrade` finds the database at head)."""
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path)
        if migrate:
            config["store"] = {"url": cluster.owner}
            async with GatewayHarness(config):
                pass
            await cluster.grant_app()
        config["store"] = {"url": cluster.app, "pool_size": 2}
        async with GatewayHarness(config) as harness:
            yield Env(harness, apns, fcm)


async def notify(server: ZulipServer, realm: str, token: str) -> tuple[int, dict[str, Any]]:
    body = {
        "realm_uuid": realm,
        "push_requests": [_apns_request(token, generate_push_key(), {"content": "hi"})],
    }
    return await asyncio.wait_for(server.json("push/e2ee/notify", body), GUARD)


def assert_retry_later(status: int, body: dict[str, Any]) -> None:
    """A 5xx in Zulip's envelope, which a Zulip server retries; no traceback in it."""
    assert status >= 500, (status, body)
    assert body["result"] == "error" and body["code"] == "INTERNAL_SERVER_ERROR", body


def logged_since(mark: int) -> str:
    return "\n".join(LOG_CAPTURE.lines[mark:])


# --- least privilege, another schema, a switchover -------------------------------------


async def test_a_read_only_switchover_is_named_in_the_log_and_recovers(
    tmp_path: Path, cluster: Cluster, register_secret: Any
) -> None:
    """During a switchover (`default_transaction_read_only = on`) a registration failed
    with `zulip: ... failed with DBAPIError`: nothing told the operator that the database
    was read-only. Now the line names the error, its SQLSTATE and the cause; the token is
    in no line; notifies (reads) go on; registrations work again once it is writable."""
    async with gateway(tmp_path, cluster) as env:
        server, realm = await env.ready_server()
        token = apns_token()
        register_secret(token)
        assert (await server.e2ee_register(realm, token))[0] == 200  # no CREATE, schema pushgw
        await cluster.read_only(True)
        mark = len(LOG_CAPTURE.lines)
        refused = apns_token()
        register_secret(refused)
        assert_retry_later(*await server.e2ee_register(realm, refused))
        status, body = await notify(server, realm, token)
        assert (status, body["apple_successfully_sent_count"]) == (200, 1), body
        log = logged_since(mark)
        assert "ReadOnlySQLTransactionError (SQLSTATE 25006)" in log, log
        assert "read-only" in log.split("SQLSTATE 25006", 1)[1], log
        assert "Traceback" not in log and refused not in log
        await cluster.read_only(False)
        assert (await server.e2ee_register(realm, refused))[0] == 200


async def test_statement_timeout_and_a_missing_grant_say_what_to_check(
    tmp_path: Path, cluster: Cluster
) -> None:
    """A statement cancelled by the role's `statement_timeout` (a table locked by a DBA)
    and a privilege the role lacks were both `failed with DBAPIError` in the log."""
    async with gateway(tmp_path, cluster) as env:
        server, realm = await env.ready_server()
        await cluster.sql(
            cluster.admin, f'ALTER ROLE "{cluster.app_role}" SET statement_timeout = 200'
        )
        await cluster.end_sessions()
        locker = create_async_engine(cluster.owner)
        try:
            async with locker.connect() as conn:
                await conn.execute(text("LOCK TABLE zulip_realms IN ACCESS EXCLUSIVE MODE"))
                mark = len(LOG_CAPTURE.lines)
                assert_retry_later(*await server.e2ee_register(realm, apns_token()))
                log = logged_since(mark)
                await conn.rollback()
        finally:
            await locker.dispose()
        assert "QueryCanceledError (SQLSTATE 57014)" in log and "statement_timeout" in log, log
        assert (await server.e2ee_register(realm, apns_token()))[0] == 200  # lock released

        await cluster.sql(
            cluster.owner, f'REVOKE INSERT ON zulip_e2ee_devices FROM "{cluster.app_role}"'
        )
        mark = len(LOG_CAPTURE.lines)
        assert_retry_later(*await server.e2ee_register(realm, apns_token()))
        log = logged_since(mark)
        assert "SQLSTATE 42501" in log and "grant" in log, log


async def test_a_gc_failing_on_a_read_only_database_leaves_the_node_ready(
    tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node started during a switchover ran its gc at start, which failed on the
    read-only database, and /readyz answered 503 until the gc's retry 5 minutes later,
    though every request was served: every node so started was out of its balancer at
    once, and stayed out after the database was writable again. Now the node stays
    ready, `service_status` shows the gc failing, and `ok` once a retry succeeds."""
    monkeypatch.setattr(gc, "GC_RETRY", 0.2)  # the retry comes within the test
    failed = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("zulip gc failed"):
                failed.set()

    seen = Seen()
    logging.getLogger("plugins.zulip.gc").addHandler(seen)
    try:
        async with gateway(tmp_path, cluster) as env:
            server, realm = await env.ready_server()
            token = apns_token()
            assert (await server.e2ee_register(realm, token))[0] == 200
        await cluster.read_only(True)
        async with gateway(tmp_path, cluster, migrate=False) as env:  # in the switchover
            await asyncio.wait_for(failed.wait(), GUARD)
            response = await env.client.get("/readyz")
            ready = await response.json()
            assert (response.status, ready["services"]["zulip"]) == (200, True), ready
            assert ready["service_status"]["zulip"]["gc"] == "failing", ready
            server.client = env.client
            assert (await notify(server, realm, token))[0] == 200
            await cluster.read_only(False)
            async with asyncio.timeout(GUARD):
                while ready["service_status"]["zulip"]["gc"] != "ok":
                    await asyncio.sleep(0.05)  # polls the gc's retry, which runs on its own
                    ready = await (await env.client.get("/readyz")).json()
    finally:
        logging.getLogger("plugins.zulip.gc").removeHandler(seen)


# --- the log line itself ------------------------------------------------------------------


async def test_the_problem_line_never_quotes_the_drivers_message(cluster: Cluster) -> None:
    """asyncpg's message for a parameter it cannot encode quotes the value (a token)."""
    secret = "TOKEN-" + uuid.uuid4().hex
    engine = create_async_engine(cluster.admin)
    try:
        async with engine.connect() as conn:
            with pytest.raises(DBAPIError) as raised:
                await conn.execute(text("SELECT CAST(:v AS integer) + 1"), {"v": secret})
    finally:
        await engine.dispose()
    assert secret in str(raised.value)  # what a line by message would have shown
    problem = database_problem(raised.value)
    assert problem is not None and secret not in problem
    assert database_problem(ValueError(secret)) is None
