"""Relay restart mid-stream: nothing lost inside the NIP-59 window, nothing pushed twice.

The gateway reaches a real nostr-relay through a TCP proxy the test controls. While the proxy is
down the relay restarts (same SQLite storage, so its stored events survive) and receives more
triggers; when the proxy comes back the gateway reconnects with
``since = disconnect - 172800 - max_future_skew`` and the relay replays everything it stored in that
window: the triggers seen before the cut (skipped by the seen-wrap cache) and those sent while the
gateway was away (pushed, once each). Cutting the proxy makes the test deterministic: the triggers
are certainly sent while the gateway is disconnected, not raced against its reconnect.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from plugins.marmot.keys import ServerKey
from plugins.marmot.tokens import MARMOT_PUSH_V1, MIP05_V1

from .gw import marmot_gateway
from .helpers import (
    V_MARMOT,
    V_MIP05,
    Device,
    NostrRelayProcess,
    TcpProxy,
    apns_device,
    chunk_for,
    content_of,
    fcm_device,
    padding_chunk,
    publish_many,
    sdk_wrap,
)

pytestmark = pytest.mark.slow


async def _until(predicate: object, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def test_relay_restart_mid_stream(tmp_path: Path) -> None:
    relay = NostrRelayProcess(tmp_path)
    await asyncio.to_thread(relay.start)
    proxy = TcpProxy(relay.port)
    await proxy.up()
    key = ServerKey.generate()
    try:
        async with marmot_gateway(
            tmp_path / "gw", [proxy.url], key=key, publish_inbox_list=False
        ) as gw:
            client = gw.service.relays[0]

            def trigger(profile_v: list[str], *devices: Device) -> str:
                fmt = MARMOT_PUSH_V1 if profile_v == V_MARMOT else MIP05_V1
                chunks = [chunk_for(key, d, fmt) for d in devices] + [padding_chunk(fmt)]
                return sdk_wrap(key, content_of(chunks), [profile_v])

            before = [apns_device(), fcm_device(), apns_device()]
            await publish_many(relay.url, [trigger(V_MARMOT, d) for d in before])
            await gw.apns.wait_for_requests(2, 20)
            await gw.fcm.wait_for_requests(1, 20)

            # cut the gateway off, restart the relay, send triggers while the gateway is away
            await proxy.down()
            await _until(lambda: not client.live)
            await asyncio.to_thread(relay.restart)
            during = [fcm_device(), apns_device(), fcm_device(), apns_device()]
            await publish_many(
                relay.url,
                [
                    trigger(V_MARMOT, during[0], during[1]),
                    trigger(V_MIP05, during[2]),
                    trigger(V_MARMOT, during[3]),
                ],
            )
            assert not client.live
            await proxy.up()
            await _until(lambda: client.live)
            await gw.service.idle()
            assert "limit" not in client.last_filter  # type: ignore[operator]
            assert client.backfilled >= len(before) + 3  # the relay replayed the whole window

            # and live delivery resumed
            after = apns_device()
            await publish_many(relay.url, [trigger(V_MARMOT, after)])
            everyone = before + during + [after]
            n_apns = sum(1 for d in everyone if d.platform == 1)
            await gw.apns.wait_for_requests(n_apns, 20)
            await gw.fcm.wait_for_requests(len(everyone) - n_apns, 20)
            await gw.service.idle()
            await asyncio.sleep(0.5)
            pushed = sorted(
                [r.token for r in gw.apns.requests] + [r.token or "" for r in gw.fcm.requests]
            )
            assert pushed == sorted(d.token for d in everyone)  # each exactly once
            assert gw.metric("pushgw_marmot_events_total", stage="seen", result="duplicate") >= 3
            assert gw.metric("pushgw_marmot_relay_reconnects_total", relay=proxy.url) >= 1
            assert client.connects >= 2
    finally:
        await proxy.down()
        await asyncio.to_thread(relay.stop)
