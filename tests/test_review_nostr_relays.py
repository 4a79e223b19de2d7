"""Review: the Marmot plugin as a Nostr relay operator and a MIP-05 client developer see it.

- A `wss://` relay behind a private CA: `plugins.marmot.ca_file` is trusted for the listener
  and for the kind-10050 publication, in addition to the system store; without it the
  certificate is refused (verification stays on).
- NIP-42 on the kind-10050 list: a relay answering CLOSED / OK false "auth-required:" (its
  challenge before or after) gets the query or the list again, authenticated, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway.testing.certs import SimulatorCA
from plugins.marmot.inbox import fetch_newest, inbox_event, publish
from plugins.marmot.keys import ServerKey
from plugins.marmot.relay import KIND_AUTH, RelayClient, RelaySettings, RelayState
from tests.marmot.gw import marmot_gateway
from tests.marmot.helpers import (
    NostrRelayProcess,
    apns_device,
    chunk_for,
    content_of,
    our_wrap,
    publish_many,
    tags_for,
)
from tests.marmot.scripted_relay import ScriptedRelay
from tests.marmot.test_relay_client import Sink


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NostrRelayProcess]:
    process = NostrRelayProcess(tmp_path_factory.mktemp("nostr-relays-review"))
    process.start()
    yield process  # type: ignore[misc]
    process.stop()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError, ConnectionError):
        writer.close()


@contextlib.asynccontextmanager
async def tls_front(ca: SimulatorCA, target_port: int) -> AsyncIterator[str]:
    """A TLS terminator on loopback (certificate from the private `ca`) in front of the real
    relay, as an operator runs one (nginx, caddy) in front of theirs: yields its wss:// URL."""
    context = ca.server_context(["127.0.0.1"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"wss://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


async def test_a_wss_relay_behind_a_private_ca_is_trusted_through_ca_file(
    relay: NostrRelayProcess, tmp_path: Path
) -> None:
    ca = SimulatorCA(tmp_path / "relay-ca")
    async with (
        tls_front(ca, relay.port) as wss_url,
        marmot_gateway(tmp_path / "gw", [wss_url], ca_file=str(ca.ca_path)) as gw,
    ):
        # the listener is live over TLS, and the kind-10050 list went out over it too
        assert gw.service.relays[0].live
        await until(
            lambda: gw.service.inbox_result is not None and gw.service.inbox_result.published,
            "the inbox list was published through the private-CA relay",
        )
        device = apns_device()
        wrap = our_wrap(gw.key, content_of([chunk_for(gw.key, device)]), tags_for("marmot-push-v1"))
        await publish_many(relay.url, [wrap])
        await gw.apns.wait_for_requests(1, 20)
        assert [r.token for r in gw.apns.requests] == [device.token]
    ca.cleanup()


async def test_without_ca_file_a_private_ca_relay_is_refused_and_retried(
    relay: NostrRelayProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = SimulatorCA(tmp_path / "relay-ca")
    caplog.set_level(logging.INFO, "plugins.marmot.relay")
    settings = RelaySettings(backoff_min=0.01, backoff_max=0.02, connect_timeout=5.0)
    async with tls_front(ca, relay.port) as wss_url:
        client = RelayClient(wss_url, ServerKey.generate(), Sink(), settings)
        states: list[RelayState] = []
        client.sink.on_state = lambda _r, _o, new: states.append(new)  # type: ignore[method-assign]
        client.start()
        try:
            await until(lambda: client.failures >= 2, "the refused relay is retried")
        finally:
            await client.stop()
    assert RelayState.SUBSCRIBED not in states and RelayState.LIVE not in states
    assert "SSLCertVerificationError" in caplog.text
    ca.cleanup()


async def test_a_kind_10050_query_refused_auth_required_is_asked_again_authenticated() -> None:
    """A relay that reads only to authenticated clients: CLOSED "auth-required:" first, its
    challenge after. The query is answered, not counted as a relay that failed."""
    key = ServerKey.generate()
    async with ScriptedRelay() as relay:
        task = asyncio.create_task(fetch_newest(relay.url, key, timeout=10.0))
        req = await relay.expect("REQ")
        await relay.send(["CLOSED", req[1], "auth-required: this relay reads to members only"])
        await relay.send(["AUTH", "challenge-1"])
        auth = await relay.expect("AUTH")
        assert auth[1]["kind"] == KIND_AUTH and ["challenge", "challenge-1"] in auth[1]["tags"]
        again = await relay.expect("REQ")
        assert again[2] == req[2]
        await relay.send(["EOSE", again[1]])
        assert await task is None  # answered: no list yet (False would mean "failed")


async def test_a_kind_10050_publish_refused_auth_required_is_sent_again_authenticated() -> None:
    """OK false "auth-required:" arriving before the relay's challenge: answer the challenge
    when it comes, then send the list again (it used to be given up at once)."""
    key = ServerKey.generate()
    event = inbox_event(key, ["wss://inbox.example.org"])
    async with ScriptedRelay() as relay:
        task = asyncio.create_task(publish(relay.url, event, key, timeout=10.0))
        first = await relay.expect("EVENT")
        assert first[1]["id"] == event.id
        await relay.send(["OK", event.id, False, "auth-required: sign in to publish"])
        await relay.send(["AUTH", "challenge-2"])
        auth = await relay.expect("AUTH")
        assert ["challenge", "challenge-2"] in auth[1]["tags"]
        again = await relay.expect("EVENT")
        assert again[1]["id"] == event.id
        await relay.send(["OK", event.id, True, ""])
        assert await task is True


async def test_a_second_auth_required_is_a_refusal_not_a_loop() -> None:
    key = ServerKey.generate()
    event = inbox_event(key, ["wss://inbox.example.org"])
    async with ScriptedRelay() as relay:
        await_task = asyncio.create_task(publish(relay.url, event, key, timeout=10.0))
        await relay.expect("EVENT")
        await relay.send(["AUTH", "c"])
        await relay.expect("AUTH")
        await relay.send(["OK", event.id, False, "auth-required: still no"])
        await relay.expect("EVENT")
        await relay.send(["OK", event.id, False, "auth-required: still no"])
        assert await await_task is False
