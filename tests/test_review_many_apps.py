"""Review (many apps): a hosting provider's gateway with many apps across plugins.

Shared credentials are shared (one APNs JWT per key and team), and `check-config`
reports every problem of such a file, one line each.
"""

from __future__ import annotations

import base64
import secrets
from pathlib import Path
from typing import Any

import pytest

from gateway.app import load_gateway
from gateway.config import ConfigError
from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config

NOTIFY = "/_matrix/push/v1/notify"


def _matrix_ios_apps(sim: ApnsSimulator, directory: Path, count: int) -> dict[str, Any]:
    """`count` APNs apps of one team, one bundle each, all signing with the same key."""
    shared = apns_app_config(sim, directory)
    return {
        f"com.customer{i}.ios": {**shared, "topic": f"com.customer{i}.ios"} for i in range(count)
    }


async def test_apps_signing_with_one_key_share_one_provider_token(
    apns_simulator: ApnsSimulator, tmp_path: Path
) -> None:
    """specs/providers.md §2.3: one JWT per (key, team) for all connections. A team key
    serves all the team's apps; each app signed its own token from it."""
    apps = _matrix_ios_apps(apns_simulator, tmp_path, 5)
    config = base_config(tmp_path, {"matrix": {"apps": apps, "notify_deadline": 5.0}})
    devices = [
        {"app_id": app_id, "pushkey": base64.b64encode(secrets.token_bytes(32)).decode()}
        for app_id in apps
    ]
    async with GatewayHarness(config) as gw:
        body = {"notification": {"event_id": "$e", "counts": {"unread": 1}, "devices": devices}}
        response = await gw.client.post(NOTIFY, json=body)
        assert response.status == 200
        assert await response.json() == {"rejected": []}
    assert len(apns_simulator.requests) == 5
    assert apns_simulator.jwts_seen == 1


def _broken_many_apps(
    apns: ApnsSimulator, fcm: FcmSimulator, directory: Path
) -> tuple[dict[str, Any], Path]:
    ios = apns_app_config(apns, directory)
    android = fcm_app_config(fcm, directory)
    bad_key = directory / "bad.p8"
    bad_key.write_text("not a key\n")
    matrix = {f"com.c{i}.ios": {**ios, "topic": f"com.c{i}.ios"} for i in range(6)}
    matrix["com.c1.ios"]["keyfile"] = str(directory / "missing-1.p8")
    matrix["com.c4.ios"]["keyfile"] = str(directory / "missing-4.p8")
    zulip = {"ios": {**ios, "keyfile": str(bad_key)}, "android": android}
    config = base_config(directory, {"matrix": {"apps": matrix}, "zulip": {"apps": zulip}})
    return config, bad_key


async def test_check_config_reports_every_plugins_problems(
    apns_simulator: ApnsSimulator, fcm_simulator: FcmSimulator, tmp_path: Path
) -> None:
    """A problem in one plugin's section hid every other plugin's, and the credentials
    of the apps that did validate: fixing a config of hundreds of apps took a run each."""
    config, _ = _broken_many_apps(apns_simulator, fcm_simulator, tmp_path)
    with pytest.raises(ConfigError) as err:
        load_gateway(data=config)
    assert err.value.problems == [
        "plugins.matrix.apps.com.c1.ios: keyfile: file not found",
        "plugins.matrix.apps.com.c4.ios: keyfile: file not found",
        "plugins.zulip.apps.ios.keyfile: not a PEM private key (expected the .p8 file from Apple)",
    ]


async def test_each_broken_matrix_app_is_its_own_line(
    apns_simulator: ApnsSimulator, fcm_simulator: FcmSimulator, tmp_path: Path
) -> None:
    """The matrix section's problems were one line joined by "; " under `plugins.matrix`:
    with many broken apps, one unreadable line."""
    config, _ = _broken_many_apps(apns_simulator, fcm_simulator, tmp_path)
    del config["plugins"]["zulip"]
    config["plugins"]["enabled"] = ["matrix"]
    config["plugins"]["matrix"]["apps"]["com.c5.ios"]["platform"] = "staging"
    with pytest.raises(ConfigError) as err:
        load_gateway(data=config)
    assert err.value.problems == [
        "plugins.matrix.apps.com.c1.ios: keyfile: file not found",
        "plugins.matrix.apps.com.c4.ios: keyfile: file not found",
        "plugins.matrix.apps.com.c5.ios: platform: invalid platform 'staging' "
        "(production or sandbox)",
    ]


async def test_many_apps_load_and_report_ready(
    apns_simulator: ApnsSimulator, fcm_simulator: FcmSimulator, tmp_path: Path
) -> None:
    """Pin: 40 apps over two plugins start; /readyz names each (plugin, app) once."""
    matrix = _matrix_ios_apps(apns_simulator, tmp_path, 20)
    android = fcm_app_config(fcm_simulator, tmp_path)
    matrix.update({f"com.customer{i}.android": dict(android) for i in range(19)})
    zulip = {"android": dict(android)}
    config = base_config(tmp_path, {"matrix": {"apps": matrix}, "zulip": {"apps": zulip}})
    async with GatewayHarness(config) as gw:
        response = await gw.client.get("/readyz")
        assert response.status == 200
        ready = await response.json()
    expected = {f"matrix/{app_id}" for app_id in matrix} | {"zulip/android"}
    assert set(ready["apps"]) == expected
    assert all(ready["apps"].values())
