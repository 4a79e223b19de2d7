"""Config mistakes as operators meet them: `pushgw` in a subprocess, one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    return subprocess.run(
        [*PUSHGW, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], line: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"pushgw: config error: {line}\n"


def test_check_config_masks_passwords_in_urls(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {
            "store": {"url": "postgresql+asyncpg://pushgw:S3cretPW@db.example/pushgw"},
            "delivery": {"proxy": "http://proxyuser:ProxyPW@proxy:3128"},
        },
    )
    result = run("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["store"]["url"] == "postgresql+asyncpg://pushgw:***@db.example/pushgw"
    assert shown["delivery"]["proxy"] == "http://proxyuser:***@proxy:3128"
    assert "S3cretPW" not in result.stdout + result.stderr
    assert "ProxyPW" not in result.stdout + result.stderr


def test_check_config_loads_credentials(tmp_path: Path) -> None:
    (tmp_path / "AuthKey.p8").write_text("not a key\n")
    (tmp_path / "sa.json").write_text("{}")
    apps = {
        "ios": {
            "type": "apns",
            "keyfile": str(tmp_path / "AuthKey.p8"),
            "key_id": "K",
            "team_id": "T",
            "topic": "com.example.ios",
        },
        "android": {"type": "fcm", "service_account_file": str(tmp_path / "sa.json")},
    }
    path = write_config(tmp_path, {"plugins": {"enabled": ["matrix"], "matrix": {"apps": apps}}})
    result = run("check-config", "--config", str(path))
    assert result.returncode == 2, result.stderr
    # apps in file order (yaml.safe_dump sorts keys): android, then ios
    assert result.stderr.splitlines() == [
        f"pushgw: config error: {path}: plugins.matrix.apps.android.service_account_file: "
        'not a service account key (a JSON object with "type": "service_account", '
        "as the Firebase console downloads it)",
        f"{path}: plugins.matrix.apps.ios.keyfile: "
        "not a PEM private key (expected the .p8 file from Apple)",
    ]


def test_db_upgrade_with_an_unsupported_url(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"store": {"url": "mysql://user:DbPW@x/y"}})
    result = run("db", "upgrade", "--config", str(path))
    assert_one_line_exit_2(
        result,
        f"{path}: store.url: unsupported database driver 'mysql': expected "
        "sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DATABASE",
    )


def test_env_mistakes_name_the_variable(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"receipts": {"hmac_key": "abc"}})
    result = run("check-config", "--config", str(path), env={"PUSHGW__SERVER": "notjson"})
    assert_one_line_exit_2(
        result,
        "PUSHGW__SERVER: expected a JSON object, or one variable per key (PUSHGW__SERVER__<KEY>)",
    )
    result = run("check-config", "--config", str(path), env={"PUSHGW__SERVR__PORT": "1"})
    assert_one_line_exit_2(result, "PUSHGW__SERVR__PORT: unknown key 'servr'")


def test_binary_config_file(tmp_path: Path) -> None:
    path = tmp_path / "pushgw.yaml"
    path.write_bytes(b"\x9e\xb1\x97\xf9 binary")
    result = run("check-config", "--config", str(path))
    assert_one_line_exit_2(result, f"{path}: not a YAML file: not UTF-8 text (byte 0)")
