"""Configuration: one YAML file, environment overrides, secrets from files.

The whole file is validated at start-up. The core sections are modelled here;
each plugin declares the model of its own `plugins.<name>` section through the
`pushgw_config_model` hook, and `validate_plugin_section` checks it with the
same rules (unknown keys are errors, `*_file` keys read secrets from files).

Errors name the file and the key path and the CLI exits with status 2.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "PUSHGW__"
CONFIG_ENV = "PUSHGW_CONFIG"


class ConfigError(Exception):
    """A configuration mistake; `str()` is the message shown to the operator."""

    def __init__(self, problems: Iterable[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


def _existing_file(value: Path) -> Path:
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError("file not found")
    return path


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
"""A path that must name a readable file at start-up ("file not found" otherwise)."""


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys are errors; `X_file` fills secret `X`.

    A key `password_file: /run/secrets/pw` sets the field `password` to the file's
    content (trailing newline stripped) when the model has a field `password` and
    no field `password_file`. Plugins derive their section models from this.
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
            path = Path(str(value)).expanduser()
            try:
                out[target] = path.read_text().rstrip("\n")
            except OSError:
                raise ValueError(f"{key}: file not found") from None
            del out[key]
        return out


# --- provider apps -----------------------------------------------------------------


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
    ca_file: ExistingFile | None = Field(None, description="Trust store for the endpoint")
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
    ca_file: ExistingFile | None = None
    max_connections: int = Field(64, ge=1)
    max_in_flight: int = Field(500, ge=1)
    request_timeout: float = Field(10.0, gt=0)


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
    ca_file: ExistingFile | None = Field(None, description="Trust store; default SSL_CERT_FILE")
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


class Settings(BaseSettings):
    """The whole gateway configuration (the YAML file plus `PUSHGW__A__B` overrides)."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
    )

    server: ServerConfig = ServerConfig()
    logging: LoggingConfig = LoggingConfig()
    store: StoreConfig = StoreConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    receipts: ReceiptsConfig = ReceiptsConfig()
    plugins: PluginsSection = PluginsSection()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML document arrives as init kwargs; the environment overrides it.
        return env_settings, init_settings


def _format_errors(error: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[str]:
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
        problems.append(f"{'.'.join(loc) or '<root>'}: {msg}")
    return problems


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(["config file not found"], str(path)) from None
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror}"], str(path)) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(
            [f"{where}invalid YAML ({getattr(exc, 'problem', exc)})"], str(path)
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping"], str(path))
    return data


def config_path(explicit: str | os.PathLike[str] | None) -> Path | None:
    chosen = explicit or os.environ.get(CONFIG_ENV)
    return Path(chosen) if chosen else None


def load_settings(
    path: str | os.PathLike[str] | None = None, data: dict[str, Any] | None = None
) -> Settings:
    """Load and validate the core sections from `path` (or `$PUSHGW_CONFIG`) or `data`."""
    file = config_path(path)
    raw = data if data is not None else (read_yaml(file) if file else {})
    source = str(file) if file else "<config>"
    # Relative paths inside the file are relative to the working directory, as in Sygnal.
    try:
        return Settings(**raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc), source) from None


def validate_plugin_section(
    settings: Settings, name: str, model: type[BaseModel], source: str | None = None
) -> BaseModel:
    """Validate `plugins.<name>` against the plugin's model, errors with full key paths."""
    try:
        return model.model_validate(settings.plugins.section(name))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, ("plugins", name)), source) from None


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


def _mask(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, key) for v in value]
    lowered = key.lower()
    if (
        isinstance(value, str)
        and value
        and lowered not in _NOT_SECRET
        and any(w in lowered for w in _SECRET_WORDS)
        and not lowered.endswith(("_file", "_uri", "_url"))
    ):
        return "**********"
    return value
