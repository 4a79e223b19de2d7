"""Typed failure reasons for the Marmot protocol layer.

Every way an event can be rejected has its own :class:`DropReason`; every way a single token chunk
can be skipped has its own :class:`ChunkResult`. Callers count them by ``reason`` (and ``stage``,
which matches the ``stage`` label of ``pushgw_marmot_events_total``).

Messages carried by these exceptions are fixed strings chosen here. They never include keys, tokens,
ids, content or any other attacker-controlled text, so they are safe to log as they are.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ChunkRejected", "ChunkResult", "DropReason", "Dropped", "Nip44Error", "Nip44Reason"]


class DropReason(StrEnum):
    """Why a gift wrap, seal, rumor or trigger was dropped. Values are stable metric labels."""

    # frame (before parsing)
    OVERSIZE = "oversize"
    # wrap: steps 1-4
    WRAP_MALFORMED = "wrap_malformed"
    WRAP_KIND = "wrap_kind"
    WRAP_BAD_ID = "wrap_bad_id"
    WRAP_BAD_SIG = "wrap_bad_sig"
    WRAP_RECIPIENT = "wrap_recipient"
    WRAP_EXPIRED = "wrap_expired"  # NIP-40 expiration in the past (before the global limiter)
    WRAP_DECRYPT = "wrap_decrypt"
    # seal: steps 5-6
    SEAL_MALFORMED = "seal_malformed"
    SEAL_BAD_ID = "seal_bad_id"
    SEAL_BAD_SIG = "seal_bad_sig"
    SEAL_KIND = "seal_kind"
    SEAL_TAGS = "seal_tags"
    SEAL_DECRYPT = "seal_decrypt"
    # rumor: step 7
    RUMOR_MALFORMED = "rumor_malformed"
    RUMOR_SIGNED = "rumor_signed"
    RUMOR_PUBKEY_MISMATCH = "rumor_pubkey_mismatch"
    RUMOR_BAD_ID = "rumor_bad_id"
    RUMOR_KIND = "rumor_kind"
    # fresh: step 8
    STALE = "stale"
    FUTURE = "future"
    # profile: step 9 (tags)
    NO_VERSION = "no_version"
    UNKNOWN_VERSION = "unknown_version"
    CONFLICTING_VERSION = "conflicting_version"
    PROFILE_DISABLED = "profile_disabled"
    BAD_TAGS = "bad_tags"
    # content: step 9 (content)
    CONTENT_TOO_LONG = "content_too_long"
    BAD_BASE64 = "bad_base64"
    CONTENT_EMPTY = "content_empty"
    BAD_CONTENT_LENGTH = "bad_content_length"
    TOO_MANY_CHUNKS = "too_many_chunks"

    @property
    def stage(self) -> str:
        """The ``stage`` metric label (spec section 11) this reason is counted under."""
        return _STAGE[self]


_STAGE: dict[DropReason, str] = {}
for _r in DropReason:
    if _r is DropReason.OVERSIZE:
        _STAGE[_r] = "frame"
    elif _r.value.startswith("wrap_"):
        _STAGE[_r] = "wrap"
    elif _r.value.startswith("seal_"):
        _STAGE[_r] = "seal"
    elif _r.value.startswith("rumor_"):
        _STAGE[_r] = "rumor"
    elif _r in (DropReason.STALE, DropReason.FUTURE):
        _STAGE[_r] = "fresh"
    elif _r in (
        DropReason.NO_VERSION,
        DropReason.UNKNOWN_VERSION,
        DropReason.CONFLICTING_VERSION,
        DropReason.PROFILE_DISABLED,
        DropReason.BAD_TAGS,
    ):
        _STAGE[_r] = "profile"
    else:
        _STAGE[_r] = "content"
del _r


class Dropped(Exception):
    """An event failed a receiver check and must be dropped (and counted, never answered)."""

    __slots__ = ("reason",)

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason

    @property
    def stage(self) -> str:
        """Metric stage of :attr:`reason`."""
        return self.reason.stage


class ChunkResult(StrEnum):
    """Per-chunk outcome labels of ``pushgw_marmot_chunks_total`` that this layer can produce."""

    OK = "ok"
    DECRYPT_FAILED = "decrypt_failed"
    INVALID_PLATFORM = "invalid_platform"
    INVALID_LENGTH = "invalid_length"
    INVALID_ENCODING = "invalid_encoding"
    #: the same chunk again in one trigger: skipped before the limiter, never decrypted twice
    DUPLICATE = "duplicate"


class ChunkRejected(Exception):
    """One token chunk is invalid (padding, another server's token, malformed): skip it."""

    __slots__ = ("reason",)

    def __init__(self, reason: ChunkResult) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Nip44Reason(StrEnum):
    """Why a NIP-44 operation failed."""

    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_PAYLOAD_LENGTH = "invalid_payload_length"
    INVALID_BASE64 = "invalid_base64"
    INVALID_MAC = "invalid_mac"
    INVALID_PADDING = "invalid_padding"
    INVALID_KEY = "invalid_key"
    INVALID_PLAINTEXT_LENGTH = "invalid_plaintext_length"
    INVALID_UTF8 = "invalid_utf8"


class Nip44Error(ValueError):
    """A NIP-44 payload could not be decrypted, or a plaintext/key could not be used."""

    __slots__ = ("reason",)

    def __init__(self, reason: Nip44Reason) -> None:
        super().__init__(reason.value)
        self.reason = reason
