"""MSC3013 encrypted push: the `m.megolm_backup.v1.curve25519-aes-sha2` construction
(libolm `PkEncryption`), matrix.md §6.3.

X25519(e, R) → HKDF-SHA256(salt = 32 zero bytes, info = "", 80 bytes) → AES-256 key,
HMAC key, IV → AES-256-CBC with PKCS#7 → MAC = first 8 bytes of HMAC-SHA256 over the
empty string (`libolm` mode, what libolm and vodozemac check) or over the ciphertext
(`ciphertext` mode, the MSC text and Synapse PR #11512). All base64 is unpadded.

`decrypt` exists for tests and `pushgw simulate`: it accepts both paddings and, with
`mac_mode=None`, both MAC modes.

A low-order public key (all zero, one, the order-8 points, and their non-canonical
encodings) gives the all-zero shared secret whatever the private key, which X25519
refuses: `decode_public_key` rejects such keys, and `encrypt` / `decrypt` raise
`Msc3013Error` for them too, never a bare `ValueError` from the X25519 layer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = [
    "ALGORITHMS",
    "EncryptedPayload",
    "MacMode",
    "Msc3013Error",
    "b64decode_any",
    "b64encode",
    "decode_public_key",
    "decrypt",
    "derive_keys",
    "encrypt",
]

MacMode = Literal["libolm", "ciphertext"]
ALGORITHMS = frozenset({"m.curve25519-aes-sha2", "com.famedly.curve25519-aes-sha2"})
_MAC_LENGTH = 8
_ZERO_SALT = bytes(32)
# Any private key detects a low-order public key: X25519 clamps private keys to multiples
# of the cofactor 8, so such a key yields the all-zero secret (refused) for every one.
_PROBE = X25519PrivateKey.generate()


class Msc3013Error(ValueError):
    """Bad key material or a message that does not decrypt (messages carry no secrets)."""


@dataclass(frozen=True, slots=True)
class EncryptedPayload:
    """The three fields that replace the notification: unpadded base64 strings."""

    ephemeral: str
    ciphertext: str
    mac: str

    def __repr__(self) -> str:
        return "EncryptedPayload(...)"


def b64encode(data: bytes) -> str:
    """Unpadded standard base64 (libolm rejects padding)."""
    return base64.b64encode(data).decode("ascii").rstrip("=")


def b64decode_any(text: str) -> bytes:
    """Standard base64 with or without padding; raises Msc3013Error."""
    stripped = text.strip().rstrip("=")
    try:
        return base64.b64decode(stripped + "=" * (-len(stripped) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise Msc3013Error("not valid base64") from None


def decode_public_key(text: object) -> X25519PublicKey:
    """A usable Curve25519 public key from (un)padded base64; raises Msc3013Error
    (also for a low-order key, with which no shared secret can be agreed)."""
    if not isinstance(text, str):
        raise Msc3013Error("public_key missing or not a string")
    raw = b64decode_any(text)
    if len(raw) != 32:
        raise Msc3013Error("public_key is not 32 bytes")
    key = X25519PublicKey.from_public_bytes(raw)
    _exchange(_PROBE, key)
    return key


def _exchange(private: X25519PrivateKey, public: X25519PublicKey) -> bytes:
    """X25519; raises Msc3013Error when `public` is a low-order point (zero secret)."""
    try:
        return private.exchange(public)
    except ValueError:
        raise Msc3013Error("low-order public key: no shared secret") from None


def derive_keys(shared_secret: bytes) -> tuple[bytes, bytes, bytes]:
    """(aes_key, mac_key, iv) from the X25519 shared secret: HKDF-SHA256, 80 bytes."""
    prk = hmac.new(_ZERO_SALT, shared_secret, hashlib.sha256).digest()
    okm = b""
    block = b""
    counter = 1
    while len(okm) < 80:
        block = hmac.new(prk, block + bytes([counter]), hashlib.sha256).digest()
        okm += block
        counter += 1
    return okm[0:32], okm[32:64], okm[64:80]


def _mac(mac_key: bytes, ciphertext: bytes, mode: MacMode) -> bytes:
    message = ciphertext if mode == "ciphertext" else b""
    return hmac.new(mac_key, message, hashlib.sha256).digest()[:_MAC_LENGTH]


def encrypt(
    plaintext: bytes,
    recipient: X25519PublicKey,
    *,
    mac_mode: MacMode = "libolm",
    ephemeral_key: X25519PrivateKey | None = None,
) -> EncryptedPayload:
    """Encrypt for `recipient` with a fresh ephemeral key (pin one only in tests).

    Raises Msc3013Error for a low-order `recipient`."""
    private = ephemeral_key if ephemeral_key is not None else X25519PrivateKey.generate()
    aes_key, mac_key, iv = derive_keys(_exchange(private, recipient))
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    encryptor = Cipher(algorithms.AES(aes_key), modes.CBC(iv)).encryptor()
    ciphertext = encryptor.update(padded) + encryptor.finalize()
    ephemeral = private.public_key().public_bytes_raw()
    return EncryptedPayload(
        ephemeral=b64encode(ephemeral),
        ciphertext=b64encode(ciphertext),
        mac=b64encode(_mac(mac_key, ciphertext, mac_mode)),
    )


def decrypt(
    recipient: X25519PrivateKey,
    ephemeral: str,
    ciphertext: str,
    mac: str,
    *,
    mac_mode: MacMode | None = None,
) -> bytes:
    """Decrypt a message; `mac_mode=None` accepts either MAC. Raises Msc3013Error."""
    try:
        sender = X25519PublicKey.from_public_bytes(b64decode_any(ephemeral))
    except ValueError as exc:
        raise Msc3013Error("bad ephemeral key") from exc
    aes_key, mac_key, iv = derive_keys(_exchange(recipient, sender))
    body = b64decode_any(ciphertext)
    tag = b64decode_any(mac)
    modes_to_try: tuple[MacMode, ...] = (mac_mode,) if mac_mode else ("libolm", "ciphertext")
    if not any(hmac.compare_digest(_mac(mac_key, body, m), tag) for m in modes_to_try):
        raise Msc3013Error("MAC mismatch")
    if not body or len(body) % 16:
        raise Msc3013Error("bad ciphertext length")
    decryptor = Cipher(algorithms.AES(aes_key), modes.CBC(iv)).decryptor()
    padded = decryptor.update(body) + decryptor.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    try:
        return unpadder.update(padded) + unpadder.finalize()
    except ValueError:
        raise Msc3013Error("bad padding") from None
