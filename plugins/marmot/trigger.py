"""Kind-446 trigger parsing: wire-profile selection by tags and content splitting (check 9).

Spec sections 1 and 3. Everything here runs before any ECDH, so an oversized or malformed trigger
costs no elliptic-curve work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from plugins.marmot._util import b64_encoded_len, strict_b64decode
from plugins.marmot.errors import ChunkResult, Dropped, DropReason
from plugins.marmot.nostr import Rumor
from plugins.marmot.tokens import (
    MARMOT_PUSH_V1,
    MIP05_V1,
    MIP05_V1_LEGACY,
    DeviceToken,
    TokenDecryptor,
    TokenFormat,
)

__all__ = [
    "MARMOT_PUSH_MAX_CHUNKS",
    "Profile",
    "Trigger",
    "TriggerConfig",
    "decrypt_trigger",
    "parse_trigger",
    "select_profile",
    "split_content",
]

#: ``marmot-push-v1`` allows at most 32 chunks (34,688 decoded bytes).
MARMOT_PUSH_MAX_CHUNKS = 32


class Profile(StrEnum):
    """Wire profile, selected by the rumor's ``["v", ...]`` tag."""

    MIP05_V1 = "mip05-v1"
    MARMOT_PUSH_V1 = "marmot-push-v1"


@dataclass(frozen=True, slots=True)
class TriggerConfig:
    """Profile settings (config ``plugins.marmot.profiles``)."""

    mip05_enabled: bool = True
    marmot_push_enabled: bool = True
    #: mip05-v1 chunk limit (clients send <= 25).
    mip05_max_chunks: int = 100
    #: accept 280-byte mip05-v1 chunks.
    legacy_280: bool = True
    #: marmot-push-v1 chunk limit; may be lowered, never raised above 32.
    marmot_push_max_chunks: int = MARMOT_PUSH_MAX_CHUNKS

    def __post_init__(self) -> None:
        if self.mip05_max_chunks < 1:
            raise ValueError("mip05_max_chunks must be >= 1")
        if not 1 <= self.marmot_push_max_chunks <= MARMOT_PUSH_MAX_CHUNKS:
            raise ValueError("marmot_push_max_chunks must be in 1..32")

    def max_chunks(self, profile: Profile) -> int:
        """Chunk limit of ``profile``."""
        if profile is Profile.MARMOT_PUSH_V1:
            return self.marmot_push_max_chunks
        return self.mip05_max_chunks

    def enabled(self, profile: Profile) -> bool:
        """Whether ``profile`` is accepted."""
        if profile is Profile.MARMOT_PUSH_V1:
            return self.marmot_push_enabled
        return self.mip05_enabled


DEFAULT_CONFIG = TriggerConfig()


@dataclass(frozen=True, slots=True)
class Trigger:
    """A parsed trigger: its profile, chunk format, chunks and the content-dedup key.

    ``content_hash`` is ``SHA-256(decoded content)``, the normative dedup key (spec section 7).
    ``repr()`` shows neither chunks nor hash.
    """

    profile: Profile
    token_format: TokenFormat
    chunks: tuple[bytes, ...] = field(repr=False)
    content_hash: bytes = field(repr=False)
    created_at: int = 0


def select_profile(tags: list[list[str]], config: TriggerConfig = DEFAULT_CONFIG) -> Profile:
    """Pick the wire profile from the rumor tags; check the tag set it allows (spec section 1)."""
    values: set[str] = set()
    for tag in tags:
        if tag and tag[0] == "v":
            if len(tag) < 2:
                raise Dropped(DropReason.BAD_TAGS)
            values.add(tag[1])
    if not values:
        raise Dropped(DropReason.NO_VERSION)
    if len(values) > 1:
        raise Dropped(DropReason.CONFLICTING_VERSION)
    try:
        profile = Profile(values.pop())
    except ValueError:
        raise Dropped(DropReason.UNKNOWN_VERSION) from None
    if not config.enabled(profile):
        raise Dropped(DropReason.PROFILE_DISABLED)
    if profile is Profile.MARMOT_PUSH_V1:
        # exactly one tag, with exactly two elements
        if len(tags) != 1 or len(tags[0]) != 2:
            raise Dropped(DropReason.BAD_TAGS)
    else:
        # every "encoding" tag must be exactly ["encoding", "base64"]; other tags are ignored
        for tag in tags:
            if tag and tag[0] == "encoding" and (len(tag) != 2 or tag[1] != "base64"):
                raise Dropped(DropReason.BAD_TAGS)
    return profile


def split_content(
    content: str, profile: Profile, config: TriggerConfig = DEFAULT_CONFIG
) -> tuple[TokenFormat, tuple[bytes, ...], bytes]:
    """Decode and split trigger content (spec section 3): ``(format, chunks, content_hash)``."""
    max_chunks = config.max_chunks(profile)
    # 2. bound the base64 text before decoding (1084-byte chunks for both profiles)
    if len(content) > b64_encoded_len(max_chunks * MIP05_V1.chunk_len):
        raise Dropped(DropReason.CONTENT_TOO_LONG)
    # 1. strict standard base64 with padding
    try:
        data = strict_b64decode(content)
    except ValueError:
        raise Dropped(DropReason.BAD_BASE64) from None
    # 3-5. length rules
    if not data:
        raise Dropped(DropReason.CONTENT_EMPTY)
    size = len(data)
    if profile is Profile.MARMOT_PUSH_V1:
        fmt = MARMOT_PUSH_V1
    elif size % MIP05_V1.chunk_len == 0:
        fmt = MIP05_V1
    elif config.legacy_280 and size % MIP05_V1_LEGACY.chunk_len == 0:
        fmt = MIP05_V1_LEGACY
    else:
        raise Dropped(DropReason.BAD_CONTENT_LENGTH)
    step = fmt.chunk_len
    if size % step:
        raise Dropped(DropReason.BAD_CONTENT_LENGTH)
    if size // step > max_chunks:
        raise Dropped(DropReason.TOO_MANY_CHUNKS)
    chunks = tuple(data[i : i + step] for i in range(0, size, step))
    return fmt, chunks, hashlib.sha256(data).digest()


def parse_trigger(rumor: Rumor, config: TriggerConfig = DEFAULT_CONFIG) -> Trigger:
    """Receiver check 9 on an unwrapped kind-446 rumor. Raises :class:`Dropped`."""
    profile = select_profile(rumor.tags, config)
    fmt, chunks, content_hash = split_content(rumor.content, profile, config)
    return Trigger(profile, fmt, chunks, content_hash, rumor.created_at)


def decrypt_trigger(
    trigger: Trigger,
    decryptor: TokenDecryptor,
    *,
    on_result: Callable[[ChunkResult], None] | None = None,
) -> list[DeviceToken]:
    """Decrypt all chunks of ``trigger`` (no limiters); distinct tokens, invalid chunks skipped."""
    return decryptor.decrypt_chunks(trigger.chunks, trigger.token_format, on_result=on_result)
