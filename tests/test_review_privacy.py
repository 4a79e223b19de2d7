"""Privacy review: what a handler without pushgw's formatter prints never holds a token.

`gateway.logs`' formatters withhold exception messages, but not every handler is
theirs: CLI commands configure no logging, so logging's last resort prints a record's
traceback *with* its message to stderr, and an operator embedding the gateway (or the
test suite's caplog) formats records with a plain `logging.Formatter`.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.app import load_gateway
from gateway.config import ConfigError
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, ProviderKind
from gateway.core.tokens import TokenInvalidation
from plugins.zulip.bouncer import forget_token
from plugins.zulip.crypto import generate_bouncer_key
from plugins.zulip.repo import token_key
from tests.conftest import SAMPLE_PLUGIN_DIR, install_plugin_dist, offline_apns_app

ROOT = Path(__file__).resolve().parent.parent


def plain_text(records: list[logging.LogRecord]) -> str:
    """The records as logging's last resort (or any default handler) prints them."""
    formatter = logging.Formatter()
    return "\n".join(formatter.format(r) for r in records)


async def test_a_failing_token_invalid_hook_does_not_log_the_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, register_secret: Any
) -> None:
    token = secrets.token_hex(32)
    register_secret(token)
    # The zulip plugin's hook on a database that fails it (here: no zulip tables; in
    # production a locked SQLite file, a dropped PostgreSQL connection): SQLAlchemy's
    # error quotes the statement's parameters, here the token's unkeyed SHA-256
    # (`token_key`); a plugin whose statement names the token quotes the token itself.
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")

    async def zulip_hook(invalid: InvalidToken) -> None:
        assert invalid.token is not None
        await forget_token(engine, invalid.token, apns=True)

    caplog.set_level(logging.ERROR, logger="gateway.core.tokens")
    try:
        invalidation = TokenInvalidation(None, Metrics(), zulip_hook)
        invalid = InvalidToken("zulip", "ios", "0" * 64, token, ProviderKind.APNS, "Unregistered")
        outcome = await invalidation.handle(invalid)
    finally:
        await engine.dispose()
    assert outcome.handled and outcome.hook_error is not None
    key = token_key(token, apns=True)
    register_secret(key)
    assert token not in outcome.hook_error and key not in outcome.hook_error
    records = [r for r in caplog.records if r.name == "gateway.core.tokens"]
    text = plain_text(records)
    assert "token-invalid hook of plugin zulip failed" in text
    assert token not in text
    assert key not in text


@pytest.mark.parametrize("dropped", ["sample_invalid", "pushgw_invalid_tokens"])
def test_tokens_retire_prints_no_exception_message_of_a_failing_hook(
    tmp_path: Path, dropped: str
) -> None:
    """`pushgw tokens retire` as operators run it (a subprocess: no pytest handlers, so
    logging's last resort prints the records): one line per token not retired, never the
    hook's exception with its SQL parameters."""
    site = tmp_path / "site"
    install_plugin_dist(site, "sample")
    app = offline_apns_app(tmp_path)
    db = tmp_path / "db.sqlite"
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"sqlite+aiosqlite:///{db}"},
                "receipts": {"directory": str(tmp_path / "receipts")},
                "plugins": {"enabled": ["sample"], "sample": {"apps": {"ios": app}}},
            }
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(SAMPLE_PLUGIN_DIR), str(ROOT)]),
    }
    cli = [sys.executable, "-m", "gateway.cli"]
    upgraded = subprocess.run(
        [*cli, "db", "upgrade", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    with sqlite3.connect(db) as conn:
        # the sample plugin's hook fails, or recording the hash does
        conn.execute(f"DROP TABLE {dropped}")
    token_hash = secrets.token_hex(32)
    dead = tmp_path / "dead.jsonl"
    dead.write_text(
        '{"plugin":"sample","app_id":"ios","provider":"apns","token_hash":"'
        + token_hash
        + '","reason":"Unregistered","failures":2,"last_seen":1735772400.5}\n'
    )
    result = subprocess.run(
        [*cli, "tokens", "retire", str(dead), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    # The hook's parameters are the hash here; the zulip plugin's are device tokens.
    assert "[parameters:" not in result.stderr
    assert token_hash not in result.stderr
    assert "Traceback" not in result.stderr
    if dropped == "sample_invalid":
        assert "not retired: the sample plugin's token-invalid hook failed" in result.stderr
    else:  # logged with its exception: one line, the kind of error only
        expected = "pushgw: error: could not record an invalid token for plugin sample"
        assert f"{expected} (OperationalError)" in result.stderr


@pytest.mark.parametrize("value", [None, 42, ["x"]])
def test_a_bouncer_key_entry_that_is_not_a_string_is_not_named_by_its_map_key(
    tmp_path: Path, value: Any
) -> None:
    # A map written {private: } (the private half pasted as the key): the map key is a
    # secret, and config errors reach `check-config`, the server's stderr and the CLI.
    _, private = generate_bouncer_key()
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "plugins": {"enabled": ["zulip"], "zulip": {"bouncer_keys": {private: value}}},
    }
    with pytest.raises(ConfigError) as caught:
        load_gateway(data=data)
    assert private not in str(caught.value)
    assert "bouncer_keys: bouncer key 1 of 1: private key is not a string" in str(caught.value)
