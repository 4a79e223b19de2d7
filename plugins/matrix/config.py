"""The `plugins.matrix` section: a Sygnal `apps:` mapping, verbatim, plus pushgw extensions.

Each app is validated and translated into the core's `ApnsAppConfig` / `FcmAppConfig`
at start-up (matrix.md §2); every misconfiguration that would otherwise reject
pushkeys wholesale (and so delete pushers on the homeserver) fails here instead.
Unknown keys inside an app are reported with a WARNING and ignored (Sygnal parity).
"""

from __future__ import annotations

import logging
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from gateway.api import (
    ApnsAppConfig,
    ConfigModel,
    FcmAppConfig,
    apns_payload_problem,
    expand_home,
    fcm_message_problem,
)
from plugins.matrix.msc3013 import ALGORITHMS
from plugins.matrix.payloads import APNS_LIMIT

log = logging.getLogger("plugins.matrix")

__all__ = ["MatrixAppConfig", "MatrixConfig", "core_app_config"]

PUSH_TYPES = ("alert", "background", "voip", "complication", "fileprovider", "mdm")
PLATFORMS = {"production": "production", "prod": "production", "sandbox": "sandbox"}
UID_OID = "0.9.2342.19200300.100.1.1"

CoreApp = ApnsAppConfig | FcmAppConfig
# Synapse gives up on a notify request whose answer has not started within 60 s
# (element-hq/synapse:synapse/http/client.py, `timeout_deferred(..., timeout=60)`) and
# retries the event later: a deadline that long lets pushgw deliver what Synapse then
# sends again.
HOMESERVER_TIMEOUT = 60.0


class MatrixAppConfig(ConfigModel):
    """One app (pushkin): Sygnal's keys, the native pushgw keys, and pushgw extensions."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    # all types
    inflight_request_limit: int = Field(512, ge=1)
    send_badge_counts: bool = True
    # apns
    platform: str | None = None
    environment: Literal["production", "sandbox"] | None = None
    certfile: str | None = None
    keyfile: str | None = None
    key_id: str | None = None
    team_id: str | None = None
    topic: str | None = None
    push_type: str | None = None
    convert_device_token_to_hex: bool = True
    host: str | None = None
    port: int | None = None
    # gcm / fcm
    api_version: Literal["legacy", "v1"] | None = None
    api_key: str | None = None
    project_id: str | None = None
    service_account_file: str | None = None
    fcm_options: dict[str, Any] = Field(default_factory=dict)
    send_url: str | None = None
    token_uri: str | None = None
    # both providers
    max_connections: int | None = Field(None, ge=1)
    max_in_flight: int | None = Field(None, ge=1)
    # pushgw extensions
    endpoint: str | None = Field(None, description="Provider base URL (simulators)")
    ca_file: str | None = None
    request_timeout: float = Field(10.0, gt=0)
    honour_sound: bool = True
    msc3013_mode: Literal["auto", "passthrough", "off"] = "auto"
    msc3013_mac: Literal["libolm", "ciphertext"] = "libolm"
    msc3013_fallback_alert: dict[str, Any] = Field(default_factory=lambda: {"body": "New message"})

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value in ("apns", "gcm", "fcm"):
            return value
        if value == "webpush":
            raise ValueError(
                "type 'webpush' is not supported by pushgw (refusing to start rather than "
                "reject every pushkey of this app)"
            )
        raise ValueError(f"unsupported app type {value!r} (expected apns or gcm)")

    @field_validator("platform", "push_type", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # Sygnal tests these with `not value`: `platform: ""` is production and
        # `push_type: ""` no push type (a templated config leaves them empty).
        return None if value == "" else value

    _core: CoreApp | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _translate(self) -> MatrixAppConfig:
        # Here, per app, rather than in `MatrixConfig`: each app's problem is then its own
        # line under its own key path, and a config of hundreds of apps reports them all
        # one per line, not joined into one.
        try:
            self._core = core_app_config(self)
        except ValueError as exc:
            raise ValueError(_message(exc)) from None
        return self

    @property
    def core(self) -> CoreApp:
        """The app as the core's provider config (made when the app was validated)."""
        assert self._core is not None
        return self._core

    @property
    def is_apns(self) -> bool:
        return self.type == "apns"

    @property
    def unknown_keys(self) -> list[str]:
        return sorted(self.model_extra or {})


def _cert_topic(certfile: str) -> str:
    """The topic of an APNs certificate: its subject UID (what aioapns uses)."""
    from cryptography import x509
    from cryptography.x509.oid import ObjectIdentifier

    try:
        path = expand_home(certfile)
    except ValueError as exc:  # `~nosuchuser/...`: pathlib's would be a RuntimeError
        raise ValueError(f"certfile: {exc}") from None
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"certfile: cannot read a PEM certificate ({type(exc).__name__})"
        ) from None
    uids = cert.subject.get_attributes_for_oid(ObjectIdentifier(UID_OID))
    if not uids:
        raise ValueError("certfile: the certificate has no subject UID; set topic")
    return str(uids[0].value)


def _host_port(endpoint: str) -> tuple[str, int]:
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not parts.hostname:
        raise ValueError("endpoint: expected a URL such as https://127.0.0.1:8443")
    return parts.hostname, parts.port or 443


def _apns(app: MatrixAppConfig) -> ApnsAppConfig:
    if app.platform is not None and app.platform not in PLATFORMS:
        raise ValueError(f"platform: invalid platform {app.platform!r} (production or sandbox)")
    environment = app.environment or PLATFORMS.get(app.platform or "production", "production")
    if app.push_type is not None and app.push_type not in PUSH_TYPES:
        raise ValueError(f"push_type: must be one of {', '.join(PUSH_TYPES)}")
    if not app.certfile and not app.keyfile:
        raise ValueError("provide certfile, or keyfile with key_id, team_id and topic")
    data: dict[str, Any] = {
        "type": "apns",
        "environment": environment,
        "request_timeout": app.request_timeout,
        "push_type": app.push_type,
    }
    if app.certfile:
        data["certfile"] = app.certfile
        data["topic"] = app.topic or _cert_topic(app.certfile)
    else:
        missing = [k for k in ("key_id", "team_id", "topic") if not getattr(app, k)]
        if missing:
            raise ValueError(f"token auth needs {', '.join(missing)}")
        data.update(keyfile=app.keyfile, key_id=app.key_id, team_id=app.team_id, topic=app.topic)
    if app.endpoint:
        data["host"], data["port"] = _host_port(app.endpoint)
    if app.host:
        data["host"] = app.host
    if app.port:
        data["port"] = app.port
    if app.ca_file:
        data["ca_file"] = app.ca_file
    if app.max_connections:
        data["max_connections"] = min(app.max_connections, 100)
    if app.max_in_flight:
        data["max_in_flight"] = app.max_in_flight
    core = ApnsAppConfig.model_validate(data)
    if app.msc3013_mode != "off":
        _check_fallback_alert(app, core)
    return core


# The longest `algorithm` an MSC3013 frame of a known algorithm carries.
_LONGEST_ALGORITHM = max(sorted(ALGORITHMS), key=len)


def _check_fallback_alert(app: MatrixAppConfig, core: ApnsAppConfig) -> None:
    """Refuse a `msc3013_fallback_alert` that no push can carry: it is the alert of every
    encrypted event frame without one of its own, so a value JSON has no form for (a
    YAML `.nan`) answered every such notify 500, and one too large for APNs even without
    the ciphertext had every such pushkey rejected (the homeserver deletes the pusher)."""
    frame = {
        "aps": {"alert": app.msc3013_fallback_alert, "mutable-content": 1},
        "algorithm": _LONGEST_ALGORITHM,
        "ciphertext_omitted": True,
    }
    # The plugin fits its APNs frames in APNS_LIMIT whatever the push type (`build`).
    push_type = core.bound_push_type or app.push_type or "alert"
    problem = apns_payload_problem(frame, push_type, APNS_LIMIT)
    if problem is not None:
        raise ValueError(f"msc3013_fallback_alert: {problem} (it is the alert of encrypted pushes)")


def _fcm(app: MatrixAppConfig) -> FcmAppConfig:
    version = app.api_version
    if version is None:
        version = "v1" if app.project_id and app.service_account_file else "legacy"
    if app.type == "fcm":
        version = "v1"
    if version == "legacy":
        raise ValueError(
            "the FCM legacy API (api_key) was shut down by Google in 2024 and pushgw does "
            "not speak it: set api_version: v1, project_id and service_account_file"
        )
    if not app.service_account_file:
        raise ValueError("api_version v1 needs project_id and service_account_file")
    if app.type == "gcm" and not app.project_id:
        raise ValueError("api_version v1 needs project_id and service_account_file")
    # The base of every message of the app: what FCM refuses in it (a legacy-API name, a
    # number for android.ttl) would fail every push, so it fails here instead.
    targets = [key for key in ("token", "topic", "condition") if key in app.fcm_options]
    if targets:
        raise ValueError(f"fcm_options: must not set {targets[0]!r} (each push sets the token)")
    problem = fcm_message_problem(app.fcm_options)
    if problem is not None:
        raise ValueError(f"fcm_options: {problem}")
    data: dict[str, Any] = {
        "type": "fcm",
        "service_account_file": app.service_account_file,
        "request_timeout": app.request_timeout,
        "max_in_flight": app.max_in_flight or app.max_connections or 20,
    }
    if app.project_id:
        data["project_id"] = app.project_id
    if app.max_connections:
        data["max_connections"] = app.max_connections
    if app.endpoint:
        data["send_url"] = app.endpoint.rstrip("/") + "/v1/projects/{project_id}/messages:send"
    if app.send_url:
        data["send_url"] = app.send_url
    if app.token_uri:
        data["token_uri"] = app.token_uri
    if app.ca_file:
        data["ca_file"] = app.ca_file
    return FcmAppConfig.model_validate(data)


def core_app_config(app: MatrixAppConfig) -> CoreApp:
    """Translate one app into the core's provider config; raise ValueError naming the key."""
    return _apns(app) if app.is_apns else _fcm(app)


class MatrixConfig(ConfigModel):
    """`plugins.matrix`: the apps, the notify deadline and Sygnal metric compatibility."""

    apps: dict[str, MatrixAppConfig] = Field(default_factory=dict)
    notify_deadline: float = Field(15.0, gt=0, description="Seconds for all devices and retries")
    sygnal_metrics: bool = True
    max_body_bytes: int = Field(512 * 1024, ge=1024, description="Larger bodies get 413")

    _core: dict[str, CoreApp] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _translate(self) -> MatrixConfig:
        if not self.apps:
            # Every pushkey would be rejected, and Synapse deletes a rejected pusher:
            # a start-up error instead (spec §1.2), as Sygnal refuses to start.
            raise ValueError("apps: no app IDs are configured; define at least one app")
        self._core = {name: app.core for name, app in self.apps.items()}
        self._warn_if_answer_can_outlast_homeserver()
        return self

    def _warn_if_answer_can_outlast_homeserver(self) -> None:
        """A request started before the deadline is let finish (its answer is definite;
        cut off, the push would end unknown): a notify can be answered as late as
        `notify_deadline` plus the slowest app's `request_timeout`."""
        slowest = max(self._core.items(), key=lambda item: item[1].request_timeout)
        latest = self.notify_deadline + slowest[1].request_timeout
        if latest >= HOMESERVER_TIMEOUT:
            log.warning(
                "plugins.matrix.notify_deadline: %g s, plus request_timeout %g s of app %r "
                "for a request still in flight at the deadline, is not below Synapse's %g s "
                "request timeout; a push answered after it is retried by the homeserver "
                "(delivered twice)",
                self.notify_deadline,
                slowest[1].request_timeout,
                slowest[0],
                HOMESERVER_TIMEOUT,
            )

    @property
    def core_apps(self) -> dict[str, CoreApp]:
        return dict(self._core)


def _message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # a pydantic ValidationError from the core model
        parts = []
        for item in errors():
            loc = ".".join(str(p) for p in item["loc"])
            msg = str(item["msg"]).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return str(exc)
