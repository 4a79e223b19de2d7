"""Encrypted device tokens: the Marmot token vectors, HKDF conformance, plaintext checks."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
from coincurve import PrivateKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from plugins.marmot import nip44
from plugins.marmot.errors import ChunkRejected, ChunkResult
from plugins.marmot.keys import ServerKey
from plugins.marmot.tokens import (
    MARMOT_PUSH_V1,
    MIP05_V1,
    MIP05_V1_LEGACY,
    DeviceToken,
    Platform,
    TokenDecryptor,
    TokenFormat,
    derive_token_key,
    encrypt_token,
    parse_token_plaintext,
)

from .conftest import MARMOT

TE = MARMOT["derived"]["token_encryption"]
INPUTS = TE["inputs"]
FORMATS = {
    "mip05-v1-280": MIP05_V1_LEGACY,
    "mip05-v1-1084": MIP05_V1,
    "marmot-push-v1": MARMOT_PUSH_V1,
}
APNS_TOKEN = bytes.fromhex(INPUTS["device_token"])


def test_profiles_table_matches_formats() -> None:
    profiles = MARMOT["profiles"]
    mip, mp = profiles["mip05-v1"], profiles["marmot-push-v1"]
    assert (MIP05_V1.salt, MIP05_V1.info) == (
        mip["hkdf_salt_ascii"].encode(),
        b"mip05-token-encryption",
    )
    assert (MIP05_V1.chunk_len, MIP05_V1.plaintext_len) == (mip["chunk_len"], mip["plaintext_len"])
    assert (MIP05_V1_LEGACY.chunk_len, MIP05_V1_LEGACY.plaintext_len) == (
        mip["legacy_chunk_len"],
        mip["legacy_plaintext_len"],
    )
    assert MIP05_V1_LEGACY.max_token_len == mip["legacy_token_len_range"][1]
    assert MIP05_V1.max_token_len == mip["token_len_range"][1]
    assert MARMOT_PUSH_V1.salt == mp["hkdf_salt_ascii"].encode()
    assert MARMOT_PUSH_V1.info == mp["hkdf_info_ascii"].encode()
    assert len(MARMOT_PUSH_V1.salt) == 20 and len(MARMOT_PUSH_V1.info) == 28
    assert MARMOT_PUSH_V1.chunk_len * mp["max_chunks"] == mp["max_decoded_len"]


def test_server_key_has_odd_y_and_ephemeral_xonly() -> None:
    server = PrivateKey(bytes.fromhex(INPUTS["server_sk"]))
    assert server.public_key.format()[0] == 0x03  # odd Y
    assert server.public_key_xonly.format().hex() == INPUTS["server_pubkey_xonly"]
    eph = PrivateKey(bytes.fromhex(INPUTS["ephemeral_sk"]))
    assert eph.public_key_xonly.format().hex() == INPUTS["ephemeral_pubkey_xonly"]


def test_shared_x_both_directions() -> None:
    server_side = nip44.ecdh_x(
        bytes.fromhex(INPUTS["server_sk"]), bytes.fromhex(INPUTS["ephemeral_pubkey_xonly"])
    )
    client_side = nip44.ecdh_x(
        bytes.fromhex(INPUTS["ephemeral_sk"]), bytes.fromhex(INPUTS["server_pubkey_xonly"])
    )
    assert server_side.hex() == client_side.hex() == TE["shared_x"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_profile_vector(name: str) -> None:
    vec: dict[str, Any] = TE["profiles"][name]
    fmt = FORMATS[name]
    assert (fmt.salt, fmt.info) == (vec["salt"].encode(), vec["info"].encode())
    assert (fmt.plaintext_len, fmt.chunk_len) == (vec["plaintext_len"], vec["token_len"])
    key = derive_token_key(bytes.fromhex(TE["shared_x"]), fmt)
    assert key.hex() == vec["encryption_key"]
    # the library HKDF agrees with the cached-extract path
    assert HKDF(SHA256(), 32, fmt.salt, fmt.info).derive(bytes.fromhex(TE["shared_x"])) == key

    chunk = encrypt_token(
        bytes.fromhex(INPUTS["server_pubkey_xonly"]),
        INPUTS["platform"],
        APNS_TOKEN,
        fmt,
        ephemeral_secret=bytes.fromhex(INPUTS["ephemeral_sk"]),
        nonce=bytes.fromhex(INPUTS["nonce"]),
        padding=b"\x99" * (fmt.plaintext_len - 3 - len(APNS_TOKEN)),
    )
    assert chunk.hex() == vec["encrypted_token_hex"]
    assert hashlib.sha256(chunk).hexdigest() == vec["sha256_encrypted_token"]

    decryptor = TokenDecryptor(ServerKey(bytes.fromhex(INPUTS["server_sk"])))
    token = decryptor.decrypt_chunk(bytes.fromhex(vec["encrypted_token_hex"]), fmt)
    assert token.platform is Platform.APNS
    assert token.token == INPUTS["device_token"]
    assert f"/3/device/{token.token}" == "/3/device/" + "cd" * 32


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_hkdf_with_shared_x_00_to_1f(name: str) -> None:
    shared_x = bytes(range(32))
    assert (
        derive_token_key(shared_x, FORMATS[name]).hex() == TE["hkdf_with_shared_x_00_to_1f"][name]
    )


def test_anchored_hkdf_conformance() -> None:
    vec = MARMOT["anchored"]["hkdf_conformance"]
    got = derive_token_key(bytes.fromhex(vec["shared_x"]), MARMOT_PUSH_V1)
    assert got.hex() == vec["marmot-push-v1_key"]


def test_skipping_extract_gives_the_documented_wrong_key() -> None:
    shared_x = bytes.fromhex(TE["shared_x"])
    wrong = HKDFExpand(SHA256(), 32, MIP05_V1.info).derive(shared_x)
    assert wrong.hex() == TE["WRONG_key_if_Extract_is_skipped"]["value"]
    assert derive_token_key(shared_x, MIP05_V1) != wrong


def test_profile_keys_are_not_interchangeable(server_key: ServerKey) -> None:
    vec = TE["profiles"]["marmot-push-v1"]
    with pytest.raises(ChunkRejected) as exc:
        TokenDecryptor(server_key).decrypt_chunk(
            bytes.fromhex(vec["encrypted_token_hex"]), MIP05_V1
        )
    assert exc.value.reason is ChunkResult.DECRYPT_FAILED


# ---- plaintext checks -----------------------------------------------------------------------


def _plaintext(platform: int, token_len: int, token: bytes, fmt: TokenFormat) -> bytes:
    body = bytes((platform,)) + token_len.to_bytes(2, "big") + token
    return body + os.urandom(fmt.plaintext_len - len(body))


@pytest.mark.parametrize(
    ("platform", "token_len", "fmt", "reason"),
    [
        (3, 32, MIP05_V1, ChunkResult.INVALID_PLATFORM),
        (0, 32, MIP05_V1, ChunkResult.INVALID_PLATFORM),
        (1, 0, MIP05_V1, ChunkResult.INVALID_LENGTH),
        (1, 1022, MIP05_V1, ChunkResult.INVALID_LENGTH),
        (2, 0xFFFF, MARMOT_PUSH_V1, ChunkResult.INVALID_LENGTH),
        (1, 218, MIP05_V1_LEGACY, ChunkResult.INVALID_LENGTH),
    ],
)
def test_invalid_plaintexts(
    platform: int, token_len: int, fmt: TokenFormat, reason: ChunkResult
) -> None:
    with pytest.raises(ChunkRejected) as exc:
        parse_token_plaintext(_plaintext(platform, token_len, b"", fmt), fmt)
    assert exc.value.reason is reason


@pytest.mark.parametrize(("fmt", "n"), [(MIP05_V1, 1), (MIP05_V1, 1021), (MIP05_V1_LEGACY, 217)])
def test_boundary_token_lengths_accepted(fmt: TokenFormat, n: int) -> None:
    token = parse_token_plaintext(_plaintext(1, n, b"\xab" * n, fmt), fmt)
    assert token.raw == b"\xab" * n and token.token == "ab" * n


def test_fcm_token_is_utf8_text() -> None:
    text = "fcm:APA91b-é"
    raw = text.encode()
    token = parse_token_plaintext(_plaintext(2, len(raw), raw, MIP05_V1), MIP05_V1)
    assert token.platform is Platform.FCM and token.token == text


def test_fcm_invalid_utf8() -> None:
    with pytest.raises(ChunkRejected) as exc:
        parse_token_plaintext(_plaintext(2, 2, b"\xff\xfe", MIP05_V1), MIP05_V1)
    assert exc.value.reason is ChunkResult.INVALID_ENCODING


def test_wrong_plaintext_length() -> None:
    with pytest.raises(ChunkRejected) as exc:
        parse_token_plaintext(b"\x01\x00\x01a", MIP05_V1)
    assert exc.value.reason is ChunkResult.INVALID_LENGTH


# ---- chunk decryption -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk",
    [
        os.urandom(1084),  # random padding chunk
        bytes(1084),  # x = 0 is not on the curve
        b"\xff" * 32 + os.urandom(1052),  # x >= p
        os.urandom(1083),  # wrong length
    ],
    ids=["random", "zeros", "x_ge_p", "short"],
)
def test_garbage_chunks_fail_decrypt(server_key: ServerKey, chunk: bytes) -> None:
    with pytest.raises(ChunkRejected) as exc:
        TokenDecryptor(server_key).decrypt_chunk(chunk, MIP05_V1)
    assert exc.value.reason is ChunkResult.DECRYPT_FAILED


def test_token_for_another_server_fails(server_key: ServerKey) -> None:
    other = ServerKey.generate()
    chunk = encrypt_token(other.pubkey, 1, b"\x01" * 32, MARMOT_PUSH_V1)
    with pytest.raises(ChunkRejected) as exc:
        TokenDecryptor(server_key).decrypt_chunk(chunk, MARMOT_PUSH_V1)
    assert exc.value.reason is ChunkResult.DECRYPT_FAILED


def test_odd_and_even_y_server_keys() -> None:
    for _ in range(8):  # both parities show up with overwhelming probability
        key = ServerKey.generate()
        chunk = encrypt_token(key.pubkey, 2, b"token", MIP05_V1)
        assert TokenDecryptor(key).decrypt_chunk(chunk, MIP05_V1).token == "token"


def test_decrypt_chunks_skips_and_dedups(server_key: ServerKey) -> None:
    fmt = MARMOT_PUSH_V1
    a = encrypt_token(server_key.pubkey, 1, b"\xaa" * 32, fmt)
    a_again = encrypt_token(server_key.pubkey, 1, b"\xaa" * 32, fmt)  # same token, new blob
    b = encrypt_token(server_key.pubkey, 2, b"fcm-token", fmt)
    bad_platform = encrypt_token(server_key.pubkey, 3, b"x", fmt)
    bad_len = encrypt_token(server_key.pubkey, 1, b"", fmt)
    bad_utf8 = encrypt_token(server_key.pubkey, 2, b"\xc3", fmt)
    chunks = [a, os.urandom(1084), bad_platform, b, a_again, bad_len, bad_utf8]
    results: list[ChunkResult] = []
    tokens = TokenDecryptor(server_key).decrypt_chunks(chunks, fmt, on_result=results.append)
    assert [(t.platform, t.token) for t in tokens] == [
        (Platform.APNS, "aa" * 32),
        (Platform.FCM, "fcm-token"),
    ]
    assert results == [
        ChunkResult.OK,
        ChunkResult.DECRYPT_FAILED,
        ChunkResult.INVALID_PLATFORM,
        ChunkResult.OK,
        ChunkResult.OK,
        ChunkResult.INVALID_LENGTH,
        ChunkResult.INVALID_ENCODING,
    ]


def test_device_token_repr_and_limiter_key() -> None:
    token = DeviceToken(Platform.APNS, "cd" * 32, b"\xcd" * 32)
    assert "cd" not in repr(token).replace("DeviceToken", "")
    assert token.limiter_key() == hashlib.sha256(b"\x01" + b"\xcd" * 32).digest()
    fcm = DeviceToken(Platform.FCM, "\xcd", b"\xcd" * 32)
    assert fcm.limiter_key() != token.limiter_key()


def test_encrypt_token_rejects_oversize() -> None:
    with pytest.raises(ValueError):
        encrypt_token(ServerKey.generate().pubkey, 1, b"x" * 218, MIP05_V1_LEGACY)
