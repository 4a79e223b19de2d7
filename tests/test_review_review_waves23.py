"""Review of today's later changes for security and correctness (review_waves23 seat).

- The mass-invalidation guard's start rule counted every token-invalid answer: a
  healthy app restarted while some of its users had uninstalled it (APNs 410
  `Unregistered`, FCM `UNREGISTERED`: answers about one device that the provider knows,
  never what a wrong environment or project gives) tripped it, held its dead tokens
  (Matrix: 502) and logged "check the app's APNs environment".
- A refused APNs certificate: the pushes already waiting for a connection each opened
  one more TLS handshake to Apple, refused in turn, although the 60 s hold was set.
- The FCM message check raised TypeError on an `android.priority` that is a list or an
  object (a Matrix app's fcm_options in YAML) instead of naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ApnsAppConfig
from gateway.core import apns as apns_module
from gateway.core.apns import ApnsClient
from gateway.core.push import Outcome, Reason
from gateway.core.tokens import InvalidationGuard
from gateway.testing import ApnsResponse, ApnsSimulator, SimulatorCA
from gateway.testing.harness import apns_app_config

# The dispatcher rig of the wrong-environment review: the same app, simulator and delivery.
from tests.test_review_apns_environment import (  # noqa: F401  (rig_factory is a fixture)
    TOPIC,
    device,
    push,
    rig_factory,
)

# -- (1) the guard's start rule and a healthy app's dead devices -----------------------------


async def test_dead_devices_after_a_restart_do_not_trip_the_start_rule(
    rig_factory: Callable[..., Any],  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Just restarted, the first 15 pushes go to devices whose app was uninstalled: APNs
    answers 410 Unregistered, which it gives only for a token of the right environment.
    They were held (`invalidation_suspended`, Matrix 502) after the 10th, and the line
    told the operator to change a correct environment."""
    async with ApnsSimulator(environment="production") as sim:
        for n in range(15):
            sim.script(device(n), ApnsResponse.error("Unregistered", timestamp=1_700_000_000))
        client = ApnsClient("ios", ApnsAppConfig(**apns_app_config(sim, tmp_path)))
        rig = await rig_factory(client)
        with caplog.at_level(logging.WARNING, logger="gateway.core.dispatcher"):
            receipts = [await rig.dispatcher.send(push(device(n))) for n in range(15)]

    assert {(r.outcome, r.reason) for r in receipts} == {(Outcome.TOKEN_INVALID, "Unregistered")}
    assert len(rig.invalid) == 15
    assert rig.suspended() in (None, 0)
    assert "token invalidation suspended" not in caplog.text


async def test_the_start_rule_still_catches_a_wrong_environment_among_dead_devices(
    rig_factory: Callable[..., Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Dead devices do not count, nor do they prove the environment: sandbox tokens sent
    to production still trip the guard after 10 `BadDeviceToken` in a row."""
    async with ApnsSimulator(environment="production") as sim:
        sim.script(device(99), ApnsResponse.error("Unregistered", timestamp=1_700_000_000))
        for n in range(12):
            sim.add_device(device(n), "sandbox")
        client = ApnsClient("ios", ApnsAppConfig(**apns_app_config(sim, tmp_path)))
        rig = await rig_factory(client)
        dead = await rig.dispatcher.send(push(device(99)))
        receipts = [await rig.dispatcher.send(push(device(n))) for n in range(12)]

    assert dead.outcome is Outcome.TOKEN_INVALID
    assert [r.reason for r in receipts[:9]] == ["BadDeviceToken"] * 9
    assert {r.reason for r in receipts[9:]} == {Reason.INVALIDATION_SUSPENDED}
    assert len(rig.invalid) == 1 + 9
    assert rig.suspended() == 1


def test_the_guard_counts_a_dead_device_in_the_ratio_rule_only() -> None:
    guard = InvalidationGuard(minimum=4, ratio=0.5, start=2)
    guard.record(True, now=0.0, suspect=False)
    guard.record(True, now=0.1, suspect=False)
    assert not guard.tripped  # two dead devices: not the start rule
    guard.record(True, now=0.2, suspect=False)
    guard.record(True, now=0.3, suspect=False)
    assert guard.tripped and not guard.unproven  # 4 of 4 invalid: the ratio rule


# -- (2) a refused certificate and the pushes waiting for a connection -----------------------


async def test_pushes_waiting_for_a_connection_do_not_each_meet_the_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 pushes at once with a certificate APNs refuses: the first connection attempt
    gets the TLS alert; the others, waiting for it, made one handshake each (20 refused
    handshakes to Apple) instead of ending on the hold it set.

    Over TLS 1.2, where the alert ends the handshake itself (over TLS 1.3 it may come
    after the client's side of the handshake is done, once the connections opened
    before it carry their first requests)."""
    opened = 0
    opened_while_held = 0
    create_connection = apns_module._ApnsPool.create_connection

    async def counting(self: Any) -> Any:
        nonlocal opened, opened_while_held
        opened += 1
        opened_while_held += client.validate(push(device(0))) is not None
        return await create_connection(self)

    monkeypatch.setattr(apns_module._ApnsPool, "create_connection", counting)
    stranger = SimulatorCA(tmp_path / "other-ca")
    try:
        async with ApnsSimulator(client_certificates=True) as sim:
            config = ApnsAppConfig(
                certfile=stranger.issue_client_certificate(TOPIC),
                topic=TOPIC,
                host=sim.host,
                port=sim.port,
                ca_file=sim.ca_path,
                max_connections=20,
                request_timeout=5.0,
            )
            client = ApnsClient("ios", config)
            await client.start()
            pool = client._pool
            assert pool is not None
            pool.ssl_context.maximum_version = ssl.TLSVersion.TLSv1_2
            try:
                attempts = await asyncio.gather(*(client.send(push(device(n))) for n in range(20)))
            finally:
                await client.close()
    finally:
        stranger.cleanup()

    assert {(a.outcome, a.reason) for a in attempts} == {
        (Outcome.PERMANENT, Reason.CERTIFICATE_REFUSED)
    }
    assert all("unknown_ca" in (a.detail or "") for a in attempts)
    assert (opened, opened_while_held) == (1, 0)


# -- (3) the FCM message check and a value that cannot be hashed -------------------------------


@pytest.mark.parametrize("priority", [["high"], {"level": "high"}])
def test_an_unhashable_android_priority_is_a_clear_error(tmp_path: Path, priority: object) -> None:
    """`priority: [high]` (a YAML list) in a Matrix app's fcm_options raised TypeError
    (unhashable type) out of the config check instead of naming the field; a plugin's
    message with it ended `client_error` ("the provider client raised")."""
    from pydantic import ValidationError

    from gateway.api import fcm_message_problem
    from gateway.testing import make_service_account
    from plugins.matrix.config import MatrixAppConfig

    message = {"android": {"priority": priority}}
    assert fcm_message_problem(message) == 'FCM android.priority must be "high" or "normal"'
    account = tmp_path / "sa.json"
    make_service_account("p1", "https://oauth2.googleapis.com/token", account, key_size=1024)
    app = {"type": "gcm", "api_version": "v1", "project_id": "p1"}
    with pytest.raises(ValidationError) as refused:
        MatrixAppConfig.model_validate(
            {**app, "service_account_file": str(account), "fcm_options": message}
        )
    assert "fcm_options: FCM android.priority" in str(refused.value)
