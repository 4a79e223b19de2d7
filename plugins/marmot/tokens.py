"""Marmot encrypted device tokens (spec section 2; receiver check 11 minus limiters/dispatch).

::

    TokenPlaintext = platform(1) || u16be(token_len) || device_token || random_padding   (P bytes)
    EncryptedToken = ephemeral_xonly(32) || nonce(12) || ChaCha20-Poly1305(key, nonce, pt, aad="")
    shared_x = X(server_secret * lift_even_y(ephemeral_xonly))          (no hashing, no parity byte)
    key      = HKDF-Expand(HKDF-Extract(salt, shared_x), info, 32)

Three chunk formats: ``mip05-v1`` (P = 1024, 1084-byte chunks), its legacy 280-byte chunks (P = 220,
same salt/info) and ``marmot-push-v1`` (P = 1024, own salt/info).

Padding chunks and tokens addressed to another server fail AEAD and are skipped as
``decrypt_failed``; malformed plaintexts are skipped with their own :class:`ChunkResult`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from plugins.marmot.errors import ChunkRejected, ChunkResult, Nip44Error
from plugins.marmot.keys import ServerKey
from plugins.marmot.nip44 import ecdh_x

__all__ = [
    "MARMOT_PUSH_V1",
    "MIP05_V1",
    "MIP05_V1_LEGACY",
    "DeviceToken",
    "Platform",
    "TokenDecryptor",
    "TokenFormat",
    "derive_token_key",
    "encrypt_token",
    "parse_token_plaintext",
]

_PUBKEY_LEN = 32
_NONCE_LEN = 12
_TAG_LEN = 16
_HEADER_LEN = _PUBKEY_LEN + _NONCE_LEN


class Platform(IntEnum):
    """Push platform byte of a token plaintext."""

    APNS = 1
    FCM = 2


_PLATFORMS = {int(p): p for p in Platform}


@dataclass(frozen=True, slots=True)
class TokenFormat:
    """One encrypted-token layout: HKDF salt/info and plaintext size ``P``."""

    name: str
    salt: bytes
    info: bytes
    plaintext_len: int
    # HKDF-Extract is HMAC keyed with the (constant) salt: its keyed state is built once and copied.
    _extract: HMAC = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_extract", HMAC(self.salt, SHA256()))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to crypto worker processes) as its fields; the keyed HMAC is rebuilt there.
        return (TokenFormat, (self.name, self.salt, self.info, self.plaintext_len))

    @property
    def chunk_len(self) -> int:
        """Encrypted chunk length: 32 + 12 + P + 16."""
        return _HEADER_LEN + self.plaintext_len + _TAG_LEN

    @property
    def max_token_len(self) -> int:
        """Largest valid ``token_len``: P - 3."""
        return self.plaintext_len - 3


MIP05_V1 = TokenFormat("mip05-v1", b"mip05-v1", b"mip05-token-encryption", 1024)
MIP05_V1_LEGACY = TokenFormat("mip05-v1-280", b"mip05-v1", b"mip05-token-encryption", 220)
MARMOT_PUSH_V1 = TokenFormat(
    "marmot-push-v1", b"marmot-push-token-v1", b"marmot-push-token-encryption", 1024
)


def derive_token_key(shared_x: bytes, fmt: TokenFormat) -> bytes:
    """``HKDF-Expand(HKDF-Extract(fmt.salt, shared_x), fmt.info, 32)``; Extract is never skipped."""
    extract = fmt._extract.copy()
    extract.update(shared_x)
    prk = extract.finalize()
    return HKDFExpand(SHA256(), 32, fmt.info).derive(prk)


@dataclass(frozen=True, slots=True)
class DeviceToken:
    """A decrypted device token. ``repr()`` never shows the token.

    ``token`` is the dispatch form: lowercase hex for APNs (``/3/device/{hex}``), the UTF-8 text
    for FCM. ``raw`` is the token bytes from the plaintext.
    """

    platform: Platform
    token: str = field(repr=False)
    raw: bytes = field(repr=False)

    def limiter_key(self) -> bytes:
        """Device-token limiter key (spec section 8): ``SHA-256(platform byte || token bytes)``."""
        return hashlib.sha256(bytes((self.platform,)) + self.raw).digest()


def parse_token_plaintext(plaintext: bytes, fmt: TokenFormat) -> DeviceToken:
    """Check a plaintext (platform, ``1 <= token_len <= P-3``, FCM UTF-8); extract the token."""
    if len(plaintext) != fmt.plaintext_len:
        raise ChunkRejected(ChunkResult.INVALID_LENGTH)
    platform = _PLATFORMS.get(plaintext[0])
    if platform is None:
        raise ChunkRejected(ChunkResult.INVALID_PLATFORM)
    token_len = int.from_bytes(plaintext[1:3], "big")
    if not 1 <= token_len <= fmt.max_token_len:
        raise ChunkRejected(ChunkResult.INVALID_LENGTH)
    raw = plaintext[3 : 3 + token_len]
    if platform is Platform.APNS:
        return DeviceToken(platform, raw.hex(), raw)
    try:
        return DeviceToken(platform, raw.decode("utf-8"), raw)
    except UnicodeDecodeError:
        raise ChunkRejected(ChunkResult.INVALID_ENCODING) from None


class TokenDecryptor:
    """Decrypts token chunks with the server key. Only state: the cached key; thread-safe."""

    __slots__ = ("_secret",)

    def __init__(self, key: ServerKey) -> None:
        """Bind to the server key (its secret scalar is used unchanged, whatever its Y parity)."""
        self._secret = key.secret

    def decrypt_chunk(self, chunk: bytes, fmt: TokenFormat) -> DeviceToken:
        """ECDH -> HKDF -> AEAD -> plaintext checks for one chunk; raises :class:`ChunkRejected`."""
        if len(chunk) != fmt.chunk_len:
            raise ChunkRejected(ChunkResult.DECRYPT_FAILED)
        try:
            shared_x = ecdh_x(self._secret, chunk[:_PUBKEY_LEN])
        except Nip44Error:  # x not on the curve, or a degenerate result
            raise ChunkRejected(ChunkResult.DECRYPT_FAILED) from None
        aead = ChaCha20Poly1305(derive_token_key(shared_x, fmt))
        try:
            plaintext = aead.decrypt(chunk[_PUBKEY_LEN:_HEADER_LEN], chunk[_HEADER_LEN:], None)
        except InvalidTag:
            raise ChunkRejected(ChunkResult.DECRYPT_FAILED) from None
        return parse_token_plaintext(plaintext, fmt)

    def decrypt_chunks(
        self,
        chunks: Iterable[bytes],
        fmt: TokenFormat,
        *,
        on_result: Callable[[ChunkResult], None] | None = None,
    ) -> list[DeviceToken]:
        """Decrypt every chunk, skipping invalid ones, and return the distinct device tokens.

        ``on_result`` receives one :class:`ChunkResult` per chunk (for the chunk metric). A
        (platform, token) seen earlier in the same call is returned only once (spec section 9).
        This helper applies no rate limits; use :meth:`decrypt_chunk` to interleave limiters.
        """
        out: list[DeviceToken] = []
        seen: set[tuple[Platform, bytes]] = set()
        for chunk in chunks:
            try:
                token = self.decrypt_chunk(chunk, fmt)
            except ChunkRejected as exc:
                if on_result is not None:
                    on_result(exc.reason)
                continue
            if on_result is not None:
                on_result(ChunkResult.OK)
            ident = (token.platform, token.raw)
            if ident not in seen:
                seen.add(ident)
                out.append(token)
        return out


def encrypt_token(
    server_pubkey: bytes,
    platform: int,
    device_token: bytes,
    fmt: TokenFormat,
    *,
    ephemeral_secret: bytes | None = None,
    nonce: bytes | None = None,
    padding: bytes | None = None,
) -> bytes:
    """Client side (tests): encrypt one token chunk to the server's 32-byte x-only key.

    ``ephemeral_secret``, ``nonce`` and ``padding`` default to fresh random values; ``padding`` must
    fill the plaintext exactly (``P - 3 - len(device_token)`` bytes). ``platform`` is not
    validated, so tests can build invalid chunks.
    """
    pad_len = fmt.plaintext_len - 3 - len(device_token)
    if pad_len < 0 or len(device_token) > 0xFFFF:
        raise ValueError("device token too long for this format")
    if padding is None:
        padding = os.urandom(pad_len)
    if len(padding) != pad_len:
        raise ValueError("padding length")
    eph = ServerKey.generate() if ephemeral_secret is None else ServerKey(ephemeral_secret)
    nonce = os.urandom(_NONCE_LEN) if nonce is None else nonce
    key = derive_token_key(ecdh_x(eph.secret, server_pubkey), fmt)
    plaintext = bytes((platform,)) + len(device_token).to_bytes(2, "big") + device_token + padding
    return eph.pubkey + nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, None)
