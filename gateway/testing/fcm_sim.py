"""A fake FCM HTTP v1 API and Google OAuth token endpoint, on aiohttp.web.

- `POST /token`: the service-account JWT-bearer grant
  (`grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer&assertion=<JWT>`).
  The RS256 assertion is verified against the accounts registered with
  `add_service_account` (any well-formed JWT is accepted when none is); an
  assertion without a scope is 400 `invalid_scope`, as Google answers it. The
  answer is `{"access_token", "expires_in", "token_type": "Bearer"}`.
- `POST /v1/projects/{project_id}/messages:send`: needs `Authorization: Bearer
  <issued token>` (else 401 `UNAUTHENTICATED`, no FcmError detail, with Google's
  `WWW-Authenticate` header and, for a missing or expired access token, a
  `google.rpc.ErrorInfo` detail saying `CREDENTIALS_MISSING` / `ACCESS_TOKEN_EXPIRED`),
  validates the message like FCM (specs/providers.md §3.1; unknown field names in
  `message` and `message.android` are refused as FCM's parser refuses them), answers
  403 `SENDER_ID_MISMATCH` to a token that `add_device` gave to another project, and
  then answers with the scripted response for the token (see `script`, `script_all`)
  or success `{"name": "projects/<id>/messages/<n>"}`.

Errors use Google's envelope: `{"error": {"code", "message", "status",
"details": [...]}}` with a `type.googleapis.com/google.firebase.fcm.v1.FcmError`
detail carrying `errorCode` where real FCM sends one.

Pointing firebase-admin at it (specs/providers.md §4.2): set the service
account's `token_uri` to `sim.token_uri` and `messaging._MessagingService.FCM_URL`
to `sim.send_url_template.replace("{project_id}", "{0}")`. Note that google-auth
always puts `https://oauth2.googleapis.com/token` in the assertion's `aud`,
whatever `token_uri` is; the simulator accepts that audience and its own URI.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import re
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from gateway.core.fcm import data_size_bound
from gateway.testing.certs import FCM_HOSTNAMES, SimulatorCA
from gateway.testing.simulator import SimulatorBase

__all__ = [
    "FCM_ERROR_TYPE",
    "FcmRequest",
    "FcmResponse",
    "FcmSimulator",
    "make_service_account",
]

FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
QUOTA_FAILURE_TYPE = "type.googleapis.com/google.rpc.QuotaFailure"
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"
ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
JWT_BEARER_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
INVALID_TOKEN_MESSAGE = "The registration token is not a valid FCM registration token"
_MESSAGING_SCOPES = frozenset(
    {
        "https://www.googleapis.com/auth/firebase.messaging",
        "https://www.googleapis.com/auth/cloud-platform",
    }
)
_RESERVED_KEYS = frozenset({"from", "message_type"})
_TTL_RE = re.compile(r"\d+(\.\d{1,9})?s")  # protobuf JSON Duration: at most 9 fractional digits
_MAX_TTL_SECONDS = 2_419_200.0
_TOKEN_DATA_LIMIT = 4096
_TOPIC_DATA_LIMIT = 2048
_ANDROID_PRIORITIES = frozenset({"high", "normal", "HIGH", "NORMAL"})
# FCM parses the JSON into its protobuf (v1 `Message`, `AndroidConfig`) and refuses names
# it does not know; proto3 JSON accepts each field's snake_case and lowerCamelCase names.
_MESSAGE_FIELDS = frozenset(
    {"name", "data", "notification", "android", "webpush", "apns", "token", "topic", "condition"}
    | {"fcm_options", "fcmOptions"}
)
_ANDROID_FIELDS = frozenset(
    {"priority", "ttl", "data", "notification"}
    | {"collapse_key", "collapseKey", "restricted_package_name", "restrictedPackageName"}
    | {"fcm_options", "fcmOptions", "direct_boot_ok", "directBootOk"}
    | {"bandwidth_constrained_ok", "bandwidthConstrainedOk"}
    | {"restricted_satellite_ok", "restrictedSatelliteOk"}
)
_INVALID_SCOPE = "Invalid OAuth scope or ID token audience provided."  # Google's words
_UNAUTHENTICATED_MESSAGE = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login "
    "cookie or other valid authentication credential. See "
    "https://developers.google.com/identity/sign-in/web/devconsole-project."
)
_MISSING_CREDENTIAL_MESSAGE = (
    "Request is missing required authentication credential. Expected OAuth 2 access token, "
    "login cookie or other valid authentication credential. See "
    "https://developers.google.com/identity/sign-in/web/devconsole-project."
)
# Google's 401 header: the `error` parameter only when a token was sent (RFC 6750 §3).
_WWW_AUTHENTICATE = 'Bearer realm="https://accounts.google.com/"'
_WWW_AUTHENTICATE_INVALID = _WWW_AUTHENTICATE + ', error="invalid_token"'


@dataclass(frozen=True, slots=True)
class FcmResponse:
    """One scripted FCM answer; build it with the class-method presets.

    - `status`: HTTP status (200 answers `{"name": ...}`).
    - `error_status`: canonical Google status (`NOT_FOUND`, `INVALID_ARGUMENT`...).
    - `message`: the error message.
    - `error_code`: the FcmError `errorCode` detail (None: no FcmError detail).
    - `details`: further `details` entries (BadRequest, QuotaFailure...).
    - `retry_after`: value of a `Retry-After` header (seconds or HTTP date).
    - `www_authenticate`: value of a `WWW-Authenticate` header (401s about the access
      token carry one).
    - `delay`: seconds to wait before answering.
    - `fault`: `"drop"` closes the connection without answering.
    """

    status: int = 200
    error_status: str | None = None
    message: str | None = None
    error_code: str | None = None
    details: tuple[Mapping[str, Any], ...] = ()
    retry_after: int | float | str | None = None
    delay: float = 0.0
    fault: Literal["drop"] | None = None
    www_authenticate: str | None = None

    def __post_init__(self) -> None:
        if self.fault not in (None, "drop"):
            raise ValueError(f"unknown fault {self.fault!r}; FCM supports 'drop'")
        if self.status != 200 and (self.error_status is None or self.message is None):
            raise ValueError("an error FcmResponse needs error_status and message")

    def error_body(self) -> dict[str, Any]:
        """The Google error envelope for this answer."""
        details: list[Mapping[str, Any]] = []
        if self.error_code is not None:
            details.append({"@type": FCM_ERROR_TYPE, "errorCode": self.error_code})
        details.extend(self.details)
        error: dict[str, Any] = {
            "code": self.status,
            "message": self.message,
            "status": self.error_status,
        }
        if details:
            error["details"] = details
        return {"error": error}

    # -- presets (specs/providers.md §3.2) --------------------------------
    @classmethod
    def ok(cls, *, delay: float = 0.0) -> FcmResponse:
        """Success."""
        return cls(delay=delay)

    @classmethod
    def unregistered(cls, *, delay: float = 0.0) -> FcmResponse:
        """404 NOT_FOUND / UNREGISTERED: the app instance is gone."""
        return cls(404, "NOT_FOUND", "Requested entity was not found.", "UNREGISTERED", delay=delay)

    @classmethod
    def invalid_token(cls, *, delay: float = 0.0) -> FcmResponse:
        """400 INVALID_ARGUMENT with a BadRequest field violation on `message.token`."""
        violation = {"field": "message.token", "description": INVALID_TOKEN_MESSAGE}
        return cls(
            400,
            "INVALID_ARGUMENT",
            INVALID_TOKEN_MESSAGE,
            "INVALID_ARGUMENT",
            ({"@type": BAD_REQUEST_TYPE, "fieldViolations": [violation]},),
            delay=delay,
        )

    @classmethod
    def invalid_argument(
        cls,
        message: str = "Request contains an invalid argument.",
        *,
        field: str | None = None,
        delay: float = 0.0,
    ) -> FcmResponse:
        """400 INVALID_ARGUMENT not about the token (optional BadRequest violation on `field`)."""
        details: tuple[Mapping[str, Any], ...] = ()
        if field is not None:
            violation = {"field": field, "description": message}
            details = ({"@type": BAD_REQUEST_TYPE, "fieldViolations": [violation]},)
        return cls(400, "INVALID_ARGUMENT", message, "INVALID_ARGUMENT", details, delay=delay)

    @classmethod
    def sender_id_mismatch(cls, *, delay: float = 0.0) -> FcmResponse:
        """403 PERMISSION_DENIED / SENDER_ID_MISMATCH: token of another project."""
        return cls(403, "PERMISSION_DENIED", "SenderId mismatch", "SENDER_ID_MISMATCH", delay=delay)

    @classmethod
    def permission_denied(cls, *, delay: float = 0.0) -> FcmResponse:
        """403 PERMISSION_DENIED without FcmError: the service account lacks permission."""
        info = {
            "@type": ERROR_INFO_TYPE,
            "reason": "IAM_PERMISSION_DENIED",
            "domain": "iam.googleapis.com",
            "metadata": {"permission": "cloudmessaging.messages.create"},
        }
        return cls(
            403,
            "PERMISSION_DENIED",
            "Permission 'cloudmessaging.messages.create' denied on resource (or it may not exist).",
            None,
            (info,),
            delay=delay,
        )

    @classmethod
    def third_party_auth_error(cls, *, delay: float = 0.0) -> FcmResponse:
        """401 UNAUTHENTICATED / THIRD_PARTY_AUTH_ERROR: bad APNs/Web Push key in Firebase."""
        return cls(
            401,
            "UNAUTHENTICATED",
            "Auth error from APNS or Web Push Service",
            "THIRD_PARTY_AUTH_ERROR",
            delay=delay,
        )

    @classmethod
    def unauthenticated(
        cls,
        *,
        delay: float = 0.0,
        reason: Literal["ACCESS_TOKEN_EXPIRED", "CREDENTIALS_MISSING"] | None = None,
    ) -> FcmResponse:
        """401 UNAUTHENTICATED without FcmError: the OAuth access token is invalid, or
        (`reason`, a `google.rpc.ErrorInfo` detail as Google sends it) expired or missing.
        With Google's `WWW-Authenticate` header."""
        details: tuple[Mapping[str, Any], ...] = ()
        if reason is not None:
            info = {
                "@type": ERROR_INFO_TYPE,
                "reason": reason,
                "domain": "googleapis.com",
                "metadata": {
                    "method": "google.firebase.fcm.v1.FcmService.SendMessage",
                    "service": "fcm.googleapis.com",
                },
            }
            details = (info,)
        missing = reason == "CREDENTIALS_MISSING"
        return cls(
            401,
            "UNAUTHENTICATED",
            _MISSING_CREDENTIAL_MESSAGE if missing else _UNAUTHENTICATED_MESSAGE,
            None,
            details,
            delay=delay,
            www_authenticate=_WWW_AUTHENTICATE if missing else _WWW_AUTHENTICATE_INVALID,
        )

    @classmethod
    def quota_exceeded(
        cls,
        *,
        retry_after: int | float | str | None = None,
        delay: float = 0.0,
        scope: Literal["project", "device", "topic"] | None = "project",
        retry_delay: str | None = None,
    ) -> FcmResponse:
        """429 RESOURCE_EXHAUSTED / QUOTA_EXCEEDED with a QuotaFailure detail naming the
        limit that was exceeded: the project's message rate (`scope="project"`), one
        device's (`"device"`) or one topic's (`"topic"`; FCM's own words for it);
        `scope=None` sends no QuotaFailure and a message that does not say.
        `retry_delay` adds a `google.rpc.RetryInfo` detail (`"30s"`)."""
        description = {
            "project": (
                "Quota exceeded for quota metric 'Send requests' and limit "
                "'Send requests per minute'."
            ),
            "device": "Device message rate exceeded.",
            "topic": "Topic quota exceeded.",
            None: "Sending limit exceeded for the message target.",
        }[scope]
        details: list[Mapping[str, Any]] = []
        if scope is not None:
            violation = {"subject": scope, "description": description}
            details.append({"@type": QUOTA_FAILURE_TYPE, "violations": [violation]})
        if retry_delay is not None:
            details.append({"@type": RETRY_INFO_TYPE, "retryDelay": retry_delay})
        return cls(
            429,
            "RESOURCE_EXHAUSTED",
            description,
            "QUOTA_EXCEEDED",
            tuple(details),
            retry_after=retry_after,
            delay=delay,
        )

    @classmethod
    def unavailable(
        cls, *, retry_after: int | float | str | None = None, delay: float = 0.0
    ) -> FcmResponse:
        """503 UNAVAILABLE."""
        return cls(
            503,
            "UNAVAILABLE",
            "The service is currently unavailable.",
            "UNAVAILABLE",
            retry_after=retry_after,
            delay=delay,
        )

    @classmethod
    def internal(cls, *, delay: float = 0.0) -> FcmResponse:
        """500 INTERNAL."""
        return cls(500, "INTERNAL", "Internal error encountered.", "INTERNAL", delay=delay)

    @classmethod
    def drop(cls, *, delay: float = 0.0) -> FcmResponse:
        """Close the connection without answering."""
        return cls(delay=delay, fault="drop")


@dataclass(slots=True)
class FcmRequest:
    """One `messages:send` request the simulator received, with the answer it decided.

    `token` is `message.token` (None when absent); `message` is the `message`
    object (`{}` when the body had none); `at` is `time.monotonic()`.
    """

    project_id: str
    token: str | None
    message: dict[str, Any]
    headers: dict[str, str]
    status: int
    at: float
    error_code: str | None = None
    fault: str | None = None


@dataclass(slots=True)
class _Account:
    client_email: str
    private_key_id: str | None
    project_id: str | None
    public_key: rsa.RSAPublicKey


@dataclass(slots=True)
class _IssuedToken:
    expires_at: float
    client_email: str | None
    project_id: str | None
    scopes: frozenset[str] = field(default_factory=frozenset)


def make_service_account(
    project_id: str,
    token_uri: str,
    path: str | Path | None = None,
    *,
    client_email: str | None = None,
    key_size: int = 2048,
    private_key: rsa.RSAPrivateKey | None = None,
) -> dict[str, str]:
    """Generate an RSA key and a complete service-account JSON dict for `project_id`.

    The dict is accepted by `firebase_admin.credentials.Certificate` and
    `google.oauth2.service_account.Credentials.from_service_account_info`;
    its `token_uri` points wherever you say (the simulator's `token_uri`).
    When `path` is given the JSON is also written there (mode 0600).
    `private_key` reuses an existing RSA key (key generation takes ~0.1 s).
    """
    key = private_key or rsa.generate_private_key(public_exponent=65537, key_size=key_size)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    email = client_email or f"pushgw-sim@{project_id}.iam.gserviceaccount.com"
    info = {
        "type": "service_account",
        "project_id": project_id,
        "private_key_id": secrets.token_hex(20),
        "private_key": pem,
        "client_email": email,
        "client_id": str(secrets.randbelow(10**21 - 10**20) + 10**20),
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
        "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
        "client_x509_cert_url": (
            "https://www.googleapis.com/robot/v1/metadata/x509/" + email.replace("@", "%40")
        ),
        "universe_domain": "googleapis.com",
    }
    if path is not None:
        p = Path(path)
        p.write_text(json.dumps(info, indent=2))
        p.chmod(0o600)
    return info


def _b64url(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


_JSON_TYPE = {"Content-Type": "application/json; charset=UTF-8"}  # as Google answers


def _json_response(
    body: Mapping[str, Any], status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json.dumps(body).encode(),
        status=status,
        headers={**_JSON_TYPE, **headers} if headers else _JSON_TYPE,
    )


def _unknown_field(obj: Mapping[str, Any], known: frozenset[str], where: str) -> FcmResponse | None:
    """FCM's 400 for the first name of `obj` its protobuf does not have (a JSON parse
    error: BadRequest detail, no FcmError)."""
    name = next((key for key in obj if key not in known), None)
    if name is None:
        return None
    message = (
        f"Invalid JSON payload received. Unknown name {json.dumps(name)} at '{where}': "
        "Cannot find field."
    )
    violation = {"field": where, "description": message}
    return FcmResponse(
        400,
        "INVALID_ARGUMENT",
        message,
        None,
        ({"@type": BAD_REQUEST_TYPE, "fieldViolations": [violation]},),
    )


class FcmSimulator(SimulatorBase[FcmRequest]):
    """Fake FCM HTTP v1 + OAuth token endpoint running in the current event loop.

    ```
    async with FcmSimulator() as sim:
        account = make_service_account("demo", sim.token_uri)
        sim.add_service_account(account)
        sim.script(token, FcmResponse.unregistered())
        ...
        await sim.wait_for_requests(1)
    ```

    - `tls`: serve HTTPS with a certificate from `ca` (plain HTTP by default).
    - `token_lifetime`: `expires_in` of issued access tokens (seconds).
    - `clock`: wall clock for token expiry (tests may pass a fake one).
    - `record`: keep `requests` (turn off for long benchmarks; counters remain).
    """

    _recording_noun = "sends"
    _recording_name = "FCM simulator"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: bool = False,
        ca: SimulatorCA | None = None,
        token_lifetime: int = 3600,
        clock: Callable[[], float] = time.time,
        record: bool = True,
    ) -> None:
        self._bind_host = host
        self._bind_port = port
        self.tls = tls
        self._own_ca = tls and ca is None
        self.ca: SimulatorCA | None = ca if ca is not None or not tls else SimulatorCA()
        self.token_lifetime = token_lifetime
        self.clock = clock
        self._init_recording(record)

        self.default = FcmResponse()
        self.tokens_issued = 0
        self.token_requests = 0
        self._accounts: dict[str, _Account] = {}
        self._tokens: dict[str, _IssuedToken] = {}
        self._scripts: dict[str, list[FcmResponse]] = {}
        self._devices: dict[str, str] = {}  # registration token -> its project
        self._script_all: dict[str | None, list[FcmResponse]] = {}
        self._message_ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._host = host
        self._port = 0

    # -- lifecycle --------------------------------------------------------
    async def start(
        self, host: str | None = None, port: int | None = None, *, reuse_port: bool = False
    ) -> None:
        """Listen on `host:port` (port 0 picks a free one).

        `reuse_port=True` sets SO_REUSEPORT so several processes can serve one port.
        Note that issued tokens and scripts live in one process.
        """
        if self._runner is not None:
            raise RuntimeError("simulator already started")
        host = self._bind_host if host is None else host
        port = self._bind_port if port is None else port
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/token", self._handle_token)
        app.router.add_post("/v1/projects/{project_id}/messages:send", self._handle_send)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        ssl_ctx: ssl.SSLContext | None = None
        if self.tls:
            assert self.ca is not None
            ssl_ctx = self.ca.server_context(FCM_HOSTNAMES)
        site = web.TCPSite(
            runner, host, port, ssl_context=ssl_ctx, backlog=1024, reuse_port=reuse_port or None
        )
        await site.start()
        self._runner = runner
        sockname = runner.addresses[0]
        self._host, self._port = sockname[0], sockname[1]

    async def stop(self) -> None:
        """Stop serving and close connections."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        await runner.cleanup()
        self._cancel_waiters()
        if self._own_ca and self.ca is not None:
            self.ca.cleanup()

    @property
    def url(self) -> str:
        """Base URL, `http(s)://<host>:<port>` (`http://[::1]:4080` on IPv6)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.netloc}"

    @property
    def token_uri(self) -> str:
        """The OAuth token endpoint to put in service accounts."""
        return f"{self.url}/token"

    @property
    def send_url_template(self) -> str:
        """`<url>/v1/projects/{project_id}/messages:send` (format with `project_id=`)."""
        return f"{self.url}/v1/projects/{{project_id}}/messages:send"

    def send_url(self, project_id: str) -> str:
        """The send URL for one project."""
        return self.send_url_template.format(project_id=project_id)

    @property
    def ca_path(self) -> Path | None:
        """PEM of the CA when serving TLS, else None."""
        return self.ca.ca_path if self.ca is not None else None

    # -- configuration ----------------------------------------------------
    def add_service_account(self, info: Mapping[str, Any]) -> None:
        """Accept token grants signed by this service account (turns assertion checks on)."""
        private = serialization.load_pem_private_key(info["private_key"].encode(), password=None)
        if not isinstance(private, rsa.RSAPrivateKey):
            raise ValueError("service-account keys are RSA keys")
        self._accounts[info["client_email"]] = _Account(
            client_email=info["client_email"],
            private_key_id=info.get("private_key_id"),
            project_id=info.get("project_id"),
            public_key=private.public_key(),
        )

    def add_device(self, token: str, project_id: str) -> None:
        """Say which Firebase project registration `token` belongs to (the sender the app
        registered with): sent through another project's `messages:send`, it is answered
        403 PERMISSION_DENIED / `SENDER_ID_MISMATCH`, as FCM answers it (before any
        script). Tokens never given here are accepted by every project."""
        self._devices[token] = project_id

    def script(self, token: str, *responses: FcmResponse) -> None:
        """Answer `token`'s next sends with `responses`, in order; the last one repeats.

        Calling it again replaces the token's script; no responses clears it.
        """
        if responses:
            self._scripts[token] = list(responses)
        else:
            self._scripts.pop(token, None)

    def script_all(self, *responses: FcmResponse, project_id: str | None = None) -> None:
        """Script every send (of `project_id`, or of any project), whatever the token.

        Same order rule as `script`; takes precedence over per-token scripts.
        No responses clears it.
        """
        if responses:
            self._script_all[project_id] = list(responses)
        else:
            self._script_all.pop(project_id, None)

    def clear_scripts(self) -> None:
        """Forget every script (the `default` answer stays)."""
        self._scripts.clear()
        self._script_all.clear()

    def revoke_tokens(self) -> None:
        """Invalidate every issued access token (the next send answers 401)."""
        self._tokens.clear()

    @property
    def active_tokens(self) -> int:
        """Issued access tokens still accepted."""
        now = self.clock()
        return sum(1 for t in self._tokens.values() if t.expires_at > now)

    # -- recording --------------------------------------------------------

    # -- OAuth ------------------------------------------------------------
    def _verify_assertion(self, assertion: str) -> tuple[str | None, _IssuedToken | None]:
        """Return (error description, token info)."""
        try:
            header_b64, claims_b64, sig_b64 = assertion.split(".")
            header = json.loads(_b64url(header_b64))
            claims = json.loads(_b64url(claims_b64))
            signature = _b64url(sig_b64)
        except (ValueError, binascii.Error):
            return "Invalid JWT: malformed assertion.", None
        if not isinstance(header, dict) or not isinstance(claims, dict):
            return "Invalid JWT: malformed assertion.", None
        iss = claims.get("iss")
        if not isinstance(iss, str) or not iss:
            return "Invalid JWT: no issuer.", None
        now = self.clock()
        exp = claims.get("exp")
        iat = claims.get("iat")
        if not isinstance(exp, int | float) or not isinstance(iat, int | float):
            return "Invalid JWT: missing iat or exp.", None
        if exp < now or iat > now + 300 or exp - iat > 3600:
            return (
                "Invalid JWT: Token must be a short-lived token (60 minutes) and in a "
                "reasonable timeframe. Check your iat and exp values in the JWT claim.",
                None,
            )
        scope = claims.get("scope")
        scopes = frozenset(scope.split()) if isinstance(scope, str) else frozenset()
        project_id: str | None = None
        if self._accounts:
            account = self._accounts.get(iss)
            if account is None:
                return "Invalid grant: account not found", None
            if header.get("alg") != "RS256":
                return "Invalid JWT Signature.", None
            kid = header.get("kid")
            if kid is not None and account.private_key_id and kid != account.private_key_id:
                return "Invalid JWT Signature.", None
            if claims.get("aud") not in (GOOGLE_TOKEN_URI, self.token_uri):
                return "Invalid JWT: audience mismatch.", None
            try:
                account.public_key.verify(
                    signature,
                    f"{header_b64}.{claims_b64}".encode(),
                    padding.PKCS1v15(),
                    hashes.SHA256(),
                )
            except InvalidSignature:
                return "Invalid JWT Signature.", None
            project_id = account.project_id
        if not scopes:
            # Google refuses a grant without a scope (400 invalid_scope); issuing a token
            # anyway would hide a client that forgot firebase.messaging.
            return _INVALID_SCOPE, None
        issued = _IssuedToken(now + self.token_lifetime, iss, project_id, scopes)
        return None, issued

    async def _handle_token(self, request: web.Request) -> web.Response:
        self.token_requests += 1
        form = await request.post()
        grant_type = form.get("grant_type")
        if grant_type != JWT_BEARER_GRANT:
            return _json_response(
                {
                    "error": "unsupported_grant_type",
                    "error_description": f"Invalid grant_type: {grant_type!s}",
                },
                400,
            )
        assertion = form.get("assertion")
        if not isinstance(assertion, str):
            return _json_response(
                {
                    "error": "invalid_request",
                    "error_description": "Missing required parameter: assertion",
                },
                400,
            )
        error, issued = self._verify_assertion(assertion)
        if error is not None or issued is None:
            code = "invalid_scope" if error == _INVALID_SCOPE else "invalid_grant"
            return _json_response({"error": code, "error_description": error}, 400)
        access_token = "ya29.sim-" + secrets.token_urlsafe(32)
        self._tokens[access_token] = issued
        self.tokens_issued += 1
        return _json_response(
            {
                "access_token": access_token,
                "expires_in": self.token_lifetime,
                "token_type": "Bearer",
            }
        )

    # -- messages:send ----------------------------------------------------
    def _authenticate(self, request: web.Request, project_id: str) -> FcmResponse | None:
        authorization = request.headers.get("Authorization", "")
        if authorization[:7].lower() != "bearer ":
            return FcmResponse.unauthenticated(reason="CREDENTIALS_MISSING")
        issued = self._tokens.get(authorization[7:].strip())
        if issued is None:
            return FcmResponse.unauthenticated()
        if issued.expires_at <= self.clock():
            return FcmResponse.unauthenticated(reason="ACCESS_TOKEN_EXPIRED")
        if issued.project_id is not None and issued.project_id != project_id:
            return FcmResponse.permission_denied()
        if issued.scopes and not issued.scopes & _MESSAGING_SCOPES:
            return FcmResponse(
                403,
                "PERMISSION_DENIED",
                "Request had insufficient authentication scopes.",
            )
        return None

    @staticmethod
    def _validate(message: Any) -> FcmResponse | None:
        if not isinstance(message, dict):
            return FcmResponse.invalid_argument("Missing message.", field="message")
        targets = [k for k in ("token", "topic", "condition") if k in message]
        if len(targets) != 1:
            return FcmResponse.invalid_argument(
                "Exactly one of token, topic or condition must be specified.", field="message"
            )
        unknown = _unknown_field(message, _MESSAGE_FIELDS, "message")
        if unknown is not None:
            return unknown
        token = message.get("token")
        if "token" in message and (not isinstance(token, str) or not token):
            return FcmResponse.invalid_token()
        data = message.get("data")
        if data is not None:
            if not isinstance(data, dict):
                return FcmResponse.invalid_argument(
                    "Invalid value at 'message.data'.", field="message.data"
                )
            for index, (key, value) in enumerate(data.items()):
                if not isinstance(value, str):
                    where = f"message.data[{index}].value"
                    return FcmResponse.invalid_argument(
                        f"Invalid value at '{where}' (TYPE_STRING), {json.dumps(value)}",
                        field=where,
                    )
                lowered = key.lower()
                if (
                    lowered in _RESERVED_KEYS
                    or lowered.startswith("google")
                    or lowered.startswith("gcm")
                ):
                    return FcmResponse.invalid_argument(f"Invalid data payload key: {key}")
            limit = _TOKEN_DATA_LIMIT if "token" in message else _TOPIC_DATA_LIMIT
            chars = sum(len(key) + len(value) for key, value in data.items())
            if data_size_bound(chars, len(data)) > limit and (  # cheap bound first
                len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()) > limit
            ):
                return FcmResponse.invalid_argument("Android message is too big")
        android = message.get("android")
        if android is not None:
            if not isinstance(android, dict):
                return FcmResponse.invalid_argument(
                    "Invalid value at 'message.android'.", field="message.android"
                )
            unknown = _unknown_field(android, _ANDROID_FIELDS, "message.android")
            if unknown is not None:
                return unknown
            ttl = android.get("ttl")
            if ttl is not None and (
                not isinstance(ttl, str)
                or not _TTL_RE.fullmatch(ttl)
                or float(ttl[:-1]) > _MAX_TTL_SECONDS
            ):
                return FcmResponse.invalid_argument(
                    f"Invalid value at 'message.android.ttl' "
                    f"(type.googleapis.com/google.protobuf.Duration), {json.dumps(ttl)}",
                    field="message.android.ttl",
                )
            priority = android.get("priority")
            if priority is not None and priority not in _ANDROID_PRIORITIES:
                return FcmResponse.invalid_argument(
                    f"Invalid value at 'message.android.priority' "
                    f"(type.googleapis.com/google.firebase.fcm.v1.AndroidMessagePriority), "
                    f"{json.dumps(priority)}",
                    field="message.android.priority",
                )
        return None

    def _next_scripted(self, project_id: str, token: str | None) -> FcmResponse:
        script = self._script_all.get(project_id) or self._script_all.get(None)
        if not script and token is not None:
            script = self._scripts.get(token)
        if not script:
            return self.default
        if len(script) == 1:
            return script[0]
        return script.pop(0)

    async def _handle_send(self, request: web.Request) -> web.StreamResponse:
        project_id = request.match_info["project_id"]
        raw = await request.read()
        message: dict[str, Any] = {}
        response = self._authenticate(request, project_id)
        if response is None:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                response = FcmResponse.invalid_argument(
                    "Invalid JSON payload received.", field="message"
                )
            else:
                candidate = body.get("message")
                if isinstance(candidate, dict):
                    message = candidate
                response = self._validate(candidate)
        token = message.get("token")
        if not isinstance(token, str):
            token = None
        if response is None and token is not None:
            issuer = self._devices.get(token)
            if issuer is not None and issuer != project_id:
                response = FcmResponse.sender_id_mismatch()
        if response is None:
            response = self._next_scripted(project_id, token)

        self._recorded(
            lambda: FcmRequest(
                project_id=project_id,
                token=token,
                message=message,
                headers=dict(request.headers),
                status=response.status,
                at=time.monotonic(),
                error_code=response.error_code,
                fault=response.fault,
            )
        )

        if response.delay > 0:
            await asyncio.sleep(response.delay)
        if response.fault == "drop":
            transport = request.transport
            if transport is not None:
                transport.abort()
            # Nothing can be written any more; aiohttp drops the connection.
            raise web.HTTPServiceUnavailable()
        if response.status == 200:
            name = f"projects/{project_id}/messages/{next(self._message_ids)}"
            return _json_response({"name": name})
        headers: dict[str, str] = {}
        if response.retry_after is not None:
            headers["Retry-After"] = str(response.retry_after)
        if response.www_authenticate is not None:
            headers["WWW-Authenticate"] = response.www_authenticate
        return _json_response(response.error_body(), response.status, headers)
