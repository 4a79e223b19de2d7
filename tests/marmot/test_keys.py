"""Server keys, key generation and NIP-19 bech32 (checked against nostr-sdk)."""

from __future__ import annotations

import nostr_sdk
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.marmot.keys import (
    ServerKey,
    bech32_decode,
    bech32_encode,
    generate_keypair,
    npub_encode,
    nsec_encode,
)


def test_generate_keypair_matches_nostr_sdk() -> None:
    secret_hex, pubkey_hex, nsec, npub = generate_keypair()
    assert len(secret_hex) == 64 and len(pubkey_hex) == 64
    keys = nostr_sdk.Keys.parse(secret_hex)
    assert keys.public_key().to_hex() == pubkey_hex
    assert keys.secret_key().to_bech32() == nsec
    assert keys.public_key().to_bech32() == npub
    assert nostr_sdk.Keys.parse(nsec).public_key().to_hex() == pubkey_hex
    assert nostr_sdk.PublicKey.parse(npub).to_hex() == pubkey_hex


@settings(max_examples=50)
@given(st.binary(min_size=32, max_size=32))
def test_bech32_roundtrip_and_nostr_sdk(data: bytes) -> None:
    npub = npub_encode(data)
    assert bech32_decode(npub) == ("npub", data)
    assert bech32_decode(npub.upper()) == ("npub", data)
    try:
        sdk = nostr_sdk.PublicKey.from_bytes(data).to_bech32()
    except nostr_sdk.NostrSdkError:
        return  # not a valid x coordinate; nostr-sdk refuses to encode it
    assert sdk == npub


def test_nip19_reference_vector() -> None:
    # NIP-19 examples
    pub = bytes.fromhex("7e7e9c42a91bfef19fa929e5fda1b72e0ebc1a4c1141673e2794234d86addf4e")
    assert npub_encode(pub) == "npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjptg"
    sec = bytes.fromhex("67dea2ed018072d675f5415ecfaed7d2597555e202d85b3d65ea4e58d2d92ffa")
    assert nsec_encode(sec) == "nsec1vl029mgpspedva04g90vltkh6fvh240zqtv9k0t9af8935ke9laqsnlfe5"


@pytest.mark.parametrize(
    "bad",
    [
        "npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjpth",  # checksum
        "Npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjptg",  # mixed case
        "npub1b",  # too short
        "npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjptgi",  # 'i' not in charset
        "noseparator",
    ],
)
def test_bech32_decode_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        bech32_decode(bad)


def test_bech32_encode_hrp() -> None:
    assert bech32_encode("a", b"").startswith("a1")


def test_server_key_parse_forms() -> None:
    secret_hex, pubkey_hex, nsec, _ = generate_keypair()
    for text in (secret_hex, secret_hex.upper(), f"  {nsec}\n"):
        key = ServerKey.parse(text)
        assert key.pubkey_hex == pubkey_hex
        assert secret_hex not in repr(key) and nsec not in repr(key)
    assert ServerKey.parse(nsec).npub.startswith("npub1")


@pytest.mark.parametrize(
    "bad",
    [
        "00" * 32,
        "ff" * 32,
        "fffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141",  # n
        "abc",
        "npub10elfcs4fr0l0r8af98jlmgdh9c8tcxjvz9qkw038js35mp4dma8qzvjptg",
    ],
)
def test_server_key_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError) as exc:
        ServerKey.parse(bad)
    assert bad not in str(exc.value)


def test_server_key_wrong_length() -> None:
    with pytest.raises(ValueError):
        ServerKey(b"\x01" * 31)
