"""Nostr events (NIP-01), BIP-340 signatures and the NIP-59 gift-wrap receiver (spec section 5).

:class:`GiftUnwrapper` runs receiver checks 1-8 of ``specs/marmot.md`` section 5, in that order,
on one kind-1059 event and returns the kind-446 rumor. Every failure raises :class:`Dropped` with
its own :class:`DropReason`; nothing else escapes (a hypothesis test fuzzes this). Checks 9-11
live in :mod:`plugins.marmot.trigger` and :mod:`plugins.marmot.tokens`.

nostr-sdk's ``UnwrappedGift.from_gift_wrap`` skips some of these checks (e.g. the seal kind), so the
receiver is implemented here on top of coincurve (BIP-340) and :mod:`plugins.marmot.nip44`.

The module also builds seals and gift wraps (tests, and wraps too large for nostr-sdk's NIP-44).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coincurve import PublicKeyXOnly

from plugins.marmot import nip44
from plugins.marmot._util import LOWER_HEX64, LOWER_HEX128
from plugins.marmot.errors import Dropped, DropReason, Nip44Error
from plugins.marmot.keys import ServerKey

__all__ = [
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_FUTURE_SKEW",
    "KIND_GIFT_WRAP",
    "KIND_SEAL",
    "KIND_TRIGGER",
    "Event",
    "GiftUnwrapper",
    "Rumor",
    "compute_event_id",
    "expiration",
    "gift_wrap",
    "load_json",
    "make_rumor",
    "parse_event",
    "seal_rumor",
    "sign_event",
    "verify_signature",
]

KIND_SEAL = 13
KIND_TRIGGER = 446
KIND_GIFT_WRAP = 1059
DEFAULT_MAX_EVENT_BYTES = 262_144
DEFAULT_MAX_AGE = 3600
DEFAULT_MAX_FUTURE_SKEW = 300
#: NIP-59 randomizes wrap and seal ``created_at`` up to two days into the past.
NIP59_TIME_WINDOW = 172_800
_MAX_TIMESTAMP = 2**64 - 1  # rust-nostr's Timestamp is a u64
_MAX_KIND = 65_535
#: A u64 as Rust's `str::parse` reads it (optional `+`, ASCII digits); bounded before `int()`.
_U64_TEXT = re.compile(r"\+?0*([0-9]{1,20})")


class _Invalid(Exception):
    """Internal: a field failed validation; mapped to the stage's ``*_malformed`` reason."""


# --------------------------------------------------------------------------------------------
# Event model


@dataclass(frozen=True, slots=True)
class Event:
    """A signed Nostr event (NIP-01) with validated field types."""

    id: str
    pubkey: str
    created_at: int
    kind: int
    tags: list[list[str]]
    content: str
    sig: str = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-ready dict, fields in NIP-01 order."""
        return {
            "id": self.id,
            "pubkey": self.pubkey,
            "created_at": self.created_at,
            "kind": self.kind,
            "tags": self.tags,
            "content": self.content,
            "sig": self.sig,
        }

    def to_json(self) -> str:
        """Compact JSON (the form sent to relays and encrypted into wraps)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Rumor:
    """An unsigned event (NIP-59 rumor). ``id`` is the id as sent, if any (checked when present)."""

    pubkey: str
    created_at: int
    kind: int
    tags: list[list[str]]
    content: str = field(repr=False)
    id: str | None = None

    def compute_id(self) -> str:
        """The NIP-01 id of this rumor's fields."""
        return compute_event_id(self.pubkey, self.created_at, self.kind, self.tags, self.content)

    def to_json(self) -> str:
        """Compact JSON with the (computed if absent) id, as a seal encrypts it."""
        return json.dumps(
            {
                "id": self.id or self.compute_id(),
                "pubkey": self.pubkey,
                "created_at": self.created_at,
                "kind": self.kind,
                "tags": self.tags,
                "content": self.content,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )


# --------------------------------------------------------------------------------------------
# NIP-01 id, BIP-340 signatures


_json_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
# Printable ASCII except '"' and '\\': the characters JSON writes verbatim.
_JSON_VERBATIM = bytes(c for c in range(0x20, 0x7F) if c not in (0x22, 0x5C))


def _json_str(value: str) -> bytes:
    # Fast path for the common case (hex keys, base64 content): when every character is written
    # verbatim, the JSON string is just the quoted text. The bytes.translate check is ~10x cheaper
    # than the json module's escaping scan (or str.isprintable) over a 100 KB content.
    if value.isascii():
        raw = value.encode("ascii")
        if not raw.translate(None, _JSON_VERBATIM):
            return b'"' + raw + b'"'
    return _json_compact(value).encode("utf-8")


def compute_event_id(
    pubkey: str, created_at: int, kind: int, tags: list[list[str]], content: str
) -> str:
    """``sha256`` of the NIP-01 serialization ``[0,pubkey,created_at,kind,tags,content]``.

    Escaping follows ``json.dumps(ensure_ascii=False)``, which matches serde_json (rust-nostr)
    and ``JSON.stringify`` (nostr-tools): short escapes for ``\\n \\" \\\\ \\r \\t \\b \\f``,
    ``\\u00XX`` for other control characters, everything else verbatim UTF-8. Raises
    :class:`ValueError` for strings that are not encodable as UTF-8 (lone surrogates).
    """
    h = hashlib.sha256(b"[0,")
    h.update(_json_str(pubkey))
    h.update(b",%d,%d," % (created_at, kind))
    h.update(_json_compact(tags).encode("utf-8"))
    h.update(b",")
    h.update(_json_str(content))
    h.update(b"]")
    return h.hexdigest()


def verify_signature(pubkey_hex: str, id_hex: str, sig_hex: str) -> bool:
    """BIP-340 verification of ``sig`` over the 32-byte id; ``False`` for any invalid input."""
    try:
        return bool(
            PublicKeyXOnly(bytes.fromhex(pubkey_hex)).verify(
                bytes.fromhex(sig_hex), bytes.fromhex(id_hex)
            )
        )
    except (ValueError, TypeError):
        return False


def sign_event(
    key: ServerKey,
    kind: int,
    content: str,
    tags: list[list[str]] | None = None,
    created_at: int | None = None,
    aux: bytes | None = None,
) -> Event:
    """Build and BIP-340-sign an event with ``key`` (``aux`` fixes the signing randomness)."""
    tags = [] if tags is None else tags
    created_at = int(time.time()) if created_at is None else created_at
    event_id = compute_event_id(key.pubkey_hex, created_at, kind, tags, content)
    sig = key.sign_schnorr(bytes.fromhex(event_id), aux).hex()
    return Event(event_id, key.pubkey_hex, created_at, kind, tags, content, sig)


# --------------------------------------------------------------------------------------------
# Strict parsing


def _reject_constant(name: str) -> Any:
    raise _Invalid(name)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Invalid("duplicate key")  # parsers disagree on which one wins: refuse
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def load_json(raw: str | bytes) -> Any:
    """Parse JSON strictly: UTF-8 only, no NaN/Infinity, no duplicate keys.

    Raises :class:`ValueError` for anything else (including nesting deep enough to exhaust the
    recursion limit, and integers over Python's digit limit).
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        return _DECODER.decode(text)
    except (ValueError, _Invalid, RecursionError, TypeError, AttributeError) as exc:
        raise ValueError("invalid JSON") from exc


def _str(obj: Mapping[str, Any], key: str) -> str:
    v = obj.get(key)
    if type(v) is not str:
        raise _Invalid(key)
    return v


def _int(obj: Mapping[str, Any], key: str, upper: int) -> int:
    v = obj.get(key)
    if type(v) is not int or not 0 <= v <= upper:  # type() excludes bool
        raise _Invalid(key)
    return v


def _hex64(obj: Mapping[str, Any], key: str) -> str:
    v = _str(obj, key)
    if not LOWER_HEX64.fullmatch(v):
        raise _Invalid(key)
    return v


def _tags(obj: Mapping[str, Any]) -> list[list[str]]:
    tags = obj.get("tags")
    if type(tags) is not list:
        raise _Invalid("tags")
    for tag in tags:
        if type(tag) is not list or any(type(x) is not str for x in tag):
            raise _Invalid("tags")
    return tags


def _parse_signed(obj: Any) -> Event:
    if not isinstance(obj, dict):
        raise _Invalid("event")
    sig = _str(obj, "sig")
    if not LOWER_HEX128.fullmatch(sig):
        raise _Invalid("sig")
    return Event(
        id=_hex64(obj, "id"),
        pubkey=_hex64(obj, "pubkey"),
        created_at=_int(obj, "created_at", _MAX_TIMESTAMP),
        kind=_int(obj, "kind", _MAX_KIND),
        tags=_tags(obj),
        content=_str(obj, "content"),
        sig=sig,
    )


def parse_event(raw: str | bytes | Mapping[str, Any]) -> Event:
    """Parse a signed event (JSON text or an already-decoded object) with strict field types.

    Only checks shape; it does not verify the id or signature. Raises :class:`ValueError`.
    """
    try:
        return _parse_signed(load_json(raw) if isinstance(raw, str | bytes) else raw)
    except _Invalid as exc:
        raise ValueError("invalid event") from exc


def _check_id_and_sig(event: Event, bad_id: DropReason, bad_sig: DropReason) -> None:
    try:
        expected = compute_event_id(
            event.pubkey, event.created_at, event.kind, event.tags, event.content
        )
    except ValueError:
        raise Dropped(bad_id) from None
    if expected != event.id:
        raise Dropped(bad_id)
    if not verify_signature(event.pubkey, event.id, event.sig):
        raise Dropped(bad_sig)


def expiration(tags: object) -> int | None:
    """NIP-40 expiration of an event with these (unvalidated) tags, or None.

    Read as rust-nostr reads it (`Tags::expiration`, what transponder's relay client applies):
    the first tag named ``expiration``, its value an unsigned integer; a first such tag without
    a usable value means no expiration, whatever later ones say.
    """
    if not isinstance(tags, list):
        return None
    for tag in tags:
        if isinstance(tag, list) and tag and tag[0] == "expiration":
            value = tag[1] if len(tag) > 1 else None
            match = _U64_TEXT.fullmatch(value) if isinstance(value, str) else None
            if match is None or int(match[1]) > _MAX_TIMESTAMP:
                return None
            return int(match[1])
    return None


# --------------------------------------------------------------------------------------------
# Receiver


class GiftUnwrapper:
    """Unwraps NIP-59 gift wraps addressed to the server key (spec section 5, checks 1-8).

    One instance per server key; it caches the key material. ``clock`` returns the current Unix
    time and is injectable for tests. Thread-safe (no mutable state).
    """

    __slots__ = (
        "_key",
        "_secret",
        "clock",
        "max_age",
        "max_event_bytes",
        "max_future_skew",
    )

    def __init__(
        self,
        key: ServerKey,
        *,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_age: int = DEFAULT_MAX_AGE,
        max_future_skew: int = DEFAULT_MAX_FUTURE_SKEW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Create a receiver for ``key`` with the given size and freshness limits."""
        self._key = key
        self._secret = key.secret
        self.max_event_bytes = max_event_bytes
        self.max_age = max_age
        self.max_future_skew = max_future_skew
        self.clock = clock

    @property
    def pubkey_hex(self) -> str:
        """The server's x-only public key (lowercase hex), the expected ``p`` tag value."""
        return self._key.pubkey_hex

    def parse_wrap(self, raw: str | bytes | Mapping[str, Any]) -> Event:
        """Size-check (JSON text only) and parse a wrap. Raises ``oversize``/``wrap_malformed``."""
        if isinstance(raw, str | bytes):
            size = len(raw)
            if isinstance(raw, str) and size <= self.max_event_bytes and not raw.isascii():
                size = len(raw.encode("utf-8", "surrogatepass"))
            if size > self.max_event_bytes:
                raise Dropped(DropReason.OVERSIZE)
            try:
                raw = load_json(raw)
            except ValueError:
                raise Dropped(DropReason.WRAP_MALFORMED) from None
        try:
            return _parse_signed(raw)
        except _Invalid:
            raise Dropped(DropReason.WRAP_MALFORMED) from None

    def off_filter(self, event: Mapping[str, Any]) -> DropReason | None:
        """Why an event is outside our subscription filter (kind 1059, ``#p`` our key), or None.

        A relay should never send such an event; a broken one that ignores the filter sends
        them all. Checks 1 and 3 give the same answer later, but only after the event took a
        token of the global budget. Only a well-formed event is judged here (a cheap parse, no
        hashing): a malformed one is left to the full checks.
        """
        try:
            parsed = _parse_signed(event)
        except _Invalid:
            return None
        if parsed.kind != KIND_GIFT_WRAP:
            return DropReason.WRAP_KIND
        ours = self._key.pubkey_hex
        if not any(len(t) >= 2 and t[0] == "p" and t[1] == ours for t in parsed.tags):
            return DropReason.WRAP_RECIPIENT
        return None

    def expired(self, tags: object) -> bool:
        """Whether an event with these (unvalidated) tags has a NIP-40 ``expiration`` before now.

        Its sender declared it dead: nostr-sdk, through which transponder receives wraps, drops
        such events before anything else, and a relay that ignores NIP-40 may still send them
        (a backfill after a reconnect). Cheap (no hashing), so it runs before the global limiter.
        """
        when = expiration(tags)
        return when is not None and when < int(self.clock())  # whole seconds, as rust-nostr

    def open_wrap(
        self,
        wrap: Event | str | bytes | Mapping[str, Any],
        *,
        on_verified: Callable[[str], None] | None = None,
    ) -> tuple[Event, Rumor]:
        """Generic NIP-59 part: checks 1-7 except the rumor kind. Returns ``(seal, rumor)``.

        ``on_verified(wrap_id)`` is called right after check 2 (id and signature verified): the
        place to insert the id into the seen-wrap cache (spec section 7). Raises :class:`Dropped`.
        """
        if not isinstance(wrap, Event):
            wrap = self.parse_wrap(wrap)
        # 1. kind
        if wrap.kind != KIND_GIFT_WRAP:
            raise Dropped(DropReason.WRAP_KIND)
        # 2. id and signature
        _check_id_and_sig(wrap, DropReason.WRAP_BAD_ID, DropReason.WRAP_BAD_SIG)
        if on_verified is not None:
            on_verified(wrap.id)
        # NIP-40 (also checked on arrival; this catches a wrap that expired while queued)
        if self.expired(wrap.tags):
            raise Dropped(DropReason.WRAP_EXPIRED)
        # 3. exactly one p tag, exactly one value, our key
        p_tags = [t for t in wrap.tags if t and t[0] == "p"]
        if len(p_tags) != 1 or len(p_tags[0]) != 2 or p_tags[0][1] != self._key.pubkey_hex:
            raise Dropped(DropReason.WRAP_RECIPIENT)
        # 4. decrypt the wrap
        try:
            wrap_conv = nip44.conversation_key(self._secret, bytes.fromhex(wrap.pubkey))
            seal_json = nip44.decrypt(wrap.content, wrap_conv, max_payload_len=self.max_event_bytes)
        except Nip44Error:
            raise Dropped(DropReason.WRAP_DECRYPT) from None
        # 5. the seal: typed fields, id, signature, kind 13, no tags
        try:
            seal = _parse_signed(load_json(seal_json))
        except (ValueError, _Invalid):
            raise Dropped(DropReason.SEAL_MALFORMED) from None
        _check_id_and_sig(seal, DropReason.SEAL_BAD_ID, DropReason.SEAL_BAD_SIG)
        if seal.kind != KIND_SEAL:
            raise Dropped(DropReason.SEAL_KIND)
        if seal.tags:
            raise Dropped(DropReason.SEAL_TAGS)
        # 6. decrypt the seal
        try:
            seal_conv = (
                wrap_conv
                if seal.pubkey == wrap.pubkey
                else nip44.conversation_key(self._secret, bytes.fromhex(seal.pubkey))
            )
            rumor_json = nip44.decrypt(
                seal.content, seal_conv, max_payload_len=self.max_event_bytes
            )
        except Nip44Error:
            raise Dropped(DropReason.SEAL_DECRYPT) from None
        # 7. the rumor: typed fields, no sig, author == seal signer, id if present
        rumor = _parse_rumor(rumor_json)
        if rumor.pubkey != seal.pubkey:
            raise Dropped(DropReason.RUMOR_PUBKEY_MISMATCH)
        if rumor.id is not None:
            try:
                ok = rumor.compute_id() == rumor.id
            except ValueError:
                ok = False
            if not ok:
                raise Dropped(DropReason.RUMOR_BAD_ID)
        return seal, rumor

    def unwrap(
        self,
        wrap: Event | str | bytes | Mapping[str, Any],
        *,
        on_verified: Callable[[str], None] | None = None,
    ) -> Rumor:
        """Run checks 1-8 on one gift wrap and return its kind-446 rumor.

        See :meth:`open_wrap` for ``on_verified``. Raises :class:`Dropped`.
        """
        _seal, rumor = self.open_wrap(wrap, on_verified=on_verified)
        # 7 (end). kind
        if rumor.kind != KIND_TRIGGER:
            raise Dropped(DropReason.RUMOR_KIND)
        # 8. freshness, on the rumor time only (wrap/seal times are randomized)
        now = self.clock()
        if rumor.created_at < now - self.max_age:
            raise Dropped(DropReason.STALE)
        if rumor.created_at > now + self.max_future_skew:
            raise Dropped(DropReason.FUTURE)
        return rumor


def _parse_rumor(rumor_json: str) -> Rumor:
    try:
        obj = load_json(rumor_json)
        if not isinstance(obj, dict):
            raise _Invalid("rumor")
        rumor = Rumor(
            pubkey=_hex64(obj, "pubkey"),
            created_at=_int(obj, "created_at", _MAX_TIMESTAMP),
            kind=_int(obj, "kind", _MAX_KIND),
            tags=_tags(obj),
            content=_str(obj, "content"),
            id=_hex64(obj, "id") if "id" in obj else None,
        )
    except (ValueError, _Invalid):
        raise Dropped(DropReason.RUMOR_MALFORMED) from None
    if "sig" in obj:
        raise Dropped(DropReason.RUMOR_SIGNED)
    return rumor


# --------------------------------------------------------------------------------------------
# Builders (tests, and wraps of >= 29 chunks that nostr-sdk cannot encrypt)


def make_rumor(
    pubkey_hex: str,
    kind: int,
    content: str,
    tags: list[list[str]] | None = None,
    created_at: int | None = None,
) -> Rumor:
    """An unsigned rumor with its id filled in."""
    tags = [] if tags is None else tags
    created_at = int(time.time()) if created_at is None else created_at
    rumor_id = compute_event_id(pubkey_hex, created_at, kind, tags, content)
    return Rumor(pubkey_hex, created_at, kind, tags, content, rumor_id)


def _randomized_now() -> int:
    return int(time.time()) - random.randrange(NIP59_TIME_WINDOW)


def seal_rumor(
    rumor: Rumor,
    sender: ServerKey,
    recipient_pubkey_hex: str,
    *,
    created_at: int | None = None,
    nonce: bytes | None = None,
    aux: bytes | None = None,
) -> Event:
    """NIP-59 seal: kind 13, no tags, the rumor JSON NIP-44-encrypted from ``sender``."""
    conv = nip44.conversation_key(sender.secret, bytes.fromhex(recipient_pubkey_hex))
    content = nip44.encrypt(rumor.to_json(), conv, nonce)
    when = _randomized_now() if created_at is None else created_at
    return sign_event(sender, KIND_SEAL, content, [], when, aux)


def gift_wrap(
    seal: Event,
    recipient_pubkey_hex: str,
    *,
    wrapper: ServerKey | None = None,
    created_at: int | None = None,
    nonce: bytes | None = None,
    aux: bytes | None = None,
    extra_tags: list[list[str]] | None = None,
) -> Event:
    """NIP-59 gift wrap: kind 1059 by a one-time key (``wrapper``), ``p``-tagged to recipient."""
    wrapper = ServerKey.generate() if wrapper is None else wrapper
    conv = nip44.conversation_key(wrapper.secret, bytes.fromhex(recipient_pubkey_hex))
    content = nip44.encrypt(seal.to_json(), conv, nonce)
    tags = [["p", recipient_pubkey_hex], *(extra_tags or [])]
    when = _randomized_now() if created_at is None else created_at
    return sign_event(wrapper, KIND_GIFT_WRAP, content, tags, when, aux)
