"""The store under load on PostgreSQL, as the Zulip bouncer's servers see it: the pool's
connections all taken, a table locked (a migration, a slow query holding it), requests
cut by their deadline.

What a Zulip server must see (specs/zulip.md §1, §5.2): every answer within its 15 s
(a notify within `notify_deadline`), a Zulip-format error it retries (5xx) when the
database cannot serve in time, and the gateway serving again once it can, without a
restart and without connections lost to cut requests.

Each test runs on a fresh PostgreSQL database of its own (skipped when none answers).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from gateway.testing import ApnsResponse, ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness
from tests.zulip.conftest import ZulipServer, apns_token, realm_dict, zulip_config

# How long a test waits for an answer that must come: far above the deadlines these
# tests configure (3 s at most), far below the hangs they catch (30 s, or for ever).
GUARD = 20.0
DEADLINE = 3.0  # the zulip plugin's `notify_deadline` here
POOL_SIZE = 1


@dataclass
class Env:
    harness: GatewayHarness
    apns: ApnsSimulator
    other: AsyncEngine  # another client of the same database (locks, held connections)

    @property
    def engine(self) -> AsyncEngine:
        engine: AsyncEngine = self.harness.context("zulip").store.engine
        return engine

    def server(self) -> ZulipServer:
        return ZulipServer(self.harness.client)

    async def legacy_user(self) -> tuple[ZulipServer, str]:
        """A registered server with one legacy APNs registration of user 1."""
        server = self.server()
        await server.register()
        token = apns_token()
        status, body = await server.legacy_register(token, 1, user_id=1)
        assert status == 200, body
        return server, token

    @asynccontextmanager
    async def locked(self, table: str) -> AsyncIterator[AsyncConnection]:
        """`table` locked as a migration locks it, until the block ends."""
        async with self.other.connect() as conn:
            await conn.execute(text("BEGIN"))
            await conn.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
            try:
                yield conn
            finally:
                await conn.execute(text("ROLLBACK"))

    @asynccontextmanager
    async def pool_taken(self) -> AsyncIterator[None]:
        """Every connection the gateway's pool may hand out (`pool_size` + overflow) held."""
        held = []
        pool: Any = self.engine.pool
        try:
            for _ in range(pool.size() + pool._max_overflow):
                held.append(await self.engine.connect())
            yield
        finally:
            for conn in held:
                await conn.close()


@pytest_asyncio.fixture
async def env(tmp_path: Path, postgres_url: str) -> AsyncIterator[Env]:
    other = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path, notify_deadline=DEADLINE)
        config["store"] = {"url": postgres_url, "pool_size": POOL_SIZE}
        try:
            async with GatewayHarness(config) as harness:
                yield Env(harness, apns, other)
        finally:
            await other.dispose()


def retry_later(status: int, body: dict[str, Any]) -> bool:
    """A Zulip-format 503: the server retries it later (specs/zulip.md §1)."""
    return status == 503 and body["result"] == "error" and body["code"] == "INTERNAL_SERVER_ERROR"


async def waiting_on_lock(env: Env) -> int:
    """Statements of the gateway waiting for a lock in its database."""
    async with env.other.connect() as conn:
        count = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
        )
    return int(count or 0)


@contextmanager
def loop_clock_ahead() -> Iterator[Callable[[float], None]]:
    """The running loop's clock, moved ahead on demand: time a request spent waiting,
    without the test waiting it out."""
    loop = asyncio.get_running_loop()
    real = loop.time
    offset = 0.0

    def advance(seconds: float) -> None:
        nonlocal offset
        offset += seconds

    loop.time = lambda: real() + offset  # type: ignore[method-assign]
    try:
        yield advance
    finally:
        del loop.time  # the class's own again


# --- every request's database work within the deadline ----------------------------------


async def test_a_registration_behind_a_locked_table_gets_a_503_by_the_deadline(env: Env) -> None:
    """`push/register` waited for a locked table for as long as it stayed locked (a
    migration: minutes), long after Zulip's 15 s, and held a pooled connection all that
    time. It gets the 503 a notify gets, and registers once the table is free again."""
    server = env.server()
    await server.register()
    token = apns_token()
    async with env.locked("zulip_legacy_devices"):
        status, body = await asyncio.wait_for(server.legacy_register(token, 1, user_id=1), GUARD)
        assert retry_later(status, body), body
    assert env.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    # The server's retry, once the lock is gone: served, no restart.
    status, body = await asyncio.wait_for(server.legacy_register(token, 1, user_id=1), GUARD)
    assert status == 200, body


async def test_an_analytics_upload_behind_a_locked_table_gets_a_503(env: Env) -> None:
    """`server/analytics` had only its authentication bounded: behind a locked realms
    table it waited as long as the lock lasted, past Zulip's 90 s, holding a pooled
    connection. Its database work gets `notify_deadline` from when it starts, then the
    503 Zulip retries; once the table is free the same upload is served."""
    server = env.server()
    await server.register()
    realms = [realm_dict(str(uuid.uuid4()))]
    async with env.locked("zulip_realms"):
        status, body = await asyncio.wait_for(server.analytics(realms), GUARD)
        assert retry_later(status, body), body
    assert env.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    status, body = await asyncio.wait_for(server.analytics(realms), GUARD)
    assert status == 200, body


async def test_server_register_with_the_pool_taken_gets_a_503_by_the_deadline(
    env: Env,
) -> None:
    """`server/register` waited SQLAlchemy's `pool_timeout` (30 s) for a pooled
    connection, then answered 500, after Zulip had given up at 15 s."""
    server = env.server()
    async with env.pool_taken():
        status, body = await asyncio.wait_for(server.try_register(), GUARD)
        assert retry_later(status, body), body
    status, body = await asyncio.wait_for(server.try_register(), GUARD)
    assert (status, body["created"]) == (200, True), body


async def test_a_legacy_notify_answers_with_its_sends_when_the_lookup_after_them_waits(
    env: Env,
) -> None:
    """After its sends, a legacy notify looks up which of the listed devices are gone.
    That lookup had no deadline: behind a locked table (or a full pool: 30 s, then a
    500) the answer came after Zulip had given up, and the server sent the whole notify
    again. The answer comes by the deadline, counting the sends; the deleted devices
    that could not be looked up are reported by a later notify."""
    server, token = await env.legacy_user()
    env.apns.default = ApnsResponse.ok(delay=DEADLINE / 3)
    notify = asyncio.ensure_future(
        server.json(
            "push/notify",
            {"user_id": 1, "apns_payload": {"alert": "x"}, "apple_devices": [token]},
        )
    )
    try:
        await env.apns.wait_for_requests(1, GUARD)  # the lookups before the sends are done
        async with env.locked("zulip_legacy_devices"):
            status, body = await asyncio.wait_for(notify, GUARD)
    finally:
        notify.cancel()
    assert status == 200, body
    assert body["total_apple_devices"] == 1
    assert body["deleted_devices"] == {"android_devices": [], "apple_devices": []}
    assert env.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_a_notify_whose_authentication_waited_gets_only_the_rest_of_its_deadline(
    env: Env,
) -> None:
    """The sends of a notify were waited for `notify_deadline` from when the handler
    started, after the server's authentication: one that had waited for the database
    (a full pool, a locked table) for 9 s of a 10 s deadline answered 19 s after the
    request came, past Zulip's 15 s. Here the loop's clock stands in for the wait."""
    server, token = await env.legacy_user()
    env.apns.default = ApnsResponse.ok(delay=10 * GUARD)  # an APNs that does not answer
    with loop_clock_ahead() as advance:
        async with env.locked("zulip_servers"):
            notify = asyncio.ensure_future(
                server.json("push/notify", {"user_id": 1, "apple_devices": [token]})
            )
            try:
                while not await waiting_on_lock(env):  # the authentication waits
                    await asyncio.sleep(0.01)
                advance(DEADLINE * 0.8)
            except BaseException:
                notify.cancel()
                raise
        try:
            status, body = await asyncio.wait_for(notify, DEADLINE * 0.8)
        finally:
            notify.cancel()
    assert status == 200, body
    assert body["total_apple_devices"] == 1  # listed; not sent in time (still running)


# --- no connection lost to a request cut by its deadline --------------------------------


async def test_requests_cut_mid_query_return_their_connections_and_the_next_are_served(
    env: Env,
) -> None:
    """Twenty notifies behind a locked table, more than the pool holds: each is cut by
    its deadline inside its query (asyncpg cancelled mid-statement). Every connection
    comes back to the pool, none is left checked out, and once the table is free the
    same load is served at once: no restart needed."""
    server = env.server()
    await server.register()
    body = {"user_id": 1, "apple_devices": [], "android_devices": []}
    async with env.locked("zulip_servers"):
        answers = await asyncio.wait_for(
            asyncio.gather(*(server.json("push/notify", body) for _ in range(20))), GUARD
        )
        assert all(retry_later(status, reply) for status, reply in answers), answers
    assert env.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    answers = await asyncio.wait_for(
        asyncio.gather(*(server.json("push/notify", body) for _ in range(20))), GUARD
    )
    assert [status for status, _ in answers] == [200] * 20
    assert env.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    response = await env.harness.client.get("/readyz")
    assert (response.status, (await response.json())["store"]) == (200, True)
