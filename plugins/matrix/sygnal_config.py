"""Run pushgw from an unchanged `sygnal.yaml` (matrix.md §2).

`load_sygnal_config(path)` returns pushgw configuration data (for
`gateway.app.load_gateway(data=...)`) with the `matrix` plugin enabled:

| Sygnal | pushgw |
|---|---|
| `http.port`, `http.bind_addresses` | `server.port`, `server.host` (first address) |
| `proxy` | `delivery.proxy` |
| `metrics.prometheus.{enabled,port,address}` | `server.metrics_port`, `server.metrics_host` |
| `apps` | `plugins.matrix.apps` (verbatim) |
| `log`, `metrics.opentracing`, `metrics.sentry`, `db`, `database` | ignored, with a warning |
| `pushgw` (not a Sygnal key) | merged as native pushgw sections (`store`, `receipts`...) |

Ports are read as Sygnal reads them, with `int()`: `port: "5000"` is port 5000.
Unknown keys are reported with their key path: as warnings by default (Sygnal itself
warns and carries on), as errors with `strict=True`. Real mistakes (a `webpush` app,
an invalid `platform`, missing credentials, no apps at all, a proxy that is not
`http://host`...) raise `SygnalConfigError` listing every problem with its path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from gateway.api import yaml_document
from plugins.matrix.config import MatrixAppConfig, MatrixConfig

log = logging.getLogger("plugins.matrix")

__all__ = ["SygnalConfigError", "load_sygnal_config", "translate_sygnal_config"]

_TOP = {"http", "log", "metrics", "proxy", "apps", "db", "database", "pushgw"}
_IGNORED = ("log", "db", "database")
_HTTP = {"port", "bind_addresses"}
_METRICS = {"prometheus", "opentracing", "sentry"}
_PROMETHEUS = {"enabled", "address", "port"}
_APP_KEYS = set(MatrixAppConfig.model_fields)


class SygnalConfigError(ValueError):
    """The Sygnal configuration cannot be used; `problems` are `key.path: message` lines."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


def _mapping(value: Any, path: str, problems: list[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.append(f"{path}: expected a mapping")
        return {}
    return dict(value)


def _proxy_url(value: str) -> str | None:
    """The proxy as `http://[user:password@]host[:port]`, or None when unusable.

    Sygnal refuses at start-up a proxy that is not `http` or names no host (and assumes
    `http` when the scheme is missing); the core tunnels with HTTP CONNECT only, so such
    a proxy would otherwise surface as a traceback from `serve` (the APNs client refuses
    it) or as every FCM push failing. The URL may carry a password: callers must not
    echo it.
    """
    try:
        parts = urlsplit(value, scheme="http")
        port = parts.port  # ValueError unless a number from 0 to 65535
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or port == 0:
        return None
    return parts.geturl()


def _port(value: Any, path: str, problems: list[str]) -> int | None:
    """A port as Sygnal reads it, with `int()`: an integer, or a string holding one
    (`port: "5000"`, as templated configs and environment substitutions write it).

    Anything else (a float, a boolean, a string that is not a number) is a problem:
    Sygnal would fail on it at start-up, or truncate a float silently.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        shown = value if len(value) <= 40 else value[:40] + "..."
        problems.append(f"{path}: expected an integer port number, not {shown!r}")
        return None
    problems.append(f"{path}: expected an integer port number, not {type(value).__name__}")
    return None


def translate_sygnal_config(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Translate parsed Sygnal YAML; returns (pushgw config data, warnings).

    Raises SygnalConfigError for anything that cannot work.
    """
    problems: list[str] = []
    warnings: list[str] = []
    if not isinstance(data, Mapping):
        raise SygnalConfigError(["<root>: the top level must be a mapping"])
    for key in data:
        if key not in _TOP:
            warnings.append(f"{key}: unknown configuration section, ignored")
    for key in _IGNORED:
        if data.get(key):
            warnings.append(f"{key}: not used by pushgw, ignored")

    config: dict[str, Any] = {}
    native = _mapping(data.get("pushgw"), "pushgw", problems)
    server: dict[str, Any] = dict(_mapping(native.pop("server", None), "pushgw.server", problems))

    http = _mapping(data.get("http"), "http", problems)
    for key in http:
        if key not in _HTTP:
            warnings.append(f"http.{key}: unknown key, ignored")
    port = _port(http.get("port", 5000), "http.port", problems)
    if port is not None:
        server["port"] = port
    addresses = http.get("bind_addresses", ["127.0.0.1"])
    if isinstance(addresses, str):
        addresses = [addresses]
    if (
        not isinstance(addresses, list)
        or not addresses
        or not all(isinstance(a, str) for a in addresses)
    ):
        problems.append("http.bind_addresses: expected a list of addresses")
    else:
        server["host"] = addresses[0]
        if len(addresses) > 1:
            warnings.append(
                f"http.bind_addresses: pushgw listens on one address; using {addresses[0]!r}"
            )

    metrics = _mapping(data.get("metrics"), "metrics", problems)
    for key in metrics:
        if key not in _METRICS:
            warnings.append(f"metrics.{key}: unknown key, ignored")
    for key in ("opentracing", "sentry"):
        section = metrics.get(key)
        if isinstance(section, Mapping) and section.get("enabled"):
            warnings.append(f"metrics.{key}: not supported by pushgw, ignored")
    prometheus = _mapping(metrics.get("prometheus"), "metrics.prometheus", problems)
    for key in prometheus:
        if key not in _PROMETHEUS:
            warnings.append(f"metrics.prometheus.{key}: unknown key, ignored")
    if prometheus.get("enabled"):
        metrics_port = _port(prometheus.get("port", 8000), "metrics.prometheus.port", problems)
        if metrics_port is not None:
            server["metrics_port"] = metrics_port
        address = prometheus.get("address", "127.0.0.1")
        if address is None or address == "":
            address = "0.0.0.0"  # Sygnal: `addr=prom_addr or ""`, every IPv4 address
        if not isinstance(address, str):
            problems.append("metrics.prometheus.address: expected an address")
        elif address != server.get("host"):
            server["metrics_host"] = address
    if server:
        config["server"] = server

    proxy = data.get("proxy")
    delivery = dict(_mapping(native.pop("delivery", None), "pushgw.delivery", problems))
    if proxy is not None and proxy != "":  # Sygnal: an empty proxy is no proxy
        url = _proxy_url(proxy) if isinstance(proxy, str) else None
        if url is None:
            # The value is not shown: it may hold the proxy password.
            problems.append(
                "proxy: expected an HTTP CONNECT proxy URL, http://[user:password@]host[:port]"
                " (only http is supported, as in Sygnal)"
            )
        else:
            delivery["proxy"] = url
    if delivery:
        config["delivery"] = delivery

    raw_apps = data.get("apps")
    apps = _mapping(raw_apps, "apps", problems)
    if not apps and (raw_apps is None or isinstance(raw_apps, Mapping)):
        # Sygnal refuses to start without apps ("No app IDs are configured"). Started,
        # pushgw would reject every pushkey, and Synapse deletes a rejected pusher.
        problems.append("apps: no app IDs are configured; define at least one app")
    for name, app in apps.items():
        if not isinstance(app, Mapping):
            problems.append(f"apps.{name}: expected a mapping")
            continue
        for key in app:
            if key not in _APP_KEYS:
                warnings.append(f"apps.{name}.{key}: unknown key, ignored")
    native_plugins = _mapping(native.pop("plugins", None), "pushgw.plugins", problems)
    raw_enabled = native_plugins.get("enabled")
    if raw_enabled is not None and not isinstance(raw_enabled, list):
        # `enabled: zulip` would be read a character at a time ("unknown plugin 'z'")
        problems.append("pushgw.plugins.enabled: expected a list of plugin names ([zulip, ...])")
        native_plugins = {k: v for k, v in native_plugins.items() if k != "enabled"}
    matrix_native = _mapping(native_plugins.pop("matrix", None), "pushgw.plugins.matrix", problems)
    matrix_section = {**matrix_native, "apps": apps}
    if not problems:
        try:
            MatrixConfig.model_validate(matrix_section)
        except ValidationError as exc:
            for item in exc.errors():
                loc = ".".join(str(p) for p in item["loc"])
                msg = str(item["msg"]).removeprefix("Value error, ")
                if item["type"] == "extra_forbidden":
                    msg = "unknown key"
                problems.append(f"{loc}: {msg}" if loc else msg)
    if problems:
        raise SygnalConfigError(problems)

    enabled = list(native_plugins.pop("enabled", []) or [])
    if "matrix" not in enabled:
        enabled.insert(0, "matrix")
    config["plugins"] = {"enabled": enabled, **native_plugins, "matrix": matrix_section}
    for key, value in native.items():  # store, receipts, logging...
        config[key] = value
    return config, warnings


def load_sygnal_config(
    path: str | Path,
    *,
    strict: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Read a `sygnal.yaml` and return pushgw config data with `matrix` enabled.

    Unknown keys are passed to `warn` (default: a WARNING log line) with their key
    path, or raise with `strict=True`. Raises SygnalConfigError.
    """
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SygnalConfigError([f"cannot read the file ({exc.strerror})"], source) from None
    try:
        data = yaml_document(raw) or {}
    except ValueError as exc:
        raise SygnalConfigError([str(exc)], source) from None
    try:
        config, warnings = translate_sygnal_config(data)
    except SygnalConfigError as exc:
        raise SygnalConfigError(exc.problems, source) from None
    if strict and warnings:
        raise SygnalConfigError(warnings, source)
    for line in warnings:
        if line.startswith("apps."):
            continue  # the plugin reports unknown app keys itself when it loads
        (warn or (lambda m: log.warning("%s: %s", source, m)))(line)
    return config
