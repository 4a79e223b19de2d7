"""What the delivery core does when what surrounds it fails while it serves: the
database locked or gone, a provider's OAuth endpoint that never answers.

Real PostgreSQL (skipped when none is reachable), real simulators over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.config import FcmAppConfig
from gateway.core.fcm import FcmClient
from gateway.core.push import Outcome, Push, PushPolicy, Reason
from gateway.testing import make_service_account
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from tests.conftest import SAMPLE_PLUGIN_DIR

TOKEN = "d4" * 32
# How long a test waits for something that must happen: far above the timeouts the
# tests configure (a second or less), far below the hangs they catch (minutes).
GUARD = 20.0


def sample_plugin() -> ModuleType:
    """tests/sample_plugin's module (one route that pushes, one table, a token hook)."""
    if str(SAMPLE_PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(SAMPLE_PLUGIN_DIR))
    import pushgw_sample

    return pushgw_sample


# --- the store locked while a push's token turns out dead ------------------------------


async def test_a_locked_store_does_not_hold_a_token_invalid_push_past_its_deadline(
    tmp_path: Path, postgres_url: str, register_secret: object
) -> None:
    """An operator's `LOCK TABLE` (a migration, VACUUM FULL) made recording a dead token
    wait for the lock, and the push's send() with it: the plugin's HTTP answer hung for
    as long as the lock was held, whatever the push's deadline. Now the push ends by its
    deadline, and the record and the plugin's hook follow once the lock goes, before
    shutdown completes: nothing is lost."""
    register_secret(TOKEN)  # type: ignore[operator]
    plugin = sample_plugin()
    admin = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    async with ApnsSimulator() as apns:
        apns.default = ApnsResponse.error("BadDeviceToken")
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        config["store"] = {"url": postgres_url}
        try:
            async with GatewayHarness(config, extra_plugins={"sample": plugin}) as gw:
                context = gw.context("sample")
                async with admin.connect() as lock:
                    await lock.execute(text("BEGIN"))
                    await lock.execute(
                        text("LOCK TABLE pushgw_invalid_tokens IN ACCESS EXCLUSIVE MODE")
                    )
                    push = Push(
                        "sample", "ios", TOKEN, {"aps": {}}, policy=PushPolicy(deadline=1.0)
                    )
                    receipt = await asyncio.wait_for(context.send(push), GUARD)
                    # Answered while the table is still locked.
                    assert receipt.outcome is Outcome.TOKEN_INVALID
                    assert context.state.get("invalid", []) == []  # the hook waits its turn
                    await lock.execute(text("ROLLBACK"))
            # Shutdown waited for the report: recorded and told to the plugin, once.
            assert [i.reason for i in context.state["invalid"]] == ["BadDeviceToken"]
            async with admin.connect() as conn:
                rows = (await conn.execute(text("SELECT reason FROM pushgw_invalid_tokens"))).all()
            assert [r.reason for r in rows] == ["BadDeviceToken"]
        finally:
            await admin.dispose()


# --- an OAuth token endpoint that accepts and never answers ----------------------------


@dataclass
class SilentServer:
    """Accepts TCP connections, reads what comes, never answers; notes when the client
    closes each connection."""

    server: asyncio.Server | None = None
    accepted: int = 0
    closed: int = 0
    all_closed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.all_closed.clear()
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass  # the request: never answered
        self.closed += 1
        if self.closed == self.accepted:
            self.all_closed.set()
        writer.close()


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[SilentServer]:
    silent = SilentServer()
    silent.server = await asyncio.start_server(silent._serve, "127.0.0.1", 0)
    try:
        yield silent
    finally:
        silent.server.close()
        # Handlers still reading would keep wait_closed() waiting (Python 3.12+).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(silent.server.wait_closed(), 1.0)


async def test_an_oauth_endpoint_that_never_answers_is_given_up_after_the_request_timeout(
    tmp_path: Path,
) -> None:
    """google-auth's token request waits 120 s by default and the gateway waited
    `request_timeout + 30` s for it: start-up and the first sends of an FCM app hung
    half a minute, and each attempt left a thread of the loop's default executor (the
    one that resolves host names for every provider connection) blocked for two minutes.
    Each token request is now bounded by the app's `request_timeout`."""
    async with silent_server() as silent:
        path = tmp_path / "sa.json"
        make_service_account("outage", f"http://127.0.0.1:{silent.port}/token", path)
        client = FcmClient(
            "android",
            FcmAppConfig(
                service_account_file=path,
                send_url=f"http://127.0.0.1:{silent.port}/{{project_id}}",
                request_timeout=0.5,
            ),
        )
        try:
            await asyncio.wait_for(client.start(), GUARD)  # logs, does not raise
            assert not client.ready() and silent.accepted == 1
            # The token request was given up, its connection closed: no thread waits on it.
            await asyncio.wait_for(silent.all_closed.wait(), GUARD)
            push = Push("test", "android", "fcm-" + "x" * 24, {"data": {"k": "v"}})
            attempt = await asyncio.wait_for(client.send(push), GUARD)
            assert attempt.outcome is Outcome.TRANSIENT
            assert attempt.reason in (Reason.CONNECTION_ERROR, Reason.TIMEOUT)
        finally:
            await client.close()


# --- a database host that takes connections and never answers --------------------------


async def test_readyz_answers_when_the_database_host_never_answers(tmp_path: Path) -> None:
    """/readyz waited asyncpg's 60 s connect timeout for a database that accepts TCP
    connections and never answers (a partition, a stopped VM): probes timed out rather
    than reading 503, and piled up connection attempts. It now answers 503 within
    `PING_TIMEOUT` (5 s)."""
    async with silent_server() as silent:
        config = base_config(tmp_path, {})
        config["store"] = {
            "url": f"postgresql+asyncpg://pushgw@127.0.0.1:{silent.port}/pushgw",
            "auto_upgrade": False,
        }
        async with GatewayHarness(config) as gw:
            ready = await asyncio.wait_for(gw.client.get("/readyz"), GUARD)
            assert ready.status == 503
            assert (await ready.json())["store"] is False
