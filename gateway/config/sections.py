"""The core sections of the file (server, logging, store, delivery, receipts, plugins)
and `Settings`, the model of the whole file.

Each plugin's own `plugins.<name>` section stays raw here (`PluginsSection`); it is
validated against the plugin's model by `gateway.config.loading.validate_plugin_section`.
"""

from __future__ import annotations

import importlib.util
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from gateway.config.base import ConfigModel, HomePath, TrustStore, expand_home
from gateway.config.errors import _key_error
from gateway.config.proxy import proxy_problem
from gateway.config.store_url import port_problem, query_problem

SUPPORTED_DATABASES = ("sqlite+aiosqlite", "postgresql+asyncpg")
"""SQLAlchemy drivers of `store.url` (the async drivers pushgw depends on)."""


ENABLED_NOT_A_STRING = "expected a list of plugin names ([matrix, ...]), not a string"


EventLoop = Literal["auto", "uvloop", "asyncio"]


# The longest `server.shutdown_delay`: a balancer notices a stopping backend in seconds.
SHUTDOWN_DELAY_MAX = 3600.0


class ServerConfig(ConfigModel):
    host: str = "127.0.0.1"
    port: int = Field(5000, ge=0, le=65535)
    workers: int = Field(1, ge=1, description="Processes sharing the port (SO_REUSEPORT)")
    # Not 0: "any free port" would be a port no one is told, and another in each worker.
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Serve /metrics on its own port"
    )
    # Sygnal's `metrics.prometheus.address`: metrics kept on loopback (or a private
    # interface) while the gateway's own port is public, or the other way round.
    metrics_host: str | None = Field(
        None, min_length=1, description="Address of metrics_port; default server.host"
    )
    shutdown_timeout: float = Field(10.0, ge=0, description="Drain deadline on shutdown")
    # A balancer that finds backends by probing (a Kubernetes Service, HAProxy) still
    # sends new connections for a while after the stop signal: refused, had the listener
    # closed at once. The gateway keeps serving this long, /readyz 503, then drains.
    # Bounded: further stop signals are ignored meanwhile, so a `.inf` (or a typo of
    # hours) left the node half-alive, unready yet serving, until a SIGKILL lost its
    # receipts.
    shutdown_delay: float = Field(
        0.0,
        ge=0,
        le=SHUTDOWN_DELAY_MAX,
        description="Seconds still serving, /readyz 503, after a stop signal",
    )
    client_max_size: int = Field(1024 * 1024, ge=1024)
    # Slow or idle clients (slowloris) must not hold connections for ever: aiohttp bounds
    # the headers by its keep-alive timer, the core bounds the body (app.py).
    keepalive_timeout: float = Field(
        75.0, gt=0, description="Idle connection lifetime; the longest a request's headers take"
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request's body may take once its headers came: then 408"
    )
    event_loop: EventLoop = Field(
        "auto", description="auto (uvloop where installed), uvloop, or asyncio"
    )

    @property
    def metrics_address(self) -> str:
        """The address `metrics_port` listens on: `metrics_host`, else `host`."""
        return self.metrics_host or self.host

    @model_validator(mode="after")
    def _metrics_host_needs_port(self) -> ServerConfig:
        # Without `metrics_port`, /metrics is on the main port: a `metrics_host` meant to
        # keep it on loopback or a private interface would be ignored without a word.
        if self.metrics_host is not None and self.metrics_port is None:
            raise ValueError(
                "metrics_host is the address of metrics_port, which is not set: /metrics "
                "would be served on the main port (host:port); set metrics_port too, or "
                "remove metrics_host"
            )
        return self

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

    @field_validator("level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        # `PUSHGW_LOGGING__LEVEL=info` and `level: debug` are how operators write it, and
        # Python's logging itself takes "WARN" for WARNING.
        if isinstance(value, str):
            value = value.strip().upper()
            return "WARNING" if value == "WARN" else value
        return value


class StoreConfig(ConfigModel):
    url: str = Field(
        "sqlite+aiosqlite:///var/pushgw.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://...",
    )
    auto_upgrade: bool = Field(True, description="Run migrations at start")
    pool_size: int = Field(10, ge=1)
    invalid_tokens_retention: float = Field(
        30 * 86400.0,
        gt=0,
        description="Seconds a dead token's keyed hash stays in pushgw_invalid_tokens "
        "(swept hourly): nothing reads older rows, and without a bound the table only grew",
    )

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
        # SQLAlchemy ends the password at its first "@" and takes the rest for the host:
        # `u:p@ss@db` would connect to "ss@db" (and show "ss" in the error).
        after_scheme = value.partition("://")[2]
        userinfo = re.match(r"[^:/]*:[^@]*@", after_scheme)
        if url.password is not None and userinfo and "@" in after_scheme[userinfo.end() :]:
            raise ValueError(
                "more than one '@' after the user name: write an '@' in the password as %40"
            )
        if url.port is not None and (problem := port_problem(url.port)):
            raise ValueError(problem)
        if problem := query_problem(url.drivername, url.query):
            raise ValueError(problem)
        if url.get_backend_name() == "sqlite" and (url.database or "").startswith("~"):
            # `~` means the home directory here too, as in every path option: SQLite
            # itself would make a directory named `~` in the working directory.
            home = str(expand_home(url.database or ""))
            return url.set(database=home).render_as_string(hide_password=False)
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
    throttle_backoff: float = Field(
        60.0, ge=0, description="Gate delay after a project-wide throttle (FCM QUOTA_EXCEEDED)"
    )
    max_retry_after: float = Field(
        600.0, gt=0, description="Longest Retry-After honoured; a longer one is cut to this"
    )
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    proxy: str | None = Field(None, description="HTTP CONNECT proxy; default HTTPS_PROXY")
    ca_file: TrustStore | None = Field(None, description="Trust store; default SSL_CERT_FILE")
    invalidation_guard_min: int = Field(100, ge=1)
    invalidation_guard_ratio: float = Field(0.5, gt=0, le=1)
    invalidation_guard_window: float = Field(300.0, gt=0)
    invalidation_guard_start: int = Field(
        10,
        ge=1,
        description="Token-invalid answers in a row, before any push of the app was "
        "accepted, that trip the mass-invalidation guard (at most invalidation_guard_min)",
    )

    @field_validator("proxy")
    @classmethod
    def _usable_proxy(cls, value: str | None) -> str | None:
        # At load, not as a traceback from the APNs client when `serve` starts. An empty
        # value stays "not set" (then HTTPS_PROXY applies, checked by `load_settings`).
        if value and (problem := proxy_problem(value)):
            raise ValueError(problem)
        return value


ReceiptsFormat = Literal["jsonl", "parquet"]

DEVELOPMENT_HMAC_KEY = "pushgw-local-development-key"
"""`receipts.hmac_key` when none is set: public (it is in this file), so hashes made
under it link to tokens for anyone who has the token; the core warns when it runs."""


class ReceiptsConfig(ConfigModel):
    enabled: bool = True
    directory: HomePath = Path("var/receipts")
    hmac_key: SecretStr = Field(
        SecretStr(DEVELOPMENT_HMAC_KEY),
        description="Key of the token hash in receipts; set a secret in production",
    )
    roll_seconds: float = Field(3600.0, gt=0)
    roll_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    buffer: int = Field(50_000, ge=1, description="Receipts buffered before back-pressure")
    # Parquet by default: bench/spark_receipts.py measured it 2.9x smaller, read 3.4x-7.8x
    # and reported on 2.5x-3x faster by the Spark jobs (docs/spark.md), for about 2 us of
    # one core per receipt when a file rolls (bench/receipts_parquet.py).
    format: ReceiptsFormat = Field(
        "parquet",
        description="Format of rolled files: parquet (converted when a file rolls), or jsonl",
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
                "parquet needs pyarrow, which is not installed: install pyarrow, or set "
                "receipts.format: jsonl"
            )
        return value


def _kind(value: Any) -> str:
    """What a YAML value is, in an operator's words."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


class PluginsSection(BaseModel):
    """`plugins.enabled` plus one raw section per plugin, validated by the plugin's model."""

    model_config = ConfigDict(extra="allow", frozen=True)
    enabled: list[str] = Field(default_factory=list)

    @field_validator("enabled", mode="before")
    @classmethod
    def _enabled_is_a_list(cls, value: Any) -> Any:
        # A list in the file, as every list setting is (a comma-separated string is the
        # environment's form only): `enabled: matrix` gets this rather than pydantic's
        # "Input should be a valid list", which does not say what the list holds.
        if isinstance(value, str):
            raise ValueError(ENABLED_NOT_A_STRING)
        return value

    @model_validator(mode="before")
    @classmethod
    def _sections_are_mappings(cls, data: Any) -> Any:
        # A section left empty (`matrix:` with every key commented out) is None: no keys.
        if isinstance(data, Mapping):
            for name, section in data.items():
                if name != "enabled" and not isinstance(section, Mapping | None):
                    raise _key_error(
                        str(name), f"the plugin's section must be a mapping, not {_kind(section)}"
                    )
        return data

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
