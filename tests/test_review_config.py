"""Configuration and plugin loading: mistakes found by review, each a clear config error."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gateway import hookspecs
from gateway.api import hookimpl
from gateway.app import load_gateway
from gateway.config import ConfigError, load_settings
from gateway.plugins import PluginRegistry

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith("PUSHGW") and k.upper() not in ("HTTPS_PROXY", "NO_PROXY")
    }
    return subprocess.run(
        [*PUSHGW, *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})}
    )


def write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def _no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


# --- delivery.proxy and HTTPS_PROXY ------------------------------------------------------------

UNUSABLE_PROXIES = [
    "socks5://proxyuser:ProxyPW@proxy:1080",  # not HTTP CONNECT
    "https://proxyuser:ProxyPW@proxy:3128",  # TLS to the proxy: not supported
    "http://proxyuser:ProxyPW@:3128",  # no host
    "http://proxyuser:ProxyPW@proxy:99999",  # port out of range
    "http://proxyuser:ProxyPW@proxy:0",
    "http://proxyuser:ProxyPW@proxy:port",  # port not a number
    "http://proxyuser:ProxyPW@[::1/",  # does not parse
    "proxyuser:ProxyPW@proxy:3128",  # no scheme: "proxyuser" would be read as one
]


@pytest.mark.parametrize("proxy", UNUSABLE_PROXIES)
def test_unusable_proxy_is_a_config_error(tmp_path: Path, proxy: str) -> None:
    path = write(tmp_path / "c.yaml", {"delivery": {"proxy": proxy}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    message = str(err.value)
    assert message.startswith(f"{path}: delivery.proxy: "), message
    assert "\n" not in message
    assert "proxyuser" not in message and "ProxyPW" not in message


@pytest.mark.parametrize("proxy", UNUSABLE_PROXIES)
def test_unusable_https_proxy_variable_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, proxy: str
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    with pytest.raises(ConfigError) as err:
        load_settings(data={})
    message = str(err.value)
    assert message.startswith("HTTPS_PROXY: "), message
    assert "\n" not in message
    assert "proxyuser" not in message and "ProxyPW" not in message


def test_lower_case_https_proxy_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("https_proxy", "socks5://proxy:1080")
    with pytest.raises(ConfigError) as err:
        load_settings(data={})
    assert str(err.value).startswith("https_proxy: ")


@pytest.mark.parametrize(
    "proxy",
    [
        "http://proxy.internal:3128",
        "http://proxy.internal",
        "HTTP://Proxy:3128/",
        "http://u:p%40ss@proxy:3128",
        "http://u:SEC@RET@proxy:3128",  # an unencoded "@" in the password: read as a password
        "http://[::1]:3128",
    ],
)
def test_usable_proxies_load(monkeypatch: pytest.MonkeyPatch, proxy: str) -> None:
    assert load_settings(data={"delivery": {"proxy": proxy}}).delivery.proxy == proxy
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    assert load_settings(data={}).delivery.proxy is None


def test_https_proxy_variable_is_not_checked_when_delivery_proxy_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The variable is then never used (`resolve_proxy`): set for other programs.
    monkeypatch.setenv("HTTPS_PROXY", "socks5://proxy:1080")
    settings = load_settings(data={"delivery": {"proxy": "http://proxy:3128"}})
    assert settings.delivery.proxy == "http://proxy:3128"


def test_https_proxy_variable_is_not_checked_when_no_proxy_exempts_every_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "socks5://proxy:1080")
    monkeypatch.setenv("NO_PROXY", "*")
    assert load_settings(data={}).delivery.proxy is None


def test_proxy_from_pushgw_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__DELIVERY__PROXY", "socks5://proxyuser:ProxyPW@proxy:1080")
    with pytest.raises(ConfigError) as err:
        load_settings(data={})
    assert str(err.value).startswith("PUSHGW__DELIVERY__PROXY: ")
    assert "ProxyPW" not in str(err.value)


def test_check_config_refuses_a_socks_proxy_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "pushgw.yaml", {"delivery": {"proxy": "socks5://u:ProxyPW@proxy:1080"}})
    result = run("check-config", "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"pushgw: config error: {path}: delivery.proxy: ")
    assert result.stderr.count("\n") == 1
    assert "ProxyPW" not in result.stderr + result.stdout

    result = run("check-config", "--config", str(path), env={"HTTPS_PROXY": "socks5://p:1080"})
    assert result.returncode == 2  # the file's proxy is the one used, and checked


def test_check_config_refuses_a_socks_https_proxy_variable(tmp_path: Path) -> None:
    path = write(tmp_path / "pushgw.yaml", {})
    result = run("check-config", "--config", str(path), env={"HTTPS_PROXY": "socks5://p:1080"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pushgw: config error: HTTPS_PROXY: ")
    assert result.stderr.count("\n") == 1


# --- plugins.enabled ---------------------------------------------------------------------------


def test_enabled_as_a_string_is_a_clear_config_error(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"plugins": {"enabled": "matrix"}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: plugins.enabled: expected a list of plugin names ([matrix, ...]), not a string"
    )


def test_registry_refuses_a_string_rather_than_reading_its_characters() -> None:
    with pytest.raises(ConfigError) as err:
        PluginRegistry("matrix")  # type: ignore[arg-type]
    assert str(err.value) == (
        "plugins.enabled: expected a list of plugin names ([matrix, ...]), not a string"
    )


# --- plugins that break while loading ----------------------------------------------------------


def _plugin(**hooks: Callable[..., object]) -> types.ModuleType:
    module = types.ModuleType("broken_plugin_module")
    for name, function in hooks.items():
        setattr(module, name, hookimpl(function))
    return module


def test_hook_with_an_argument_the_spec_lacks_is_one_line_naming_the_plugin() -> None:
    def pushgw_apps(context: object, bogus: object) -> None:
        return None

    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}},
            extra_plugins={"x": _plugin(pushgw_apps=pushgw_apps)},
        )
    message = str(err.value)
    assert message.startswith("plugin 'x': "), message
    assert "pushgw_apps" in message and "bogus" in message
    assert "\n" not in message


def test_unknown_hook_names_the_plugin_not_its_module() -> None:
    def pushgw_nosuch() -> None:
        return None

    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}},
            extra_plugins={"x": _plugin(pushgw_nosuch=pushgw_nosuch)},
        )
    assert str(err.value) == "plugin 'x': unknown hook 'pushgw_nosuch'"


@pytest.mark.parametrize("hook", ["pushgw_config_model", "pushgw_apps"])
def test_a_hook_raising_at_load_is_one_line_naming_the_plugin(hook: str) -> None:
    def raising(**_: object) -> None:
        raise RuntimeError("SECRET-in-message")

    # pluggy passes the hook's arguments by name: give the function the spec's signature
    spec = getattr(hookspecs, hook)
    raising.__signature__ = inspect.signature(spec)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}}, extra_plugins={"x": _plugin(**{hook: raising})}
        )
    message = str(err.value)
    assert message.startswith(f"plugin 'x': its {hook} hook raised RuntimeError"), message
    assert "\n" not in message
    assert "SECRET" not in message  # the message could quote a secret; the kind and place do not


def test_a_config_error_raised_by_a_hook_is_kept() -> None:
    def pushgw_config_model() -> None:
        raise ConfigError(["plugins.x.key: the plugin's own words"])

    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}},
            extra_plugins={"x": _plugin(pushgw_config_model=pushgw_config_model)},
        )
    assert str(err.value) == "plugins.x.key: the plugin's own words"


@pytest.mark.parametrize("returned", ["not a model", dict, ConfigError])
def test_a_config_model_hook_returning_no_model_class_is_one_line(returned: object) -> None:
    def pushgw_config_model() -> object:
        return returned

    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}},
            extra_plugins={"x": _plugin(pushgw_config_model=pushgw_config_model)},
        )
    message = str(err.value)
    assert message.startswith("plugin 'x': its pushgw_config_model hook returned "), message
    assert message.endswith(", not a pydantic model class (or None)")


@pytest.mark.parametrize("returned", [["ios"], {"ios": {"type": "apns"}}, {1: None}])
def test_an_apps_hook_returning_no_app_configs_is_one_line(returned: object) -> None:
    def pushgw_apps(context: object) -> object:
        return returned

    with pytest.raises(ConfigError) as err:
        load_gateway(
            data={"plugins": {"enabled": ["x"]}},
            extra_plugins={"x": _plugin(pushgw_apps=pushgw_apps)},
        )
    assert str(err.value) == (
        f"plugin 'x': its pushgw_apps hook returned {type(returned).__name__}, "
        "not a mapping of app ids to ApnsAppConfig or FcmAppConfig"
    )


# --- migrations ---------------------------------------------------------------------------------

SAMPLE_MIGRATIONS = str(Path(__file__).parent / "sample_plugin" / "pushgw_sample" / "migrations")


async def test_upgrade_after_a_plugin_is_disabled(store_url: str) -> None:
    """A plugin disabled after its branch was applied leaves its revision in the
    database: the core's branch (and other plugins') still upgrade, the disabled
    plugin's branch is left as it is, and nothing is reported pending."""
    from sqlalchemy import text

    from gateway.cli import _pending_migrations
    from gateway.core.store import Store

    store = Store(store_url)
    try:
        await store.upgrade([SAMPLE_MIGRATIONS])  # the plugin enabled
        # ... then disabled: its directory is known (installed), not upgraded
        await store.upgrade([], known=[SAMPLE_MIGRATIONS])
        assert await _pending_migrations(store, [], [SAMPLE_MIGRATIONS]) == []
        async with store.engine.connect() as conn:
            versions = {
                r[0] for r in await conn.execute(text("SELECT version_num FROM alembic_version"))
            }
        assert "sample_0001" in versions
    finally:
        await store.close()


async def test_a_disabled_plugin_is_not_upgraded_nor_pending(store_url: str) -> None:
    """An installed plugin never enabled gets no tables, and is not pending."""
    from sqlalchemy import inspect

    from gateway.cli import _pending_migrations
    from gateway.core.store import Store

    store = Store(store_url)
    try:
        await store.upgrade([], known=[SAMPLE_MIGRATIONS])
        assert await _pending_migrations(store, [], [SAMPLE_MIGRATIONS]) == []
        assert await _pending_migrations(store, [SAMPLE_MIGRATIONS], []) == ["sample_0001"]
        async with store.engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        assert "sample_invalid" not in tables
    finally:
        await store.close()
