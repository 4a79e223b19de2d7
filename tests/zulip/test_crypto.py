"""Cryptography against specs/vectors/zulip-crypto.json."""

from __future__ import annotations

import json

import pytest

from plugins.zulip.crypto import (
    CryptoError,
    b64decode_strict,
    decrypt_content,
    encrypt_content,
    generate_bouncer_key,
    generate_push_key,
    load_bouncer_keys,
    open_registration,
    seal_registration,
    token_id_from_int64,
    token_id_of,
    token_id_to_int64,
)
from tests.zulip.conftest import VECTOR


@pytest.mark.parametrize("case", VECTOR["token-id"]["cases"], ids=lambda c: c["token"])
def test_token_id(case: dict) -> None:
    assert token_id_of(case["token"]) == case["token_id"]
    assert token_id_to_int64(case["token_id"]) == case["token_id_int64"]
    assert token_id_from_int64(case["token_id_int64"]) == case["token_id"]


@pytest.mark.parametrize("case", VECTOR["token-id-int64-codec"]["cases"], ids=str)
def test_token_id_codec(case: dict) -> None:
    assert token_id_from_int64(case["int64"]) == case["token_id"]
    assert token_id_to_int64(case["token_id"]) == case["int64"]


@pytest.mark.parametrize("bad", ["192057", "AAAAAAAAAAE", "AAAA", "AA-AAAAAAAE=", "ü", ""])
def test_token_id_refuses_non_base64_or_wrong_length(bad: str) -> None:
    with pytest.raises(CryptoError):
        token_id_to_int64(bad)


def _vector_key() -> dict:
    kp = VECTOR["bouncer-keypair"]
    return load_bouncer_keys({kp["public_key"]: kp["private_key"]})


def test_vector_sealed_registration_opens() -> None:
    vec = VECTOR["sealed-registration"]
    key = _vector_key()[vec["to_public_key"]]
    plaintext = open_registration(key, vec["encrypted_push_registration"])
    assert plaintext.decode() == vec["plaintext"]
    assert token_id_of(json.loads(plaintext)["token"]) == vec["token_id"]
    assert len(b64decode_strict(vec["encrypted_push_registration"])) == len(plaintext) + 48


def test_seal_open_round_trip_and_failures() -> None:
    kp = VECTOR["bouncer-keypair"]
    key = _vector_key()[kp["public_key"]]
    sealed = seal_registration(kp["public_key"], b'{"x":1}')
    assert open_registration(key, sealed) == b'{"x":1}'
    other_pub, _ = generate_bouncer_key()
    for bad in (
        seal_registration(other_pub, b"{}"),
        "not base64!",
        "AAAA",
        sealed[:-8] + "AAAAAAA=",
    ):
        with pytest.raises(CryptoError):
            open_registration(key, bad)


def test_load_bouncer_keys_checks_pairs() -> None:
    pub, priv = generate_bouncer_key()
    assert list(load_bouncer_keys({pub: priv})) == [pub]
    other_pub, _ = generate_bouncer_key()
    with pytest.raises(CryptoError) as info:
        load_bouncer_keys({other_pub: priv})
    assert priv not in str(info.value)
    with pytest.raises(CryptoError):
        load_bouncer_keys({pub: "short"})
    assert priv not in repr(load_bouncer_keys({pub: priv})[pub])


def test_official_app_key_is_not_ours() -> None:
    assert VECTOR["official-app-bouncer-key"]["public_key"] not in _vector_key()


def test_secretbox_vector() -> None:
    vec = VECTOR["secretbox-encrypted-data"]
    push_key = b64decode_strict(vec["push_key"])
    nonce = bytes.fromhex(vec["nonce_hex"])
    assert encrypt_content(push_key, vec["plaintext"].encode(), nonce) == vec["encrypted_data"]
    assert decrypt_content(push_key, vec["encrypted_data"]).decode() == vec["plaintext"]
    payload = json.loads(vec["plaintext"])
    assert encrypt_content(push_key, payload, nonce) == vec["encrypted_data"]


@pytest.mark.parametrize("encoded", VECTOR["push-key-examples"]["push_keys"])
def test_push_key_examples(encoded: str) -> None:
    key = b64decode_strict(encoded)
    assert len(key) == 33 and key[0] == 0x31
    assert decrypt_content(key, encrypt_content(key, {"a": 1})) == b'{"a":1}'


def test_push_key_tag_and_length_refused() -> None:
    key = generate_push_key()
    data = encrypt_content(key, {"a": 1})
    for bad in (b"\x32" + key[1:], key[:-1], key + b"\x00"):
        with pytest.raises(CryptoError):
            decrypt_content(bad, data)
    with pytest.raises(CryptoError):
        decrypt_content(generate_push_key(), data)
