"""Config loading: YAML, environment overrides, secrets from files, errors with key paths."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from pydantic import SecretStr

from gateway.app import load_gateway
from gateway.config import (
    MASK,
    ApnsAppConfig,
    ConfigError,
    ConfigModel,
    CredentialError,
    FcmAppConfig,
    load_settings,
    mask_url,
    masked,
    validate_plugin_section,
)
from gateway.core.apns import ApnsClient
from gateway.core.fcm import FcmClient
from gateway.testing.apns_sim import generate_apns_auth_key
from gateway.testing.fcm_sim import make_service_account


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


@pytest.mark.parametrize(
    ("section", "key", "text"),
    [
        ("server", "shutdown_timeout", ".inf"),
        ("server", "keepalive_timeout", ".nan"),
        ("delivery", "backoff_cap", ".inf"),
        ("receipts", "roll_seconds", ".inf"),
    ],
)
def test_infinite_and_nan_durations_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str, key: str, text: str
) -> None:
    # YAML's `.inf` passed `ge=0`: a drain that never ends (only SIGKILL, which loses the
    # receipts, stops it), a connection never timed out, a receipts file never rolled.
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {text}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == f"{path}: {section}.{key}: Input should be a finite number"
    variable = f"PUSHGW__{section.upper()}__{key.upper()}"
    monkeypatch.setenv(variable, "inf")
    with pytest.raises(ConfigError) as err:
        load_settings(data={})
    assert str(err.value) == f"{variable}: Input should be a finite number"


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
    with pytest.raises(ConfigError, match=r"receipts\.hmac_key_file: file not found"):
        load_settings(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "absent.yaml")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: [1,\n")
    with pytest.raises(ConfigError, match=r"line \d+: invalid YAML"):
        load_settings(path)


def test_top_level_key_that_is_not_a_string(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("1: x\nserver:\n  2: y\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value).splitlines() == [
        f"{path}: 1: Keys should be strings",
        f"{path}: server.2: Keys should be strings",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "x: " + "[" * 5000 + "]" * 5000,  # beyond Python's recursion limit
        "x: " + "[" * 100 + "]" * 100,  # 101 levels (pydantic's serializer stops at ~250)
        "plugins:\n  enabled: []\n  x: &a {k: *a}",  # an alias inside itself
    ],
)
def test_yaml_nested_too_deeply(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: the YAML document is nested too deeply (more than 100 levels)"
    )
    path.write_text("x: " + "[" * 99 + "]" * 99 + "\n")  # 100 levels, with the top one
    with pytest.raises(ConfigError, match=r"x: unknown key$"):
        load_settings(path)


def test_yaml_aliases_that_expand_beyond_reason(tmp_path: Path) -> None:
    lines = ["plugins:", "  enabled: []", "  x:", "    l0: &l0 [a, a, a, a, a, a, a, a, a, a]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 8)]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: the YAML document is too large (more than 1000000 values, aliases expanded)"
    )


@pytest.mark.parametrize("depth", [5000, 101])
@pytest.mark.parametrize("name", ["PUSHGW__SERVER", "PUSHGW__PLUGINS__ENABLED"])
def test_env_json_nested_too_deeply(monkeypatch: pytest.MonkeyPatch, name: str, depth: int) -> None:
    deep = "[" * depth + "]" * depth
    monkeypatch.setenv(name, '{"a": ' + deep + "}" if name == "PUSHGW__SERVER" else deep)
    with pytest.raises(ConfigError) as err:
        load_settings(data={})
    assert str(err.value) == f"{name}: the JSON value is nested too deeply (more than 100 levels)"


def test_env_json_nested_too_deeply_in_a_plugin_section(monkeypatch: pytest.MonkeyPatch) -> None:
    class Section(ConfigModel):
        relays: list[str]

    monkeypatch.setenv("PUSHGW__PLUGINS__X__RELAYS", "[" * 5000 + "]" * 5000)
    settings = load_settings(data={})
    with pytest.raises(ConfigError) as err:
        validate_plugin_section(settings, "x", Section)
    assert str(err.value) == (
        "PUSHGW__PLUGINS__X__RELAYS: the JSON value is nested too deeply (more than 100 levels)"
    )


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ([1], "the plugin's section must be a mapping, not a list"),
        ("oops", "the plugin's section must be a mapping, not a string"),
        (3, "the plugin's section must be a mapping, not a number"),
    ],
)
def test_plugin_section_that_is_not_a_mapping(
    tmp_path: Path, section: object, problem: str
) -> None:
    path = write(tmp_path / "c.yaml", {"plugins": {"enabled": ["matrix"], "matrix": section}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == f"{path}: plugins.matrix: {problem}"


def test_empty_plugin_section_is_no_keys() -> None:
    settings = load_settings(data={"plugins": {"enabled": ["matrix"], "matrix": None}})
    assert settings.plugins.section("matrix") == {}


@pytest.mark.parametrize(
    ("port", "problem"),
    [
        (70000, "Input should be less than or equal to 65535"),
        (0, "Input should be greater than or equal to 1"),  # any free port: shown nowhere
        (-1, "Input should be greater than or equal to 1"),
    ],
)
def test_metrics_port_is_a_port_number(port: int, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(data={"server": {"metrics_port": port}})
    assert str(err.value) == f"server.metrics_port: {problem}"
    assert load_settings(data={"server": {"metrics_port": 65535}}).server.metrics_port == 65535


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


def test_receipts_format_defaults_to_parquet_and_accepts_jsonl() -> None:
    assert load_settings(data={}).receipts.format == "parquet"
    assert load_settings(data={"receipts": {"format": "jsonl"}}).receipts.format == "jsonl"


def test_parquet_receipts_without_pyarrow_fail_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    path = write(tmp_path / "c.yaml", {"receipts": {"format": "parquet"}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: receipts.format: parquet needs pyarrow, which is not installed: "
        "install pyarrow, or set receipts.format: jsonl"
    )
    # the default is no request: the writer keeps JSON Lines, with a warning
    assert load_settings(data={}).receipts.format == "parquet"
    monkeypatch.setenv("PUSHGW__RECEIPTS__FORMAT", "jsonl")
    assert load_settings(path).receipts.format == "jsonl"


# --- secrets in URLs are masked (check-config) -----------------------------------------------


def test_masked_keeps_url_shape_but_hides_passwords() -> None:
    settings = load_settings(
        data={
            "store": {"url": "postgresql+asyncpg://pushgw:S3cretPW@db.example/pushgw"},
            "delivery": {"proxy": "http://proxyuser:ProxyPW@proxy:3128"},
        }
    )
    shown = masked(settings, {})
    assert shown["store"]["url"] == "postgresql+asyncpg://pushgw:***@db.example/pushgw"
    assert shown["delivery"]["proxy"] == "http://proxyuser:***@proxy:3128"
    assert "S3cretPW" not in str(shown) and "ProxyPW" not in str(shown)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+asyncpg://u:pa/ss@host/db", "postgresql+asyncpg://u:***@host/db"),
        ("wss://u:pw@relay.example/inbox?x=1", "wss://u:***@relay.example/inbox?x=1"),
        ("https://h/send?access_token=abc&x=1", "https://h/send?access_token=***&x=1"),
        ("postgresql+asyncpg://pushgw@db/pushgw", "postgresql+asyncpg://pushgw@db/pushgw"),
        ("https://host/path?email=a@b", "https://host/path?email=a@b"),
        ("not a url", "not a url"),
        # unparsable, or a password with an unencoded "@": masked up to the last "@"
        ("http://u:SECRET@[::1/", "http://u:***@[::1/"),
        ("http://u:SEC@RET@proxy:3128", "http://u:***@proxy:3128"),
        (
            "postgresql+asyncpg://postgres:p@ss@127.0.0.1/test",
            "postgresql+asyncpg://postgres:***@127.0.0.1/test",
        ),
        ("postgresql+asyncpg://u:p@s/s@h:5432/db", "postgresql+asyncpg://u:***@h:5432/db"),
        ("http://me@example.com:PW@proxy:3128", "http://me@example.com:***@proxy:3128"),
    ],
)
def test_mask_url(url: str, expected: str) -> None:
    assert mask_url(url) == expected


@pytest.mark.parametrize(
    "password", ["S3cretPW", "SEC@RET", "abc@def/ghi", "xyz@qrs?tuv", "pqr:wst@dfg#hij"]
)
@pytest.mark.parametrize(
    "template",
    [
        "http://u:{}@proxy:3128",
        "http://u:{}@[::1/",
        "postgresql+asyncpg://pushgw:{}@db.example:5432/pushgw?ssl=require",
        "wss://user:{}@relay.example/inbox?x=a@b",
    ],
)
def test_mask_url_never_shows_any_part_of_a_password(template: str, password: str) -> None:
    shown = mask_url(template.format(password))
    assert shown.startswith(template.partition("{}")[0].rstrip(":") + ":***@"), shown
    for part in password.split("@"):
        assert part not in shown, shown


def test_masked_plugin_sections_mask_urls_too() -> None:
    class Section(ConfigModel):
        relay: str

    settings = load_settings(data={})
    shown = masked(settings, {"x": Section(relay="wss://user:RelayPW@relay.example")})
    assert shown["plugins"]["x"]["relay"] == "wss://user:***@relay.example"


def test_masked_hides_every_value_read_from_a_file_whatever_its_name(tmp_path: Path) -> None:
    class Section(ConfigModel):
        bearer: str  # not a secret's name: a secret because it was read from a file
        label: str

    bearer, url = tmp_path / "bearer", tmp_path / "url"
    bearer.write_text("Bearer-S3cret\n")
    url.write_text("sqlite+aiosqlite:///var/S3cretPath.db\n")
    settings = load_settings(data={"store": {"url_file": str(url)}})
    section = Section.model_validate({"bearer_file": str(bearer), "label": "shown"})
    shown = masked(settings, {"x": section})
    assert shown["plugins"]["x"] == {"bearer": MASK, "label": "shown"}
    assert shown["store"]["url"] == MASK
    assert section.model_dump()["bearer"] == "Bearer-S3cret"  # only check-config masks


# --- provider credentials load at validation (check-config = start) ---------------------------


def _apns_app(keyfile: Path, **extra: object) -> dict[str, object]:
    return {
        "type": "apns",
        "keyfile": str(keyfile),
        "key_id": "ABCDEFGHIJ",
        "team_id": "ABCDEFGHIJ",
        "topic": "com.example.ios",
        **extra,
    }


def _gateway_with_apps(apps: dict[str, object]) -> object:
    return load_gateway(data={"plugins": {"enabled": ["sample"], "sample": {"apps": apps}}})


def _self_signed(key: ec.EllipticCurvePrivateKey | None = None) -> tuple[bytes, bytes]:
    key = key or ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "com.example.ios")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_valid_credentials_load(sample_plugin_installed: str, tmp_path: Path) -> None:
    p8 = generate_apns_auth_key().write_p8(tmp_path / "AuthKey.p8")
    cert, key = _self_signed()
    (tmp_path / "apns.pem").write_bytes(cert + key)
    make_service_account("example-project", "http://127.0.0.1:9/token", tmp_path / "sa.json")
    gateway = _gateway_with_apps(
        {
            "token": _apns_app(p8),
            "cert": {"type": "apns", "certfile": str(tmp_path / "apns.pem")},
            "android": {"type": "fcm", "service_account_file": str(tmp_path / "sa.json")},
        }
    )
    assert len(gateway.apps) == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"not a key\n", "not a PEM private key (expected the .p8 file from Apple)"),
        (b"\x9e\x01\xff binary", "not a PEM private key (expected the .p8 file from Apple)"),
        (
            rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            "not an EC P-256 key (expected the .p8 file from Apple)",
        ),
        (
            ec.generate_private_key(ec.SECP256R1()).private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"pw"),
            ),
            "the key is encrypted (Apple's .p8 is not)",
        ),
    ],
)
def test_apns_key_that_does_not_load(
    sample_plugin_installed: str, tmp_path: Path, content: bytes, problem: str
) -> None:
    p8 = tmp_path / "AuthKey.p8"
    p8.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        _gateway_with_apps({"ios": _apns_app(p8)})
    assert str(err.value) == f"plugins.sample.apps.ios.keyfile: {problem}"


def test_truncated_apns_key(sample_plugin_installed: str, tmp_path: Path) -> None:
    pem = generate_apns_auth_key().private_key_pem
    p8 = tmp_path / "AuthKey.p8"
    p8.write_text(pem[: len(pem) // 2])
    with pytest.raises(ConfigError) as err:
        _gateway_with_apps({"ios": _apns_app(p8)})
    assert "plugins.sample.apps.ios.keyfile: not a PEM private key" in str(err.value)
    assert pem.splitlines()[1][:20] not in str(err.value)


def test_apns_certificate_that_does_not_load(sample_plugin_installed: str, tmp_path: Path) -> None:
    cert, key = _self_signed()
    _, other_key = _self_signed()
    cases = {
        b"junk": "no PEM certificate in the file",
        cert: "no PEM private key in the file (put the key after the certificate)",
        cert + other_key: "the private key does not match the certificate",
    }
    for content, problem in cases.items():
        (tmp_path / "apns.pem").write_bytes(content)
        with pytest.raises(ConfigError) as err:
            _gateway_with_apps({"ios": {"type": "apns", "certfile": str(tmp_path / "apns.pem")}})
        assert str(err.value) == f"plugins.sample.apps.ios.certfile: {problem}"
        assert key.decode().splitlines()[1] not in str(err.value)


def _account() -> dict[str, object]:
    return dict(make_service_account("example-project", "http://127.0.0.1:9/token"))


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"type": "service_account", "project_id": ', "not valid JSON (Expecting value"),
        ("{}", 'not a service account key (a JSON object with "type": "service_account"'),
        ('["service_account"]', "not a service account key"),
        (b"\xff\xfe junk", "not a JSON file (not UTF-8 text)"),
    ],
)
def test_fcm_service_account_that_does_not_load(
    sample_plugin_installed: str, tmp_path: Path, content: str | bytes, problem: str
) -> None:
    path = tmp_path / "sa.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ConfigError) as err:
        _gateway_with_apps({"android": {"type": "fcm", "service_account_file": str(path)}})
    assert str(err.value).startswith(f"plugins.sample.apps.android.service_account_file: {problem}")


def test_fcm_service_account_with_a_truncated_or_missing_key(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    info = _account()
    secret = str(info["private_key"])
    path = tmp_path / "sa.json"
    cases = [
        (
            {**info, "private_key": secret[: len(secret) // 2]},
            "the private_key does not load (not a PEM RSA key, or truncated)",
        ),
        ({k: v for k, v in info.items() if k != "client_email"}, "no client_email"),
        ({**info, "private_key": ""}, "no private_key"),
    ]
    for account, problem in cases:
        path.write_text(json.dumps(account))
        with pytest.raises(ConfigError) as err:
            _gateway_with_apps({"android": {"type": "fcm", "service_account_file": str(path)}})
        assert problem in str(err.value)
        assert "service_account_file" in str(err.value)
        assert secret.splitlines()[1] not in str(err.value)  # never key material


def test_fcm_project_id_is_required_somewhere(sample_plugin_installed: str, tmp_path: Path) -> None:
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({**_account(), "project_id": None}))
    app = {"type": "fcm", "service_account_file": str(path)}
    with pytest.raises(ConfigError) as err:
        _gateway_with_apps({"android": app})
    assert str(err.value) == (
        "plugins.sample.apps.android.project_id: not set, and the service account names none"
    )
    gateway = _gateway_with_apps({"android": {**app, "project_id": "p"}})
    assert gateway.apps  # type: ignore[attr-defined]


def test_fcm_send_url_placeholders_are_checked(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    make_service_account("p", "http://127.0.0.1:9/token", tmp_path / "sa.json")
    app = {"type": "fcm", "service_account_file": str(tmp_path / "sa.json")}
    with pytest.raises(ConfigError, match=r"apps\.android\.send_url: the only placeholder"):
        _gateway_with_apps({"android": {**app, "send_url": "http://h/{project}/send"}})


def test_ca_file_must_be_a_trust_store(sample_plugin_installed: str, tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("junk")
    with pytest.raises(ConfigError, match=r"^delivery\.ca_file: not a PEM trust store"):
        load_settings(data={"delivery": {"ca_file": str(tmp_path / "ca.pem")}})


def test_the_clients_use_the_same_loaders(tmp_path: Path) -> None:
    p8 = tmp_path / "AuthKey.p8"
    p8.write_text("not a key")
    apns = ApnsAppConfig.model_validate(_apns_app(p8))
    with pytest.raises(CredentialError, match="keyfile: not a PEM private key"):
        ApnsClient("ios", apns)
    (tmp_path / "sa.json").write_text("{}")
    fcm = FcmAppConfig(service_account_file=tmp_path / "sa.json")
    with pytest.raises(CredentialError, match="service_account_file: not a service account"):
        FcmClient("android", fcm)


# --- store.url -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("not a url", "not a database URL"),
        ("mysql://x/y", "unsupported database driver 'mysql'"),
        ("postgresql://u:TopSecret@h/db", "unsupported database driver 'postgresql'"),
        ("sqlite:///var/x.db", "unsupported database driver 'sqlite'"),
    ],
)
def test_store_url_must_be_a_supported_async_driver(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(data={"store": {"url": url}})
    message = str(err.value)
    assert message.startswith(f"store.url: {problem}")
    assert "sqlite+aiosqlite:///PATH or postgresql+asyncpg://" in message
    assert "TopSecret" not in message


@pytest.mark.parametrize(
    "url",
    [
        "sqlite+aiosqlite:///var/pushgw.db",
        "sqlite+aiosqlite://",
        "postgresql+asyncpg://pushgw:pw@db.internal:5432/pushgw",
    ],
)
def test_store_url_supported(url: str) -> None:
    assert load_settings(data={"store": {"url": url}}).store.url == url


PG = "postgresql+asyncpg://postgres@127.0.0.1/test"
PG_ACCEPTS = (
    "postgresql+asyncpg accepts: command_timeout, gsslib, host, krbsrvname, passfile, port, "
    "prepared_statement_cache_size, ssl, target_session_attrs"
)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            f"{PG}?sslmode=require",
            f"unknown query parameter 'sslmode' (asyncpg's name for it is ssl); {PG_ACCEPTS}",
        ),
        (
            f"{PG}?application_name=pushgw",
            f"unknown query parameter 'application_name'; {PG_ACCEPTS}",
        ),
        (f"{PG}?timeout=10", f"unknown query parameter 'timeout'; {PG_ACCEPTS}"),
        (
            "sqlite+aiosqlite:///var/x.db?timeout=5",
            "unknown query parameter 'timeout'; sqlite+aiosqlite accepts none",
        ),
        (
            f"{PG}?ssl=true",
            "query parameter ssl: expected disable, allow, prefer, require, verify-ca "
            "or verify-full",
        ),
        (f"{PG}?ssl=require&ssl=disable", "query parameter ssl: given more than once"),
        (
            f"{PG}?target_session_attrs=master",
            "query parameter target_session_attrs: expected any, primary, standby, "
            "prefer-standby, read-write or read-only",
        ),
        (
            f"{PG}?command_timeout=soon",
            "query parameter command_timeout: expected a number of seconds greater than 0",
        ),
        (
            f"{PG}?command_timeout=0",
            "query parameter command_timeout: expected a number of seconds greater than 0",
        ),
        (
            f"{PG}?prepared_statement_cache_size=-1",
            "query parameter prepared_statement_cache_size: expected a whole number, 0 or more",
        ),
        (f"{PG}?gsslib=krb5", "query parameter gsslib: expected gssapi or sspi"),
        # ports: in the URL and in its host and port query parameters
        (
            "postgresql+asyncpg://postgres@127.0.0.1:99999/test",
            "port 99999 is out of range (0-65535)",
        ),
        ("postgresql+asyncpg://postgres@127.0.0.1:-1/test", "port -1 is out of range (0-65535)"),
        (f"{PG}?host=db:70000", "query parameter host: port 70000 is out of range (0-65535)"),
        (
            f"{PG}?host=db1:5432&host=db2:65536",
            "query parameter host: port 65536 is out of range (0-65535)",
        ),
        (
            f"{PG}?host=db1,db2&port=5432,99999",
            "query parameter port: port 99999 is out of range (0-65535)",
        ),
        (f"{PG}?port=pg", "query parameter port: expected port numbers (0-65535), comma-separated"),
        (f"{PG}?host=db:pg", "query parameter host: expected HOST or HOST:PORT, comma-separated"),
        (
            f"{PG}?host=::1&host=db",
            "query parameter host: expected HOST or HOST:PORT where host is repeated",
        ),
        # a password with an unencoded "@": never any part of it in the message
        (
            "postgresql+asyncpg://postgres:TopS@cret@127.0.0.1/test",
            "more than one '@' after the user name: write an '@' in the password as %40",
        ),
        (
            "postgresql+asyncpg://postgres:Top@Se?cret@127.0.0.1/test",
            "more than one '@' after the user name: write an '@' in the password as %40",
        ),
    ],
)
def test_store_url_query_parameters_and_ports_are_checked(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(data={"store": {"url": url}})
    assert str(err.value) == f"store.url: {problem}"
    assert "cret" not in str(err.value)


@pytest.mark.parametrize(
    "url",
    [
        f"{PG}?ssl=require",
        f"{PG}?ssl=verify-full&command_timeout=2.5&prepared_statement_cache_size=0",
        f"{PG}?target_session_attrs=read-write&passfile=/run/secrets/pgpass",
        f"{PG}?krbsrvname=postgres&gsslib=gssapi",
        "postgresql+asyncpg://pushgw@/pushgw?host=/run/postgresql",
        "postgresql+asyncpg://pushgw@/pushgw?host=db1:5432&host=db2:5433",
        "postgresql+asyncpg://pushgw@/pushgw?host=db1,db2&port=5432,5433",
        "postgresql+asyncpg://pushgw@/pushgw?host=::1",
        "postgresql+asyncpg://pushgw@db:65535/pushgw",
        "postgresql+asyncpg://me@example.com:pw@db/pushgw",
        "postgresql+asyncpg://pushgw:p%40ss@db/pushgw",
    ],
)
def test_store_url_query_parameters_the_driver_takes(url: str) -> None:
    assert load_settings(data={"store": {"url": url}}).store.url == url


# --- environment overrides -----------------------------------------------------------------


def test_env_list_as_comma_separated_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__PLUGINS__ENABLED", "matrix, zulip")
    assert load_settings(data={}).plugins.enabled == ["matrix", "zulip"]
    monkeypatch.setenv("PUSHGW__PLUGINS__ENABLED", '["matrix"]')
    assert load_settings(data={}).plugins.enabled == ["matrix"]
    monkeypatch.setenv("PUSHGW__PLUGINS__ENABLED", "")
    assert load_settings(data={"plugins": {"enabled": ["zulip"]}}).plugins.enabled == []


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "PUSHGW__SERVER",
            "notjson",
            "PUSHGW__SERVER: expected a JSON object, "
            "or one variable per key (PUSHGW__SERVER__<KEY>)",
        ),
        (
            "PUSHGW__PLUGINS__ENABLED",
            '["matrix"',
            "PUSHGW__PLUGINS__ENABLED: not valid JSON (Expecting ',' delimiter at column 10)",
        ),
        ("PUSHGW__SERVR__PORT", "1", "PUSHGW__SERVR__PORT: unknown key 'servr'"),
        ("PUSHGW__SERVER__PROT", "1", "PUSHGW__SERVER__PROT: unknown key 'server.prot'"),
        (
            "PUSHGW__SERVER__PORT__X",
            "1",
            "PUSHGW__SERVER__PORT__X: 'server.port' takes a value, not keys",
        ),
        ("PUSHGW__", "1", "PUSHGW__: not a config key (PUSHGW__SECTION__KEY, joined by __)"),
    ],
)
def test_env_mistakes_name_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"port": 6000}})
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == message


def test_env_bad_value_is_reported_under_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "c.yaml", {"server": {"workers": 0}})
    monkeypatch.setenv("PUSHGW__SERVER__PORT", "abc")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value).splitlines() == [
        "PUSHGW__SERVER__PORT: Input should be a valid integer, unable to parse string as an "
        "integer",
        f"{path}: server.workers: Input should be greater than or equal to 1",
    ]
    monkeypatch.setenv("PUSHGW__SERVER", '{"port": "abc"}')
    monkeypatch.delenv("PUSHGW__SERVER__PORT")
    with pytest.raises(ConfigError, match=r"PUSHGW__SERVER: port: Input should be a valid integer"):
        load_settings(path)


def test_env_variables_that_overlap_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__SERVER", '{"port": 1}')
    monkeypatch.setenv("PUSHGW__SERVER__PORT", "2")
    with pytest.raises(ConfigError, match="PUSHGW__SERVER: conflicts with PUSHGW__SERVER__PORT"):
        load_settings(data={})


def test_env_names_are_case_insensitive_and_aliases_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("pushgw__logging__json", "true")
    monkeypatch.setenv("PUSHGW__STORE__AUTO_UPGRADE", "false")
    settings = load_settings(data={})
    assert settings.logging.json_format is True and settings.store.auto_upgrade is False


@pytest.mark.parametrize(
    ("written", "level"), [("info", "INFO"), (" Debug", "DEBUG"), ("warn", "WARNING")]
)
def test_log_level_in_any_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, level: str
) -> None:
    assert load_settings(data={"logging": {"level": written}}).logging.level == level
    monkeypatch.setenv("PUSHGW__LOGGING__LEVEL", written)
    assert load_settings(data={}).logging.level == level


def test_unknown_log_level_is_still_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__LOGGING__LEVEL", "verbose")
    with pytest.raises(ConfigError, match=r"PUSHGW__LOGGING__LEVEL: .*'DEBUG'"):
        load_settings(data={})


def test_env_secret_file_replaces_the_file_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "key").write_text("from-the-secret-file\n")
    path = write(tmp_path / "c.yaml", {"receipts": {"hmac_key": "from-yaml"}})
    monkeypatch.setenv("PUSHGW__RECEIPTS__HMAC_KEY_FILE", str(tmp_path / "key"))
    assert load_settings(path).receipts.hmac_key.get_secret_value() == "from-the-secret-file"
    monkeypatch.setenv("PUSHGW__RECEIPTS__HMAC_KEY_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == "PUSHGW__RECEIPTS__HMAC_KEY_FILE: file not found"


def test_env_in_plugin_sections(
    sample_plugin_installed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "c.yaml", {"plugins": {"enabled": ["sample"]}})
    monkeypatch.setenv("PUSHGW__PLUGINS__SAMPLE__GREETING", "hi")
    gateway = load_gateway(path)
    assert gateway.contexts["sample"].config.greeting == "hi"  # type: ignore[union-attr]
    monkeypatch.setenv("PUSHGW__PLUGINS__SAMPLE__GREETIN", "hi")
    with pytest.raises(ConfigError) as err:
        load_gateway(path)
    assert str(err.value) == (
        "PUSHGW__PLUGINS__SAMPLE__GREETIN: unknown key 'plugins.sample.greetin'"
    )
    monkeypatch.delenv("PUSHGW__PLUGINS__SAMPLE__GREETIN")
    monkeypatch.setenv("PUSHGW__PLUGINS__SAMPLE__APPS", "[1]")
    with pytest.raises(
        ConfigError, match=r"^PUSHGW__PLUGINS__SAMPLE__APPS: expected a JSON object"
    ):
        load_gateway(path)


def test_env_section_of_a_plugin_not_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__PLUGINS__MATRX__APPS", "{}")
    with pytest.raises(ConfigError) as err:
        load_gateway(data={})
    assert str(err.value) == (
        "PUSHGW__PLUGINS__MATRX__APPS: plugins.matrx: section for a plugin that is not enabled"
    )


def test_env_unknown_plugin_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUSHGW__PLUGINS__ENABLED", "nope")
    with pytest.raises(ConfigError, match=r"^PUSHGW__PLUGINS__ENABLED: unknown plugin 'nope'"):
        load_gateway(data={})


def test_env_list_in_a_plugin_section_accepts_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    class Section(ConfigModel):
        relays: list[str]

    monkeypatch.setenv("PUSHGW__PLUGINS__X__RELAYS", "wss://a, wss://b")
    settings = load_settings(data={})
    section = validate_plugin_section(settings, "x", Section)
    assert section.relays == ["wss://a", "wss://b"]  # type: ignore[attr-defined]


# --- secrets from files ------------------------------------------------------------------------


def test_binary_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xce\x9e\xff\x00binary")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == f"{path}: not a YAML file: not UTF-8 text (byte 2)"


@pytest.mark.parametrize(
    ("value", "content", "problem"),
    [
        ("key", b"", "the file is empty"),
        ("key", b"\n", "the file is empty"),
        ("key", b"\x9e\xd1\xbe binary", "the file is not UTF-8 text"),
        ("dir", None, "is a directory, not a file"),
        (["a"], None, "expected the path of a file"),
        (None, None, "expected the path of a file"),
        ("", None, "expected the path of a file"),
    ],
)
def test_secret_file_problems_name_the_key(
    tmp_path: Path, value: object, content: bytes | None, problem: str
) -> None:
    (tmp_path / "dir").mkdir()
    if content is not None:
        (tmp_path / "key").write_bytes(content)
    if isinstance(value, str) and value:
        value = str(tmp_path / value)
    path = write(tmp_path / "c.yaml", {"receipts": {"hmac_key_file": value}})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == f"{path}: receipts.hmac_key_file: {problem}"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_path_that_is_not_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    for name, kind in [("fifo", "a named pipe"), ("/dev/null", "a character device")]:
        where = tmp_path / name
        with pytest.raises(ConfigError) as err:
            load_settings(data={"delivery": {"ca_file": str(where)}})
        assert str(err.value) == f"delivery.ca_file: not a regular file ({kind})"
    # a secret file: /dev/null (the named pipe, which a read would wait on: test_config_cli)
    with pytest.raises(ConfigError) as err:
        load_settings(data={"receipts": {"hmac_key_file": "/dev/null"}})
    assert str(err.value) == "receipts.hmac_key_file: not a regular file (a character device)"


def test_secret_and_secret_file_together_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("k")
    receipts = {"hmac_key": "x", "hmac_key_file": str(tmp_path / "key")}
    path = write(tmp_path / "c.yaml", {"receipts": receipts})
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value) == (
        f"{path}: receipts.hmac_key_file: set hmac_key or hmac_key_file, not both"
    )


def test_empty_hmac_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^receipts\.hmac_key: must not be empty"):
        load_settings(data={"receipts": {"hmac_key": ""}})


def test_plugin_secret_files_follow_the_same_rules(tmp_path: Path) -> None:
    class Section(ConfigModel):
        password: SecretStr

    (tmp_path / "pw").write_bytes(b"")
    raw = {"plugins": {"x": {"password_file": str(tmp_path / "pw")}}}
    with pytest.raises(ConfigError) as err:
        validate_plugin_section(load_settings(data=raw), "x", Section)
    assert str(err.value) == "plugins.x.password_file: the file is empty"
    raw = {"plugins": {"x": {"password": "a", "password_file": str(tmp_path / "pw")}}}
    with pytest.raises(ConfigError, match="set password or password_file, not both"):
        validate_plugin_section(load_settings(data=raw), "x", Section)
