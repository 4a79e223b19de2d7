"""Provider apps: one APNs or FCM credential set each (`ApnsAppConfig`, `FcmAppConfig`).

Their credentials are loaded here too (`check_credentials`, `signing_key`,
`load_certificate`, `service_account`), so that `pushgw check-config` and a start
share one set of loaders. A credential that does not load raises `CredentialError`,
whose message never carries key material.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.base import ConfigModel, ExistingFile, TrustStore

log = logging.getLogger("gateway.config")

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey


class CredentialError(ValueError):
    """A provider credential that does not load; `key` is the config key that names it.

    The message never carries key material.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _read_credential(key: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CredentialError(key, f"cannot read the file ({exc.strerror})") from None


#: Apple's `apns-push-type` values (`widgets` is recent): APNs refuses any other.
APNS_PUSH_TYPES = (
    "alert",
    "background",
    "location",
    "voip",
    "complication",
    "fileprovider",
    "mdm",
    "liveactivity",
    "pushtotalk",
    "widgets",
)
#: The topic of each push type that has one of its own: `<bundle id><suffix>`. Its tokens
#: (PushKit's, a complication's...) take that push type only: APNs answers
#: `InvalidPushType` to any other sent to such a topic.
APNS_TOPIC_SUFFIXES = {
    "voip": ".voip",
    "complication": ".complication",
    "liveactivity": ".push-type.liveactivity",
    "pushtotalk": ".voip-ptt",
    "location": ".location-query",
    "fileprovider": ".pushkit.fileprovider",
    "widgets": ".push-type.widgets",
}


def topic_refusal(push_type: str | None, topic: str | None) -> str | None:
    """Why APNs refuses `push_type` on `topic`, None when it may take it (or either is
    unknown: no header, or a certificate's own topic).

    Apple: a push type with a topic of its own (`voip`, `complication`, ...) must go to
    `<bundle id><suffix>`. Sent to another topic, APNs answers `DeviceTokenNotForTopic`,
    which says the token is dead: the registration would be ended for a sender's mistake.
    """
    suffix = APNS_TOPIC_SUFFIXES.get(push_type or "")
    if suffix is None or topic is None or topic.endswith(suffix):
        return None
    return (
        f"apns-push-type {push_type} needs an apns-topic ending in {suffix} "
        "(APNs answers DeviceTokenNotForTopic to any other)"
    )


class ApnsAppConfig(ConfigModel):
    """One APNs credential set (an iOS app, sandbox or production)."""

    type: Literal["apns"] = "apns"
    topic: str | None = Field(None, description="Bundle id; required with token auth")
    keyfile: ExistingFile | None = Field(None, description=".p8 signing key (token auth)")
    key_id: str | None = None
    team_id: str | None = None
    certfile: ExistingFile | None = Field(None, description="PEM cert+key (certificate auth)")
    environment: Literal["production", "sandbox"] = "production"
    host: str | None = Field(None, description="Override the APNs host (simulator)")
    # 1 to 65535, as server.metrics_port: a port to connect to, so never 0 ("any").
    port: int | None = Field(
        None, ge=1, le=65535, description="Override the APNs port (simulator); default 443"
    )
    ca_file: TrustStore | None = Field(None, description="Trust store for the endpoint")
    max_connections: int = Field(4, ge=1, le=100)
    max_in_flight: int = Field(500, ge=1, description="Concurrent requests for this app")
    request_timeout: float = Field(10.0, gt=0)
    push_type: str | None = Field(None, description="Default apns-push-type for this app")

    @field_validator("host")
    @classmethod
    def _host_without_brackets(cls, value: str | None) -> str | None:
        """`[::1]`, as a URL writes an IPv6 address, is `::1`: a host name is resolved,
        and the brackets would make it one that never resolves (every push retried)."""
        if value is None or not value.startswith("["):
            return value
        inner = value[1:-1] if value.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError("brackets only go around an IPv6 address, [::1]") from None
        return inner

    @field_validator("push_type")
    @classmethod
    def _apple_push_type(cls, value: str | None) -> str | None:
        # A typo would pass every check and fail every push (`InvalidPushType`).
        if value is not None and value not in APNS_PUSH_TYPES:
            raise ValueError(f"must be one of {', '.join(APNS_PUSH_TYPES)}")
        return value

    @property
    def bound_push_type(self) -> str | None:
        """The push type every push of this app must carry, None when each may choose:
        `push_type` when it has a topic of its own (`voip`, ...), else the one `topic`'s
        suffix names (`<bundle id>.voip`, the topic of a VoIP Services certificate)."""
        if self.push_type in APNS_TOPIC_SUFFIXES:
            return self.push_type
        return self._topic_push_type()

    def _topic_push_type(self) -> str | None:
        topic = self.topic or ""
        return next(
            (kind for kind, end in APNS_TOPIC_SUFFIXES.items() if topic.endswith(end)), None
        )

    @model_validator(mode="after")
    def _push_type_fits_topic(self) -> ApnsAppConfig:
        bound = self._topic_push_type()
        if self.push_type is not None and bound is not None and self.push_type != bound:
            raise ValueError(
                f"push_type {self.push_type} cannot go to the topic {self.topic} "
                f"(APNs answers InvalidPushType): set push_type {bound}, or leave it unset"
            )
        if topic_refusal(self.push_type, self.topic) is not None:
            # In the config's own words (the keys to change, both ways out): a config
            # that an earlier release took is refused here after an upgrade.
            suffix = APNS_TOPIC_SUFFIXES[self.push_type or ""]
            raise ValueError(
                f"push_type {self.push_type} needs a topic ending in {suffix}, not "
                f"{self.topic} (APNs answers DeviceTokenNotForTopic to any other, which "
                f"ends the device's registration as a dead token): set topic "
                f"{self.topic}{suffix} for a {self.push_type} app, or leave push_type unset"
            )
        return self

    @model_validator(mode="after")
    def _one_auth_method(self) -> ApnsAppConfig:
        token_auth = self.keyfile is not None
        if token_auth == (self.certfile is not None):
            raise ValueError("set either keyfile (+ key_id, team_id, topic) or certfile")
        if token_auth and not (self.key_id and self.team_id and self.topic):
            raise ValueError("token auth needs key_id, team_id and topic")
        return self

    def check_credentials(self) -> None:
        """Load the key or certificate as a start would, without contacting Apple.

        Raises CredentialError naming `keyfile` or `certfile`.
        """
        if self.keyfile is not None:
            self.signing_key()
        if self.certfile is not None:
            self.load_certificate(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))

    def signing_key(self) -> EllipticCurvePrivateKey:
        """The token-auth signing key of `keyfile` (Apple's .p8: a P-256 EC key)."""
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        if self.keyfile is None:
            raise CredentialError("keyfile", "not set: this app uses certificate auth")
        data = _read_credential("keyfile", self.keyfile)
        try:
            key = load_pem_private_key(data, password=None)
        except TypeError:  # "password was not given but private key is encrypted"
            raise CredentialError("keyfile", "the key is encrypted (Apple's .p8 is not)") from None
        except (ValueError, UnsupportedAlgorithm):
            raise CredentialError(
                "keyfile", "not a PEM private key (expected the .p8 file from Apple)"
            ) from None
        if not (isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"):
            raise CredentialError(
                "keyfile", "not an EC P-256 key (expected the .p8 file from Apple)"
            )
        return key

    def load_certificate(self, context: ssl.SSLContext) -> None:
        """Load `certfile` (the certificate and its unencrypted key, PEM) into `context`."""
        if self.certfile is None:
            raise CredentialError("certfile", "not set: this app uses token auth")
        path = self.certfile
        encrypted = False

        def no_password() -> bytes:  # never OpenSSL's prompt on the terminal
            nonlocal encrypted
            encrypted = True
            return b""

        try:
            context.load_cert_chain(str(path), password=no_password)
        except (ssl.SSLError, OSError) as exc:
            data = _read_credential("certfile", path)
            if b"-----BEGIN CERTIFICATE-----" not in data:
                problem = "no PEM certificate in the file"
            elif b"PRIVATE KEY-----" not in data:
                problem = "no PEM private key in the file (put the key after the certificate)"
            elif encrypted:
                problem = "the private key is encrypted: pushgw needs it unencrypted"
            elif getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
                problem = "the private key does not match the certificate"
            else:
                problem = "the certificate or its private key does not load"
            raise CredentialError("certfile", problem) from None

    def certificate_expires(self) -> datetime.datetime | None:
        """When the certificate of `certfile` (its first: the one presented to APNs)
        expires, in UTC; None with token auth or when no certificate can be read.

        Apple's push certificates are valid for a year, and APNs refuses an expired one
        at the TLS handshake, before any request: a loaded certificate says nothing of it.
        """
        if self.certfile is None:
            return None
        from cryptography import x509

        try:
            certificates = x509.load_pem_x509_certificates(self.certfile.read_bytes())
        except (OSError, ValueError):
            return None
        return certificates[0].not_valid_after_utc if certificates else None


@dataclass(frozen=True)
class ServiceAccount:
    """A loaded FCM service account: the google-auth credential and the project it sends for."""

    credential: Any  # google.oauth2.service_account.Credentials
    project_id: str


_SERVICE_ACCOUNT_FIELDS = ("client_email", "private_key", "token_uri")


class FcmAppConfig(ConfigModel):
    """One Firebase project (an Android app, or iOS through FCM)."""

    type: Literal["fcm"] = "fcm"
    project_id: str | None = Field(None, description="Defaults to the service account's")
    service_account_file: ExistingFile
    send_url: str | None = Field(
        None,
        description="Override of https://fcm.googleapis.com/v1/projects/{project_id}/messages:send",
    )
    token_uri: str | None = Field(None, description="Override the service account's token_uri")
    ca_file: TrustStore | None = None
    max_connections: int = Field(64, ge=1)
    max_in_flight: int = Field(500, ge=1)
    request_timeout: float = Field(10.0, gt=0)

    @field_validator("send_url")
    @classmethod
    def _send_url_template(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            url = value.format(project_id="p")
        except (KeyError, IndexError, ValueError):
            raise ValueError("the only placeholder allowed is {project_id}") from None
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError("expected an http:// or https:// URL") from None
        _warn_if_cleartext("send_url", url)
        return value

    @field_validator("token_uri")
    @classmethod
    def _token_uri_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            _warn_if_cleartext("token_uri", value)
        return value

    def check_credentials(self) -> None:
        """Load the service account as a start would, without contacting Google.

        Raises CredentialError naming `service_account_file` or `project_id`.
        """
        self.service_account()

    def service_account(self) -> ServiceAccount:
        """The service account of `service_account_file`, through firebase-admin."""
        key = "service_account_file"
        data = _read_credential(key, self.service_account_file)
        try:
            info = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise CredentialError(key, "not a JSON file (not UTF-8 text)") from None
        except json.JSONDecodeError as exc:
            raise CredentialError(
                key, f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
            ) from None
        if not isinstance(info, dict) or info.get("type") != "service_account":
            raise CredentialError(
                key,
                'not a service account key (a JSON object with "type": "service_account", '
                "as the Firebase console downloads it)",
            )
        missing = [
            f for f in _SERVICE_ACCOUNT_FIELDS if not (isinstance(info.get(f), str) and info[f])
        ]
        if missing:
            raise CredentialError(key, f"incomplete service account key: no {', '.join(missing)}")

        import google.auth.exceptions
        from firebase_admin import credentials

        try:
            certificate = credentials.Certificate(info)
        except (ValueError, TypeError, google.auth.exceptions.GoogleAuthError):
            raise CredentialError(
                key, "the private_key does not load (not a PEM RSA key, or truncated)"
            ) from None
        credential = certificate.get_credential()
        if self.token_uri:
            credential = credential.with_token_uri(self.token_uri)
        project_id = self.project_id or certificate.project_id
        if not isinstance(project_id, str) or not project_id:
            raise CredentialError("project_id", "not set, and the service account names none")
        return ServiceAccount(credential, project_id)


def _warn_if_cleartext(field: str, url: str) -> None:
    """Warn of an FCM endpoint in plain http:// on another machine: the OAuth bearer
    token (and, for `token_uri`, the signed assertion that gets one) would cross the
    network readable. Loopback is a simulator or a local proxy: allowed quietly, as the
    example configs do."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        return
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost" or host.endswith(".localhost")
    if not loopback:
        log.warning(
            "%s is plain http:// to %s: the FCM credentials it carries cross the network "
            "unencrypted; use https://",
            field,
            host,
        )


AppConfig = Annotated[ApnsAppConfig | FcmAppConfig, Field(discriminator="type")]
