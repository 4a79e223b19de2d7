"""Review (noisy neighbour): a gateway hosting many tenants, one of which misbehaves or
is served by a provider endpoint that stalls. The others' pushes must still go out.

Real simulators over TCP, a real token endpoint that accepts and never answers. No
timing asserts: waits here only stop a test from hanging when the isolation is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import FcmAppConfig
from gateway.core.fcm import FcmClient
from gateway.core.push import Outcome, Push
from gateway.testing import (
    ApnsResponse,
    ApnsSimulator,
    FcmSimulator,
    make_service_account,
)
from gateway.testing.harness import GatewayHarness
from tests.zulip.conftest import Env, apns_token, fcm_token, zulip_config

# Far above what the tests configure (a few seconds at most), far below the hangs they
# catch (the stalled endpoints here answer never, or after a minute).
GUARD = 20.0


# --- one Zulip server, one stalled provider: its pushes to the other app ------------------


async def test_a_stalled_apns_app_does_not_take_a_servers_fcm_sends(tmp_path: Path) -> None:
    """`server_in_flight` bounds one Zulip server's sends so that it cannot fill the
    lanes every server shares; it was counted across all apps. With APNs (or one APNs
    app) stalling, the server's iOS sends sat in flight until their deadline, and every
    push of that server to its Android users was not sent either, although the FCM
    lane was idle: a slow provider for one app held the sends another app needed. The
    bound is now per server and app (each lane is bounded per server, as before)."""
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path, notify_deadline=1.0, server_in_flight=2)
        config["plugins"]["zulip"]["apps"]["ios"]["request_timeout"] = 60.0
        async with GatewayHarness(config) as harness:
            env = Env(harness, apns, fcm)
            server, _ = await env.ready_server()
            stalled = [apns_token(), apns_token()]
            for token in stalled:
                apns.script(token, ApnsResponse.ok(delay=60.0))
                status, body = await server.legacy_register(token, 1, user_id=1)
                assert status == 200, body
            android = fcm_token()
            status, body = await server.legacy_register(android, 2, user_id=2)
            assert status == 200, body

            # User 1's two iPhones: both sends out, answered in a minute.
            status, body = await server.json(
                "push/notify", {"user_id": 1, "apns_payload": {"alert": "x"}}
            )
            assert status == 200, body
            await asyncio.wait_for(apns.wait_for_requests(2), GUARD)
            # User 2's Android phone: the FCM lane is idle; the push must go out.
            status, body = await server.json(
                "push/notify", {"user_id": 2, "gcm_payload": {"event": "message"}}
            )
            assert status == 200, body
            assert len(fcm.requests_for(android)) == 1
            # The bound still holds for the stalled app: a third iPhone push is not sent.
            status, body = await server.json(
                "push/notify", {"user_id": 1, "apns_payload": {"alert": "y"}}
            )
            assert status == 200, body
            assert len(apns.requests) == 2


# --- FCM apps whose token endpoint stalls: the others' OAuth tokens ------------------------


@dataclass
class StalledEndpoint:
    """Accepts TCP connections and never answers; `arrived` is set once `expect`
    connections came. Closing it aborts them, so that no request thread outlives a test."""

    expect: int
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    handlers: set[asyncio.Task[object]] = field(default_factory=set)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/token"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.writers.append(writer)
        if len(self.writers) >= self.expect:
            self.arrived.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass  # the token request: never answered


@contextlib.asynccontextmanager
async def stalled_endpoint(expect: int) -> AsyncIterator[StalledEndpoint]:
    endpoint = StalledEndpoint(expect)
    endpoint.server = await asyncio.start_server(endpoint._serve, "127.0.0.1", 0)
    try:
        yield endpoint
    finally:
        endpoint.server.close()
        for writer in endpoint.writers:
            writer.transport.abort()
        if endpoint.handlers:  # they end with their connections
            await asyncio.wait(endpoint.handlers, timeout=GUARD)


def _default_executor_workers() -> int:
    """What `ThreadPoolExecutor()` (the loop's default executor) starts with."""
    return min(32, (os.cpu_count() or 1) + 4)


async def test_stalled_token_endpoints_of_some_apps_do_not_starve_another_apps_token(
    tmp_path: Path,
) -> None:
    """Each FCM app fetched its OAuth token in the event loop's default executor, a few
    threads shared by every app (and by /metrics, and by host-name lookups on asyncio's
    loop). A handful of tenants whose token endpoint accepts and never answers (their own
    token_uri, a stalled proxy) held every thread for their request timeout, again and
    again: another app's token request waited behind them, and its sends ended
    transient/timeout though its own endpoint answered at once. Each app now fetches
    its token in its own thread."""
    stalled_count = _default_executor_workers()
    async with stalled_endpoint(stalled_count) as stalled, FcmSimulator() as fcm:
        stalled_clients: list[FcmClient] = []
        starts: list[asyncio.Task[None]] = []
        healthy: FcmClient | None = None
        try:
            for i in range(stalled_count):
                path = tmp_path / f"stalled-{i}.json"
                make_service_account(f"stalled-{i}", stalled.url, path)
                client = FcmClient(
                    f"tenant-{i}",
                    FcmAppConfig(
                        service_account_file=path,
                        send_url=fcm.send_url_template,
                        request_timeout=60.0,
                    ),
                )
                stalled_clients.append(client)
                starts.append(asyncio.create_task(client.start()))
            await asyncio.wait_for(stalled.arrived.wait(), GUARD)  # every thread is taken

            path = tmp_path / "healthy.json"
            fcm.add_service_account(make_service_account("healthy", fcm.token_uri, path))
            healthy = FcmClient(
                "healthy",
                FcmAppConfig(
                    service_account_file=path, send_url=fcm.send_url_template, request_timeout=2.0
                ),
            )
            await asyncio.wait_for(healthy.start(), GUARD)
            push = Push("test", "healthy", fcm_token(), {"data": {"k": "v"}})
            attempt = await asyncio.wait_for(healthy.send(push), GUARD)
            assert attempt.outcome is Outcome.OK, attempt
            assert healthy.ready() and fcm.tokens_issued == 1
            # The stalled apps are still waiting for their tokens meanwhile.
            assert not any(c.ready() for c in stalled_clients)
        finally:
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await asyncio.gather(
                *(c.close() for c in [*stalled_clients, *([healthy] if healthy else [])])
            )
