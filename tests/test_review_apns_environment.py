"""Review: an operator who got the APNs environment or certificate wrong (apns_environment).

- A wrong environment (sandbox tokens sent to production) answers `BadDeviceToken` to
  every push: at fewer than `invalidation_guard_min` sends per window (a small
  deployment) the ratio rule never held, and every registration was deleted. The guard
  now also trips after `invalidation_guard_start` invalid answers in a row before any
  push of the app was accepted, and its line says what to check.
- A client certificate APNs refuses at the TLS handshake (another CA, revoked, ...) was
  `connection_error`, retried, then an open breaker pointing at the network. The TLS
  certificate alert now ends pushes `permanent`/`certificate_refused`, a configuration
  reason whose line says to check the certificate.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ApnsAppConfig, DeliveryConfig
from gateway.context import TokenHasher
from gateway.core.apns import ApnsClient
from gateway.core.dispatcher import Dispatcher
from gateway.core.metrics import Metrics
from gateway.core.push import ApnsOptions, InvalidToken, Outcome, Push, Reason, Receipt
from gateway.core.tokens import InvalidationGuard, TokenInvalidation
from gateway.testing import ApnsSimulator, SimulatorCA
from gateway.testing.harness import apns_app_config

TOPIC = "com.example.app"
FAST = {"backoff_base": 0.02, "backoff_cap": 0.1, "throttle_backoff": 0.2}


def device(n: int) -> str:
    return f"{n:064x}"


def push(token: str) -> Push:
    return Push("p", "ios", token, {"aps": {"alert": "hi"}}, apns=ApnsOptions())


class Rig:
    def __init__(self, dispatcher: Dispatcher, metrics: Metrics) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.invalid: list[InvalidToken] = []

    def suspended(self) -> float | None:
        return self.metrics.registry.get_sample_value(
            "pushgw_token_invalidation_suspended", {"plugin": "p", "app": "ios"}
        )


@pytest.fixture
async def rig_factory() -> AsyncIterator[Callable[..., Any]]:
    made: list[Rig] = []

    async def make(client: ApnsClient, **delivery: Any) -> Rig:
        metrics = Metrics()
        rig: Rig

        async def notify(invalid: InvalidToken) -> None:
            rig.invalid.append(invalid)

        async def sink(_push: Push, _receipt: Receipt) -> None:
            pass

        dispatcher = Dispatcher(
            DeliveryConfig(**{**FAST, **delivery}),
            metrics,
            TokenInvalidation(None, metrics, notify),
            TokenHasher(b"k"),
            sink,
        )
        rig = Rig(dispatcher, metrics)
        dispatcher.add_app("p", "ios", client)
        await dispatcher.start()
        made.append(rig)
        return rig

    yield make
    for rig in made:
        await rig.dispatcher.close()


# -- (1) wrong environment ------------------------------------------------------------------


async def test_wrong_environment_on_a_small_app_does_not_delete_every_registration(
    rig_factory: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """30 users whose (sandbox) tokens are sent to production: far below 100 sends in
    5 minutes, so the ratio rule never held and all 30 registrations were deleted."""
    async with ApnsSimulator(environment="production") as sim:
        for n in range(30):
            sim.add_device(device(n), "sandbox")
        client = ApnsClient("ios", ApnsAppConfig(**apns_app_config(sim, tmp_path)))
        rig = await rig_factory(client)
        with caplog.at_level(logging.WARNING, logger="gateway.core.dispatcher"):
            receipts = [await rig.dispatcher.send(push(device(n))) for n in range(30)]

    assert [r.reason for r in receipts[:9]] == ["BadDeviceToken"] * 9
    assert len(rig.invalid) == 9  # the 10th invalid answer in a row, no push accepted
    held = receipts[9:]
    assert {(r.outcome, r.reason) for r in held} == {
        (Outcome.PERMANENT, Reason.INVALIDATION_SUSPENDED)
    }
    assert rig.suspended() == 1
    lines = [r.getMessage() for r in caplog.records if "suspended" in r.getMessage()]
    assert len(lines) == 1
    assert "no push accepted since start" in lines[0]
    assert "BadDeviceToken" in lines[0]
    assert "APNs `environment`" in lines[0] and "TestFlight" in lines[0]
    assert device(0) not in caplog.text


async def test_an_accepted_push_proves_the_environment(
    rig_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """Once one push was accepted, the environment is right: dead tokens of a small app
    are invalidated as before (only the ratio rule holds them)."""
    async with ApnsSimulator(environment="production") as sim:
        sim.add_device(device(100), "production")
        for n in range(15):
            sim.add_device(device(n), "sandbox")
        client = ApnsClient("ios", ApnsAppConfig(**apns_app_config(sim, tmp_path)))
        rig = await rig_factory(client)
        assert (await rig.dispatcher.send(push(device(100)))).ok
        receipts = [await rig.dispatcher.send(push(device(n))) for n in range(15)]
    assert {r.reason for r in receipts} == {"BadDeviceToken"}
    assert len(rig.invalid) == 15
    assert rig.suspended() in (None, 0)


def test_the_start_rule_is_off_with_ratio_one_and_releases_on_an_accepted_push() -> None:
    off = InvalidationGuard(minimum=100, ratio=1.0, start=3)
    for i in range(50):
        off.record(True, now=float(i))
    assert not off.tripped  # Sygnal's behaviour: every dead token rejected at once

    guard = InvalidationGuard(minimum=100, ratio=0.5, start=3)
    guard.record(True, now=0.0)
    guard.record(False, now=0.5, proven=False)  # a connection error proves nothing
    guard.record(True, now=1.0)
    assert not guard.tripped
    guard.record(True, now=2.0)
    assert guard.tripped and guard.unproven
    guard.record(False, now=3.0)  # an accepted push
    assert not guard.tripped


# -- (2) a certificate APNs refuses at the handshake ----------------------------------------


async def test_a_certificate_refused_at_the_handshake_is_a_certificate_problem(
    rig_factory: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A push certificate from another CA: APNs sends a TLS alert (unknown_ca). That was
    `connection_error`, retried, and a breaker pointing at DNS/firewall/proxy."""
    stranger = SimulatorCA(tmp_path / "other-ca")
    try:
        async with ApnsSimulator(client_certificates=True) as sim:
            certfile = stranger.issue_client_certificate(TOPIC)
            config = ApnsAppConfig(
                certfile=certfile,
                topic=TOPIC,
                host=sim.host,
                port=sim.port,
                ca_file=sim.ca_path,
                request_timeout=2.0,
            )
            rig = await rig_factory(ApnsClient("ios", config))
            with caplog.at_level(logging.WARNING, logger="gateway.core.dispatcher"):
                first = await rig.dispatcher.send(push(device(1)))
                second = await rig.dispatcher.send(push(device(2)))
            assert sim.connections_opened == 0
    finally:
        stranger.cleanup()

    assert (first.outcome, first.reason, first.attempts) == (
        Outcome.PERMANENT,
        Reason.CERTIFICATE_REFUSED,
        1,
    )
    assert "unknown_ca" in (first.detail or "")
    # Remembered: no handshake per push while the refusal holds.
    assert (second.outcome, second.reason, second.attempts) == (
        Outcome.PERMANENT,
        Reason.CERTIFICATE_REFUSED,
        0,
    )
    assert "circuit breaker opened" not in caplog.text
    lines = [r.getMessage() for r in caplog.records if "configuration reason" in r.getMessage()]
    assert len(lines) == 1
    assert "(certificate_refused)" in lines[0] and "check the app's certfile" in lines[0]
    sample = rig.metrics.registry.get_sample_value(
        "pushgw_pushes_total",
        {
            "plugin": "p",
            "provider": "apns",
            "app": "ios",
            "outcome": "permanent",
            "reason": "certificate_refused",
        },
    )
    assert sample == 2


async def test_the_simulator_sends_the_tls_alert_of_a_refused_certificate(
    tmp_path: Path,
) -> None:
    """Apple's servers send the alert; asyncio's server closed the socket without it,
    which a client could only read as a connection reset."""
    import asyncio
    import ssl

    stranger = SimulatorCA(tmp_path / "other-ca")
    try:
        async with ApnsSimulator(client_certificates=True) as sim:
            context = ssl.create_default_context(cafile=str(sim.ca_path))
            context.load_cert_chain(str(stranger.issue_client_certificate(TOPIC)))
            with pytest.raises(ssl.SSLError) as caught:
                reader, writer = await asyncio.open_connection(
                    sim.host, sim.port, ssl=context, server_hostname="api.push.apple.com"
                )
                try:
                    await asyncio.wait_for(reader.read(1 << 16), 5)
                finally:
                    writer.close()
    finally:
        stranger.cleanup()
    assert caught.value.reason == "TLSV1_ALERT_UNKNOWN_CA"
