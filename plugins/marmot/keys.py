"""Server key handling, key generation and NIP-19 (``nsec``/``npub``) bech32 encoding.

Why a hand-written bech32: no *runtime* dependency of pushgw provides it. ``nostr-sdk`` (which has
NIP-19) is only a dev/test dependency, and the ``bech32`` module that happens to ship inside
``aionostr`` (pulled in by the test relay ``nostr-relay``) is not a declared dependency either.
BIP-173 bech32 is ~40 lines and fully specified, so it is implemented here and tested against
nostr-sdk's encoder.
"""

from __future__ import annotations

import os

from coincurve import PrivateKey

from plugins.marmot._util import LOWER_HEX64

__all__ = [
    "ServerKey",
    "bech32_decode",
    "bech32_encode",
    "generate_keypair",
    "npub_encode",
    "nsec_encode",
]

_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_CHARSET_REV = {c: i for i, c in enumerate(_CHARSET)}
_GEN = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)


def _polymod(values: list[int]) -> int:
    chk = 1
    for v in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ v
        for i in range(5):
            if (top >> i) & 1:
                chk ^= _GEN[i]
    return chk


def _hrp_expand(hrp: str) -> list[int]:
    return [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]


def _convertbits(data: bytes | list[int], frombits: int, tobits: int, pad: bool) -> list[int]:
    acc = bits = 0
    out: list[int] = []
    maxv = (1 << tobits) - 1
    for value in data:
        if value >> frombits:
            raise ValueError("bech32 data")
        acc = (acc << frombits) | value
        bits += frombits
        while bits >= tobits:
            bits -= tobits
            out.append((acc >> bits) & maxv)
    if pad:
        if bits:
            out.append((acc << (tobits - bits)) & maxv)
    elif bits >= frombits or (acc << (tobits - bits)) & maxv:
        raise ValueError("bech32 padding")
    return out


def bech32_encode(hrp: str, data: bytes) -> str:
    """Encode ``data`` as BIP-173 bech32 (not bech32m) with human-readable part ``hrp``."""
    five = _convertbits(data, 8, 5, True)
    polymod = _polymod([*_hrp_expand(hrp), *five, 0, 0, 0, 0, 0, 0]) ^ 1
    checksum = [(polymod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_CHARSET[d] for d in five + checksum)


def bech32_decode(s: str) -> tuple[str, bytes]:
    """Decode a BIP-173 bech32 string to ``(hrp, data)``; raise :class:`ValueError` if invalid."""
    if s.lower() != s and s.upper() != s:
        raise ValueError("bech32 mixed case")
    s = s.lower()
    pos = s.rfind("1")
    if pos < 1 or pos + 7 > len(s) or len(s) > 1000:
        raise ValueError("bech32 format")
    hrp = s[:pos]
    if any(ord(c) < 33 or ord(c) > 126 for c in hrp):
        raise ValueError("bech32 hrp")
    try:
        values = [_CHARSET_REV[c] for c in s[pos + 1 :]]
    except KeyError as exc:
        raise ValueError("bech32 character") from exc
    if _polymod(_hrp_expand(hrp) + values) != 1:
        raise ValueError("bech32 checksum")
    return hrp, bytes(_convertbits(values[:-6], 5, 8, False))


def nsec_encode(secret: bytes) -> str:
    """NIP-19 ``nsec`` for a 32-byte secret key."""
    return bech32_encode("nsec", secret)


def npub_encode(xonly_pubkey: bytes) -> str:
    """NIP-19 ``npub`` for a 32-byte x-only public key."""
    return bech32_encode("npub", xonly_pubkey)


class ServerKey:
    """The server's Nostr key, validated once with its coincurve objects and encodings cached.

    ``repr()`` shows only the public key, so the object is safe to log.
    """

    __slots__ = ("_private", "_secret", "pubkey", "pubkey_hex")

    def __init__(self, secret: bytes) -> None:
        """Wrap a 32-byte secret scalar; raise :class:`ValueError` if it is not in ``1..n-1``."""
        if len(secret) != 32:
            raise ValueError("secret key must be 32 bytes")
        try:
            private = PrivateKey(secret)
        except (ValueError, TypeError):  # coincurve raises ValueError for 0 or >= n
            raise ValueError("invalid secret key") from None
        self._secret = bytes(secret)
        self._private = private
        #: 32-byte x-only public key.
        self.pubkey: bytes = private.public_key_xonly.format()
        #: Lowercase hex of :attr:`pubkey` (the value of ``p`` tags).
        self.pubkey_hex: str = self.pubkey.hex()

    @classmethod
    def parse(cls, text: str) -> ServerKey:
        """Parse a secret key given as 64 hex digits or as a NIP-19 ``nsec``."""
        text = text.strip()
        if LOWER_HEX64.fullmatch(text.lower()):
            return cls(bytes.fromhex(text))
        try:
            hrp, data = bech32_decode(text)
        except ValueError:
            raise ValueError("secret key is neither 64 hex digits nor an nsec") from None
        if hrp != "nsec":
            raise ValueError("secret key is neither 64 hex digits nor an nsec")
        return cls(data)

    @classmethod
    def generate(cls) -> ServerKey:
        """A fresh random key."""
        return cls(PrivateKey().secret)

    @property
    def secret(self) -> bytes:
        """The 32-byte secret scalar (used as is for ECDH; never log it)."""
        return self._secret

    @property
    def npub(self) -> str:
        """NIP-19 ``npub`` of the public key."""
        return npub_encode(self.pubkey)

    def sign_schnorr(self, msg32: bytes, aux: bytes | None = None) -> bytes:
        """BIP-340 signature over a 32-byte message; ``aux`` defaults to 32 fresh random bytes."""
        return self._private.sign_schnorr(msg32, os.urandom(32) if aux is None else aux)

    def __repr__(self) -> str:
        return f"ServerKey(pubkey={self.pubkey_hex})"


def generate_keypair() -> tuple[str, str, str, str]:
    """Generate a server key: ``(secret_hex, pubkey_hex, nsec, npub)``."""
    key = ServerKey.generate()
    return key.secret.hex(), key.pubkey_hex, nsec_encode(key.secret), key.npub
