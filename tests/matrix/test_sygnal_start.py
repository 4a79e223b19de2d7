"""The Sygnal-config start path: sygnal.yaml → pushgw config → a gateway answering notify."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app import load_gateway
from gateway.testing.apns_sim import ApnsSimulator, generate_apns_auth_key
from gateway.testing.fcm_sim import FcmSimulator, make_service_account
from gateway.testing.harness import GatewayHarness
from plugins.matrix.sygnal_config import load_sygnal_config
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey, notification


def _sygnal_yaml(tmp_path: Path, apns: ApnsSimulator, fcm: FcmSimulator) -> Path:
    key = generate_apns_auth_key()
    apns.add_jwt_key(key.key_id, key.team_id, key.public_key)
    account = tmp_path / "service_account.json"
    sim_account = make_service_account("sygnal-project", fcm.token_uri, account)
    fcm.add_service_account(sim_account)
    config: dict[str, Any] = {
        "http": {"bind_addresses": ["127.0.0.1"], "port": 5000},
        "log": {"setup": {"version": 1}, "access": {"x_forwarded_for": False}},
        "metrics": {"prometheus": {"enabled": False}, "sentry": {"enabled": False}},
        "apps": {
            "im.vector.app.ios": {
                "type": "apns",
                "keyfile": str(key.write_p8(tmp_path / "AuthKey.p8")),
                "key_id": key.key_id,
                "team_id": key.team_id,
                "topic": "im.vector.app",
                "platform": "production",
                # pushgw extensions: where the "provider" is
                "endpoint": apns.url,
                "ca_file": str(apns.ca_path),
            },
            "im.vector.app.android": {
                "type": "gcm",
                "api_version": "v1",
                "project_id": "sygnal-project",
                "service_account_file": str(account),
                "endpoint": fcm.url,
            },
        },
        "pushgw": {
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
            "receipts": {"directory": str(tmp_path / "receipts")},
        },
    }
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_gateway_from_sygnal_yaml(
    tmp_path: Path, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    data = load_sygnal_config(_sygnal_yaml(tmp_path, apns, fcm))
    assert data["server"] == {"host": "127.0.0.1", "port": 5000}
    async with GatewayHarness(data) as gw:
        key, hexkey = apns_pushkey()
        body = notification(
            [device("im.vector.app.ios", key), device("im.vector.app.android", fcm_pushkey())]
        )
        response = await gw.client.post(NOTIFY, json=body)
        assert response.status == 200 and await response.json() == {"rejected": []}
    assert apns.requests[0].token == hexkey
    assert apns.requests[0].headers["apns-topic"] == "im.vector.app"
    assert fcm.requests[0].project_id == "sygnal-project"


async def test_check_config_cli(tmp_path: Path, apns: ApnsSimulator, fcm: FcmSimulator) -> None:
    path = _sygnal_yaml(tmp_path, apns, fcm)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "check-config",
        "--sygnal-config",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    printed = out.decode()
    normalized = json.loads(printed[: printed.rindex("}") + 1])
    assert normalized["apps"] == ["matrix/im.vector.app.android", "matrix/im.vector.app.ios"]


async def test_webpush_app_fails_startup(tmp_path: Path) -> None:
    path = tmp_path / "sygnal.yaml"
    path.write_text(
        yaml.safe_dump({"apps": {"web": {"type": "webpush", "vapid_private_key": "k"}}})
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "check-config",
        "--sygnal-config",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "apps.web.type" in err.decode() and "webpush" in err.decode()


def test_native_config_without_apps_fails_startup(tmp_path: Path) -> None:
    """Every pushkey would be rejected, and Synapse deletes a rejected pusher (§1.2):
    `plugins.matrix` enabled with no app is a start-up error, as in a Sygnal config."""
    from gateway.config import ConfigError
    from gateway.testing.harness import base_config

    config = base_config(tmp_path, {})
    config["plugins"] = {"enabled": ["matrix"]}
    with pytest.raises(ConfigError, match=r"plugins\.matrix.*no app IDs are configured"):
        load_gateway(data=config)
