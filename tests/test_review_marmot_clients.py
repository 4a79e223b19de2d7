"""Review from the seat of a Marmot client developer (White Noise, mdk): docs/marmot.md §10.

A client developer builds triggers from the docs, not from pushgw's code. These tests read the
client section of docs/marmot.md, build the token chunks from what it says with independent
crypto (coincurve ECDH, `cryptography` HKDF and ChaCha20-Poly1305, never the plugin's own
`encrypt_token`), gift-wrap them with nostr-sdk as mdk does, publish them to a real nostr-relay
and check what the APNs/FCM simulators receive, and what the docs promise about repeats.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import coincurve
import nostr_sdk
import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from plugins.marmot.config import MarmotConfig
from tests.marmot.gw import MarmotGateway, marmot_gateway
from tests.marmot.helpers import NostrRelayProcess, publish_many

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[1] / "docs" / "marmot.md"
PROFILES = ("marmot-push-v1", "mip05-v1")


# -- what the client section of docs/marmot.md says --------------------------------------------


def client_section() -> str:
    text = DOC.read_text("utf-8")
    start = text.index("## 10. For client developers")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def documented_profile(profile: str) -> dict[str, object]:
    """The column of `profile` in the section's token table, as a client would read it."""
    lines = [line for line in client_section().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    column = next(i for i, cell in enumerate(header) if f"`{profile}`" in cell)
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[column]

    def code(cell: str) -> list[str]:
        return re.findall(r"`([^`]+)`", cell)

    plaintext_len, chunk_len = (int(v) for v in code(rows["plaintext / chunk bytes"])[:2])
    return {
        "salt": code(rows["HKDF salt"])[0].encode("ascii"),
        "info": code(rows["HKDF info"])[0].encode("ascii"),
        "plaintext_len": plaintext_len,
        "chunk_len": chunk_len,
        "tags": [json.loads(code(rows["rumor tags"])[0])],
    }


def test_the_client_section_is_the_adopted_and_the_white_noise_profile() -> None:
    """The values a client copies are the ones the reference clients use (mdk, transponder)."""
    assert documented_profile("marmot-push-v1") == {
        "salt": b"marmot-push-token-v1",
        "info": b"marmot-push-token-encryption",
        "plaintext_len": 1024,
        "chunk_len": 1084,
        "tags": [["v", "marmot-push-v1"]],
    }
    assert documented_profile("mip05-v1") == {
        "salt": b"mip05-v1",
        "info": b"mip05-token-encryption",
        "plaintext_len": 1024,
        "chunk_len": 1084,
        "tags": [["v", "mip05-v1"]],
    }
    section = client_section()
    # the key in the form token records carry, and no pointer to the 280-byte draft as normative
    assert "`pubkey_hex`" in section
    head = DOC.read_text("utf-8").split("## 1.")[0]
    assert "features/push-notifications.md" in head
    assert "Give clients the **npub**" not in DOC.read_text("utf-8")


# -- an independent client -----------------------------------------------------------------------


def encrypt_chunk(
    server_xonly: bytes, platform: int, token: bytes, spec: dict[str, object]
) -> bytes:
    """One token chunk as docs/marmot.md §10 describes it (no plugin code)."""
    plaintext_len = spec["plaintext_len"]
    assert isinstance(plaintext_len, int)
    ephemeral = coincurve.PrivateKey()
    server_point = coincurve.PublicKey(b"\x02" + server_xonly)  # lifted to even Y
    shared_x = server_point.multiply(ephemeral.secret).format(compressed=True)[1:]
    salt, info = spec["salt"], spec["info"]
    assert isinstance(salt, bytes) and isinstance(info, bytes)
    key = HKDF(SHA256(), 32, salt, info).derive(shared_x)  # Extract, then Expand
    nonce = os.urandom(12)
    padding = os.urandom(plaintext_len - 3 - len(token))
    plaintext = bytes([platform]) + len(token).to_bytes(2, "big") + token + padding
    xonly = ephemeral.public_key.format(compressed=True)[1:]
    chunk = xonly + nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, None)
    assert len(chunk) == spec["chunk_len"]
    return chunk


def mdk_like_wrap(server_hex: str, chunks: list[bytes], tags: list[list[str]]) -> str:
    """A gift wrap as mdk builds one: nostr-sdk rumor by a fresh key, sealed and wrapped."""
    sender = nostr_sdk.Keys.generate()
    content = base64.b64encode(b"".join(chunks)).decode()
    rumor = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(446), content)
        .tags([nostr_sdk.Tag.parse(t) for t in tags])
        .finalize_unsigned(sender.public_key())
    )
    wrap = nostr_sdk.nip59_make_gift_wrap(sender, nostr_sdk.PublicKey.parse(server_hex), rumor)
    return str(wrap.as_json())


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NostrRelayProcess]:
    process = NostrRelayProcess(tmp_path_factory.mktemp("client-relay"))
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def gateway(relay: NostrRelayProcess, tmp_path: Path) -> AsyncIterator[MarmotGateway]:
    async with marmot_gateway(tmp_path, [relay.url], publish_inbox_list=False) as gw:
        yield gw


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def settle(gw: MarmotGateway, received: int) -> None:
    """Every wrap the relay took has reached the service, been processed, and its pushes ended."""
    await until(
        lambda: (
            gw.metric("pushgw_marmot_events_total", stage="frame", result="received") >= received
        ),
        f"{received} frames",
    )
    await gw.service.idle()
    service = gw.service
    await until(lambda: service.pushes_finished == service.pushes_submitted, "pushes to end")


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_client_built_from_the_client_guide_wakes_its_devices(
    gateway: MarmotGateway, profile: str
) -> None:
    spec = documented_profile(profile)
    gw = gateway
    server = gw.key.pubkey  # the documented `pubkey_hex`, as bytes
    apns_token = secrets.token_bytes(32)  # the raw bytes, not their hex text
    fcm_token = ("fcm:" + secrets.token_urlsafe(120)).encode()
    chunk_len = spec["chunk_len"]
    assert isinstance(chunk_len, int)
    chunks = [
        encrypt_chunk(server, 0x01, apns_token, spec),
        os.urandom(chunk_len),  # a padding chunk: skipped
        encrypt_chunk(server, 0x02, fcm_token, spec),
    ]
    tags = spec["tags"]
    assert isinstance(tags, list)
    wrap = mdk_like_wrap(gw.key.pubkey_hex, chunks, tags)
    await publish_many(gateway_relay_url(gw), [wrap])
    await gw.apns.wait_for_requests(1, 20)
    await gw.fcm.wait_for_requests(1, 20)
    await settle(gw, 1)

    assert [r.token for r in gw.apns.requests] == [apns_token.hex()]
    apns = gw.apns.requests[0]
    assert apns.headers["apns-push-type"] == "background"
    assert apns.headers["apns-priority"] == "5"
    assert apns.json == {"aps": {"content-available": 1}}
    assert [r.token for r in gw.fcm.requests] == [fcm_token.decode()]
    message = gw.fcm.requests[0].message
    assert message["android"] == {"priority": "high"}
    assert message["data"] == {"content_available": "true"}
    assert gw.metric("pushgw_marmot_chunks_total", profile=profile, result="ok") == 2
    assert gw.metric("pushgw_marmot_chunks_total", profile=profile, result="decrypt_failed") == 1


def gateway_relay_url(gw: MarmotGateway) -> str:
    (url,) = gw.service.config.inbox_relays
    return url


async def test_the_same_token_list_wakes_once_per_retention_and_new_content_wakes_again(
    gateway: MarmotGateway,
) -> None:
    """mdk sends its stored token list unchanged for every message: §10 says what that does."""
    section = client_section()
    retention = MarmotConfig.model_fields["dedup_retention"].default
    assert f"`dedup_retention` ({retention:g} s)" in section
    assert "SHA-256 of" in section and "decoded content" in section

    gw = gateway
    spec = documented_profile("marmot-push-v1")
    device = secrets.token_bytes(32)
    tokens = [encrypt_chunk(gw.key.pubkey, 0x01, device, spec)]
    tags = [["v", "marmot-push-v1"]]
    url = gateway_relay_url(gw)
    # two messages, the same token list: two different wraps (fresh keys), the same content
    await publish_many(url, [mdk_like_wrap(gw.key.pubkey_hex, tokens, tags) for _ in range(2)])
    await settle(gw, 2)
    assert [r.token for r in gw.apns.requests] == [device.hex()]
    assert gw.metric("pushgw_marmot_events_total", stage="dedup", result="duplicate") == 1

    # a third message whose content differs (a fresh padding chunk) is a new trigger
    padded = [*tokens, os.urandom(1084)]
    await publish_many(url, [mdk_like_wrap(gw.key.pubkey_hex, padded, tags)])
    await gw.apns.wait_for_requests(2, 20)
    await settle(gw, 3)
    assert [r.token for r in gw.apns.requests] == [device.hex(), device.hex()]


async def test_a_trigger_from_the_280_byte_draft_alone_is_dropped(gateway: MarmotGateway) -> None:
    """The draft 05.md rumor has no tags: the docs now say it is not what the server takes."""
    gw = gateway
    spec = {
        "salt": b"mip05-v1",
        "info": b"mip05-token-encryption",
        "plaintext_len": 220,
        "chunk_len": 280,
    }
    chunk = encrypt_chunk(gw.key.pubkey, 0x01, secrets.token_bytes(32), spec)
    await publish_many(gateway_relay_url(gw), [mdk_like_wrap(gw.key.pubkey_hex, [chunk], [])])
    await settle(gw, 1)
    assert gw.apns.requests == []
    assert gw.metric("pushgw_marmot_events_total", stage="profile", result="no_version") == 1
    assert "**not** what this server accepts" in DOC.read_text("utf-8").split("## 1.")[0]
