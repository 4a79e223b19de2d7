"""Review from the seat of the engineer who owns an operator's Apple credentials."""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.app import load_gateway, running_core
from gateway.config import ApnsAppConfig
from gateway.core.apns import ApnsClient, _ProviderToken
from gateway.core.classify import CONFIG_REASONS
from gateway.core.push import Outcome, Push, Reason
from gateway.testing import ApnsSimulator, generate_apns_auth_key
from gateway.testing.harness import base_config
from tests.conftest import offline_apns_app


def _certificate_bundle(path: Path, *, valid_for: datetime.timedelta) -> datetime.datetime:
    """A push certificate and its key (PEM, one file) expiring `valid_for` from now;
    returns its notAfter (whole seconds, as the certificate keeps it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Apple Push Services: com.ex")])
    now = datetime.datetime.now(datetime.UTC)
    not_after = (now + valid_for).replace(microsecond=0)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(min(now, not_after) - datetime.timedelta(days=365))
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return not_after


def _apps(tmp_path: Path) -> tuple[dict[str, object], dict[str, datetime.datetime]]:
    expiries = {
        "expired": _certificate_bundle(
            tmp_path / "expired.pem", valid_for=-datetime.timedelta(days=2)
        ),
        "soon": _certificate_bundle(
            tmp_path / "soon.pem", valid_for=datetime.timedelta(days=10, hours=12)
        ),
        "fresh": _certificate_bundle(
            tmp_path / "fresh.pem", valid_for=datetime.timedelta(days=300)
        ),
    }
    apps: dict[str, object] = {
        name: {"type": "apns", "certfile": str(tmp_path / f"{name}.pem")} for name in expiries
    }
    apps["token"] = offline_apns_app(tmp_path)
    return apps, expiries


def test_an_expired_or_expiring_apns_certificate_is_warned_of_at_load(
    sample_plugin_installed: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An expired push certificate loaded without a word: APNs then refused every TLS
    handshake, which read as `connection_error` and an open circuit breaker ("check DNS,
    firewall, proxy"). One nearing expiry was not mentioned anywhere either."""
    apps, expiries = _apps(tmp_path)
    caplog.set_level(logging.WARNING)
    gateway = load_gateway(data={"plugins": {"enabled": ["sample"], "sample": {"apps": apps}}})
    assert len(gateway.apps) == 4  # a warning, not an error: the other apps start
    lines = [r.getMessage() for r in caplog.records if "APNs certificate" in r.getMessage()]
    expired_on = expiries["expired"].strftime("%Y-%m-%d %H:%M UTC")
    soon_on = expiries["soon"].strftime("%Y-%m-%d %H:%M UTC")
    assert lines == [
        f"app sample/expired: its APNs certificate (certfile) expired on {expired_on}: APNs "
        "refuses its connections, every push of the app ends certificate_expired; renew the "
        "certificate in the Apple developer account, replace the file and restart",
        f"app sample/soon: its APNs certificate (certfile) expires on {soon_on}, in 10 day(s); "
        "renew it in the Apple developer account, replace the file and restart before then",
    ]
    assert "PRIVATE KEY" not in caplog.text


async def test_the_apns_certificate_expiry_is_a_metric(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    """Nothing exported when a push certificate expires: no alert could fire before it did."""
    apps, expiries = _apps(tmp_path)
    gateway = load_gateway(data=base_config(tmp_path, {"sample": {"apps": apps}}))
    registry = gateway.runtime.metrics.registry
    name = "pushgw_apns_certificate_expiry_timestamp_seconds"
    async with running_core(gateway):
        for app_id, not_after in expiries.items():
            labels = {"plugin": "sample", "app": app_id}
            assert registry.get_sample_value(name, labels) == not_after.timestamp()
        assert registry.get_sample_value(name, {"plugin": "sample", "app": "token"}) is None


@pytest.mark.parametrize("expired", [True, False])
async def test_the_pushes_of_an_expired_apns_certificate_end_before_any_connection(
    tmp_path: Path, expired: bool
) -> None:
    """APNs refuses an expired certificate at the TLS handshake: every push was a
    connection attempt ending `connection_error`, retried until its deadline, until the
    circuit breaker opened with a line sending the operator to DNS, firewall and proxy.
    Now each ends at once (before queueing: `validate`), `permanent`, with a reason (one
    of the configuration reasons the dispatcher logs when they start) and a detail that
    say what to fix."""
    bundle = tmp_path / "push-cert.pem"
    valid_for = datetime.timedelta(days=-1 if expired else 1)
    not_after = _certificate_bundle(bundle, valid_for=valid_for)
    async with ApnsSimulator() as sim:
        config = ApnsAppConfig(
            certfile=bundle,
            topic="com.example.app",
            host=sim.host,
            port=sim.port,
            ca_file=sim.ca_path,
        )
        client = ApnsClient("ios", config)
        await client.start()
        try:
            push = Push(plugin="test", app_id="ios", token="ab" * 32, payload={"aps": {}})
            refused = client.validate(push)  # the dispatcher's check before queueing
            attempt = await client.send(push)
        finally:
            await client.close()
        opened = sim.connections_opened
    if not expired:
        assert (refused, attempt.outcome, opened) == (None, Outcome.OK, 1)
        return
    assert refused == attempt
    assert attempt.outcome is Outcome.PERMANENT
    assert attempt.reason == Reason.CERTIFICATE_EXPIRED == "certificate_expired"
    assert attempt.reason in CONFIG_REASONS
    expired_on = not_after.strftime("%Y-%m-%d %H:%M UTC")
    assert attempt.detail == f"the app's APNs certificate expired on {expired_on}: renew it"
    assert opened == 0


def test_a_forced_provider_token_re_sign_comes_at_most_once_per_20_minutes() -> None:
    """`ExpiredProviderToken` forced a re-sign however young the token: with this host's
    clock an hour behind Apple's every new token is expired too, and each push signed
    one more (Apple's answer then turns TooManyProviderTokenUpdates, hiding the clock)."""
    key = generate_apns_auth_key()
    now = [1_000_000.0]
    provider = _ProviderToken(key.private_key_pem, key.key_id, key.team_id, clock=lambda: now[0])
    provider.expired(provider.generation)
    assert provider.refresh()  # the first: the token may really have aged out
    for _ in range(5):  # the new token is expired at once as well: the clock is off
        now[0] += 60
        provider.expired(provider.generation)
        assert not provider.refresh()
    assert provider.signatures == 2
    now[0] += 15 * 60  # 20 min after the forced re-sign
    provider.expired(provider.generation)
    assert provider.refresh()
    assert provider.signatures == 3


async def test_a_host_clock_behind_apples_signs_no_token_per_push(tmp_path: Path) -> None:
    """Through the client and the simulator, as the dispatcher does it: send, `auth`,
    `refresh_credentials()`, send again."""
    key = generate_apns_auth_key()
    ahead = datetime.timedelta(hours=2).total_seconds()
    async with ApnsSimulator(clock=lambda: time.time() + ahead) as sim:
        sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
        config = ApnsAppConfig(
            keyfile=key.write_p8(tmp_path / "AuthKey.p8"),
            key_id=key.key_id,
            team_id=key.team_id,
            topic="com.example.app",
            host=sim.host,
            port=sim.port,
            ca_file=sim.ca_path,
        )
        client = ApnsClient("ios", config)
        await client.start()
        reasons = []
        try:
            for _ in range(6):
                push = Push(plugin="test", app_id="ios", token="ab" * 32, payload={"aps": {}})
                for _ in range(2):  # the attempt and its one retry after the refresh
                    attempt = await client.send(push)
                    reasons.append(attempt.reason)
                    await client.refresh_credentials()
        finally:
            await client.close()
        seen = sim.jwts_seen
    assert set(reasons) == {"ExpiredProviderToken"}
    assert client.provider_token is not None
    assert client.provider_token.signatures == 2
    assert seen == 2


async def test_a_revoked_key_fails_its_own_app_only(tmp_path: Path) -> None:
    """The simulator could not revoke a key: its verdicts are cached per token, so a
    test dropping the key from its table still saw the token accepted. Revoking one
    key refuses that app's pushes (`auth`, InvalidProviderToken) and no other's."""
    async with ApnsSimulator() as sim:
        clients = {}
        for name in ("revoked", "other"):
            key = generate_apns_auth_key()
            sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
            config = ApnsAppConfig(
                keyfile=key.write_p8(tmp_path / f"AuthKey_{name}.p8"),
                key_id=key.key_id,
                team_id=key.team_id,
                topic="com.example.app",
                host=sim.host,
                port=sim.port,
                ca_file=sim.ca_path,
            )
            clients[name] = (ApnsClient(name, config), key.key_id)
        for client, _ in clients.values():
            await client.start()
        try:

            async def send(name: str) -> tuple[Outcome, str | None]:
                push = Push(plugin="test", app_id=name, token="ab" * 32, payload={"aps": {}})
                attempt = await clients[name][0].send(push)
                return attempt.outcome, attempt.reason

            assert await send("revoked") == (Outcome.OK, None)
            sim.revoke_jwt_key(clients["revoked"][1])
            assert await send("revoked") == (Outcome.AUTH, "InvalidProviderToken")
            assert await send("other") == (Outcome.OK, None)
        finally:
            for client, _ in clients.values():
                await client.close()
