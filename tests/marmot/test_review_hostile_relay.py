"""Regression tests from a review of the relay side: a hostile or broken Nostr relay.

A relay is the gateway's only network peer for Marmot. Whatever one relay sends (events it was
never asked for, garbage, floods, hang-ups) must cost bounded work, be logged once per connection
with the relay's name (metrics carry no relay label), and leave the other relays' triggers alone.
Relays here are TEST DOUBLES (scripted_relay.py, or a bare TCP server) because no real relay
misbehaves on demand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from plugins.marmot.keys import ServerKey
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState

from .gw import MarmotGateway, marmot_gateway
from .helpers import V_MARMOT, apns_device, chunk_for, content_of, our_wrap
from .scripted_relay import ScriptedRelay
from .test_oversize import _until
from .test_relay_client import Sink

NOW = 1_800_000_000.0
TWO_DAYS = 172_800
RELAY_LOG = "plugins.marmot.relay"


@asynccontextmanager
async def client_of(
    url: str, clock: Callable[[], float] = lambda: NOW, **settings: Any
) -> AsyncIterator[RelayClient]:
    """A started client of `url` with a short backoff, stopped on the way out."""
    merged: dict[str, Any] = {"backoff_min": 0.01, "backoff_max": 0.05} | settings
    client = RelayClient(url, ServerKey.generate(), Sink(), RelaySettings(**merged), clock=clock)
    client.start()
    try:
        yield client
    finally:
        await client.stop()


def _sample(gw: MarmotGateway, stage: str, result: str) -> float:
    return gw.metric("pushgw_marmot_events_total", stage=stage, result=result)


# ---- events never asked for -----------------------------------------------------------------


async def test_a_relay_ignoring_our_filter_does_not_starve_the_other_relays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken relay streams events our REQ did not ask for: other kinds, wraps for other
    recipients. They used to take the shared global budget (600 a minute) before being dropped,
    so a good relay's trigger right after them was dropped as `rate_limited`: lost."""
    caplog.set_level(logging.INFO, logger="plugins.marmot")
    async with (
        ScriptedRelay() as bad,
        ScriptedRelay() as good,
        marmot_gateway(
            tmp_path, [bad.url, good.url], wait_live=False, publish_inbox_list=False
        ) as gw,
    ):
        bad_sub = (await bad.expect("REQ"))[1]
        good_sub = (await good.expect("REQ"))[1]
        await bad.send(["EOSE", bad_sub])
        await good.send(["EOSE", good_sub])
        await gw.service.wait_live()
        other = ServerKey.generate().pubkey_hex
        for i in range(800):
            kind, tags = (1, [["t", "nostr"]]) if i < 700 else (1059, [["p", other]])
            event = {"id": f"{i:064x}", "pubkey": other, "created_at": int(NOW), "kind": kind}
            event |= {"tags": tags, "content": "hi", "sig": "ab" * 64}
            await bad.send(["EVENT", bad_sub, event])
        await _until(lambda: _sample(gw, "frame", "received") == 800)
        dev = apns_device()
        wrap = our_wrap(gw.key, content_of([chunk_for(gw.key, dev)]), [V_MARMOT])
        await good.send(f'["EVENT","{good_sub}",{wrap}]')
        await gw.apns.wait_for_requests(1, 10)
        await gw.service.idle()
        assert [r.token for r in gw.apns.requests] == [dev.token]
        assert _sample(gw, "global_limit", "rate_limited") == 0
        assert _sample(gw, "wrap", "wrap_kind") == 700
        assert _sample(gw, "wrap", "wrap_recipient") == 100
    lines = [r.getMessage() for r in caplog.records if "did not ask for" in r.getMessage()]
    assert len(lines) == 1 and bad.url in lines[0]  # once, naming the relay, no content
    assert "nostr" not in lines[0] and other not in lines[0]


async def test_the_same_wrap_thousands_of_times_is_unwrapped_once(tmp_path: Path) -> None:
    """Already right: a burst of copies of one wrap is unwrapped and pushed once (later copies
    hit the seen-wrap cache or the copy still queued) and the connection stays up. The
    global limit is raised: this test is about the copies, not about that budget."""
    async with (
        ScriptedRelay() as bad,
        ScriptedRelay() as good,
        marmot_gateway(
            tmp_path,
            [bad.url, good.url],
            wait_live=False,
            publish_inbox_list=False,
            rate_limits={"global": {"per_minute": 100_000, "per_hour": 100_000}},
        ) as gw,
    ):
        bad_sub = (await bad.expect("REQ"))[1]
        good_sub = (await good.expect("REQ"))[1]
        await bad.send(["EOSE", bad_sub])
        await good.send(["EOSE", good_sub])
        await gw.service.wait_live()
        first, second = apns_device(), apns_device()
        wrap = our_wrap(gw.key, content_of([chunk_for(gw.key, first)]), [V_MARMOT])
        frame = f'["EVENT","{bad_sub}",{wrap}]'.encode()
        conn = bad.connections[-1]
        for _ in range(3000):  # one burst: written to the socket at once
            conn.protocol.send_text(frame)
        conn.send_data()
        await _until(lambda: _sample(gw, "frame", "received") == 3000)
        wrap = our_wrap(gw.key, content_of([chunk_for(gw.key, second)]), [V_MARMOT])
        await good.send(f'["EVENT","{good_sub}",{wrap}]')
        await gw.apns.wait_for_requests(2, 10)
        await gw.service.idle()
        assert sorted(r.token for r in gw.apns.requests) == sorted([first.token, second.token])
        assert _sample(gw, "seen", "duplicate") == 2999
        assert _sample(gw, "trigger", "accepted") == 2
        assert gw.service.relays[0].connects == 1


# ---- one log line per condition ---------------------------------------------------------------


async def test_each_fault_is_logged_once_per_connection_naming_the_relay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Metrics count oversize and malformed frames without a relay label, so only the log can
    tell the operator which relay sends them: one line per fault and connection, never the
    relay's text. Events and EOSE for a subscription we do not have were not logged at all."""
    caplog.set_level(logging.INFO, logger="plugins.marmot.relay")
    async with ScriptedRelay() as relay, client_of(relay.url, max_event_bytes=4096) as client:
        sub = (await relay.expect("REQ"))[1]
        await relay.send(["EOSE", sub])
        for _ in range(3):
            await relay.send("SECRET-not-json")
            await relay.connections[-1].send(b"\xff\xfe binary SECRET")
            await relay.send(["EVENT", sub, {"content": "SECRET" * 1000}])
            await relay.send(["EVENT", "not-our-sub", {"content": "SECRET"}])
            await relay.send(["EOSE", "not-our-sub"])
        await relay.send(["CLOSED", sub, "error: restarting"])
        sub = (await relay.expect("REQ"))[1]  # frames are read in order: all handled by now
        faults = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == RELAY_LOG]
        assert len(faults) == 3, [r.getMessage() for r in faults]
        for record in faults:
            assert record.getMessage().startswith(f"relay {client.label} ")
            assert "SECRET" not in record.getMessage()
        # a new connection: the relay's faults are worth a line again
        await relay.connections[-1].close()
        sub = (await relay.expect("REQ"))[1]
        await relay.send("not json either")
        await relay.send(["CLOSED", sub, "error: restarting"])
        await relay.expect("REQ")
        faults = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == RELAY_LOG]
        assert len(faults) == 4
        assert faults[-1].getMessage() == faults[0].getMessage()
    assert client.events_received == 0


# ---- the reconnect window --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["hang-up", "CLOSED"])
async def test_a_relay_that_drops_us_before_eose_does_not_move_the_backfill_window(
    how: str,
) -> None:
    """After a live subscription is lost at D, each REQ asks for wraps since D - 2 days. A relay
    that then takes the REQ and drops us before EOSE (hang-up or CLOSED, in a loop) never sent
    that backfill, yet each drop used to move D forward. Once it behaved again, wraps sent
    while it flapped whose randomized `created_at` fell before the new window were lost."""
    wall = [NOW]
    async with ScriptedRelay() as relay, client_of(relay.url, clock=lambda: wall[0]) as client:
        first = await relay.expect("REQ")
        await relay.send(["EOSE", first[1]])
        await _until(lambda: client.live)
        await relay.connections[-1].close()  # the live subscription is lost at NOW
        expected = int(NOW) - TWO_DAYS - 300
        for _ in range(3):
            req = await relay.expect("REQ")
            assert req[2]["since"] == expected and "limit" not in req[2]
            wall[0] += 600  # the relay flaps for a while
            if how == "hang-up":
                await relay.connections[-1].close()
            else:
                await relay.send(["CLOSED", req[1], "error: too busy"])
        req = await relay.expect("REQ")
        assert req[2]["since"] == expected
        await relay.send(["EOSE", req[1]], conn=-1)
        await _until(lambda: client.live)
    assert client.disconnect_at == NOW


# ---- relays that do not answer ---------------------------------------------------------------


@asynccontextmanager
async def tcp_server(handler: Callable[..., Any]) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        server.close()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(65536)  # the handshake request, never answered
    await asyncio.sleep(3600)


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(65536)
    for byte in b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n" * 100:
        writer.write(bytes([byte]))
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("handler", [_silent, _trickle], ids=["silent", "byte-at-a-time"])
async def test_a_relay_that_never_completes_the_handshake_is_retried(
    handler: Callable[..., Any],
) -> None:
    """Already right: `connect_timeout` bounds the handshake, however slowly the relay answers;
    the attempt counts as a failure and the listener backs off and tries again."""
    async with tcp_server(handler) as url, client_of(url, connect_timeout=0.2) as client:
        await _until(lambda: client.failures >= 2)
        assert client.state in (RelayState.BACKOFF, RelayState.CONNECTING)
        assert client.connects == 0


def test_backoff_is_bounded_and_jittered() -> None:
    """The delay stays within [backoff_min, backoff_max] however many failures, and varies
    from the first retry on (a restarting relay's gateways do not come back in lockstep:
    the first retry was exactly backoff_min)."""
    client = RelayClient("ws://r", ServerKey.generate(), Sink(), RelaySettings())
    random.seed(1)
    for failures in (1, 2, 5, 7, 100, 10_000):
        client.failures = failures
        delays = {client._backoff() for _ in range(50)}
        assert all(1.0 <= d <= 60.0 for d in delays)
        assert len(delays) > 1
    assert min(delays) >= 30.0  # at the cap: between half the cap and the cap


def test_garbage_frames_never_reach_the_service() -> None:
    """A unit view of the frame path: whatever bytes arrive, `_handle` returns normally."""
    client = RelayClient("ws://r", ServerKey.generate(), Sink(), RelaySettings())
    client._sub_id = "s"
    frames = [
        b"",
        b"\x00",
        b"\xff" * 10,
        b"[",
        b"null",
        b'["EVENT"]',
        b'["EVENT","s"]',
        b'["EVENT","s",[]]',
        b'["CLOSED"]',
        b'["AUTH"]',
        b'["AUTH",1]',
        b'["OK",1,2,3]',
        b'["NOTICE"]',
        b"[1e999999]",
        b"[" * 100_000,
        json.dumps(["EOSE", None]).encode(),
    ]
    for frame in frames:
        client._handle(frame)
    assert isinstance(client.sink, Sink) and client.sink.events == []


async def test_eose_for_a_closed_subscription_neither_revives_it_nor_multiplies_reqs() -> None:
    """After CLOSED the subscription waits for its resubscription. An EOSE for it used to mark it
    live again, which let the next CLOSED through the one-resubscription guard: a relay sending
    CLOSED, EOSE, CLOSED, EOSE... made the gateway queue one REQ per pair (memory and REQs
    without bound), and reported a closed subscription as live."""
    async with (
        ScriptedRelay() as relay,
        client_of(relay.url, backoff_min=5.0, backoff_max=5.0) as client,
    ):
        sub = (await relay.expect("REQ"))[1]
        await relay.send(["EOSE", sub])
        for _ in range(200):
            await relay.send(["CLOSED", sub, "error: go away"])
            await relay.send(["EOSE", sub])
        await relay.send(["AUTH", "sentinel"])  # answered at once: every frame before was read
        await relay.expect("AUTH")
        assert client.state is RelayState.BACKOFF and not client.live
        assert client.failures == 1
        pending = [t for t in client._side_tasks if not t.done()]
        assert len(pending) <= 2  # the resubscription (and perhaps the AUTH answer's wait)
