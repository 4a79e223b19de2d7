"""matrix.md §2: a Sygnal config file becomes pushgw config data."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app import load_gateway
from gateway.config import ConfigError
from gateway.testing.apns_sim import generate_apns_auth_key
from gateway.testing.fcm_sim import make_service_account
from plugins.matrix.config import MatrixConfig
from plugins.matrix.sygnal_config import (
    SygnalConfigError,
    load_sygnal_config,
    translate_sygnal_config,
)

EXAMPLE = Path(__file__).parents[2] / "config" / "sygnal.example.yaml"


@pytest.fixture
def credentials(tmp_path: Path) -> dict[str, str]:
    key = generate_apns_auth_key()
    p8 = key.write_p8(tmp_path / "AuthKey.p8")
    account = tmp_path / "service_account.json"
    make_service_account("example-project", "http://127.0.0.1:9/token", account)
    return {
        "keyfile": str(p8),
        "key_id": key.key_id,
        "team_id": key.team_id,
        "service_account_file": str(account),
    }


def sygnal(credentials: dict[str, str], **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "http": {"bind_addresses": ["0.0.0.0"], "port": 5005},
        "proxy": "http://user:pass@proxy.example:8080",
        "metrics": {"prometheus": {"enabled": True, "address": "0.0.0.0", "port": 8005}},
        "log": {"setup": {"version": 1}},
        "apps": {
            "com.example.ios": {
                "type": "apns",
                "keyfile": credentials["keyfile"],
                "key_id": credentials["key_id"],
                "team_id": credentials["team_id"],
                "topic": "com.example.ios",
                "platform": "sandbox",
                "push_type": "alert",
                "convert_device_token_to_hex": False,
                "inflight_request_limit": 100,
                "send_badge_counts": False,
            },
            "com.example.android": {
                "type": "gcm",
                "api_version": "v1",
                "project_id": "example-project",
                "service_account_file": credentials["service_account_file"],
                "fcm_options": {"android": {"ttl": "60s"}},
                "max_connections": 30,
            },
        },
    }
    data.update(extra)
    return data


def test_translation(credentials: dict[str, str]) -> None:
    config, warnings = translate_sygnal_config(sygnal(credentials))
    assert config["server"] == {"host": "0.0.0.0", "port": 5005, "metrics_port": 8005}
    assert config["delivery"] == {"proxy": "http://user:pass@proxy.example:8080"}
    assert config["plugins"]["enabled"] == ["matrix"]
    assert set(config["plugins"]["matrix"]["apps"]) == {"com.example.ios", "com.example.android"}
    assert warnings == ["log: not used by pushgw, ignored"]


def test_loads_into_a_gateway(credentials: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump(sygnal(credentials)))
    data = load_sygnal_config(path)
    data["store"] = {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"}
    gateway = load_gateway(data=data)
    apps = gateway.apps
    ios = apps[("matrix", "com.example.ios")]
    android = apps[("matrix", "com.example.android")]
    assert ios.environment == "sandbox" and ios.topic == "com.example.ios"  # type: ignore[union-attr]
    assert android.project_id == "example-project" and android.max_in_flight == 30  # type: ignore[union-attr]
    matrix = gateway.contexts["matrix"].config
    assert matrix.apps["com.example.ios"].inflight_request_limit == 100
    assert matrix.apps["com.example.android"].fcm_options == {"android": {"ttl": "60s"}}
    assert gateway.settings.delivery.proxy == "http://user:pass@proxy.example:8080"


def test_defaults(credentials: dict[str, str]) -> None:
    # One app: a Sygnal config without any is refused (test_review_msc3013.py).
    android = sygnal(credentials)["apps"]["com.example.android"]
    config, _ = translate_sygnal_config({"apps": {"com.example.android": android}})
    assert config["server"] == {"host": "127.0.0.1", "port": 5000}
    assert "metrics_port" not in config["server"]


def test_ports_read_with_int_as_sygnal(credentials: dict[str, str]) -> None:
    data = sygnal(credentials, http={"port": " 5005 "})
    data["metrics"]["prometheus"]["port"] = "8005"
    config, _ = translate_sygnal_config(data)
    assert (config["server"]["port"], config["server"]["metrics_port"]) == (5005, 8005)


@pytest.mark.parametrize(
    ("port", "shown"),
    [("http", "not 'http'"), ("5000.0", "not '5000.0'"), (True, "not bool"), (5000.0, "not float")],
)
def test_ports_that_are_not_integers(credentials: dict[str, str], port: Any, shown: str) -> None:
    data = sygnal(credentials, http={"port": port})
    data["metrics"]["prometheus"]["port"] = port
    with pytest.raises(SygnalConfigError) as info:
        translate_sygnal_config(data)
    assert info.value.problems == [
        f"http.port: expected an integer port number, {shown}",
        f"metrics.prometheus.port: expected an integer port number, {shown}",
    ]


def test_empty_platform_and_push_type_are_unset(credentials: dict[str, str]) -> None:
    data = sygnal(credentials)
    data["apps"]["com.example.ios"].update(platform="", push_type="")
    config, _ = translate_sygnal_config(data)
    matrix = MatrixConfig.model_validate(config["plugins"]["matrix"])
    ios = matrix.core_apps["com.example.ios"]
    assert ios.environment == "production" and ios.push_type is None  # type: ignore[union-attr]


def test_unknown_keys_warn_with_paths(
    credentials: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = sygnal(credentials, extra_section={"a": 1})
    data["http"]["prot"] = 1
    data["metrics"]["prometheus"]["adress"] = "x"
    data["apps"]["com.example.ios"]["colour"] = "blue"
    _, warnings = translate_sygnal_config(data)
    assert "extra_section: unknown configuration section, ignored" in warnings
    assert "http.prot: unknown key, ignored" in warnings
    assert "metrics.prometheus.adress: unknown key, ignored" in warnings
    assert "apps.com.example.ios.colour: unknown key, ignored" in warnings
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING):
        load_sygnal_config(path)
    assert "http.prot: unknown key, ignored" in caplog.text
    with pytest.raises(SygnalConfigError) as info:
        load_sygnal_config(path, strict=True)
    assert "apps.com.example.ios.colour: unknown key, ignored" in info.value.problems
    # the plugin warns about unknown app keys when it loads, and carries on
    config = load_sygnal_config(path)
    config["store"] = {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"}
    with caplog.at_level(logging.WARNING):
        load_gateway(data=config)
    assert "plugins.matrix.apps.com.example.ios.colour: unknown key, ignored" in caplog.text


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ({"type": "webpush", "vapid_private_key": "x"}, "apps.bad.type"),
        ({"type": "sygnal.custom.Pushkin"}, "apps.bad.type"),
        ({"type": "apns", "certfile": "/nonexistent.pem"}, "apps.bad"),
        ({"type": "apns"}, "certfile"),
        ({"type": "apns", "keyfile": "{keyfile}", "key_id": "K"}, "team_id, topic"),
        (
            {
                "type": "apns",
                "keyfile": "{keyfile}",
                "key_id": "K",
                "team_id": "T",
                "topic": "t",
                "platform": "staging",
            },
            "platform",
        ),
        (
            {
                "type": "apns",
                "keyfile": "{keyfile}",
                "key_id": "K",
                "team_id": "T",
                "topic": "t",
                "push_type": "location",
            },
            "push_type",
        ),
        ({"type": "gcm", "api_key": "legacy-key"}, "legacy"),
        ({"type": "gcm", "api_version": "v1", "project_id": "p"}, "service_account_file"),
        ({"type": "gcm", "api_version": "v2"}, "api_version"),
    ],
)
def test_startup_failures(credentials: dict[str, str], app: dict[str, Any], message: str) -> None:
    app = {k: (v.format(**credentials) if isinstance(v, str) else v) for k, v in app.items()}
    with pytest.raises(SygnalConfigError) as info:
        translate_sygnal_config({"apps": {"bad": app}})
    assert message in str(info.value)
    assert all(p.startswith("apps.bad") for p in info.value.problems)


def test_certificate_topic_from_uid(tmp_path: Path) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.USER_ID, "com.example.fromcert"),
            x509.NameAttribute(NameOID.COMMON_NAME, "Apple Push Services"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    pem = tmp_path / "apns.pem"
    pem.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    config, _ = translate_sygnal_config({"apps": {"ios": {"type": "apns", "certfile": str(pem)}}})
    config["store"] = {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"}
    gateway = load_gateway(data=config)
    assert gateway.apps[("matrix", "ios")].topic == "com.example.fromcert"  # type: ignore[union-attr]


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SygnalConfigError, match="cannot read"):
        load_sygnal_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("apps: [\n")
    with pytest.raises(SygnalConfigError, match="invalid YAML"):
        load_sygnal_config(bad)
    bad.write_bytes(b"apps: \xff\n")  # a traceback (UnicodeDecodeError) before
    with pytest.raises(SygnalConfigError, match=r"not UTF-8 text \(byte 6\)"):
        load_sygnal_config(bad)
    bad.write_text("- 1\n")
    with pytest.raises(SygnalConfigError, match="mapping"):
        load_sygnal_config(bad)


def test_native_config_errors_name_the_path(tmp_path: Path) -> None:
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"x": {"type": "webpush"}}}},
    }
    with pytest.raises(ConfigError, match=r"plugins\.matrix\.apps\.x\.type"):
        load_gateway(data=data)


def test_native_sections_pass_through(credentials: dict[str, str]) -> None:
    config, _ = translate_sygnal_config(
        sygnal(
            credentials,
            pushgw={
                "store": {"url": "sqlite+aiosqlite:///x.db"},
                "server": {"workers": 2},
                "plugins": {"matrix": {"notify_deadline": 5}},
            },
        )
    )
    assert config["store"] == {"url": "sqlite+aiosqlite:///x.db"}
    assert config["server"]["workers"] == 2 and config["server"]["port"] == 5005
    assert config["plugins"]["matrix"]["notify_deadline"] == 5


def test_example_file_is_a_valid_sygnal_file() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert set(data) <= {"http", "log", "metrics", "proxy", "apps"}
    with pytest.raises(SygnalConfigError):  # its credentials are placeholders
        translate_sygnal_config(data)
