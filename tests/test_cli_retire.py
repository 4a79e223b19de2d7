"""`pushgw tokens retire FILE`: a bad file retires nothing, and what is reported happened."""

from __future__ import annotations

import json
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as pushgw
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, ProviderKind
from gateway.core.store import Store
from gateway.core.tokens import TokenInvalidation
from tests.conftest import offline_apns_app

GOOD = "ab" * 32
OTHER = "cd" * 32


def record(**fields: Any) -> str:
    base = {
        "plugin": "sample",
        "app_id": "ios",
        "provider": "apns",
        "token_hash": GOOD,
        "reason": "Unregistered",
        "failures": 2,
        "last_seen": 1735772400.123456,
    }
    return json.dumps({**base, **fields})


@pytest.fixture
def config(tmp_path: Path, sample_plugin_installed: str) -> Path:
    """The sample plugin with one configured app (`ios`), SQLite at tmp_path/db.sqlite."""
    app = offline_apns_app(tmp_path)
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {"enabled": [sample_plugin_installed], "sample": {"apps": {"ios": app}}},
    }
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def retire(
    capsys: pytest.CaptureFixture[str], file: Path, config: Path | None
) -> tuple[int, str, str]:
    argv = ["tokens", "retire", str(file)]
    status = pushgw([*argv, "--config", str(config)] if config else argv)
    out, err = capsys.readouterr()
    return status, out, err


def rows(db: Path, table: str) -> list[tuple[Any, ...]]:
    return sqlite3.connect(db).execute(f"SELECT token_hash, reason FROM {table}").fetchall()


BAD_LINES: list[Any] = [
    (record(token_hash=OTHER, provider="bogus"), 'provider: must be "apns", "fcm" or null'),
    ("[1,2]", "not a dead-token record (a JSON list, not an object)"),
    ("{not json", "not a dead-token record (not JSON"),
    (record(token_hash="bbbb"), "token_hash: must be 64 lowercase hex characters"),
    (record(token_hash=""), "token_hash: must be a non-empty string (empty)"),
    (record(token_hash=GOOD.upper()), "token_hash: must be 64 lowercase hex characters"),
    (record(token_hash=7), "token_hash: must be a non-empty string (a number)"),
    (json.dumps({"app_id": "ios", "token_hash": OTHER}), "plugin: must be a non-empty string"),
    (record(provider=["apns"]), 'provider: must be "apns", "fcm" or null, not ["apns"]'),
    pytest.param("[" * 100_000, "not a dead-token record (JSON nested too deeply)", id="deep"),
    (record(reason=42), "reason: must be a string or null (a number)"),
    # printed one line each, stored (PostgreSQL refuses NUL), handed to plugins
    (record(app_id="x\npushgw: retired 99 tokens"), "app_id: must not hold control characters"),
    (record(plugin="sam\tple"), "plugin: must not hold control characters"),
    (record(reason="Unregistered\u0000x"), "reason: must not hold control characters"),
    (record(failures="2"), "failures: must be a whole number"),
    (record(last_seen=True), "last_seen: must be a number"),
]


@pytest.mark.parametrize(("bad", "problem"), BAD_LINES)
def test_a_bad_line_retires_nothing(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str], bad: str, problem: str
) -> None:
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n" + bad + "\n")  # line 1 is valid: not applied either
    status, out, err = retire(capsys, dead, config)
    assert status == 2
    assert err.startswith(f"pushgw: error: {dead}:2: {problem}"), err
    assert err.endswith("; nothing was retired\n") and err.count("\n") == 1
    assert out == ""
    assert not (tmp_path / "db.sqlite").exists()  # checked before the database is opened


def test_a_binary_file_retires_nothing(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = tmp_path / "dead.jsonl"
    dead.write_bytes(record().encode() + b"\n\xff\xfe\x00garbage\n\x80\n")
    status, _, err = retire(capsys, dead, config)
    assert status == 2
    assert (
        err == f"pushgw: error: {dead}:2: not UTF-8 text (1 more bad line); nothing was retired\n"
    )
    assert not (tmp_path / "db.sqlite").exists()


def test_a_bad_token_hash_is_not_echoed(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    device_token = "f00dfeed" * 3  # a device token in clear where a hash belongs
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record(token_hash=device_token) + "\n")
    status, _, err = retire(capsys, dead, config)
    assert status == 2 and "(got 24 characters)" in err
    assert device_token not in err


def test_retires_and_reports_skipped_apps_and_plugins(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = tmp_path / "dead.jsonl"
    dead.write_text(
        "\n".join(
            [
                record(),
                record(reason="again"),  # the same token twice: applied once
                record(app_id="no.such.app", token_hash=OTHER),
                record(plugin="other", app_id="x", token_hash=OTHER, provider=None),
                "",
            ]
        )
    )
    status, out, err = retire(capsys, dead, config)
    assert status == 0, err
    db = tmp_path / "db.sqlite"
    assert out == (
        f"retired 1 token in sqlite+aiosqlite:///{db}; skipped 1 of plugins not enabled, "
        "1 of apps not configured, 1 duplicate lines\n"
    )
    assert (
        "pushgw: skipped 1 token of app sample/no.such.app: not an app of this configuration" in err
    )
    assert "pushgw: skipped 1 token of plugin other: not enabled in this configuration" in err
    assert rows(db, "sample_invalid") == [(GOOD, "Unregistered")]
    assert rows(db, "pushgw_invalid_tokens") == [(GOOD, "Unregistered")]


def test_a_long_reason_is_recorded_cut_to_its_column(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = "SomeProviderReason" * 5  # provider reasons are passed through as sent
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record(reason=reason) + "\n")
    status, _, err = retire(capsys, dead, config)
    assert status == 0, err
    db = tmp_path / "db.sqlite"
    assert rows(db, "pushgw_invalid_tokens") == [(GOOD, reason[:64])]
    assert rows(db, "sample_invalid") == [(GOOD, reason)]  # the plugin is told all of it


def _migrated(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pushgw(["db", "upgrade", "--config", str(config)]) == 0
    capsys.readouterr()


def test_a_failing_plugin_hook_is_reported_and_exits_1(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _migrated(config, capsys)
    db = tmp_path / "db.sqlite"
    sqlite3.connect(db).execute("DROP TABLE sample_invalid")  # the plugin's hook will fail
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n")
    status, out, err = retire(capsys, dead, config)
    assert status == 1
    assert err == (
        f"pushgw: {dead}:1: not retired: the sample plugin's token-invalid hook failed "
        "(OperationalError: no such table: sample_invalid); the hash was recorded\n"
    )
    assert out.startswith("retired 0 tokens in ") and out.endswith("; 1 not retired (see above)\n")
    assert rows(db, "pushgw_invalid_tokens") == [(GOOD, "Unregistered")]


def test_a_failing_record_is_reported_and_exits_1(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _migrated(config, capsys)
    db = tmp_path / "db.sqlite"
    sqlite3.connect(db).execute("DROP TABLE pushgw_invalid_tokens")
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n")
    status, out, err = retire(capsys, dead, config)
    assert status == 1
    assert err == (
        f"pushgw: {dead}:1: not retired: hash not recorded (OperationalError: no such table: "
        "pushgw_invalid_tokens); the sample plugin's token-invalid hook ran\n"
    )
    assert "retired 0 tokens" in out and "1 not retired" in out


def test_an_unmigrated_database_retires_nothing(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(config.read_text())
    data["store"]["auto_upgrade"] = False
    config.write_text(yaml.safe_dump(data))
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n")
    status, out, err = retire(capsys, dead, config)
    assert status == 1 and out == ""
    db = tmp_path / "db.sqlite"
    assert err == (
        f"pushgw: error: database sqlite+aiosqlite:///{db}: not migrated (core_0001, "
        "core_0002, sample_0001 pending) and store.auto_upgrade is false: run `pushgw db upgrade`\n"
    )
    tables = sqlite3.connect(db).execute("SELECT name FROM sqlite_master").fetchall()
    assert tables == []


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port where connections are refused: bound, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("command", ["db-upgrade", "retire"])
def test_an_unreachable_database_is_one_line_without_the_password(
    tmp_path: Path,
    config: Path,
    capsys: pytest.CaptureFixture[str],
    refused_port: int,
    command: str,
) -> None:
    data = yaml.safe_load(config.read_text())
    data["store"]["url"] = f"postgresql+asyncpg://u:S3cretPw@127.0.0.1:{refused_port}/x"
    config.write_text(yaml.safe_dump(data))
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n")
    if command == "retire":
        status, out, err = retire(capsys, dead, config)
    else:
        status = pushgw(["db", "upgrade", "--config", str(config)])
        out, err = capsys.readouterr()
    assert status == 1 and out == ""
    assert err.startswith(
        f"pushgw: error: database postgresql+asyncpg://u:***@127.0.0.1:{refused_port}/x: "
        "ConnectionRefusedError: "
    )
    assert err.count("\n") == 1 and "S3cretPw" not in err


@pytest.mark.parametrize("url", ["not a url", "sqlite:///x.db", "mysql://u@h/x"])
def test_an_unusable_store_url_is_a_config_error(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    data = yaml.safe_load(config.read_text())
    data["store"]["url"] = url
    config.write_text(yaml.safe_dump(data))
    status = pushgw(["db", "upgrade", "--config", str(config)])
    _, err = capsys.readouterr()
    assert status == 2
    assert err.startswith(f"pushgw: config error: {config}: store.url: ")
    assert err.count("\n") == 1


def test_without_a_config_nothing_is_created_and_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PUSHGW_CONFIG", raising=False)
    dead = tmp_path / "dead.jsonl"
    dead.write_text(record() + "\n")
    status, out, err = retire(capsys, dead, None)
    assert status == 0
    assert "pushgw: no --config or $PUSHGW_CONFIG: using the built-in defaults" in err
    assert "skipped 1 token of plugin sample: not enabled" in err
    assert out == (
        "retired 0 tokens (nothing to apply: database not opened); "
        "skipped 1 of plugins not enabled\n"
    )
    assert not (tmp_path / "var").exists()


def test_db_upgrade_without_a_config_names_the_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PUSHGW_CONFIG", raising=False)
    assert pushgw(["db", "upgrade"]) == 0
    out, err = capsys.readouterr()
    assert "pushgw: no --config or $PUSHGW_CONFIG: using the built-in defaults" in err
    assert out == "database at head (sqlite): sqlite+aiosqlite:///var/pushgw.db\n"
    assert (tmp_path / "var" / "pushgw.db").exists()


def test_the_no_config_note_names_environment_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PUSHGW_CONFIG", raising=False)
    monkeypatch.setenv("PUSHGW__STORE__URL", f"sqlite+aiosqlite:///{tmp_path / 'env.db'}")
    assert pushgw(["db", "upgrade"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        "pushgw: no --config or $PUSHGW_CONFIG: "
        "using the built-in defaults and PUSHGW__ environment overrides\n"
    )
    assert out == f"database at head (sqlite): sqlite+aiosqlite:///{tmp_path / 'env.db'}\n"
    assert (tmp_path / "env.db").exists() and not (tmp_path / "var").exists()


# --- the outcomes the CLI reports, from the one invalidation path ---------------------


async def test_outcomes_say_what_failed_and_live_reporting_still_goes_on(tmp_path: Path) -> None:
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")  # never migrated: no table
    told: list[InvalidToken] = []

    async def failing_hook(invalid: InvalidToken) -> None:
        told.append(invalid)
        raise RuntimeError("plugin bug")

    try:
        invalidation = TokenInvalidation(store, Metrics(), failing_hook)
        invalid = InvalidToken("p", "a", GOOD, "device-token", ProviderKind.APNS, "Unregistered")
        outcome = await invalidation.handle(invalid)
        assert outcome.handled and not outcome.complete
        assert outcome.record_error == ("OperationalError: no such table: pushgw_invalid_tokens")
        assert outcome.hook_error == "RuntimeError: plugin bug"
        assert "device-token" not in f"{outcome.record_error} {outcome.hook_error}"
        assert len(told) == 1  # the hook ran although the record failed
        # the live path: the same failures neither raise nor stop delivery
        other = InvalidToken("p", "a", OTHER, "device-token-2", ProviderKind.APNS, None)
        assert await invalidation.report(other) is True
        assert len(told) == 2
        assert not (await invalidation.handle(invalid)).handled  # handled recently
    finally:
        await store.close()
