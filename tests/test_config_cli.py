"""Config mistakes as operators meet them: `pushgw` in a subprocess, one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.testing.apns_sim import generate_apns_auth_key

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    return subprocess.run(
        [*PUSHGW, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
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


@pytest.mark.parametrize(
    ("proxy", "shown"),
    [
        ("http://u:SEC@RET@proxy:3128", "http://u:***@proxy:3128"),  # "@" not encoded
    ],
)
def test_check_config_masks_a_password_that_does_not_parse(
    tmp_path: Path, proxy: str, shown: str
) -> None:
    path = write_config(tmp_path, {})
    result = run("check-config", "--config", str(path), env={"PUSHGW__DELIVERY__PROXY": proxy})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["delivery"]["proxy"] == shown
    assert "SEC" not in result.stdout + result.stderr
    assert "RET" not in result.stdout + result.stderr


def test_check_config_refuses_a_proxy_that_does_not_parse_without_showing_it(
    tmp_path: Path,
) -> None:
    # The APNs client could not use it (`serve` died on it): refused at load, unquoted.
    path = write_config(tmp_path, {})
    env = {"PUSHGW__DELIVERY__PROXY": "http://u:SECRET@[::1/"}
    result = run("check-config", "--config", str(path), env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pushgw: config error: PUSHGW__DELIVERY__PROXY: not a URL")
    assert "SECRET" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            "postgresql+asyncpg://postgres@127.0.0.1/test?sslmode=require",
            "unknown query parameter 'sslmode' (asyncpg's name for it is ssl); "
            "postgresql+asyncpg accepts: command_timeout, gsslib, host, krbsrvname, passfile, "
            "port, prepared_statement_cache_size, ssl, target_session_attrs",
        ),
        (
            "postgresql+asyncpg://postgres@127.0.0.1:99999/test",
            "port 99999 is out of range (0-65535)",
        ),
        (
            "postgresql+asyncpg://postgres:p@ss@127.0.0.1/test",
            "more than one '@' after the user name: write an '@' in the password as %40",
        ),
    ],
)
def test_db_upgrade_with_a_store_url_the_driver_cannot_take(url: str, problem: str) -> None:
    result = run("db", "upgrade", env={"PUSHGW__STORE__URL": url})
    assert_one_line_exit_2(result, f"PUSHGW__STORE__URL: {problem}")


async def test_db_upgrade_with_the_query_parameters_pushgw_accepts(postgres_url: str) -> None:
    url = (
        f"{postgres_url}?ssl=disable&command_timeout=30&prepared_statement_cache_size=0"
        "&target_session_attrs=any"
    )
    result = run("db", "upgrade", env={"PUSHGW__STORE__URL": url})
    assert result.returncode == 0, result.stderr


def test_top_level_key_that_is_not_a_string(tmp_path: Path) -> None:
    path = tmp_path / "pushgw.yaml"
    path.write_text("1: x\n")
    result = run("check-config", "--config", str(path))
    assert_one_line_exit_2(result, f"{path}: 1: Keys should be strings")


def test_config_nested_too_deeply(tmp_path: Path) -> None:
    path = tmp_path / "pushgw.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    result = run("check-config", "--config", str(path))
    assert_one_line_exit_2(
        result, f"{path}: the YAML document is nested too deeply (more than 100 levels)"
    )
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    result = run("check-config", env={"PUSHGW__SERVER": deep})
    assert_one_line_exit_2(
        result, "PUSHGW__SERVER: the JSON value is nested too deeply (more than 100 levels)"
    )


def test_check_config_with_a_deep_value_a_plugin_accepts(tmp_path: Path) -> None:
    # matrix takes any mapping as fcm_options: 300 levels passed validation, then
    # check-config failed printing it (pydantic: "Maximum serialization depth exceeded")
    p8 = generate_apns_auth_key().write_p8(tmp_path / "AuthKey.p8")
    app = {
        "type": "apns",
        "keyfile": str(p8),
        "key_id": "ABCDEFGHIJ",
        "team_id": "ABCDEFGHIJ",
        "topic": "com.example.ios",
    }
    path = write_config(
        tmp_path, {"plugins": {"enabled": ["matrix"], "matrix": {"apps": {"ios": app}}}}
    )
    deep = '{"a": ' * 300 + "1" + "}" * 300
    env = {"PUSHGW__PLUGINS__MATRIX__APPS__IOS__FCM_OPTIONS": deep}
    result = run("check-config", "--config", str(path), env=env)
    assert_one_line_exit_2(
        result,
        "PUSHGW__PLUGINS__MATRIX__APPS__IOS__FCM_OPTIONS: the JSON value is nested too deeply "
        "(more than 100 levels)",
    )
    env = {"PUSHGW__PLUGINS__MATRIX__APPS__IOS__FCM_OPTIONS": '{"a": ' * 90 + "1" + "}" * 90}
    result = run("check-config", "--config", str(path), env=env)
    assert result.returncode == 0, result.stderr


def test_plugin_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"plugins": {"enabled": ["matrix"], "matrix": [1]}})
    result = run("check-config", "--config", str(path))
    assert_one_line_exit_2(
        result, f"{path}: plugins.matrix: the plugin's section must be a mapping, not a list"
    )


def test_metrics_port_out_of_range(tmp_path: Path) -> None:
    result = run("check-config", env={"PUSHGW__SERVER__METRICS_PORT": "70000"})
    assert_one_line_exit_2(
        result, "PUSHGW__SERVER__METRICS_PORT: Input should be less than or equal to 65535"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_secret_file_that_is_a_named_pipe(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "key")
    env = {"PUSHGW__RECEIPTS__HMAC_KEY_FILE": str(tmp_path / "key")}
    result = run("check-config", env=env, timeout=30)  # a read would wait for a writer
    assert_one_line_exit_2(
        result, "PUSHGW__RECEIPTS__HMAC_KEY_FILE: not a regular file (a named pipe)"
    )
