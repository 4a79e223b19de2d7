"""What to deliver (`Push`) and what happened (`Receipt`).

These are the provider-neutral objects that flow one way through the gateway:
a plugin builds a `Push`, the dispatcher delivers it through a provider client,
each provider answer is an `Attempt`, and the final outcome is a `Receipt`.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_VARIANT = "89ab"  # the RFC 4122 variant nibble for the two random bits it keeps
_IDS_PER_DRAW = 256


class _PushIds:
    """Random canonical version 4 UUID strings, one per push.

    Apple sees every `apns-id`. Ids from a per-process prefix and a counter linked all
    the pushes of a gateway, and the counter's gaps told Apple how many pushes went
    out in between through Google or for other apps (for Marmot: how many Android
    members a woken group has). Each id is 122 random bits instead. One `os.urandom`
    call serves 256 ids: a system call per push (`uuid.uuid4()`) costs four times as
    much. A forked child drops the bytes it inherited: parent and child would
    otherwise hand out the same ids.
    """

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self._drawn: Iterator[str] = iter(())

    def __call__(self) -> str:
        h = next(self._drawn, None)
        if h is None:
            raw = os.urandom(16 * _IDS_PER_DRAW).hex()
            self._drawn = iter([raw[i : i + 32] for i in range(0, len(raw), 32)])
            h = next(self._drawn)
        variant = _VARIANT[int(h[16], 16) & 3]
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{variant}{h[17:20]}-{h[20:]}"


new_push_id = _PushIds()


class ProviderKind(enum.StrEnum):
    """The two push providers a phone can be woken through."""

    APNS = "apns"
    FCM = "fcm"


class Outcome(enum.StrEnum):
    """Classification of a provider answer (specs/providers.md §1)."""

    OK = "ok"
    TOKEN_INVALID = "token_invalid"  # the token will never work again for this app
    PERMANENT = "permanent"  # request or configuration wrong; retrying cannot help
    AUTH = "auth"  # credential rejected or stale: refresh once, retry once
    THROTTLED = "throttled"  # provider asks us to slow down
    TRANSIENT = "transient"  # 5xx, connection trouble, local timeout

    @property
    def retryable(self) -> bool:
        return self in (Outcome.AUTH, Outcome.THROTTLED, Outcome.TRANSIENT)


class Reason:
    """Reasons the gateway itself gives (provider reasons are passed through as sent)."""

    DEADLINE_EXCEEDED = "deadline_exceeded"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_PAYLOAD = "invalid_payload"
    INVALIDATION_SUSPENDED = "invalidation_suspended"
    CIRCUIT_OPEN = "circuit_open"
    GATE_CLOSED = "gate_closed"
    QUEUE_FULL = "queue_full"
    UNKNOWN_APP = "unknown_app"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"
    SHUTTING_DOWN = "shutting_down"
    CLIENT_ERROR = "client_error"  # a provider client raised instead of classifying
    # The app's APNs certificate has expired: APNs refuses it at the TLS handshake.
    CERTIFICATE_EXPIRED = "certificate_expired"
    # APNs refused the app's certificate at the TLS handshake with a certificate alert
    # (revoked, not issued by Apple, unknown to it, ...).
    CERTIFICATE_REFUSED = "certificate_refused"


#: Every reason the gateway gives itself (`Reason`'s values): never a provider's answer,
#: even when a receipt keeps the HTTP status of the provider's last answer before it.
GATEWAY_REASONS: frozenset[str] = frozenset(
    value for name, value in vars(Reason).items() if name.isupper() and isinstance(value, str)
)


@dataclass(frozen=True, slots=True)
class ApnsOptions:
    """APNs request headers a plugin may set for one push (ignored for FCM).

    `push_type=None` leaves the `apns-push-type` header to the app's `push_type`
    setting, and omits it when that is unset too (protocols that need parity with
    servers that never sent it). `topic=None` uses the app's topic.
    """

    push_type: str | None = "alert"
    priority: int | None = None
    collapse_id: str | None = None
    expiration: int | None = None
    topic: str | None = None


@dataclass(frozen=True, slots=True)
class PushPolicy:
    """Delivery policy a plugin chooses for one push, clamped by operator bounds.

    - `deadline`: seconds from submission after which no attempt starts.
    - `max_retries`: retries after the first attempt (None: as many as the deadline allows,
      up to the operator's `delivery.max_retries`). SimpleX allows one.
    - `max_payload_bytes`: override of the provider's payload limit (None: provider default).
    - `persist_token_hash`: whether the keyed token hash may be persisted anywhere (the
      receipt, the core's invalid-token record). Protocols that forbid any persisted
      linkage (Marmot) set it to False.
    """

    deadline: float = 10.0
    max_retries: int | None = None
    max_payload_bytes: int | None = None
    persist_token_hash: bool = True


@dataclass(slots=True)
class Push:
    """One notification for one device token, ready for a provider.

    `payload` is provider-shaped:
    - APNs: the JSON body sent to `/3/device/<token>` (`{"aps": {...}, ...}`).
    - FCM: the HTTP v1 `message` object *without* `token`
      (`{"data": {...}, "android": {...}, "apns": {...}, ...}`).

    `ref` is an opaque value the plugin gets back in its token-invalid hook (a
    registration id, say); it never reaches receipts, logs or metrics.
    """

    plugin: str
    app_id: str
    token: str
    payload: Mapping[str, Any]
    apns: ApnsOptions = ApnsOptions()  # immutable, so one shared default
    policy: PushPolicy = PushPolicy()
    ref: str | None = None
    id: str = field(default_factory=new_push_id)
    submitted: float = field(default_factory=time.monotonic)
    # The provider client's request built from this push by its `validate`, reused by
    # each attempt's `send` while the fields it was built from are the same objects
    # (the APNs client's: `ApnsClient._prepare`). Encoding the payload is a push's
    # largest cost before the network. Not an argument, not compared, not shown;
    # `dataclasses.replace` starts a new push without it.
    prepared: object = field(default=None, init=False, repr=False, compare=False)

    def __repr__(self) -> str:  # never show the token or payload
        return f"Push(id={self.id!r}, plugin={self.plugin!r}, app_id={self.app_id!r})"


@dataclass(frozen=True, slots=True)
class Attempt:
    """The classified answer of one provider request."""

    outcome: Outcome
    status: int | None = None
    reason: str | None = None
    retry_after: float | None = None  # seconds, from Retry-After
    credential_wide: bool = False  # throttling applies to the whole credential (gate)
    token_timestamp: int | None = None  # APNs 410: ms since epoch the token was last valid
    provider_id: str | None = None  # apns-id / FCM message name
    detail: str | None = None  # human-readable, safe for logs: never a token or payload


@dataclass(frozen=True, slots=True)
class Receipt:
    """The final outcome of one push: returned to the plugin and written to the receipts sink."""

    push_id: str
    plugin: str
    app_id: str
    provider: ProviderKind | None
    outcome: Outcome
    status: int | None
    reason: str | None
    attempts: int
    latency: float  # seconds from submission to final outcome
    finished_at: float  # unix time
    token_hash: str | None = None
    token_timestamp: int | None = None
    provider_id: str | None = None
    detail: str | None = None  # human-readable, safe for logs; not written to receipt files

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


@dataclass(frozen=True, slots=True)
class InvalidToken:
    """Told to the owning plugin when one of its tokens is dead.

    `token` is the token itself for a live provider answer and None when the
    invalidation comes from a dead-token file (`pushgw tokens retire`), which only
    carries the keyed hash: plugins find their records by `token_hash`
    (`PluginContext.token_hash(token)` computes the same value).

    `observed_at` (unix seconds) is when the token was seen dead: the start of the
    provider request that got the answer, or a dead-token file's `last_seen`; None when
    unknown. The answer is about the token as it was then: a plugin keeps a registration
    the device made after it (registered again while the push was out, or since the
    receipts the file was made from).
    """

    plugin: str
    app_id: str
    token_hash: str
    token: str | None
    provider: ProviderKind | None
    reason: str | None
    ref: str | None = None
    token_timestamp: int | None = None
    observed_at: float | None = None

    def __repr__(self) -> str:
        return (
            f"InvalidToken(plugin={self.plugin!r}, app_id={self.app_id!r}, reason={self.reason!r})"
        )
