"""Test helpers: a real nostr-relay process, trigger builders (nostr-sdk and ours), a TCP proxy.

- :class:`NostrRelayProcess` runs PyPI ``nostr-relay`` (``nostr-relay -c FILE serve --use-uvicorn``)
  on a free loopback port with SQLite storage in a temp directory and ``max_event_size`` raised
  (its default of 4096 bytes of content would refuse any real trigger).
- :func:`sdk_wrap` builds a gift wrap with nostr-sdk (an independent NIP-44/NIP-59
  implementation). nostr-sdk 0.45 refuses NIP-44 plaintexts of 65,536 bytes or more, so triggers of
  29+ chunks are built with :func:`our_wrap` (the plugin's vector-verified builders).
- :class:`TcpProxy` sits between the gateway and the relay so a test can cut the gateway off while
  the relay keeps accepting events (deterministic reconnect backfill).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import nostr_sdk
from websockets.asyncio.client import connect

from gateway.testing.relay import NostrRelayProcess as NostrRelayProcess
from gateway.testing.relay import free_port
from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import gift_wrap, make_rumor, seal_rumor
from plugins.marmot.tokens import (
    MARMOT_PUSH_V1,
    MIP05_V1,
    MIP05_V1_LEGACY,
    TokenFormat,
    encrypt_token,
)

V_MARMOT = ["v", "marmot-push-v1"]
V_MIP05 = ["v", "mip05-v1"]
ENC_B64 = ["encoding", "base64"]
FORMATS = {"marmot-push-v1": MARMOT_PUSH_V1, "mip05-v1": MIP05_V1, "mip05-v1-280": MIP05_V1_LEGACY}


async def publish(url: str, event_json: str | dict[str, Any], timeout: float = 10.0) -> str:
    """Send one event to a relay and return the OK message ("" when accepted)."""
    event = json.loads(event_json) if isinstance(event_json, str) else event_json
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps(["EVENT", event], separators=(",", ":")))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            if msg[0] == "OK" and msg[1] == event["id"]:
                return "" if msg[2] else str(msg[3])


async def publish_many(url: str, events: Sequence[str | dict[str, Any]]) -> None:
    """Send events over one connection and wait for every OK (raise if one is refused)."""
    objs = [json.loads(e) if isinstance(e, str) else e for e in events]
    async with connect(url, max_size=None) as ws:
        for obj in objs:
            await ws.send(json.dumps(["EVENT", obj], separators=(",", ":")))
        pending = {o["id"] for o in objs}
        while pending:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if msg[0] == "OK":
                if not msg[2] and "duplicate" not in str(msg[3]):
                    raise AssertionError(f"relay refused an event: {msg[3]}")
                pending.discard(msg[1])


async def query(url: str, flt: dict[str, Any], timeout: float = 10.0) -> list[dict[str, Any]]:
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps(["REQ", "q", flt]))
        out = []
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            if msg[0] == "EVENT":
                out.append(msg[2])
            elif msg[0] == "EOSE":
                return out


# --- triggers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    platform: int  # 1 APNs, 2 FCM
    raw: bytes

    @property
    def token(self) -> str:
        """Dispatch form: hex for APNs, text for FCM."""
        return self.raw.hex() if self.platform == 1 else self.raw.decode()


def apns_device() -> Device:
    return Device(1, secrets.token_bytes(32))


def fcm_device() -> Device:
    return Device(2, ("fcm:" + secrets.token_urlsafe(110)).encode())


def chunk_for(server: ServerKey, device: Device, fmt: TokenFormat = MARMOT_PUSH_V1) -> bytes:
    return encrypt_token(server.pubkey, device.platform, device.raw, fmt)


def decoy_for(device: Device, fmt: TokenFormat = MARMOT_PUSH_V1) -> bytes:
    """A real token encrypted to another server (what mip05 decoys look like to us)."""
    return encrypt_token(ServerKey.generate().pubkey, device.platform, device.raw, fmt)


def padding_chunk(fmt: TokenFormat = MARMOT_PUSH_V1) -> bytes:
    return os.urandom(fmt.chunk_len)


def content_of(chunks: Sequence[bytes]) -> str:
    return base64.b64encode(b"".join(chunks)).decode()


def tags_for(profile: str) -> list[list[str]]:
    return [V_MARMOT] if profile == "marmot-push-v1" else [V_MIP05, ENC_B64]


def sdk_wrap(
    server: ServerKey,
    content: str,
    tags: list[list[str]],
    *,
    created_at: int | None = None,
    sender: nostr_sdk.Keys | None = None,
) -> str:
    """A gift wrap built by nostr-sdk (independent NIP-44 + NIP-59): its JSON."""
    sender = sender or nostr_sdk.Keys.generate()
    builder = nostr_sdk.EventBuilder(nostr_sdk.Kind(446), content).tags(
        [nostr_sdk.Tag.parse(t) for t in tags]
    )
    if created_at is not None:
        builder = builder.custom_created_at(nostr_sdk.Timestamp.from_secs(created_at))
    rumor = builder.finalize_unsigned(sender.public_key())
    wrap = nostr_sdk.nip59_make_gift_wrap(
        sender, nostr_sdk.PublicKey.from_bytes(server.pubkey), rumor
    )
    return str(wrap.as_json())


def our_wrap(
    server: ServerKey,
    content: str,
    tags: list[list[str]],
    *,
    created_at: int | None = None,
    sender: ServerKey | None = None,
    kind: int = 446,
) -> str:
    """A gift wrap built with the plugin's builders (needed for >= 29 chunks)."""
    sender = sender or ServerKey.generate()
    rumor = make_rumor(sender.pubkey_hex, kind, content, tags, created_at)
    return gift_wrap(seal_rumor(rumor, sender, server.pubkey_hex), server.pubkey_hex).to_json()


# --- TCP proxy -----------------------------------------------------------------------------------


class TcpProxy:
    """A loopback TCP proxy to ``target_port`` that a test can cut (``down()``) and restore."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def down(self) -> None:
        """Refuse new connections and reset the open ones (both directions)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        await asyncio.sleep(0.05)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.transport.abort()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._writers.difference_update((writer, up_w))
