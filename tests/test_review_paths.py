"""Paths in pushgw.yaml: `~` means the home directory in every path option, and a `~user`
that names no user is a configuration error naming the key, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.engine import make_url

from gateway.app import load_gateway
from gateway.cli import main
from gateway.config import ConfigError, load_settings
from gateway.core.store import Store
from tests.conftest import offline_apns_app

NO_USER = "~pushgw-no-such-user"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of its own, and a working directory that is not it (a literal `~`
    made by mistake would show up there)."""
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for name in [n for n in os.environ if n.upper().startswith("PUSHGW")]:
        monkeypatch.delenv(name)
    return home


def test_receipts_directory_expands_the_home_directory(home: Path) -> None:
    settings = load_settings(data={"receipts": {"directory": "~/receipts"}})
    assert settings.receipts.directory == home / "receipts"


def test_receipts_directory_from_the_environment_expands_too(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PUSHGW__RECEIPTS__DIRECTORY", "~/r")
    assert load_settings(data={}).receipts.directory == home / "r"


async def test_sqlite_store_url_under_the_home_directory(home: Path) -> None:
    settings = load_settings(data={"store": {"url": "sqlite+aiosqlite:///~/db/pushgw.db"}})
    assert make_url(settings.store.url).database == str(home / "db" / "pushgw.db")
    store = Store(settings.store.url)
    try:
        async with store.engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await store.engine.dispose()
    assert (home / "db" / "pushgw.db").is_file()
    assert not Path("~").exists()  # no literal `~` directory in the working directory


@pytest.mark.parametrize(
    "url",
    [
        "sqlite+aiosqlite:////abs/dir/pushgw.db",
        "sqlite+aiosqlite:///var/pushgw.db",
        "sqlite+aiosqlite:///:memory:",
        "sqlite+aiosqlite://",
        "sqlite+aiosqlite:///file:pushgw.db",
        "postgresql+asyncpg://pushgw@db/~pushgw",  # a database name, not a path
    ],
)
def test_other_store_urls_are_kept_as_written(home: Path, url: str) -> None:
    assert load_settings(data={"store": {"url": url}}).store.url == url


def test_sqlite_store_url_keeps_escapes(home: Path) -> None:
    url = load_settings(data={"store": {"url": "sqlite+aiosqlite:///~/a%3Fb%20c.db"}}).store.url
    assert make_url(url).database == str(home / "a?b c.db")


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"receipts": {"directory": f"{NO_USER}/receipts"}}, "receipts.directory"),
        ({"store": {"url": f"sqlite+aiosqlite:///{NO_USER}/x.db"}}, "store.url"),
        ({"receipts": {"hmac_key_file": f"{NO_USER}/key"}}, "receipts.hmac_key_file"),
        ({"delivery": {"ca_file": f"{NO_USER}/ca.pem"}}, "delivery.ca_file"),
    ],
)
def test_a_home_of_no_user_is_a_config_error(home: Path, data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(data=data)
    message = str(caught.value)
    assert message.startswith(f"{key}: ") and NO_USER in message
    assert not Path(NO_USER).exists()


@pytest.mark.parametrize("key", ["keyfile", "certfile"])
def test_a_credential_in_the_home_of_no_user_is_a_config_error(
    home: Path, tmp_path: Path, key: str
) -> None:
    """Was pathlib's RuntimeError ("Could not determine home directory"): a traceback."""
    app = offline_apns_app(tmp_path)
    if key == "certfile":  # certificate auth, the topic read from the certificate
        for name in ("keyfile", "key_id", "team_id", "topic"):
            app.pop(name)
    app[key] = f"{NO_USER}/credential.pem"
    data = {"plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}}}
    with pytest.raises(ConfigError) as caught:
        load_gateway(data=data)
    assert f"plugins.matrix.apps.com.example.ios: {key}: " in str(caught.value)
    assert NO_USER in str(caught.value)


def _zulip_config(tmp_path: Path, keys_file: str) -> Path:
    """A pushgw.yaml enabling zulip with `bouncer_keys_file` as given."""
    config = tmp_path / "pushgw.yaml"
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
        "plugins": {"enabled": ["zulip"], "zulip": {"bouncer_keys_file": keys_file}},
    }
    config.write_text(yaml.safe_dump(data))
    return config


def test_zulip_keys_file_in_the_home_of_no_user(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _zulip_config(tmp_path, f"{NO_USER}/k.json")
    assert main(["-c", str(config), "zulip", "keys", "generate"]) == 2
    err = capsys.readouterr().err
    assert "plugins.zulip.bouncer_keys_file: " in err and NO_USER in err
    assert err.count("\n") == 1


def test_zulip_keys_file_under_the_home_directory(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _zulip_config(tmp_path, "~/keys.json")
    assert main(["-c", str(config), "zulip", "keys", "generate"]) == 0
    public = capsys.readouterr().out.strip()
    assert public in (home / "keys.json").read_text()
