"""Small shared helpers: strict base64 and lowercase-hex checks."""

from __future__ import annotations

import binascii
import re

__all__ = ["LOWER_HEX64", "LOWER_HEX128", "b64_encoded_len", "strict_b64decode"]

#: 32-byte value as 64 lowercase hex digits (event ids, x-only public keys).
LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")
#: 64-byte value as 128 lowercase hex digits (BIP-340 signatures).
LOWER_HEX128 = re.compile(r"[0-9a-f]{128}")


def b64_encoded_len(n: int) -> int:
    """Length of the padded standard base64 encoding of ``n`` bytes: ``4 * ceil(n / 3)``."""
    return 4 * ((n + 2) // 3)


def strict_b64decode(s: str) -> bytes:
    """Decode RFC 4648 section 4 base64 *strictly*; raise :class:`ValueError` otherwise.

    Rejects: whitespace and any character outside the standard alphabet (so URL-safe input),
    missing or excess padding, and non-canonical encodings (non-zero unused bits in the last
    quantum, as Rust's ``base64::STANDARD`` does). ``binascii``'s ``strict_mode`` alone accepts
    excess trailing ``=`` and non-canonical bits, hence the two extra checks.
    """
    if len(s) % 4:
        raise ValueError("base64 length")
    try:
        raw = binascii.a2b_base64(s, strict_mode=True)
    except ValueError as exc:  # binascii.Error, or non-ASCII str
        raise ValueError("base64 alphabet") from exc
    if b64_encoded_len(len(raw)) != len(s):
        raise ValueError("base64 padding")
    if s and s[-1] == "=":
        # Only a padded last quantum can carry unused bits; re-encode it and compare.
        tail_start = (len(raw) - 1) // 3 * 3
        if binascii.b2a_base64(raw[tail_start:], newline=False).decode() != s[-4:]:
            raise ValueError("base64 non-canonical")
    return raw
