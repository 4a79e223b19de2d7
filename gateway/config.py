"""Configuration: one YAML file, environment overrides, secrets from files.

The whole file is validated at start-up. The core sections are modelled here;
each plugin declares the model of its own `plugins.<name>` section through the
`pushgw_config_model` hook, and `validate_plugin_section` checks it with the
same rules (unknown keys are errors, `*_file` keys read secrets from files).

Environment variables `PUSHGW__SECTION__KEY` override the file (`environment_overrides`);
provider credentials (APNs keys and certificates, FCM service accounts) are loaded here
too (`ApnsAppConfig.check_credentials`, `FcmAppConfig.check_credentials`), so that
`pushgw check-config` and a start share one validation path and one set of loaders.

Errors name the file (or the environment variable) and the key path, never a secret,
and the CLI exits with status 2.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import ssl
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import parse_qsl, urlencode, urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey

ENV_PREFIX = "PUSHGW__"
CONFIG_ENV = "PUSHGW_CONFIG"

SUPPORTED_DATABASES = ("sqlite+aiosqlite", "postgresql+asyncpg")
"""SQLAlchemy drivers of `store.url` (the async drivers pushgw depends on)."""

MASK = "**********"


class ConfigError(Exception):
    """A configuration mistake; `str()` is the message shown to the operator."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


def _key_error(key: str, message: str) -> PydanticCustomError:
    """A validation error about `key` of the model being validated (not the model itself).

    `_format_errors` appends `key` to the error's location; elsewhere the message reads
    `key: message`.
    """
    return PydanticCustomError("config_key", "{key}: {message}", {"key": key, "message": message})


def _existing_file(value: Path) -> Path:
    path = Path(value).expanduser()
    if path.is_dir():
        raise ValueError("is a directory, not a file")
    if not path.is_file():
        raise ValueError("file not found")
    return path


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
"""A path that must name a readable file at start-up ("file not found" otherwise)."""


def _trust_store(path: Path) -> Path:
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError):
        raise ValueError("not a PEM trust store (no CA certificate loads from it)") from None
    return path


TrustStore = Annotated[Path, AfterValidator(_existing_file), AfterValidator(_trust_store)]
"""A file of PEM CA certificates, loaded at start-up."""


def read_secret_file(value: Any) -> str:
    """The secret in the file `value` names: UTF-8 text, trailing newlines stripped.

    Raises ValueError with a message fit for the operator (never the file's content):
    not a path, no such file, a directory, unreadable, not UTF-8, or empty.
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError("expected the path of a file")
    path = Path(value).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError("file not found") from None
    except IsADirectoryError:
        raise ValueError("is a directory, not a file") from None
    except OSError as exc:
        raise ValueError(f"cannot read the file ({exc.strerror or type(exc).__name__})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the file is not UTF-8 text") from None
    text = text.rstrip("\n")
    if not text.strip():
        raise ValueError("the file is empty")
    return text


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys are errors; `X_file` fills secret `X`.

    A key `password_file: /run/secrets/pw` sets the field `password` to the file's
    content (trailing newline stripped) when the model has a field `password` and
    no field `password_file`. Setting both `password` and `password_file` is an error,
    and so is a file that is missing, a directory, not UTF-8 text, or empty
    (`read_secret_file`). Plugins derive their section models from this.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        out = dict(data)
        for key, value in data.items():
            if not (isinstance(key, str) and key.endswith("_file")):
                continue
            target = key[: -len("_file")]
            if key in cls.model_fields or target not in cls.model_fields:
                continue
            if target in data:
                raise _key_error(key, f"set {target} or {key}, not both")
            try:
                out[target] = read_secret_file(value)
            except ValueError as exc:
                raise _key_error(key, str(exc)) from None
            del out[key]
        return out


# --- provider apps -----------------------------------------------------------------


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
    port: int | None = Field(None, description="Override the APNs port (simulator)")
    ca_file: TrustStore | None = Field(None, description="Trust store for the endpoint")
    max_connections: int = Field(4, ge=1, le=100)
    max_in_flight: int = Field(500, ge=1, description="Concurrent requests for this app")
    request_timeout: float = Field(10.0, gt=0)
    push_type: str | None = Field(None, description="Default apns-push-type for this app")

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


AppConfig = Annotated[ApnsAppConfig | FcmAppConfig, Field(discriminator="type")]
# --- core sections ---------------------------------------------------------------


EventLoop = Literal["auto", "uvloop", "asyncio"]


class ServerConfig(ConfigModel):
    host: str = "127.0.0.1"
    port: int = Field(5000, ge=0, le=65535)
    workers: int = Field(1, ge=1, description="Processes sharing the port (SO_REUSEPORT)")
    metrics_port: int | None = Field(None, description="Serve /metrics on its own port")
    shutdown_timeout: float = Field(10.0, ge=0, description="Drain deadline on shutdown")
    client_max_size: int = Field(1024 * 1024, ge=1024)
    event_loop: EventLoop = Field(
        "auto", description="auto (uvloop where installed), uvloop, or asyncio"
    )

    @field_validator("event_loop")
    @classmethod
    def _uvloop_installed(cls, value: str) -> str:
        if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("uvloop is not installed on this platform: use auto or asyncio")
        return value


class LoggingConfig(ConfigModel):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = Field(False, alias="json")
    access_log: bool = False

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class StoreConfig(ConfigModel):
    url: str = Field(
        "sqlite+aiosqlite:///var/pushgw.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://...",
    )
    auto_upgrade: bool = Field(True, description="Run migrations at start")
    pool_size: int = Field(10, ge=1)

    @field_validator("url")
    @classmethod
    def _supported_database(cls, value: str) -> str:
        # Never the URL itself in the message: it may carry a password.
        expected = "sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DATABASE"
        try:
            url = make_url(value)
        except (ArgumentError, ValueError):
            raise ValueError(f"not a database URL: expected {expected}") from None
        if url.drivername not in SUPPORTED_DATABASES:
            raise ValueError(f"unsupported database driver {url.drivername!r}: expected {expected}")
        return value


class CircuitBreakerConfig(ConfigModel):
    failure_threshold: int = Field(20, ge=1, description="Consecutive failures that open it")
    reset_after: float = Field(30.0, gt=0, description="Seconds before a trial request")


class DeliveryConfig(ConfigModel):
    max_deadline: float = Field(60.0, gt=0, description="Upper bound on a push's deadline")
    max_retries: int = Field(8, ge=0, description="Upper bound on a push's retries")
    queue_size: int = Field(20_000, ge=1, description="Pushes waiting per app before shedding")
    backoff_base: float = Field(1.0, gt=0)
    backoff_cap: float = Field(60.0, gt=0)
    throttle_backoff: float = Field(60.0, ge=0, description="Initial delay after QUOTA_EXCEEDED")
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    proxy: str | None = Field(None, description="HTTP CONNECT proxy; default HTTPS_PROXY")
    ca_file: TrustStore | None = Field(None, description="Trust store; default SSL_CERT_FILE")
    invalidation_guard_min: int = Field(100, ge=1)
    invalidation_guard_ratio: float = Field(0.5, gt=0, le=1)
    invalidation_guard_window: float = Field(300.0, gt=0)


ReceiptsFormat = Literal["jsonl", "parquet"]


class ReceiptsConfig(ConfigModel):
    enabled: bool = True
    directory: Path = Path("var/receipts")
    hmac_key: SecretStr = Field(
        SecretStr("pushgw-local-development-key"),
        description="Key of the token hash in receipts; set a secret in production",
    )
    roll_seconds: float = Field(3600.0, gt=0)
    roll_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    buffer: int = Field(50_000, ge=1, description="Receipts buffered before back-pressure")
    format: ReceiptsFormat = Field(
        "jsonl",
        description="Format of rolled files: jsonl, or parquet (converted when a file rolls)",
    )

    @field_validator("hmac_key")
    @classmethod
    def _key_not_empty(cls, value: SecretStr) -> SecretStr:
        if not value.get_secret_value().strip():
            raise ValueError("must not be empty: the key protects the token hashes")
        return value

    @field_validator("format")
    @classmethod
    def _parquet_needs_pyarrow(cls, value: str) -> str:
        # At start-up rather than at the first roll, an hour later.
        if value == "parquet" and importlib.util.find_spec("pyarrow") is None:
            raise ValueError(
                "parquet needs pyarrow, which is not installed: install pushgw[parquet]"
            )
        return value


class PluginsSection(BaseModel):
    """`plugins.enabled` plus one raw section per plugin, validated by the plugin's model."""

    model_config = ConfigDict(extra="allow", frozen=True)
    enabled: list[str] = Field(default_factory=list)

    def section(self, name: str) -> dict[str, Any]:
        raw = (self.model_extra or {}).get(name)
        return dict(raw) if isinstance(raw, Mapping) else {}

    def configured_names(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


Origins = dict[tuple[str, ...], str]
"""Key path (lower case) -> the environment variable that set it."""


class Settings(BaseSettings):
    """The whole gateway configuration (the YAML file plus `PUSHGW__A__B` overrides)."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    server: ServerConfig = ServerConfig()
    logging: LoggingConfig = LoggingConfig()
    store: StoreConfig = StoreConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    receipts: ReceiptsConfig = ReceiptsConfig()
    plugins: PluginsSection = PluginsSection()

    _env_origins: Origins = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML document, already merged with the environment by `load_settings`
        # (`environment_overrides`), arrives as init kwargs. pydantic-settings' own
        # environment source is not used: its errors cannot name the variable, it
        # ignores misspelled ones, and it takes lists only as JSON.
        return (init_settings,)

    @property
    def env_origins(self) -> Mapping[tuple[str, ...], str]:
        """Which environment variable set which key path (lower case)."""
        return types.MappingProxyType(self._env_origins)


# --- errors ------------------------------------------------------------------------


Problem = tuple[tuple[str, ...], str]
"""A key path and what is wrong there."""


def _format_errors(error: ValidationError, prefix: tuple[str, ...] = ()) -> list[Problem]:
    problems = []
    for item in error.errors():
        raw = [str(p) for p in (*prefix, *item["loc"])]
        # pydantic puts the app's union tag ("apns", "fcm") after `apps.<id>`: not a key.
        loc = [
            p
            for i, p in enumerate(raw)
            if not (i >= 2 and raw[i - 2] == "apps" and p in ("apns", "fcm"))
        ]
        msg = item["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        elif item["type"] == "config_key":
            ctx = item.get("ctx") or {}
            loc.append(str(ctx["key"]))
            msg = str(ctx["message"])
        problems.append((tuple(loc), msg))
    return problems


def _env_origin(
    origins: Mapping[tuple[str, ...], str], loc: Sequence[str]
) -> tuple[int, str] | None:
    """(length of the key path it set, name) of the variable that set `loc`, if one did."""
    path = tuple(loc)
    for length in range(len(path), 0, -1):
        name = origins.get(path[:length])
        if name is not None:
            return length, name
    return None


def config_error(
    problems: Iterable[Problem],
    source: str | None,
    origins: Mapping[tuple[str, ...], str] | None = None,
    *,
    below: bool = False,
) -> ConfigError:
    """A ConfigError whose lines name the key path, and the environment variable when
    one set the key (`PUSHGW__SERVER__PORT: ...`), else the file (`source`).

    `origins`: `Settings.env_origins`. `below`: a problem with a whole section is the
    environment's too when a variable set a key inside it (`PUSHGW__PLUGINS__X__Y` for
    `plugins.x`), and the file's only if none did.
    """
    origins = origins or {}
    lines: list[tuple[str | None, str]] = []
    for loc, msg in problems:
        origin = _env_origin(origins, loc)
        inside = [n for p, n in sorted(origins.items()) if p[: len(loc)] == loc] if below else []
        if origin is None and loc and inside:
            lines.append((inside[0], f"{'.'.join(loc)}: {msg}"))
        elif origin is None:
            lines.append((None, f"{'.'.join(loc) or '<root>'}: {msg}"))
        else:
            length, name = origin
            rest = ".".join(loc[length:])
            lines.append((name, f"{rest}: {msg}" if rest else msg))
    if all(name is None for name, _ in lines):
        return ConfigError([text for _, text in lines], source)
    prefix = f"{source}: " if source else ""
    return ConfigError(f"{name}: {text}" if name else prefix + text for name, text in lines)


# --- environment overrides -----------------------------------------------------------


@dataclass(frozen=True)
class EnvOverrides:
    """The `PUSHGW__...` variables as a nested mapping, and which variable set which key."""

    data: dict[str, Any]
    origins: Origins


_NONE = type(None)
_FREE: Any = object()  # a key only a plugin's model knows (inside `plugins.<name>`)


def _members(annotation: Any) -> list[Any]:
    """The types a value of `annotation` may have (Annotated, Optional and unions opened)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for a in get_args(annotation) if a is not _NONE for m in _members(a)]
    return [annotation]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _is_mapping(t: Any) -> bool:
    origin = get_origin(t) or t
    return isinstance(origin, type) and issubclass(origin, Mapping)


def _is_list(t: Any) -> bool:
    origin = get_origin(t) or t
    return (
        isinstance(origin, type)
        and issubclass(origin, (Sequence, set, frozenset))
        and not issubclass(origin, (str, bytes))
    )


def _field(model: type[BaseModel], key: str) -> Any:
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info.annotation
    secret = key[: -len("_file")] if key.endswith("_file") else None
    if secret and issubclass(model, ConfigModel) and _field(model, secret) is not None:
        return str  # a secret from a file (`ConfigModel._secrets_from_files`)
    if model.model_config.get("extra") == "allow":
        return _FREE
    return None


def _target(root: Any, path: tuple[str, ...], base: tuple[str, ...] = ()) -> list[Any] | None:
    """The types the key `path` below `root` may have; None when no model knows it here
    (free-form: a plugin's section, or a plugin model that allows extra keys).

    Raises ValueError for a key no model has, or for keys below a plain value.
    """
    candidates = _members(root)
    for i, key in enumerate(path):
        found: list[Any] = []
        for t in candidates:
            if _is_model(t):
                field = _field(t, key)
                if field is _FREE:
                    return None
                if field is not None:
                    found += _members(field)
            elif _is_mapping(t):
                args = get_args(t)
                found += _members(args[1]) if len(args) == 2 else [Any]
            elif t is Any:
                return None
        if not found:
            if any(_is_model(t) or _is_mapping(t) for t in candidates):
                raise ValueError(f"unknown key '{'.'.join((*base, *path[: i + 1]))}'")
            raise ValueError(f"'{'.'.join((*base, *path[:i]))}' takes a value, not keys")
        candidates = found
    return candidates


def _env_value(candidates: list[Any] | None, raw: str, name: str) -> Any:
    """The text of the environment variable `name` as the value of a key of one of the
    types `candidates` (None: unknown).

    Lists: a JSON array, or comma-separated items. Mappings and sections: a JSON object.
    Anything else: the text, which the model converts (`8080`, `true`, `2.5`, ...).
    Where the type is unknown, text that starts with `[` or `{` is read as JSON.
    """
    text = raw.strip()
    if candidates is None:
        as_list, as_object = text.startswith("["), text.startswith("{")
    else:
        as_list = any(_is_list(t) for t in candidates)
        as_object = any(_is_model(t) or _is_mapping(t) for t in candidates)
    if not (as_list or as_object):
        return raw
    if as_list and not text.startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    if as_object and not as_list and not text.startswith("{"):
        raise ValueError(f"expected a JSON object, or one variable per key ({name}__<KEY>)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if as_list and not isinstance(value, list) and not (as_object and isinstance(value, dict)):
        raise ValueError("expected a JSON array or comma-separated items")
    if as_object and not isinstance(value, dict) and not (as_list and isinstance(value, list)):
        raise ValueError("expected a JSON object")
    return value


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def environment_overrides(environ: Mapping[str, str] | None = None) -> EnvOverrides:
    """The `PUSHGW__SECTION__KEY` variables of `environ` (default: `os.environ`).

    Names are matched case-insensitively and the keys are lower case. Every variable
    must name a key of the core model or lie inside a plugin section (checked against
    the plugin's model by `validate_plugin_section`); a misspelled one is an error,
    as an unknown key in the file is. Raises ConfigError naming each variable.
    """
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    found: list[tuple[tuple[str, ...], str]] = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        if not all(path):
            problems.append(f"{name}: not a config key (PUSHGW__SECTION__KEY, joined by __)")
        else:
            found.append((path, name))
    for i, (path, name) in enumerate(found):
        for other, other_name in found[i + 1 :]:
            shorter, longer = sorted((path, other), key=len)
            if longer[: len(shorter)] == shorter:
                problems.append(f"{name}: conflicts with {other_name} (set one of them)")
    data: dict[str, Any] = {}
    origins: Origins = {}
    for path, name in found:
        try:
            candidates = _target(Settings, path)
            if path[0] == "plugins" and len(path) == 2 and path[1] != "enabled":
                candidates = [dict]  # a whole plugin section
            elif candidates is None:
                candidates = [str]  # converted for the plugin's model by validate_plugin_section
            value = _env_value(candidates, environ[name], name)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        _put(data, path, value)
        origins[path] = name
    if problems:
        raise ConfigError(problems)
    return EnvOverrides(data, origins)


def _merge(base: Any, override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` (from the environment) deep-merged over `base` (from the file).

    A variable for `X_file` replaces the file's `X` and one for `X` its `X_file`: the
    environment wins, and the pair set together would be an error.
    """
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in override.items():
        sibling = key[: -len("_file")] if key.endswith("_file") else f"{key}_file"
        if sibling not in override:
            out.pop(sibling, None)
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# --- loading -----------------------------------------------------------------------


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(["config file not found"], str(path)) from None
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror}"], str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"not a YAML file: not UTF-8 text (byte {exc.start})"], str(path)
        ) from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(
            [f"{where}invalid YAML ({getattr(exc, 'problem', exc)})"], str(path)
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(["the top level must be a mapping"], str(path))
    return loaded


def config_path(explicit: str | os.PathLike[str] | None) -> Path | None:
    chosen = explicit or os.environ.get(CONFIG_ENV)
    return Path(chosen) if chosen else None


def load_settings(
    path: str | os.PathLike[str] | None = None, data: dict[str, Any] | None = None
) -> Settings:
    """Load and validate the core sections from `path` (or `$PUSHGW_CONFIG`) or `data`,
    with the environment's `PUSHGW__...` overrides."""
    file = config_path(path)
    raw = data if data is not None else (read_yaml(file) if file else {})
    source = str(file) if data is None and file else None
    env = environment_overrides()
    merged = _merge(raw, env.data)
    # Relative paths inside the file are relative to the working directory, as in Sygnal.
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        raise config_error(_format_errors(exc), source, env.origins) from None
    settings._env_origins = env.origins
    return settings


def validate_plugin_section(
    settings: Settings, name: str, model: type[BaseModel], source: str | None = None
) -> BaseModel:
    """Validate `plugins.<name>` against the plugin's model, errors with full key paths."""
    section = _plugin_env_values(settings, name, model, settings.plugins.section(name))
    try:
        return model.model_validate(section)
    except ValidationError as exc:
        raise config_error(
            _format_errors(exc, ("plugins", name)), source, settings.env_origins
        ) from None


def _plugin_env_values(
    settings: Settings, name: str, model: type[BaseModel], section: dict[str, Any]
) -> dict[str, Any]:
    """`section` with the text of its environment variables converted for `model`."""
    base = ("plugins", name)
    pending = {
        path[2:]: var
        for path, var in settings.env_origins.items()
        if len(path) > 2 and path[:2] == base
    }
    if not pending:
        return section
    section = copy.deepcopy(section)
    problems = []
    for path, var in sorted(pending.items()):
        holder: Any = section
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or not isinstance(holder.get(path[-1]), str):
            continue
        try:
            holder[path[-1]] = _env_value(_target(model, path, base), holder[path[-1]], var)
        except ValueError as exc:
            problems.append(f"{var}: {exc}")
    if problems:
        raise ConfigError(problems)
    return section


# --- masking -------------------------------------------------------------------------


def masked(settings: Settings, plugin_sections: Mapping[str, BaseModel]) -> dict[str, Any]:
    """The normalized config as plain data, with every secret masked."""
    out = settings.model_dump(mode="json", by_alias=True, exclude={"plugins"})
    plugins: dict[str, Any] = {"enabled": list(settings.plugins.enabled)}
    for name, section in plugin_sections.items():
        plugins[name] = section.model_dump(mode="json")
    out["plugins"] = plugins
    return _mask(out)


_SECRET_WORDS = ("secret", "password", "hmac_key", "private", "token", "key")
_NOT_SECRET = {"key_id", "keyfile", "push_key_id", "public_key", "keys"}


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return lowered not in _NOT_SECRET and any(w in lowered for w in _SECRET_WORDS)


def _mask(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, key) for v in value]
    if not (isinstance(value, str) and value):
        return value
    lowered = key.lower()
    if _secret_name(lowered) and not lowered.endswith(("_file", "_uri", "_url")):
        return MASK
    return mask_url(value)


def mask_url(value: str) -> str:
    """`value` with the password of a URL in it (and secret-named query values) masked.

    `postgresql+asyncpg://pushgw:S3cret@db/pushgw` -> `postgresql+asyncpg://pushgw:***@db/pushgw`:
    scheme, user, host and path stay, so that the output stays useful.
    """
    scheme, sep, rest = value.partition("://")
    if not sep:
        return value
    password = None
    # SQLAlchemy's reading first: its password runs to the first "@" (it may hold "/").
    with contextlib.suppress(ArgumentError, ValueError):
        password = make_url(value).password
    if password is None:
        with contextlib.suppress(ValueError):
            password = urlsplit(value).password
    if password is not None:
        userinfo, _, rest = rest.partition("@")
        rest = f"{userinfo.partition(':')[0]}:***@{rest}"
    head, qmark, query = rest.partition("?")
    if qmark:
        fragment_sep = "#" if "#" in query else ""
        query, _, fragment = query.partition("#")
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _secret_name(k) else v) for k, v in pairs], safe="*")
        rest = f"{head}?{query}{fragment_sep}{fragment}"
    return f"{scheme}://{rest}"
