"""Review findings: Sygnal configurations that Sygnal refuses at start-up must not start
pushgw either (matrix.md §2: a misconfiguration that rejects pushkeys wholesale, or that
cannot deliver at all, fails at start-up with a message naming the key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.testing.fcm_sim import make_service_account
from plugins.matrix.sygnal_config import (
    SygnalConfigError,
    load_sygnal_config,
    translate_sygnal_config,
)


@pytest.fixture
def android_app(tmp_path: Path) -> dict[str, Any]:
    account = tmp_path / "service_account.json"
    make_service_account("example-project", "http://127.0.0.1:9/token", account)
    return {
        "type": "gcm",
        "api_version": "v1",
        "project_id": "example-project",
        "service_account_file": str(account),
    }


@pytest.mark.parametrize("apps", [None, {}], ids=["apps-absent", "apps-empty"])
def test_sygnal_config_without_apps_fails_startup(tmp_path: Path, apps: Any) -> None:
    # Sygnal's own sample file has every app commented out, and Sygnal then refuses to
    # start ("No app IDs are configured"). pushgw used to start, answer every pushkey
    # with `rejected`, and so make Synapse delete every pusher that reached it.
    data: dict[str, Any] = {"http": {"port": 5000}}
    if apps is not None:
        data["apps"] = apps
    with pytest.raises(SygnalConfigError) as info:
        translate_sygnal_config(data)
    assert any(p.startswith("apps: ") for p in info.value.problems), info.value.problems
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SygnalConfigError, match="apps: "):
        load_sygnal_config(path)


@pytest.mark.parametrize(
    "proxy",
    [
        "socks5://bob:s3cret@proxy.example:1080",
        "https://bob:s3cret@proxy.example:3128",
        "bob:s3cret@proxy.example:3128",  # no scheme: urlsplit reads "bob" as one
        "http://",
        "http://proxy.example:notaport",
    ],
)
def test_unusable_proxy_fails_startup_without_echoing_it(
    android_app: dict[str, Any], proxy: str
) -> None:
    # Sygnal refuses any proxy but http://host at start-up. pushgw passed it through:
    # `check-config` said OK, then `serve` died with a ValueError traceback building the
    # APNs client (or every FCM push failed).
    with pytest.raises(SygnalConfigError) as info:
        translate_sygnal_config({"proxy": proxy, "apps": {"android": android_app}})
    assert [p for p in info.value.problems if p.startswith("proxy: ")], info.value.problems
    assert "s3cret" not in str(info.value) and "bob" not in str(info.value)


@pytest.mark.parametrize(
    ("proxy", "expected"),
    [
        ("http://user:pass@proxy.example:8080", "http://user:pass@proxy.example:8080"),
        ("http://proxy.example", "http://proxy.example"),
        ("//proxy.example:3128", "http://proxy.example:3128"),  # Sygnal assumes http
    ],
)
def test_http_proxy_still_accepted(android_app: dict[str, Any], proxy: str, expected: str) -> None:
    config, _ = translate_sygnal_config({"proxy": proxy, "apps": {"android": android_app}})
    assert config["delivery"] == {"proxy": expected}


@pytest.mark.parametrize("enabled", ["zulip", {"zulip": True}])
def test_sygnal_config_pushgw_plugins_enabled_must_be_a_list(enabled: object) -> None:
    data = {
        "apps": {
            "a": {
                "type": "gcm",
                "api_version": "v1",
                "project_id": "p",
                "service_account_file": "/nonexistent.json",
            }
        },
        "pushgw": {"plugins": {"enabled": enabled}},
    }
    with pytest.raises(SygnalConfigError) as err:
        translate_sygnal_config(data)
    assert "pushgw.plugins.enabled: expected a list of plugin names" in str(err.value)
