"""matrix.md §6.3: the published vectors, and independent decryption (python-olm, vodozemac)."""

from __future__ import annotations

import base64
from typing import Any

import olm
import pytest
import vodozemac
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from plugins.matrix import msc3013
from tests.matrix.conftest import VECTORS

VECTOR_LIST: list[dict[str, Any]] = VECTORS["vectors"]
FIRST = VECTOR_LIST[0]
RECIPIENT_SECRET = bytes.fromhex(FIRST["recipient_private_key_hex"])


def _ephemeral(vector: dict[str, Any]) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["ephemeral_private_key_hex"]))


@pytest.mark.parametrize("vector", VECTOR_LIST, ids=[v["id"] for v in VECTOR_LIST])
@pytest.mark.parametrize(
    ("mode", "mac_key"), [("libolm", "mac_libolm"), ("ciphertext", "mac_ciphertext_mode")]
)
def test_vectors_reproduced(vector: dict[str, Any], mode: msc3013.MacMode, mac_key: str) -> None:
    out = msc3013.encrypt(
        vector["plaintext"].encode(),
        msc3013.decode_public_key(vector["recipient_public_key"]),
        mac_mode=mode,
        ephemeral_key=_ephemeral(vector),
    )
    assert (out.ephemeral, out.ciphertext, out.mac) == (
        vector["ephemeral"],
        vector["ciphertext"],
        vector[mac_key],
    )
    assert len(vector["plaintext"].encode()) == vector.get(
        "plaintext_utf8_bytes", len(vector["plaintext"].encode())
    )


def test_derived_keys_of_first_vector() -> None:
    secret = X25519PrivateKey.from_private_bytes(RECIPIENT_SECRET).exchange(
        _ephemeral(FIRST).public_key()
    )
    assert secret.hex() == FIRST["shared_secret_hex"]
    aes, mac, iv = msc3013.derive_keys(secret)
    assert (aes.hex(), mac.hex(), iv.hex()) == (
        FIRST["aes_key_hex"],
        FIRST["mac_key_hex"],
        FIRST["iv_hex"],
    )


@pytest.mark.parametrize("vector", VECTOR_LIST, ids=[v["id"] for v in VECTOR_LIST])
def test_vodozemac_decrypts_libolm_mode_and_rejects_ciphertext_mode(vector: dict[str, Any]) -> None:
    decryption = vodozemac.PkDecryption.from_key(
        vodozemac.Curve25519SecretKey.from_bytes(RECIPIENT_SECRET)
    )
    good = vodozemac.Message.from_base64(
        vector["ciphertext"], vector["mac_libolm"], vector["ephemeral"]
    )
    assert decryption.decrypt(good) == vector["plaintext"].encode()
    bad = vodozemac.Message.from_base64(
        vector["ciphertext"], vector["mac_ciphertext_mode"], vector["ephemeral"]
    )
    with pytest.raises(Exception, match=r"(?i)mac"):
        decryption.decrypt(bad)


def test_live_output_decrypts_with_python_olm() -> None:
    decryption = olm.PkDecryption()
    plaintext = '{"room_name":"Ünïcödé 😀","prio":"high"}'
    out = msc3013.encrypt(plaintext.encode(), msc3013.decode_public_key(decryption.public_key))
    for value in (out.ephemeral, out.ciphertext, out.mac):
        assert "=" not in value
    assert decryption.decrypt(olm.PkMessage(out.ephemeral, out.mac, out.ciphertext)) == plaintext
    second = msc3013.encrypt(plaintext.encode(), msc3013.decode_public_key(decryption.public_key))
    assert second.ephemeral != out.ephemeral  # fresh ephemeral key per push


def test_python_olm_rejects_ciphertext_mode() -> None:
    decryption = olm.PkDecryption()
    out = msc3013.encrypt(
        b"{}", msc3013.decode_public_key(decryption.public_key), mac_mode="ciphertext"
    )
    with pytest.raises(olm.PkDecryptionError, match="BAD_MESSAGE_MAC"):
        decryption.decrypt(olm.PkMessage(out.ephemeral, out.mac, out.ciphertext))


def test_own_decoder_accepts_both_paddings_and_modes() -> None:
    secret = X25519PrivateKey.generate()
    public = base64.b64encode(secret.public_key().public_bytes_raw()).decode()  # padded
    for mode in ("libolm", "ciphertext"):
        out = msc3013.encrypt(b"hello", msc3013.decode_public_key(public), mac_mode=mode)  # type: ignore[arg-type]
        padded = {
            k: v + "=" * (-len(v) % 4)
            for k, v in {"e": out.ephemeral, "c": out.ciphertext, "m": out.mac}.items()
        }
        assert msc3013.decrypt(secret, out.ephemeral, out.ciphertext, out.mac) == b"hello"
        assert msc3013.decrypt(secret, padded["e"], padded["c"], padded["m"]) == b"hello"
        assert (
            msc3013.decrypt(secret, out.ephemeral, out.ciphertext, out.mac, mac_mode=mode)
            == b"hello"
        )
    out = msc3013.encrypt(b"hello", secret.public_key())
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.decrypt(secret, out.ephemeral, out.ciphertext, out.mac, mac_mode="ciphertext")


@pytest.mark.parametrize(
    "key", [None, 5, "", "not base64!", "AAAA", base64.b64encode(b"x" * 33).decode()]
)
def test_bad_public_keys(key: Any) -> None:
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.decode_public_key(key)


# Low-order Curve25519 points (zero, one, p-1, the two order-8 points, and the non-canonical
# p and p+1), plus the zero key with the ignored top bit set: no shared secret with any key.
_P = 2**255 - 19
_ORDER_8 = "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"
LOW_ORDER = [
    *(u.to_bytes(32, "little") for u in (0, 1, _P - 1, _P, _P + 1, 1 << 255)),
    bytes.fromhex(_ORDER_8),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
]


@pytest.mark.parametrize("raw", LOW_ORDER, ids=lambda raw: raw.hex()[:8])
def test_low_order_public_keys_are_msc3013_errors(raw: bytes) -> None:
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.decode_public_key(msc3013.b64encode(raw))
    point = X25519PublicKey.from_public_bytes(raw)
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.encrypt(b"hello", point)
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.decrypt(X25519PrivateKey.generate(), msc3013.b64encode(raw), "AAAA", "AAAA")
