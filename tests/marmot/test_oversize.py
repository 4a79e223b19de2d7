"""Oversize relay messages are dropped and counted; the subscription stays live.

A relay stores and backfills whatever it accepted, on every REQ whose window still covers it. A
message the client cannot take must therefore be dropped without losing the connection: closing it
(websocket close 1009) only brings the same stored event back on the reconnect's backfill, for as
long as the NIP-59 window (two days) covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import sign_event
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState

from .gw import marmot_gateway
from .helpers import (
    V_MARMOT,
    NostrRelayProcess,
    apns_device,
    chunk_for,
    content_of,
    our_wrap,
    publish,
)
from .scripted_relay import ScriptedRelay

pytestmark = pytest.mark.slow


async def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def test_stored_oversize_event_is_dropped_and_the_relay_goes_live(tmp_path: Path) -> None:
    """The reviewer's case on a real relay: one stored 1.2 MB wrap, backfilled on every REQ."""
    relay = NostrRelayProcess(tmp_path / "relay", max_event_size=2_000_000)
    await asyncio.to_thread(relay.start)
    key = ServerKey.generate()
    try:
        huge = sign_event(ServerKey.generate(), 1059, "x" * 1_200_000, [["p", key.pubkey_hex]])
        assert await publish(relay.url, huge.to_json()) == ""
        async with marmot_gateway(
            tmp_path / "gw",
            [relay.url],
            key=key,
            wait_live=False,
            publish_inbox_list=False,
            backfill_on_start=True,
        ) as gw:
            client = gw.service.relays[0]
            await gw.service.wait_live(20)
            assert client.connects == 1
            assert gw.metric("pushgw_marmot_events_total", stage="frame", result="oversize") == 1
            dev = apns_device()
            trigger = our_wrap(key, content_of([chunk_for(key, dev)]), [V_MARMOT])
            assert await publish(relay.url, trigger) == ""
            await gw.apns.wait_for_requests(1, 20)
            assert [r.token for r in gw.apns.requests] == [dev.token]
            assert client.connects == 1 and client.live  # never dropped the connection
    finally:
        await asyncio.to_thread(relay.stop)


async def test_message_over_the_websocket_ceiling_is_counted_and_not_backfilled_again(
    tmp_path: Path,
) -> None:
    """TEST DOUBLE relay: a frame above even the websocket ceiling. The library closes with 1009;
    the drop is counted and the next REQ asks for no stored events, so a relay that honours
    ``limit: 0`` cannot send the same event again."""
    async with (
        ScriptedRelay() as relay,
        marmot_gateway(
            tmp_path, [relay.url], wait_live=False, publish_inbox_list=False, backfill_on_start=True
        ) as gw,
    ):
        client = gw.service.relays[0]
        first = await relay.expect("REQ")
        assert "limit" not in first[2]  # a backfill
        ceiling = client.settings.max_message_bytes
        frame = f'["EVENT","{first[1]}",{{"kind":1059,"content":"{"x" * ceiling}"}}]'
        with contextlib.suppress(ConnectionClosed):  # the client hangs up mid-frame
            await relay.send(frame)
        second = await relay.expect("REQ")
        assert second[2]["limit"] == 0
        assert second[2]["since"] <= int(time.time()) - 172_800
        assert gw.metric("pushgw_marmot_events_total", stage="frame", result="oversize") == 1
        await relay.send(["EOSE", second[1]], conn=-1)
        await gw.service.wait_live()
        assert client.connects == 2 and client.failures == 1


class _Sink:
    def __init__(self) -> None:
        self.states: list[RelayState] = []

    def on_event(self, *a: Any) -> None: ...
    def on_oversize(self, *a: Any) -> None: ...
    def on_malformed(self, *a: Any) -> None: ...
    def on_unrequested(self, *a: Any) -> None: ...

    def on_state(self, relay: RelayClient, old: RelayState, new: RelayState) -> None:
        self.states.append(new)


async def test_a_relay_that_drops_us_right_after_eose_meets_growing_backoff() -> None:
    """TEST DOUBLE relay: EOSE, then a hang-up, on every connection. A subscription that went live
    only for an instant must not reset the backoff, or such a relay spins us at ``backoff_min``."""
    async with ScriptedRelay() as relay:
        settings = RelaySettings(backoff_min=0.01, backoff_max=10.0)
        client = RelayClient(relay.url, ServerKey.generate(), _Sink(), settings)
        client.start()
        try:
            streak = []
            for _ in range(3):
                req = await relay.expect("REQ")
                await relay.send(["EOSE", req[1]])
                await _until(lambda: client.live)
                await relay.connections[-1].close()
                await _until(lambda: client.state is RelayState.BACKOFF)
                streak.append(client.failures)
            assert streak == [1, 2, 3]
        finally:
            await client.stop()
