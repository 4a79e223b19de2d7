"""Config loading: YAML, environment overrides, secrets from files, errors with key paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from gateway.app import load_gateway
from gateway.config import ConfigError, load_settings


def write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_without_a_file() -> None:
    settings = load_settings(data={})
    assert settings.server.port == 5000
    assert settings.store.url.startswith("sqlite+aiosqlite://")
    assert settings.plugins.enabled == []


def test_unknown_core_key_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"prot": 1}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == f"{path}: server.prot: unknown key"


def test_wrong_type_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"port": "many"}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value).startswith(f"{path}: server.port: ")


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"port": 6000, "host": "0.0.0.0"}})
    monkeypatch.setenv("PUSHGW__SERVER__PORT", "7000")
    settings = load_settings(path)
    assert settings.server.port == 7000
    assert settings.server.host == "0.0.0.0"


def test_config_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"port": 6100}})
    monkeypatch.setenv("PUSHGW_CONFIG", str(path))
    assert load_settings().server.port == 6100


def test_secret_from_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret-value\n")
    path = write(tmp_path / "c.yaml", {"receipts": {"hmac_key_file": str(tmp_path / "key")}})
    settings = load_settings(path)
    assert settings.receipts.hmac_key.get_secret_value() == "s3cret-value"


def test_secret_file_missing_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", {"receipts": {"hmac_key_file": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"receipts: hmac_key_file: file not found"):
        load_settings(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "absent.yaml")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: [1,\n")
    with pytest.raises(ConfigError, match=r"line \d+: invalid YAML"):
        load_settings(path)


def test_unknown_enabled_plugin(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"plugins.enabled: unknown plugin 'nope'"):
        load_gateway(data={"plugins": {"enabled": ["nope"]}})


def test_section_for_disabled_plugin_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"plugins.sample: section for a plugin that is not enabled"
    ):
        load_gateway(data={"plugins": {"enabled": [], "sample": {"greeting": "x"}}})


def test_plugin_section_errors_carry_the_full_key_path(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    data = {
        "plugins": {
            "enabled": ["sample"],
            "sample": {
                "apps": {
                    "com.example.ios": {
                        "type": "apns",
                        "keyfile": str(tmp_path / "missing.p8"),
                        "key_id": "ABCDEFGHIJ",
                        "team_id": "ABCDEFGHIJ",
                        "topic": "com.example.ios",
                    }
                }
            },
        }
    }
    with pytest.raises(ConfigError) as err:
        load_gateway(data=data)
    assert "plugins.sample.apps.com.example.ios.keyfile: file not found" in str(err.value)


def test_plugin_section_unknown_key(sample_plugin_installed: str) -> None:
    data = {"plugins": {"enabled": ["sample"], "sample": {"greetin": "typo"}}}
    with pytest.raises(ConfigError, match=r"plugins.sample.greetin: unknown key"):
        load_gateway(data=data)


def test_apns_app_needs_one_auth_method(sample_plugin_installed: str) -> None:
    data = {"plugins": {"enabled": ["sample"], "sample": {"apps": {"a": {"type": "apns"}}}}}
    with pytest.raises(ConfigError, match=r"plugins.sample.apps.a: set either keyfile"):
        load_gateway(data=data)


def test_receipts_format_defaults_to_jsonl_and_accepts_parquet() -> None:
    assert load_settings(data={}).receipts.format == "jsonl"
    assert load_settings(data={"receipts": {"format": "parquet"}}).receipts.format == "parquet"


def test_parquet_receipts_without_pyarrow_fail_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    path = write(tmp_path / "c.yaml", {"receipts": {"format": "parquet"}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: receipts.format: parquet needs pyarrow, which is not installed: "
        "install pushgw[parquet]"
    )
    monkeypatch.setenv("PUSHGW__RECEIPTS__FORMAT", "jsonl")
    assert load_settings(path).receipts.format == "jsonl"
