"""NIP-44 v2 encryption, including the 2026 extended length prefix (nips PR #1907).

Spec: ``specs/marmot.md`` section 4. Decryption is what the server needs; encryption exists for
tests and for building large gift wraps (nostr-sdk refuses plaintexts of 65,536 bytes or more).

Primitives come from libraries: secp256k1 from coincurve, HMAC/HKDF-Expand/ChaCha20 from
``cryptography``. Only the NIP-44 framing (padding, length prefix, payload layout) is written here,
because no installed library implements the extended-length variant.
"""

from __future__ import annotations

import base64
import os

from coincurve import PublicKey
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from plugins.marmot._util import strict_b64decode
from plugins.marmot.errors import Nip44Error, Nip44Reason

__all__ = [
    "MAX_PLAINTEXT_LEN",
    "MIN_PAYLOAD_B64_LEN",
    "calc_padded_len",
    "conversation_key",
    "decrypt",
    "decrypt_bytes",
    "ecdh_x",
    "encrypt",
    "message_keys",
    "pad",
    "unpad",
]

VERSION = 2
#: Largest plaintext the extended prefix can describe (u32).
MAX_PLAINTEXT_LEN = 0xFFFFFFFF
#: Smallest valid base64 payload (99 decoded bytes), checked before decoding.
MIN_PAYLOAD_B64_LEN = 132
_MIN_PAYLOAD_RAW_LEN = 99
_EXTENDED_THRESHOLD = 65536
_ZERO32 = bytes(32)
_CHACHA_COUNTER0 = bytes(4)

# HKDF-Extract(salt, ikm) is HMAC(key=salt, ikm). The salt is fixed, so the keyed HMAC state
# (inner/outer pad blocks) is computed once here and copied per call.
_CONV_EXTRACT = HMAC(b"nip44-v2", SHA256())


def ecdh_x(secret: bytes, xonly_pubkey: bytes) -> bytes:
    """Return the unhashed 32-byte X of ``secret * P``, ``P`` = ``xonly_pubkey`` lifted to even Y.

    This is the shared secret of NIP-44 and of Marmot token encryption. coincurve's ``ecdh()``
    hashes the point, so the point multiplication is used instead. Raises :class:`Nip44Error`
    (``invalid_key``) for an x that is not on the curve, a secret outside ``1..n-1``, or an all-zero
    result.
    """
    if len(xonly_pubkey) != 32:
        raise Nip44Error(Nip44Reason.INVALID_KEY)
    try:
        point = PublicKey(b"\x02" + xonly_pubkey)  # BIP-340 lift: even Y
        shared = point.multiply(secret)
    except (ValueError, TypeError) as exc:
        raise Nip44Error(Nip44Reason.INVALID_KEY) from exc
    x = shared.format(compressed=True)[1:]
    if x == _ZERO32:
        raise Nip44Error(Nip44Reason.INVALID_KEY)
    return x


def conversation_key(secret: bytes, xonly_pubkey: bytes) -> bytes:
    """NIP-44 v2 conversation key: ``HKDF-Extract(salt="nip44-v2", ikm=ecdh_x(secret, pub))``."""
    h = _CONV_EXTRACT.copy()
    h.update(ecdh_x(secret, xonly_pubkey))
    return h.finalize()


def message_keys(conv_key: bytes, nonce: bytes) -> tuple[bytes, bytes, bytes]:
    """Return ``(chacha_key, chacha_nonce, hmac_key)`` = HKDF-Expand(conv_key, info=nonce, 76)."""
    if len(conv_key) != 32 or len(nonce) != 32:
        raise Nip44Error(Nip44Reason.INVALID_KEY)
    okm = HKDFExpand(SHA256(), 76, nonce).derive(conv_key)
    return okm[0:32], okm[32:44], okm[44:76]


def calc_padded_len(n: int) -> int:
    """Padded length of an ``n``-byte plaintext (without the length prefix)."""
    if n <= 32:
        return 32
    next_pow2 = 1 << (n - 1).bit_length()
    chunk = 32 if next_pow2 <= 256 else next_pow2 // 8
    return chunk * ((n + chunk - 1) // chunk)


def pad(plaintext: bytes) -> bytes:
    """Length prefix (u16be; ``00 00 || u32be`` from 65,536 bytes) + plaintext + zero padding."""
    n = len(plaintext)
    if n < 1 or n > MAX_PLAINTEXT_LEN:
        raise Nip44Error(Nip44Reason.INVALID_PLAINTEXT_LENGTH)
    prefix = n.to_bytes(2, "big") if n < _EXTENDED_THRESHOLD else b"\x00\x00" + n.to_bytes(4, "big")
    return prefix + plaintext + bytes(calc_padded_len(n) - n)


def unpad(padded: bytes) -> bytes:
    """Inverse of :func:`pad`; raises ``invalid_padding`` on any inconsistency."""
    if len(padded) < 2:
        raise Nip44Error(Nip44Reason.INVALID_PADDING)
    n = int.from_bytes(padded[0:2], "big")
    prefix = 2
    if n == 0:
        if len(padded) < 6:
            raise Nip44Error(Nip44Reason.INVALID_PADDING)
        n = int.from_bytes(padded[2:6], "big")
        prefix = 6
        if n < _EXTENDED_THRESHOLD:
            raise Nip44Error(Nip44Reason.INVALID_PADDING)
    # n >= 1 holds here; calc_padded_len(n) >= n, so the equality also proves the slice is complete.
    if len(padded) != prefix + calc_padded_len(n):
        raise Nip44Error(Nip44Reason.INVALID_PADDING)
    return padded[prefix : prefix + n]


def _chacha20(key: bytes, nonce12: bytes, data: bytes | memoryview) -> bytes:
    # cryptography's ChaCha20 takes a 16-byte nonce: 32-bit little-endian counter || 96-bit nonce.
    cipher = Cipher(algorithms.ChaCha20(key, _CHACHA_COUNTER0 + nonce12), mode=None)
    return cipher.encryptor().update(data)


def encrypt(plaintext: str | bytes, conv_key: bytes, nonce: bytes | None = None) -> str:
    """Encrypt to a NIP-44 v2 base64 payload; ``nonce`` (32 bytes) is random unless given."""
    if isinstance(plaintext, str):
        plaintext = plaintext.encode("utf-8")
    if nonce is None:
        nonce = os.urandom(32)
    chacha_key, chacha_nonce, hmac_key = message_keys(conv_key, nonce)
    ciphertext = _chacha20(chacha_key, chacha_nonce, pad(plaintext))
    mac = HMAC(hmac_key, SHA256())
    mac.update(nonce)
    mac.update(ciphertext)
    return base64.b64encode(b"\x02" + nonce + ciphertext + mac.finalize()).decode("ascii")


def decrypt_bytes(payload: str, conv_key: bytes, *, max_payload_len: int | None = None) -> bytes:
    """Decrypt a NIP-44 v2 payload to the plaintext bytes.

    Checks, in the spec's order: version marker (empty or ``#``), base64 length bounds (before
    decoding), strict base64, decoded length and version byte, constant-time MAC (before
    decrypting), then padding. Raises :class:`Nip44Error` with a distinct reason for each.
    """
    plen = len(payload)
    if plen == 0 or payload[0] == "#":
        raise Nip44Error(Nip44Reason.UNSUPPORTED_VERSION)
    if plen < MIN_PAYLOAD_B64_LEN or (max_payload_len is not None and plen > max_payload_len):
        raise Nip44Error(Nip44Reason.INVALID_PAYLOAD_LENGTH)
    try:
        raw = strict_b64decode(payload)
    except ValueError as exc:
        raise Nip44Error(Nip44Reason.INVALID_BASE64) from exc
    if len(raw) < _MIN_PAYLOAD_RAW_LEN:
        raise Nip44Error(Nip44Reason.INVALID_PAYLOAD_LENGTH)
    if raw[0] != VERSION:
        raise Nip44Error(Nip44Reason.UNSUPPORTED_VERSION)
    view = memoryview(raw)
    nonce = bytes(view[1:33])
    ciphertext = view[33:-32]
    chacha_key, chacha_nonce, hmac_key = message_keys(conv_key, nonce)
    mac = HMAC(hmac_key, SHA256())
    mac.update(nonce)
    mac.update(ciphertext)
    try:
        mac.verify(bytes(view[-32:]))  # constant-time comparison
    except InvalidSignature as exc:
        raise Nip44Error(Nip44Reason.INVALID_MAC) from exc
    return unpad(_chacha20(chacha_key, chacha_nonce, ciphertext))


def decrypt(payload: str, conv_key: bytes, *, max_payload_len: int | None = None) -> str:
    """Decrypt a NIP-44 v2 payload to a string (the plaintext must be valid UTF-8)."""
    plaintext = decrypt_bytes(payload, conv_key, max_payload_len=max_payload_len)
    try:
        return plaintext.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Nip44Error(Nip44Reason.INVALID_UTF8) from exc
