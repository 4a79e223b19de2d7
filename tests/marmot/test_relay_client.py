"""The relay client alone against hostile or dead relays (spec section 10): the listener
survives whatever a relay does, for as long as the relay does it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from gateway.testing.relay import free_port
from plugins.marmot.keys import ServerKey
from plugins.marmot.relay import NOTICES_PER_MINUTE, RelayClient, RelaySettings, RelayState

from .scripted_relay import ScriptedRelay


class Sink:
    """Records what the client hands to the service."""

    def __init__(self) -> None:
        self.events: list[Mapping[str, Any]] = []

    def on_event(self, relay: RelayClient, event: Mapping[str, Any]) -> None:
        self.events.append(event)

    def on_oversize(self, relay: RelayClient) -> None:
        pass

    def on_malformed(self, relay: RelayClient) -> None:
        pass

    def on_unrequested(self, relay: RelayClient) -> None:
        pass

    def on_state(self, relay: RelayClient, old: RelayState, new: RelayState) -> None:
        pass


@asynccontextmanager
async def running_client(relay: ScriptedRelay) -> AsyncIterator[RelayClient]:
    """A started client of `relay` with a short backoff, stopped on the way out."""
    settings = RelaySettings(backoff_min=0.05, backoff_max=0.1)
    client = RelayClient(relay.url, ServerKey.generate(), Sink(), settings)
    client.start()
    try:
        yield client
    finally:
        await client.stop()


async def test_listener_survives_a_long_run_of_failed_connections() -> None:
    """Backoff doubles per failure: after ~1,025 failures in a row (17 h of a dead relay at the
    default 60 s cap) the doubling must not overflow and end the listener for good."""
    settings = RelaySettings(backoff_min=0.000_01, backoff_max=0.000_1, connect_timeout=1.0)
    client = RelayClient(f"ws://127.0.0.1:{free_port()}", ServerKey.generate(), Sink(), settings)
    client.start()
    task = client._task
    assert task is not None
    try:
        async with asyncio.timeout(60):
            while client.failures < 1_100 and not task.done():
                await asyncio.sleep(0.05)
        assert not task.done(), task.exception() if task.done() else None
        assert client.state in (RelayState.BACKOFF, RelayState.CONNECTING)
    finally:
        await client.stop()


async def test_repeated_closed_for_one_subscription_resubscribes_once() -> None:
    """A relay repeating CLOSED for the same subscription gets one new REQ, not one per frame
    (each extra REQ would leave an orphan subscription streaming every wrap again)."""
    async with ScriptedRelay() as relay, running_client(relay) as client:
        first = await relay.expect("REQ")
        await relay.send(["EOSE", first[1]])
        for _ in range(20):
            await relay.send(["CLOSED", first[1], "error: shutting down idle subscription"])
        again = await relay.expect("REQ")
        assert again[1] != first[1]
        # The frames are read in order, and the new REQ waited a backoff period after
        # the first CLOSED: the other 19 were read by then. Each one counted as a new
        # failure would have scheduled a REQ of its own.
        assert client.failures == 1


async def test_an_unusable_auth_challenge_is_ignored_not_a_dead_subscription() -> None:
    """A challenge with a lone surrogate (valid JSON, not encodable as UTF-8) cannot be signed.
    It must be refused where it arrives, not blow up the AUTH task (a traceback in the logs,
    and after ``CLOSED auth-required:`` no resubscription at all)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        async with ScriptedRelay() as relay, running_client(relay):
            first = await relay.expect("REQ")
            await relay.send('["AUTH","\\ud800 challenge"]')
            await relay.send(["CLOSED", first[1], "auth-required: members only"])
            again = await relay.expect("REQ", timeout=5)
            assert again[1] != first[1]
    finally:
        loop.set_exception_handler(None)
    gc.collect()  # "Task exception was never retrieved" is reported when the task is freed
    await asyncio.sleep(0)
    assert errors == []


async def test_an_auth_flood_is_not_answered_frame_for_frame() -> None:
    """Each answer costs a Schnorr signature (~0.1 ms) for a ~20-byte frame: a relay repeating
    AUTH must not make the gateway's event loop sign for every frame. One answer per challenge,
    and one at a time; a CLOSED ``auth-required:`` still answers the newest challenge."""
    async with ScriptedRelay() as relay, running_client(relay):
        first = await relay.expect("REQ")
        for _ in range(100):
            await relay.send(["AUTH", "same-challenge"])
        for i in range(100):
            await relay.send(["AUTH", f"challenge-{i}"])
        answered = (await relay.expect("AUTH"))[1]
        assert ["challenge", "same-challenge"] in answered["tags"]
        await relay.send(["OK", answered["id"], True, ""])
        await relay.send(["CLOSED", first[1], "auth-required: members only"])
        # The next answer is the one CLOSED asks for, to the newest challenge: no
        # answer went out per AUTH frame (those would have come first, in order).
        answer = (await relay.expect("AUTH"))[1]
        assert ["challenge", "challenge-99"] in answer["tags"]
        await relay.send(["OK", answer["id"], True, ""])
        await relay.expect("REQ")


async def test_a_notice_flood_is_not_logged_line_for_line(caplog: Any) -> None:
    """NOTICE text is the relay's to choose and costs it ~20 bytes a frame: a relay repeating
    it must not fill the gateway's log. A few a minute are logged; the next logged one says
    how many were left out meanwhile."""
    now = [1000.0]
    caplog.set_level("INFO", logger="plugins.marmot.relay")
    async with ScriptedRelay() as relay, running_client(relay) as client:
        client.notice_limiter.clock = lambda: now[0]
        first = await relay.expect("REQ")
        for i in range(50):
            await relay.send(["NOTICE", f"notice {i}"])
        await relay.send(["CLOSED", first[1], "error: restarting"])
        again = await relay.expect("REQ")  # frames are read in order: every NOTICE was handled
        logged = [r.getMessage() for r in caplog.records if "NOTICE" in r.getMessage()]
        assert len(logged) == NOTICES_PER_MINUTE
        assert logged[0].endswith("notice 0")
        now[0] += 60.0  # a minute later, the budget is back
        await relay.send(["NOTICE", "later"])
        await relay.send(["CLOSED", again[1], "error: restarting"])
        await relay.expect("REQ")
    logged = [r.getMessage() for r in caplog.records if "NOTICE" in r.getMessage()]
    assert logged[-1].endswith(f"later ({50 - NOTICES_PER_MINUTE} earlier NOTICEs not logged)")
