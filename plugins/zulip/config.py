"""The `plugins.zulip` config section.

```yaml
plugins:
  zulip:
    registration: open            # open | allowlist | closed
    allowlist: []                 # server UUIDs, `zulip_org_id` (registration: allowlist)
    legacy_api: true              # false: relay only end-to-end encrypted pushes
    bouncer_keys_file: /etc/pushgw/zulip-bouncer-keys.json   # {"<public b64>": "<private b64>"}
    apps:
      ios:     {type: apns, topic: org.example.zulip, keyfile: ..., key_id: ..., team_id: ...}
      android: {type: fcm, service_account_file: ...}
    ios_app_ids: {}               # optional ios_app_id → APNs app id aliases
    fcm_app: null                 # FCM app id; default: the only FCM app
```

An APNs push for `ios_app_id` X goes through `ios_app_ids[X]`, else the APNs app whose
id is X, else the APNs app whose `topic` is X; the `apns-topic` header is always X.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from gateway.api import ApnsAppConfig, AppConfig, ConfigModel, FcmAppConfig
from plugins.zulip.crypto import BouncerKey, CryptoError, load_bouncer_keys

__all__ = ["ZulipConfig"]


class ZulipConfig(ConfigModel):
    """Configuration of the Zulip push bouncer."""

    registration: Literal["open", "allowlist", "closed"] = "open"
    allowlist: list[str] = Field(
        default_factory=list, description="Server UUIDs (zulip_org_id) for registration: allowlist"
    )
    legacy_api: bool = True
    bouncer_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="{base64 public: base64 private}; Zulip's push_registration_encryption_keys",
    )
    apps: dict[str, AppConfig] = Field(default_factory=dict)
    ios_app_ids: dict[str, str] = Field(default_factory=dict)
    fcm_app: str | None = None
    rate_limit_requests: int = Field(1000, ge=1)
    rate_limit_window: float = Field(60.0, gt=0)
    notify_deadline: float = Field(
        10.0, gt=0, lt=15, description="Seconds before a notify answers (Zulip waits 15 s)"
    )
    push_deadline: float = Field(
        30.0, gt=0, description="Core deadline of each push (retries continue after answering)"
    )
    analytics_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Body limit of server/analytics uploads"
    )
    analytics_max_realms: int = Field(
        1000, ge=1, description="Realms a server/analytics upload may list (else a 400)"
    )
    server_in_flight: int = Field(
        200,
        ge=1,
        description="Sends one Zulip server may have running at once to one app; beyond "
        "it a push request is not sent (counted as not sent), so that one server cannot "
        "fill the lanes every server shares",
    )
    registration_liveness: int = Field(86400, gt=0)
    duplicate_window: float = Field(120.0, ge=0)
    gc_older_than: float = Field(30 * 86400.0, gt=0, description="Seconds (for `gc`)")
    # Daily by default: without it, the tokens of expired registrations, deleted realms
    # and deactivated servers stayed in clear for as long as nobody ran `pushgw zulip gc`.
    gc_interval: float | None = Field(
        86400.0,
        gt=0,
        description="Run garbage collection at start and every N seconds (null: only by command)",
    )

    @field_validator("bouncer_keys", mode="before")
    @classmethod
    def _keys_from_json(cls, value: Any) -> Any:
        # `bouncer_keys_file` (and env overrides) give the JSON text of the map.
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError:
                raise ValueError("bouncer_keys must be a JSON object {public: private}") from None
        if isinstance(value, dict):
            # Named by position, never by the map key (pydantic's own error would be): a
            # map written {private: } has the private half as its key.
            for number, private in enumerate(value.values(), 1):
                if not isinstance(private, (str, SecretStr)):
                    raise ValueError(
                        f"bouncer key {number} of {len(value)}: private key is not a string"
                    )
        return value

    @field_validator("allowlist")
    @classmethod
    def _server_uuids(cls, value: list[str]) -> list[str]:
        # Entries are server UUIDs only. A hostname is whatever a registering server
        # claims (nothing checks it), so a hostname entry let anyone register under it
        # and then, hostnames being unique, locked the real server out.
        entries = []
        for entry in value:
            try:
                parsed = uuid.UUID(entry.strip())
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not a server UUID: list the Zulip server's zulip_org_id "
                    "(from its /etc/zulip/zulip-secrets.conf) instead. Hostnames are not "
                    "accepted: a hostname is only what a registering server claims, so "
                    "anyone could register under it (docs/zulip.md)"
                ) from None
            if parsed.version != 4:
                raise ValueError(f"{entry!r} is not a Zulip server UUID (a UUID version 4)")
            entries.append(str(parsed))
        return entries

    @model_validator(mode="after")
    def _check(self) -> ZulipConfig:
        try:
            load_bouncer_keys(self.private_keys())
        except CryptoError as exc:
            raise ValueError(str(exc)) from None
        fcm_apps = [a for a, c in self.apps.items() if isinstance(c, FcmAppConfig)]
        if self.fcm_app is not None and self.fcm_app not in fcm_apps:
            raise ValueError(f"fcm_app {self.fcm_app!r} is not an FCM app in apps")
        if self.fcm_app is None and len(fcm_apps) > 1:
            raise ValueError("several FCM apps: set fcm_app")
        for alias, app_id in self.ios_app_ids.items():
            if not isinstance(self.apps.get(app_id), ApnsAppConfig):
                raise ValueError(f"ios_app_ids.{alias}: {app_id!r} is not an APNs app in apps")
        return self

    def private_keys(self) -> dict[str, str]:
        return {pub: priv.get_secret_value() for pub, priv in self.bouncer_keys.items()}

    def bouncer_key_map(self) -> dict[str, BouncerKey]:
        return load_bouncer_keys(self.private_keys())

    def fcm_app_id(self) -> str | None:
        if self.fcm_app is not None:
            return self.fcm_app
        fcm_apps = [a for a, c in self.apps.items() if isinstance(c, FcmAppConfig)]
        return fcm_apps[0] if fcm_apps else None

    def apns_app_id(self, ios_app_id: str) -> str | None:
        if ios_app_id in self.ios_app_ids:
            return self.ios_app_ids[ios_app_id]
        app = self.apps.get(ios_app_id)
        if isinstance(app, ApnsAppConfig):
            return ios_app_id
        for app_id, config in self.apps.items():
            if isinstance(config, ApnsAppConfig) and config.topic == ios_app_id:
                return app_id
        return None
