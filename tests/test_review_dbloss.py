"""The database goes away for a while, on PostgreSQL: backends killed by an admin, the
server restarting (connections cut, new ones refused), a network partition (packets
dropped, nothing answered), a statement waiting on a lock.

Real PostgreSQL, a fresh database per test (skipped when none is reachable, a failure
with PUSHGW_REQUIRE_POSTGRES=1), reached through a TCP proxy the test can cut or pause.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness
from plugins.zulip.crypto import generate_push_key
from tests.conftest import LOG_CAPTURE
from tests.zulip.conftest import Env, ZulipServer, apns_token, zulip_config
from tests.zulip.test_e2ee import _apns_request

# Far above what the gateway should take (a few seconds), far below the hangs caught.
GUARD = 30.0
PASSWORD = "dbloss-Pa55word-not-for-logs"


class PgProxy:
    """A TCP proxy in front of PostgreSQL.

    `cut()`: every connection closed, new ones closed at once (a restart, a failover).
    `blackhole()`: connections kept, nothing forwarded either way, new ones accepted and
    never answered (a network partition, a stopped VM). `restore()`: forward again.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.mode = "up"
        self.server: asyncio.Server | None = None
        self.links: set[asyncio.StreamWriter] = set()
        self.flowing = asyncio.Event()
        self.flowing.set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        self.links.add(writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            await self.flowing.wait()
            if self.mode == "cut":
                return
            up_reader, upstream_writer = await asyncio.open_connection(*self.target)
            self.links.add(upstream_writer)
            await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(up_reader, writer))
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    self.links.discard(w)
                    w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.flowing.wait()
                if self.mode == "cut" or writer.transport.is_closing():
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    def cut(self) -> None:
        self.mode = "cut"
        self.flowing.set()  # wake paused pipes: they see the cut and close
        for w in list(self.links):
            w.transport.abort()

    def blackhole(self) -> None:
        self.mode = "blackhole"
        self.flowing.clear()

    def restore(self) -> None:
        self.mode = "up"
        self.flowing.set()

    async def close(self) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 2.0)


@pytest_asyncio.fixture
async def proxied(postgres_url: str) -> AsyncIterator[tuple[PgProxy, str]]:
    """(proxy, URL of the test's database through the proxy, with a password)."""
    url = make_url(postgres_url)
    proxy = PgProxy(url.host or "127.0.0.1", url.port or 5432)
    await proxy.start()
    through = url.set(host="127.0.0.1", port=proxy.port, password=PASSWORD)
    try:
        yield proxy, through.render_as_string(hide_password=False)
    finally:
        await proxy.close()


@pytest_asyncio.fixture
async def admin(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        yield engine
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def zulip_gateway(tmp_path: Path, url: str, **overrides: Any) -> AsyncIterator[Env]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path, **overrides)
        config["store"] = {"url": url, "pool_size": 2}
        async with GatewayHarness(config) as harness:
            yield Env(harness, apns, fcm)


async def registered_device(env: Env, register_secret: Any) -> tuple[ZulipServer, str, str]:
    server, realm = await env.ready_server()
    token = apns_token()
    register_secret(token)
    assert (await server.e2ee_register(realm, token))[0] == 200
    return server, realm, token


async def notify(server: ZulipServer, realm: str, token: str) -> tuple[int, dict[str, Any]]:
    body = {
        "realm_uuid": realm,
        "push_requests": [_apns_request(token, generate_push_key(), {"content": "hi"})],
    }
    return await asyncio.wait_for(server.json("push/e2ee/notify", body), GUARD)


async def readyz(env: Env) -> tuple[int, dict[str, Any]]:
    resp = await asyncio.wait_for(env.client.get("/readyz"), GUARD)
    return resp.status, await resp.json()


async def kill_backends(admin: AsyncEngine, database: str) -> int:
    async with admin.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": database},
        )
        return len(rows.all())


def log_mark() -> int:
    return len(LOG_CAPTURE.lines)


def logged_since(mark: int) -> str:
    return "\n".join(LOG_CAPTURE.lines[mark:])


def assert_retry_later(status: int, body: dict[str, Any]) -> None:
    """A 5xx in Zulip's envelope: what a Zulip server retries (specs/zulip.md §1)."""
    assert status >= 500, (status, body)
    assert body["result"] == "error" and body["code"], body
    assert PASSWORD not in str(body)


# --- backends killed by an admin ---------------------------------------------------------


async def test_killed_backends_are_replaced_without_an_error(
    tmp_path: Path, postgres_url: str, admin: AsyncEngine, register_secret: Any
) -> None:
    """`pg_terminate_backend` on every pooled connection (an admin, a proxy dropping idle
    connections): the next request is served on a new one (pool_pre_ping), not a 500."""
    async with zulip_gateway(tmp_path, postgres_url) as env:
        server, realm, token = await registered_device(env, register_secret)
        assert (await notify(server, realm, token))[0] == 200
        assert await kill_backends(admin, make_url(postgres_url).database or "") >= 1
        status, body = await notify(server, realm, token)
        assert (status, body["apple_successfully_sent_count"]) == (200, 1), body
        assert (await readyz(env))[0] == 200


# --- a restart: connections cut, new ones refused -----------------------------------------


async def test_a_restart_answers_5xx_then_recovers_by_itself(
    tmp_path: Path, proxied: tuple[PgProxy, str], register_secret: Any
) -> None:
    """While the database restarts, requests end at once in a 5xx in Zulip's envelope
    (retried by the server), /readyz is 503; once it is back, both recover with no
    restart of the gateway. The URL's password is in no answer and no log line."""
    register_secret(PASSWORD)
    proxy, url = proxied
    async with zulip_gateway(tmp_path, url) as env:
        server, realm, token = await registered_device(env, register_secret)
        mark = log_mark()
        proxy.cut()
        assert_retry_later(*await notify(server, realm, token))
        assert_retry_later(*await server.e2ee_register(realm, apns_token()))
        status, ready = await readyz(env)
        assert (status, ready["store"]) == (503, False)
        proxy.restore()
        status, body = await notify(server, realm, token)
        assert (status, body["apple_successfully_sent_count"]) == (200, 1), body
        assert (await readyz(env))[0] == 200
        log = logged_since(mark)
        assert PASSWORD not in log and "Traceback" not in log, log


# --- a partition: nothing answers -----------------------------------------------------------


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "new-connection"])
async def test_a_partition_answers_503_by_the_notify_deadline_and_recovers(
    tmp_path: Path, proxied: tuple[PgProxy, str], register_secret: Any, pooled: bool
) -> None:
    """A database that stopped answering (a partition, a failover that reset no
    connection) held every Zulip request: a pooled connection's pre-ping waits until TCP
    gives up (minutes), a new connection asyncpg's 60 s, far past Zulip's 15 s timeout
    and the notify deadline (specs/zulip.md §5.2), each holding a connection meanwhile.
    Now they answer 503 once `notify_deadline` has passed; the rest of the gateway is
    served meanwhile, and once the network is back everything works again."""
    register_secret(PASSWORD)
    proxy, url = proxied
    async with zulip_gateway(tmp_path, url, notify_deadline=1.0) as env:
        server, realm, token = await registered_device(env, register_secret)
        if not pooled:
            await env.engine.dispose()  # the next request opens a connection
        proxy.blackhole()
        # More requests than the pool has connections (2 + 10 overflow).
        answers = await asyncio.gather(*(notify(server, realm, token) for _ in range(14)))
        for status, body in answers:
            assert status == 503, body
            assert_retry_later(status, body)
        health = await asyncio.wait_for(env.client.get("/healthz"), GUARD)
        assert health.status == 200  # the loop is not blocked
        assert (await readyz(env))[0] == 503
        proxy.restore()
        status, body = await notify(server, realm, token)
        assert (status, body["apple_successfully_sent_count"]) == (200, 1), body
        assert (await readyz(env))[0] == 200


# --- a statement waiting on a lock ------------------------------------------------------------


async def test_a_locked_table_answers_503_by_the_notify_deadline(
    tmp_path: Path, postgres_url: str, admin: AsyncEngine, register_secret: Any
) -> None:
    """A migration or `VACUUM FULL` holding the devices table: a notify waited for the
    lock, past the notify deadline and Zulip's timeout. It answers 503 in time now, and
    normally once the lock is gone; other routes are served meanwhile."""
    async with zulip_gateway(tmp_path, postgres_url, notify_deadline=1.0) as env:
        server, realm, token = await registered_device(env, register_secret)
        async with admin.connect() as lock:
            await lock.execute(text("BEGIN"))
            await lock.execute(text("LOCK TABLE zulip_e2ee_devices IN ACCESS EXCLUSIVE MODE"))
            status, body = await notify(server, realm, token)
            assert status == 503, body
            assert_retry_later(status, body)
            # Another server's registration does not touch the locked table.
            other = env.server()
            await asyncio.wait_for(other.register(), GUARD)
            await lock.execute(text("ROLLBACK"))
        status, body = await notify(server, realm, token)
        assert (status, body["apple_successfully_sent_count"]) == (200, 1), body
