"""NIP-44 v2: every official vector, the extended-length vectors, and nostr-sdk cross-checks."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import nostr_sdk
import pytest
from coincurve import PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.marmot import nip44
from plugins.marmot.errors import Nip44Error, Nip44Reason
from plugins.marmot.keys import ServerKey

from .conftest import MARMOT, NIP44

VALID = NIP44["valid"]
INVALID = NIP44["invalid"]
#: Valid under the 2026 extension, listed as invalid in the 2024 file: skipped per spec section 4.
EXTENSION_SKIPS = {65536, 100000, 10000000}


def _xonly(sec_hex: str) -> bytes:
    return PrivateKey(bytes.fromhex(sec_hex)).public_key_xonly.format()


def _ids(entries: list[dict[str, Any]]) -> list[str]:
    return [str(i) + ":" + str(e.get("note", ""))[:30] for i, e in enumerate(entries)]


@pytest.mark.parametrize(
    "vec", VALID["get_conversation_key"], ids=_ids(VALID["get_conversation_key"])
)
def test_valid_conversation_key(vec: dict[str, str]) -> None:
    got = nip44.conversation_key(bytes.fromhex(vec["sec1"]), bytes.fromhex(vec["pub2"]))
    assert got.hex() == vec["conversation_key"]


@pytest.mark.parametrize("vec", VALID["get_message_keys"]["keys"])
def test_valid_message_keys(vec: dict[str, str]) -> None:
    conv = bytes.fromhex(VALID["get_message_keys"]["conversation_key"])
    chacha_key, chacha_nonce, hmac_key = nip44.message_keys(conv, bytes.fromhex(vec["nonce"]))
    assert chacha_key.hex() == vec["chacha_key"]
    assert chacha_nonce.hex() == vec["chacha_nonce"]
    assert hmac_key.hex() == vec["hmac_key"]


@pytest.mark.parametrize(("n", "padded"), VALID["calc_padded_len"])
def test_valid_calc_padded_len(n: int, padded: int) -> None:
    assert nip44.calc_padded_len(n) == padded


@pytest.mark.parametrize("vec", VALID["encrypt_decrypt"], ids=_ids(VALID["encrypt_decrypt"]))
def test_valid_encrypt_decrypt(vec: dict[str, str]) -> None:
    sec1, sec2 = bytes.fromhex(vec["sec1"]), bytes.fromhex(vec["sec2"])
    conv = nip44.conversation_key(sec1, _xonly(vec["sec2"]))
    assert conv.hex() == vec["conversation_key"]
    assert nip44.conversation_key(sec2, _xonly(vec["sec1"])) == conv
    payload = nip44.encrypt(vec["plaintext"], conv, bytes.fromhex(vec["nonce"]))
    assert payload == vec["payload"]
    assert nip44.decrypt(vec["payload"], conv) == vec["plaintext"]


@pytest.mark.parametrize("vec", VALID["encrypt_decrypt_long_msg"])
def test_valid_long_messages(vec: dict[str, Any]) -> None:
    plaintext = vec["pattern"] * vec["repeat"]
    assert hashlib.sha256(plaintext.encode()).hexdigest() == vec["plaintext_sha256"]
    conv = bytes.fromhex(vec["conversation_key"])
    payload = nip44.encrypt(plaintext, conv, bytes.fromhex(vec["nonce"]))
    assert hashlib.sha256(payload.encode()).hexdigest() == vec["payload_sha256"]
    assert nip44.decrypt(payload, conv) == plaintext


@pytest.mark.parametrize("length", INVALID["encrypt_msg_lengths"])
def test_invalid_msg_lengths(length: int) -> None:
    if length in EXTENSION_SKIPS:
        pytest.skip("valid under the NIP-44 extended length prefix (spec section 4)")
    with pytest.raises(Nip44Error) as exc:
        nip44.encrypt(b"x" * length, bytes(32), bytes(32))
    assert exc.value.reason is Nip44Reason.INVALID_PLAINTEXT_LENGTH


@pytest.mark.parametrize(
    "vec", INVALID["get_conversation_key"], ids=_ids(INVALID["get_conversation_key"])
)
def test_invalid_conversation_key(vec: dict[str, str]) -> None:
    with pytest.raises(Nip44Error) as exc:
        nip44.conversation_key(bytes.fromhex(vec["sec1"]), bytes.fromhex(vec["pub2"]))
    assert exc.value.reason is Nip44Reason.INVALID_KEY


_EXPECTED_DECRYPT_REASON = {
    "unknown encryption version": Nip44Reason.UNSUPPORTED_VERSION,
    "unknown encryption version 0": Nip44Reason.UNSUPPORTED_VERSION,
    "invalid base64": Nip44Reason.INVALID_BASE64,
    "invalid MAC": Nip44Reason.INVALID_MAC,
    "invalid padding": Nip44Reason.INVALID_PADDING,
}


@pytest.mark.parametrize("vec", INVALID["decrypt"], ids=_ids(INVALID["decrypt"]))
def test_invalid_decrypt(vec: dict[str, str]) -> None:
    with pytest.raises(Nip44Error) as exc:
        nip44.decrypt(vec["payload"], bytes.fromhex(vec["conversation_key"]))
    note = vec["note"]
    if note == "invalid payload length: 0":
        # the empty payload is checked first, as an unsupported version (spec section 4, rule 1)
        assert exc.value.reason is Nip44Reason.UNSUPPORTED_VERSION
    elif note.startswith("invalid payload length"):
        assert exc.value.reason is Nip44Reason.INVALID_PAYLOAD_LENGTH
    else:
        assert exc.value.reason is _EXPECTED_DECRYPT_REASON[note]


EXTENDED = MARMOT["anchored"]["nip44_extended_length"]


@pytest.mark.parametrize("case", EXTENDED["cases"], ids=lambda c: str(c["plaintext_len"]))
def test_anchored_extended_length(case: dict[str, Any]) -> None:
    plaintext = b"a" * case["plaintext_len"]
    assert hashlib.sha256(plaintext).hexdigest() == case["plaintext_sha256"]
    assert nip44.calc_padded_len(len(plaintext)) == case["padded_len"]
    padded = nip44.pad(plaintext)
    prefix_len = 2 if case["prefix"] == "u16" else 6
    assert len(padded) == prefix_len + case["padded_len"]
    if prefix_len == 6:
        assert padded[:2] == b"\x00\x00"
    conv = bytes.fromhex(EXTENDED["conversation_key"])
    payload = nip44.encrypt(plaintext, conv, bytes.fromhex(EXTENDED["nonce"]))
    assert hashlib.sha256(payload.encode()).hexdigest() == case["payload_sha256"]
    assert nip44.decrypt_bytes(payload, conv) == plaintext


def test_70000_byte_roundtrip() -> None:
    conv = os.urandom(32)
    plaintext = os.urandom(70_000)
    assert nip44.decrypt_bytes(nip44.encrypt(plaintext, conv), conv) == plaintext


def test_unpad_rejects_short_extended_length() -> None:
    # 00 00 || u32 with a length below 65,536 is not a valid extended prefix
    padded = b"\x00\x00" + (5).to_bytes(4, "big") + b"hello" + bytes(27)
    with pytest.raises(Nip44Error) as exc:
        nip44.unpad(padded)
    assert exc.value.reason is Nip44Reason.INVALID_PADDING


@pytest.mark.parametrize("bad", ["x" * 200 + "=", "A" * 131 + "=", " " + "A" * 131])
def test_malformed_payloads(bad: str) -> None:
    with pytest.raises(Nip44Error):
        nip44.decrypt(bad, os.urandom(32))


def test_max_payload_len_checked_before_decoding() -> None:
    conv = os.urandom(32)
    payload = nip44.encrypt("hello", conv)
    with pytest.raises(Nip44Error) as exc:
        nip44.decrypt(payload, conv, max_payload_len=len(payload) - 1)
    assert exc.value.reason is Nip44Reason.INVALID_PAYLOAD_LENGTH


def test_non_canonical_base64_rejected() -> None:
    conv = os.urandom(32)
    payload = nip44.encrypt("x" * 40, conv)  # 131 raw bytes: one "=" of padding
    assert payload.endswith("=") and not payload.endswith("==")
    # flip one of the two unused low bits of the last data character
    last = payload.rstrip("=")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    tweaked = last[:-1] + alphabet[alphabet.index(last[-1]) ^ 1] + "="
    with pytest.raises(Nip44Error) as exc:
        nip44.decrypt(tweaked, conv)
    assert exc.value.reason is Nip44Reason.INVALID_BASE64


# ---- cross-checks with nostr-sdk (rust-nostr), an independent implementation ----------------


@settings(max_examples=25, deadline=None)
@given(st.text(min_size=1, max_size=3000))
def test_ours_to_nostr_sdk(text: str) -> None:
    a, b = ServerKey.generate(), ServerKey.generate()
    payload = nip44.encrypt(text, nip44.conversation_key(a.secret, b.pubkey))
    got = nostr_sdk.nip44_decrypt(
        nostr_sdk.SecretKey.from_bytes(b.secret), nostr_sdk.PublicKey.from_bytes(a.pubkey), payload
    )
    assert got == text


@settings(max_examples=25, deadline=None)
@given(st.text(min_size=1, max_size=3000))
def test_nostr_sdk_to_ours(text: str) -> None:
    a, b = ServerKey.generate(), ServerKey.generate()
    payload = nostr_sdk.nip44_encrypt(
        nostr_sdk.SecretKey.from_bytes(a.secret),
        nostr_sdk.PublicKey.from_bytes(b.pubkey),
        text,
        nostr_sdk.Nip44Version.V2,
    )
    assert nip44.decrypt(payload, nip44.conversation_key(b.secret, a.pubkey)) == text


def test_nostr_sdk_refuses_extended_length() -> None:
    """Documents the interop limit of nostr-sdk 0.45 (spec section 12): no extended prefix."""
    a, b = ServerKey.generate(), ServerKey.generate()
    with pytest.raises(nostr_sdk.NostrSdkError):
        nostr_sdk.nip44_encrypt(
            nostr_sdk.SecretKey.from_bytes(a.secret),
            nostr_sdk.PublicKey.from_bytes(b.pubkey),
            "a" * 65536,
            nostr_sdk.Nip44Version.V2,
        )
