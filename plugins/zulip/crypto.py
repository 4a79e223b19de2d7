"""Zulip push cryptography (specs/zulip.md §7).

- `token_id`: padded standard base64 of SHA-256(UTF-8 token)[0:8]; stored as the same
  8 bytes read as a signed big-endian int64.
- Registrations: libsodium sealed boxes (`crypto_box_seal`) to a bouncer key pair.
- Content: `crypto_secretbox_easy` with a 33-byte push key (tag 0x31 + 32-byte key).
  The bouncer never decrypts content; `encrypt_content` / `decrypt_content` exist for
  tests, `pushgw simulate` and operators checking a deployment.

Nothing here logs or puts secrets in exception messages.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.public
import nacl.secret
import nacl.utils

__all__ = [
    "PUSH_KEY_TAG",
    "BouncerKey",
    "CryptoError",
    "b64decode_strict",
    "b64encode",
    "decrypt_content",
    "encrypt_content",
    "generate_bouncer_key",
    "generate_push_key",
    "load_bouncer_keys",
    "open_registration",
    "seal_registration",
    "token_id_from_int64",
    "token_id_of",
    "token_id_to_int64",
]

PUSH_KEY_TAG = 0x31
_KEY_LEN = 32


class CryptoError(ValueError):
    """Decoding, decryption or key problem; the message never contains secret material."""


def b64encode(data: bytes) -> str:
    """Standard base64 with padding (the Zulip wire format)."""
    return base64.b64encode(data).decode("ascii")


def b64decode_strict(value: str) -> bytes:
    """Decode standard padded base64, refusing any other alphabet or missing padding."""
    if not isinstance(value, str):
        raise CryptoError("not a string")
    try:
        raw = value.encode("ascii")
    except UnicodeEncodeError:
        raise CryptoError("not base64") from None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise CryptoError("not base64") from None


# --- token_id ---------------------------------------------------------------------


def _token_id_bytes(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()[:8]


def token_id_of(token: str) -> str:
    """The base64 `token_id` of a device token."""
    return b64encode(_token_id_bytes(token))


def token_id_to_int64(token_id: str) -> int:
    """Base64 token_id → signed big-endian int64; CryptoError when it is not 8 bytes of base64."""
    raw = b64decode_strict(token_id)
    if len(raw) != 8:
        raise CryptoError("token_id is not 8 bytes")
    value: int = struct.unpack(">q", raw)[0]
    return value


def token_id_from_int64(value: int) -> str:
    """Signed int64 → base64 token_id."""
    return b64encode(struct.pack(">q", value))


# --- bouncer keys and sealed registrations ---------------------------------------


@dataclass(frozen=True)
class BouncerKey:
    """One bouncer key pair; `public` is the exact base64 string apps carry."""

    public: str
    private: nacl.public.PrivateKey

    def __repr__(self) -> str:  # never show the private half
        return f"BouncerKey(public={self.public!r})"


def generate_bouncer_key() -> tuple[str, str]:
    """A fresh key pair as (base64 public, base64 private)."""
    private = nacl.public.PrivateKey.generate()
    return b64encode(bytes(private.public_key)), b64encode(bytes(private))


def load_bouncer_keys(keys: Mapping[str, str]) -> dict[str, BouncerKey]:
    """Check a `{base64 public: base64 private}` map: each private half must derive its public."""
    out: dict[str, BouncerKey] = {}
    for number, (public, private_b64) in enumerate(keys.items(), 1):
        # Entries are named by position, never by the map key: until the pair checks out,
        # that key may be a private half (a map written `{private: public}`), and these
        # messages reach `check-config`, the server log and the CLI.
        where = f"bouncer key {number} of {len(keys)}"
        try:
            raw = b64decode_strict(private_b64)
        except CryptoError:
            raise CryptoError(f"{where}: private key is not base64") from None
        if len(raw) != _KEY_LEN:
            raise CryptoError(f"{where}: private key is not 32 bytes")
        private = nacl.public.PrivateKey(raw)
        if b64encode(bytes(private.public_key)) != public:
            if _derives(public, private_b64):
                raise CryptoError(
                    f"{where}: public and private halves are swapped (the map is "
                    "{public: private})"
                )
            raise CryptoError(f"{where}: private key does not match the public key")
        out[public] = BouncerKey(public, private)
    return out


def _derives(private_b64: str, public: str) -> bool:
    """Whether `private_b64` is a private key whose public half is `public`."""
    try:
        raw = b64decode_strict(private_b64)
    except CryptoError:
        return False
    if len(raw) != _KEY_LEN:
        return False
    return b64encode(bytes(nacl.public.PrivateKey(raw).public_key)) == public


def seal_registration(public_key: str, plaintext: bytes) -> str:
    """What an app does: seal `plaintext` to a bouncer public key, base64."""
    key = nacl.public.PublicKey(b64decode_strict(public_key))
    return b64encode(nacl.public.SealedBox(key).encrypt(plaintext))


def open_registration(key: BouncerKey, encrypted: str) -> bytes:
    """Open a base64 sealed box with a bouncer key; CryptoError on any failure."""
    sealed = b64decode_strict(encrypted)
    try:
        return nacl.public.SealedBox(key.private).decrypt(sealed)
    except (nacl.exceptions.CryptoError, nacl.exceptions.TypeError, ValueError):
        raise CryptoError("cannot open sealed box") from None


# --- content (server → app) --------------------------------------------------------


def generate_push_key() -> bytes:
    """A fresh 33-byte push key (tag ‖ key), as a client would create it."""
    return bytes([PUSH_KEY_TAG]) + nacl.utils.random(_KEY_LEN)


def _secret_box(push_key: bytes) -> nacl.secret.SecretBox:
    if len(push_key) != 1 + _KEY_LEN or push_key[0] != PUSH_KEY_TAG:
        raise CryptoError("unsupported push key")
    return nacl.secret.SecretBox(push_key[1:])


def encrypt_content(push_key: bytes, payload: Any, nonce: bytes | None = None) -> str:
    """What a Zulip server does: secretbox the compact JSON of `payload`, base64."""
    data = (
        payload
        if isinstance(payload, bytes)
        else json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    )
    box = _secret_box(push_key)
    nonce = nonce if nonce is not None else nacl.utils.random(nacl.secret.SecretBox.NONCE_SIZE)
    sealed = box.encrypt(data, nonce)
    return b64encode(bytes(sealed))


def decrypt_content(push_key: bytes, encrypted_data: str) -> bytes:
    """What the app does: open `encrypted_data` (nonce ‖ MAC ‖ ciphertext)."""
    box = _secret_box(push_key)
    try:
        return box.decrypt(b64decode_strict(encrypted_data))
    except (nacl.exceptions.CryptoError, ValueError):
        raise CryptoError("cannot decrypt content") from None
