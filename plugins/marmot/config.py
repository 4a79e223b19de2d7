"""The ``plugins.marmot`` config section (spec section 11).

```yaml
plugins:
  marmot:
    server_secret_key_file: /run/secrets/marmot-nsec   # 64 hex digits or nsec1...
    inbox_relays: [wss://relay.example.org, wss://inbox.example.net]
    publish_relays: [wss://purplepag.es]                # also receive the kind-10050 list
    profiles:
      mip05_v1: {enabled: true, max_chunks: 100, legacy_280: true}
      marmot_push_v1: {enabled: true, max_chunks: 32}
    max_age: 3600            # rumor freshness window (s)
    max_future_skew: 300
    dedup_retention: 300
    max_event_bytes: 262144
    rate_limits:
      global: {per_minute: 600, per_hour: 30000}
      encrypted_token: {per_minute: 240, per_hour: 5000}
      device_token: {per_minute: 240, per_hour: 5000}
    concurrency: 64
    backfill_on_start: false
    apps:
      ios: {type: apns, topic: ..., keyfile: ..., key_id: ..., team_id: ...}
      android: {type: fcm, service_account_file: ...}
    apns: {app: ios, mode: silent}      # or mode: alert, alert_title, alert_body
    fcm: {app: android}
```
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from gateway.api import (
    ApnsAppConfig,
    AppConfig,
    ConfigModel,
    FcmAppConfig,
    TrustStore,
    apns_payload_problem,
)
from plugins.marmot.keys import ServerKey
from plugins.marmot.trigger import MARMOT_PUSH_MAX_CHUNKS, TriggerConfig

__all__ = [
    "ApnsRouting",
    "FcmRouting",
    "MarmotConfig",
    "ProfilesConfig",
    "RateLimit",
    "RateLimits",
    "normalize_relay_url",
    "validate_relay_url",
]

_MAX_RELAY_URL_BYTES = 512
#: Apple's limit on `apns-collapse-id`, in bytes (the payload is checked by the core's own
#: `apns_payload_problem`).
APNS_COLLAPSE_ID_LIMIT = 64


def validate_relay_url(url: str) -> str:
    """Check the Nostr relay URL profile of spec section 10; return the URL unchanged."""
    if len(url.encode("utf-8", "surrogatepass")) > _MAX_RELAY_URL_BYTES:
        raise ValueError("relay URL longer than 512 bytes")
    try:
        url.encode("utf-8")
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except (UnicodeError, ValueError):
        raise ValueError("relay URL is not a valid URL") from None
    if parts.scheme.lower() not in ("ws", "wss"):
        raise ValueError("relay URL must use ws:// or wss://")
    if not parts.hostname:
        raise ValueError("relay URL has no host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("relay URL must not contain userinfo")
    if parts.fragment or url.endswith("#"):
        raise ValueError("relay URL must not contain a fragment")
    if port == 0:
        raise ValueError("relay URL has port 0")
    return url


def normalize_relay_url(url: str) -> str:
    """Comparison form (section 10): lowercase scheme and host, no default port, no trailing /."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = parts.port
    default = {"ws": 80, "wss": 443}.get(scheme)
    netloc = host if port is None or port == default else f"{host}:{port}"
    path = parts.path.rstrip("/")
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{netloc}{path}{query}"


class RateLimit(ConfigModel):
    """A two-rate limit: both must allow (token buckets with burst = the limit)."""

    per_minute: int = Field(ge=1)
    per_hour: int = Field(ge=1)


class RateLimits(ConfigModel):
    """Spec section 8. Limits of 0 are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    global_: RateLimit = Field(
        default=RateLimit(per_minute=600, per_hour=30_000),
        alias="global",
        description="Wraps accepted for unwrapping, before any NIP-44 work",
    )
    encrypted_token: RateLimit = RateLimit(per_minute=240, per_hour=5_000)
    device_token: RateLimit = RateLimit(per_minute=240, per_hour=5_000)


class Mip05Profile(ConfigModel):
    enabled: bool = True
    max_chunks: int = Field(default=100, ge=1, le=100)
    legacy_280: bool = True


class MarmotPushProfile(ConfigModel):
    enabled: bool = True
    max_chunks: int = Field(default=MARMOT_PUSH_MAX_CHUNKS, ge=1, le=MARMOT_PUSH_MAX_CHUNKS)


class ProfilesConfig(ConfigModel):
    mip05_v1: Mip05Profile = Mip05Profile()
    marmot_push_v1: MarmotPushProfile = MarmotPushProfile()

    def trigger_config(self) -> TriggerConfig:
        return TriggerConfig(
            mip05_enabled=self.mip05_v1.enabled,
            marmot_push_enabled=self.marmot_push_v1.enabled,
            mip05_max_chunks=self.mip05_v1.max_chunks,
            legacy_280=self.mip05_v1.legacy_280,
            marmot_push_max_chunks=self.marmot_push_v1.max_chunks,
        )


class ApnsRouting(ConfigModel):
    """Where platform 0x01 tokens go, and how (spec section 9).

    Everything a push will carry is checked here, at load: a value APNs would refuse (an
    oversized payload, a collapse id that is no header value) would otherwise fail every push.
    """

    app: str | None = Field(
        default=None, description="An APNs app id of `apps`; None: APNs disabled"
    )
    mode: Literal["silent", "alert"] = "silent"
    alert_title: str = "New activity"
    alert_body: str = "Open the app to sync"
    mutable_content: bool = Field(
        default=True,
        description="Alert mode: set `mutable-content` so the app's Notification Service "
        "Extension may replace the text (transponder `mutable_alert`; false: `generic_alert`)",
    )
    collapse_id: str | None = Field(
        default=None, description="Alert mode: `apns-collapse-id` (<= 64 bytes; empty: none)"
    )
    custom: dict[str, Any] = Field(
        default_factory=dict, description="Extra top-level payload keys (alert mode only)"
    )

    @field_validator("collapse_id")
    @classmethod
    def _valid_collapse_id(cls, value: str | None) -> str | None:
        if not value:
            return None  # transponder's "" means "no collapse id"; an empty header is refused
        if len(value.encode("utf-8", "surrogatepass")) > APNS_COLLAPSE_ID_LIMIT:
            raise ValueError(f"collapse_id is longer than {APNS_COLLAPSE_ID_LIMIT} bytes")
        if not value.isprintable() or value.strip() != value:
            raise ValueError(
                "collapse_id must be a header value: printable, no surrounding whitespace"
            )
        return value

    @model_validator(mode="after")
    def _sendable_alert(self) -> ApnsRouting:
        if self.mode != "alert":
            return self
        if not self.alert_title.strip() and not self.alert_body.strip():
            raise ValueError("set apns.alert_title or apns.alert_body for apns.mode: alert")
        # The core's own check of every APNs push (its encoding, its limit), not a copy.
        problem = apns_payload_problem(self.payload(), "alert")
        if problem is not None:
            raise ValueError(
                f"the alert payload would be refused: {problem} (shorten or fix the alert "
                "text or apns.custom)"
            )
        return self

    def payload(self) -> dict[str, Any]:
        """The APNs body of every push: content-free, the same for every device."""
        if self.mode != "alert":
            return {"aps": {"content-available": 1}}
        # An empty text is left out, not sent as "" (what transponder does).
        text = {k: v for k, v in (("title", self.alert_title), ("body", self.alert_body)) if v}
        aps: dict[str, Any] = {"alert": text}
        if self.mutable_content:
            aps["mutable-content"] = 1
        aps["sound"] = "default"
        return {**self.custom, "aps": aps}


class FcmRouting(ConfigModel):
    """Where platform 0x02 tokens go."""

    app: str | None = Field(default=None, description="An FCM app id of `apps`; None: FCM disabled")


class MarmotConfig(ConfigModel):
    """Configuration of the Marmot notification server."""

    server_secret_key: SecretStr = Field(
        description="Server Nostr secret key, 64 hex digits or nsec (use server_secret_key_file)"
    )
    inbox_relays: list[str] = Field(min_length=1)
    publish_relays: list[str] = Field(default_factory=list)
    publish_inbox_list: bool = Field(
        default=True, description="Publish kind 10050 at start if changed"
    )
    profiles: ProfilesConfig = ProfilesConfig()
    max_age: int = Field(default=3600, ge=1)
    max_future_skew: int = Field(default=300, ge=0)
    dedup_retention: float = Field(default=300.0, gt=0)
    max_event_bytes: int = Field(default=262_144, ge=4096)
    rate_limits: RateLimits = RateLimits()
    concurrency: int = Field(default=64, ge=1, description="Events unwrapped/decrypted at once")
    queue_size: int = Field(
        default=1024, ge=1, description="Events waiting for a slot; more are dropped"
    )
    crypto_threads: int = Field(
        default=0,
        ge=0,
        description="Threads for unwrap/decrypt (0: inline on the event loop)",
    )
    crypto_processes: int = Field(
        default=0,
        ge=0,
        description="Worker processes for unwrap/decrypt, each on a core of its own "
        "(0: in the gateway process; see crypto_threads)",
    )
    cache_size: int = Field(
        default=100_000, ge=1, description="Entries of the seen-wrap, dedup and limiter LRUs"
    )
    backfill_on_start: bool = False
    ping_interval: float = Field(default=30.0, gt=0)
    backoff_min: float = Field(default=1.0, gt=0)
    backoff_max: float = Field(default=60.0, gt=0)
    connect_timeout: float = Field(default=10.0, gt=0)
    ws_compression: bool = Field(
        default=False,
        description="Offer permessage-deflate to relays (gift wraps are base64 ciphertext: ~25 % "
        "smaller for a lot of CPU on both ends)",
    )
    ca_file: TrustStore | None = Field(
        default=None,
        description="PEM CA certificates trusted for wss:// relays, in addition to the system "
        "store (a relay behind a private CA)",
    )
    push_deadline: float = Field(
        default=30.0, gt=0, description="A wake hint goes stale: short deadline"
    )
    apps: dict[str, AppConfig] = Field(default_factory=dict)
    apns: ApnsRouting = ApnsRouting()
    fcm: FcmRouting = FcmRouting()

    @field_validator("server_secret_key")
    @classmethod
    def _valid_key(cls, value: SecretStr) -> SecretStr:
        ServerKey.parse(value.get_secret_value())  # ValueError names no key material
        return value

    @field_validator("inbox_relays", "publish_relays")
    @classmethod
    def _valid_relays(cls, urls: list[str]) -> list[str]:
        seen: set[str] = set()
        out = []
        for url in urls:
            validate_relay_url(url)
            norm = normalize_relay_url(url)
            if norm not in seen:
                seen.add(norm)
                out.append(url)
        return out

    @model_validator(mode="after")
    def _routing(self) -> MarmotConfig:
        for name, wanted, routing in (
            ("apns", ApnsAppConfig, self.apns.app),
            ("fcm", FcmAppConfig, self.fcm.app),
        ):
            if routing is None:
                continue
            app = self.apps.get(routing)
            if app is None:
                raise ValueError(f"{name}.app: no app {routing!r} in apps")
            if not isinstance(app, wanted):
                raise ValueError(f"{name}.app: app {routing!r} is not of type {name}")
            bound = app.bound_push_type if isinstance(app, ApnsAppConfig) else None
            if bound is not None:
                # Marmot wakes the app's ordinary remote-notification tokens with
                # `background` (or `alert`) pushes: a VoIP (PushKit), complication, ...
                # topic refuses them all (InvalidPushType).
                raise ValueError(
                    f"apns.app: app {routing!r} takes only {bound} pushes (its topic or "
                    "push_type); Marmot sends background or alert pushes: use the app's "
                    "bundle id as topic and leave push_type unset"
                )
        if self.apns.app is None and self.fcm.app is None:
            raise ValueError("configure apns.app or fcm.app (or both)")
        if self.backoff_max < self.backoff_min:
            raise ValueError("backoff_max must be >= backoff_min")
        if self.crypto_threads and self.crypto_processes:
            raise ValueError("set crypto_threads or crypto_processes, not both")
        return self

    @property
    def server_key(self) -> ServerKey:
        return ServerKey.parse(self.server_secret_key.get_secret_value())
