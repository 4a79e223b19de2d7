"""Config validation, in-memory limiters and caches, relay URL handling, the CLI commands."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.app import load_gateway
from gateway.config import ConfigError
from gateway.testing.apns_sim import generate_apns_auth_key
from plugins.marmot.config import MarmotConfig, normalize_relay_url, validate_relay_url
from plugins.marmot.keys import ServerKey, bech32_decode
from plugins.marmot.limits import DualRateLimiter, KeyedLimiter, LruSet, TtlLru
from plugins.marmot.relay import RelayClient, RelaySettings, relay_label, safe_text

NOW = 1_800_000_000
KEY = ServerKey.generate()


def section(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "server_secret_key": KEY.secret.hex(),
        "inbox_relays": ["wss://relay.example.org"],
        "apps": {"ios": {"type": "apns", "certfile": __file__}},
        "apns": {"app": "ios"},
    }
    base.update(kw)
    return base


# ---- config -----------------------------------------------------------------------------------


def test_defaults_follow_the_spec() -> None:
    c = MarmotConfig.model_validate(section())
    assert (c.max_age, c.max_future_skew, c.dedup_retention) == (3600, 300, 300)
    assert c.max_event_bytes == 262_144 and c.concurrency == 64 and not c.backfill_on_start
    assert (c.rate_limits.global_.per_minute, c.rate_limits.global_.per_hour) == (600, 30_000)
    assert c.rate_limits.encrypted_token.per_minute == 240
    assert c.rate_limits.device_token.per_hour == 5_000
    t = c.profiles.trigger_config()
    assert t.mip05_max_chunks == 100 and t.legacy_280 and t.marmot_push_max_chunks == 32
    assert c.server_key.pubkey_hex == KEY.pubkey_hex


def test_secret_key_from_file_as_nsec(tmp_path: Path) -> None:
    from plugins.marmot.keys import nsec_encode

    path = tmp_path / "nsec"
    path.write_text(nsec_encode(KEY.secret) + "\n")
    data = section()
    del data["server_secret_key"]
    data["server_secret_key_file"] = str(path)
    c = MarmotConfig.model_validate(data)
    assert c.server_key.pubkey_hex == KEY.pubkey_hex
    assert KEY.secret.hex() not in repr(c)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ({"server_secret_key": "zz"}, "neither 64 hex digits nor an nsec"),
        ({"inbox_relays": []}, "at least 1"),
        ({"inbox_relays": ["https://relay.example.org"]}, "ws:// or wss://"),
        ({"inbox_relays": ["wss://user:pw@relay.example.org"]}, "userinfo"),
        ({"inbox_relays": ["wss://relay.example.org/#frag"]}, "fragment"),
        ({"inbox_relays": ["wss:///path"]}, "no host"),
        ({"inbox_relays": ["wss://r.example/" + "a" * 600]}, "512"),
        ({"rate_limits": {"global": {"per_minute": 0, "per_hour": 1}}}, "greater than or equal"),
        ({"rate_limits": {"device_token": {"per_minute": 5, "per_hour": 0}}}, "greater than"),
        ({"profiles": {"marmot_push_v1": {"max_chunks": 33}}}, "less than or equal to 32"),
        ({"apns": {"app": "nope"}}, "no app 'nope'"),
        ({"fcm": {"app": "ios"}}, "not of type fcm"),
        ({"apns": {"app": None}}, "apns.app or fcm.app"),
        ({"surprise": 1}, "Extra inputs"),
    ],
)
def test_invalid_config(override: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError) as exc:
        MarmotConfig.model_validate(section(**override))
    assert problem in str(exc.value)
    assert KEY.secret.hex() not in str(exc.value)


def test_gateway_config_error_names_the_key(tmp_path: Path) -> None:
    data = {"plugins": {"enabled": ["marmot"], "marmot": section(inbox_relays=["http://x"])}}
    with pytest.raises(ConfigError) as exc:
        load_gateway(data=data)
    assert "plugins.marmot.inbox_relays" in str(exc.value)


def test_relay_urls_deduplicated_and_normalized() -> None:
    c = MarmotConfig.model_validate(
        section(
            inbox_relays=["wss://Relay.Example.org:443/", "wss://relay.example.org", "ws://b:80"]
        )
    )
    assert c.inbox_relays == ["wss://Relay.Example.org:443/", "ws://b:80"]
    assert normalize_relay_url("WSS://Relay.Example.org:443/") == "wss://relay.example.org"
    assert normalize_relay_url("ws://h:8080/inbox/") == "ws://h:8080/inbox"
    assert validate_relay_url("wss://[::1]:7000") == "wss://[::1]:7000"


def test_relay_label_drops_path_and_query() -> None:
    assert relay_label("wss://Relay.example.org/secret-token?key=abc") == "wss://relay.example.org"
    assert relay_label("ws://127.0.0.1:7777/x") == "ws://127.0.0.1:7777"
    assert safe_text("a\nb\x00" + "x" * 500, 10) == "a\\nb\\x00xxxxxx"


# ---- relay subscription window -----------------------------------------------------------------


class _Sink:
    def on_event(self, *a: Any) -> None: ...
    def on_oversize(self, *a: Any) -> None: ...
    def on_malformed(self, *a: Any) -> None: ...
    def on_unrequested(self, *a: Any) -> None: ...
    def on_state(self, *a: Any) -> None: ...


def test_subscription_filters() -> None:
    client = RelayClient("ws://r", KEY, _Sink(), RelaySettings(), clock=lambda: NOW)
    first = client.subscription_filter()
    assert first == {"kinds": [1059], "#p": [KEY.pubkey_hex], "since": NOW - 172_800, "limit": 0}
    client.connects, client.disconnect_at = 1, NOW - 100.0
    assert client.subscription_filter() == {
        "kinds": [1059],
        "#p": [KEY.pubkey_hex],
        "since": NOW - 100 - 172_800 - 300,
    }
    client.disconnect_at = NOW - 10_000.0  # long outage: nothing older than max_age is fresh
    assert client.subscription_filter()["since"] == NOW - 3600 - 172_800 - 300
    backfill = RelayClient(
        "ws://r", KEY, _Sink(), RelaySettings(backfill_on_start=True), clock=lambda: NOW
    )
    assert backfill.subscription_filter() == {
        "kinds": [1059],
        "#p": [KEY.pubkey_hex],
        "since": NOW - 172_800 - 300,
    }


# ---- limiters and caches -------------------------------------------------------------------------


def test_dual_rate_limiter_minute_and_hour() -> None:
    t = [0.0]
    lim = KeyedLimiter(3, 5, 10, clock=lambda: t[0])
    assert [lim.allow("k") for _ in range(4)] == [True, True, True, False]
    t[0] += 20  # one minute-token back (one every 20 s)
    assert lim.allow("k") and not lim.allow("k")
    t[0] += 60
    assert lim.allow("k")  # fifth in the hour
    assert not lim.allow("k")  # the hourly budget (5) is spent although the minute one is not
    assert lim.allow("other")  # keys are independent
    with pytest.raises(ValueError):
        DualRateLimiter(0, 1)


def test_allow_each_is_allow_in_turn() -> None:
    keys = ["a", "b", "a", "a", "c", "a", "b"]
    one_by_one = KeyedLimiter(2, 5, 2, clock=lambda: 0.0)
    batched = KeyedLimiter(2, 5, 2, clock=lambda: 0.0)
    expected = [one_by_one.allow(k) for k in keys]
    assert batched.allow_each(keys) == expected
    assert expected.count(False) > 0  # the batch did hit the limit
    assert len(batched) == len(one_by_one) == 2  # and kept the LRU bound


def test_limiter_keys_are_bounded() -> None:
    lim = KeyedLimiter(1, 1, 3)
    for k in range(10):
        lim.allow(k)
    assert len(lim) == 3


def test_ttl_lru_fixed_lifetime_and_capacity() -> None:
    t = [0.0]
    d = TtlLru(3, 300, clock=lambda: t[0])
    assert d.check_and_add("a") and not d.check_and_add("a")
    t[0] = 299.9
    assert not d.check_and_add("a")  # a duplicate does not extend the lifetime...
    t[0] = 300.0
    assert d.check_and_add("a")  # ...which ends at exactly 300 s
    for k in "bcd":
        d.check_and_add(k)
    assert len(d) == 3 and d.check_and_add("a")  # full of live entries: the oldest went


def test_lru_set() -> None:
    s = LruSet(2)
    s.add("a")
    s.add("b")
    s.add("a")
    s.add("c")
    assert "a" in s and "c" in s and "b" not in s


# ---- CLI --------------------------------------------------------------------------------------


def _pushgw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_keygen_prints_a_valid_pair() -> None:
    result = _pushgw("marmot", "keygen", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    key = ServerKey(bytes.fromhex(data["secret_key_hex"]))
    assert data["pubkey_hex"] == key.pubkey_hex and data["npub"] == key.npub
    assert bech32_decode(data["nsec"]) == ("nsec", key.secret)


def test_keygen_secret_file_and_pubkey(tmp_path: Path) -> None:
    secret = tmp_path / "marmot.key"
    result = _pushgw("marmot", "keygen", "--secret-file", str(secret))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    key = ServerKey.parse(secret.read_text())
    assert key.npub in result.stdout and key.secret.hex() not in result.stdout
    assert "nsec" not in result.stdout
    again = _pushgw("marmot", "keygen", "--secret-file", str(secret))
    assert again.returncode == 2 and again.stdout == ""  # no overwrite, no traceback
    assert again.stderr == f"pushgw marmot: --secret-file {secret}: exists; not overwritten\n"
    assert ServerKey.parse(secret.read_text()).secret == key.secret
    marmot = section()
    del marmot["server_secret_key"]
    marmot["server_secret_key_file"] = str(secret)
    auth = generate_apns_auth_key()  # the config is loaded whole, credentials included
    marmot["apps"] = {
        "ios": {
            "type": "apns",
            "keyfile": str(auth.write_p8(tmp_path / "AuthKey.p8")),
            "key_id": auth.key_id,
            "team_id": auth.team_id,
            "topic": "org.example.app",
        }
    }
    config = tmp_path / "pushgw.yaml"
    config.write_text(json.dumps({"plugins": {"enabled": ["marmot"], "marmot": marmot}}))
    shown = _pushgw("marmot", "pubkey", "--config", str(config), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"npub": key.npub, "pubkey_hex": key.pubkey_hex}


def test_pubkey_without_the_plugin_is_one_line_on_stderr(tmp_path: Path) -> None:
    config = tmp_path / "pushgw.yaml"
    config.write_text(json.dumps({"plugins": {"enabled": []}}))
    result = _pushgw("marmot", "pubkey", "--config", str(config))
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr == "pushgw marmot: the marmot plugin is not enabled in this configuration\n"
    )
