"""The dispatcher against the simulators with the real provider clients: retries within the
deadline, Retry-After, gates, shedding, circuit breaking, the invalidation guard, draining,
and sends cancelled at shutdown."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app, load_gateway, running_core
from gateway.config import ApnsAppConfig, DeliveryConfig, FcmAppConfig
from gateway.context import TokenHasher
from gateway.core.apns import ApnsClient
from gateway.core.dispatcher import CircuitBreaker, Dispatcher, backoff_delay
from gateway.core.fcm import FcmClient
from gateway.core.metrics import Metrics
from gateway.core.push import (
    Attempt,
    InvalidToken,
    Outcome,
    ProviderKind,
    Push,
    PushPolicy,
    Reason,
    Receipt,
)
from gateway.core.tokens import TokenInvalidation
from gateway.receipt_files import read_records
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import apns_app_config, base_config, fcm_app_config

FAST = {"backoff_base": 0.02, "backoff_cap": 0.1, "throttle_backoff": 0.2}


def token(n: int) -> str:
    return f"{n:064x}"


@dataclass
class Rig:
    apns: ApnsSimulator
    fcm: FcmSimulator
    dispatcher: Dispatcher
    invalid: list[InvalidToken] = field(default_factory=list)
    receipts: list[Receipt] = field(default_factory=list)

    def push(self, app: str, tok: str, **policy: Any) -> Push:
        payload: dict[str, Any] = (
            {"aps": {"alert": "hi"}} if app.startswith("ios") else {"data": {"k": "v"}}
        )
        return Push("p", app, tok, payload, policy=PushPolicy(**policy))


@pytest.fixture
async def rig_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    rigs: list[Rig] = []
    sims: list[Any] = []

    async def make(apps: dict[str, dict[str, Any]] | None = None, **delivery: Any) -> Rig:
        apns = ApnsSimulator()
        fcm = FcmSimulator()
        await apns.start()
        await fcm.start()
        sims.extend([apns, fcm])
        rig = Rig(apns, fcm, None)  # type: ignore[arg-type]

        async def notify(invalid: InvalidToken) -> None:
            rig.invalid.append(invalid)

        async def sink(_push: Push, receipt: Receipt) -> None:
            rig.receipts.append(receipt)

        config = DeliveryConfig(**{**FAST, **delivery})
        metrics = Metrics()
        dispatcher = Dispatcher(
            config, metrics, TokenInvalidation(None, metrics, notify), TokenHasher(b"k"), sink
        )
        apps = apps or {"ios": {}, "android": {}}
        for app_id, overrides in apps.items():
            if app_id.startswith("ios"):
                cfg = ApnsAppConfig(**apns_app_config(apns, tmp_path, **overrides))
                dispatcher.add_app("p", app_id, ApnsClient(app_id, cfg))
            else:
                cfg_f = FcmAppConfig(
                    **fcm_app_config(fcm, tmp_path, project_id=f"proj-{app_id}", **overrides)
                )
                dispatcher.add_app("p", app_id, FcmClient(app_id, cfg_f))
        await dispatcher.start()
        rig.dispatcher = dispatcher
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.dispatcher.close()
    for sim in sims:
        await sim.stop()


async def test_success_on_both_providers(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    ios, android = await rig.dispatcher.send_all(
        [rig.push("ios", token(1)), rig.push("android", "f1")]
    )
    assert (ios.outcome, ios.status, ios.attempts) == (Outcome.OK, 200, 1)
    assert (android.outcome, android.status, android.attempts) == (Outcome.OK, 200, 1)
    assert android.provider_id and android.provider_id.startswith("projects/proj-android/messages/")
    assert rig.receipts == [ios, android] or rig.receipts == [android, ios]


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (ApnsResponse.error("InternalServerError"), "InternalServerError"),
        (ApnsResponse.error("ServiceUnavailable"), "ServiceUnavailable"),
        (ApnsResponse.faulty("reset"), Reason.CONNECTION_ERROR),
        (ApnsResponse.faulty("drop"), Reason.CONNECTION_ERROR),
    ],
)
async def test_apns_transient_failures_are_retried(
    rig_factory: Callable[..., Any], response: ApnsResponse, reason: str
) -> None:
    rig = await rig_factory()
    rig.apns.script(token(2), response, ApnsResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("ios", token(2)))
    assert receipt.outcome is Outcome.OK and receipt.attempts == 2
    assert len(rig.apns.requests_for(token(2))) >= 1


async def test_apns_error_without_body_ends_as_transient(rig_factory: Callable[..., Any]) -> None:
    # aioapns alone would hang on this answer until the connection drops
    rig = await rig_factory({"ios": {"request_timeout": 0.3}})
    rig.apns.script(token(3), ApnsResponse.faulty("no_body", status=500))
    receipt = await rig.dispatcher.send(rig.push("ios", token(3), deadline=2.0, max_retries=0))
    assert (receipt.outcome, receipt.status, receipt.attempts) == (Outcome.TRANSIENT, 500, 1)


@pytest.mark.parametrize(
    "reason", ["BadTopic", "TopicDisallowed", "BadCertificate", "MissingTopic"]
)
async def test_permanent_failures_are_not_retried(
    rig_factory: Callable[..., Any], reason: str
) -> None:
    rig = await rig_factory()
    rig.apns.script(token(4), ApnsResponse.error(reason))
    receipt = await rig.dispatcher.send(rig.push("ios", token(4)))
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (Outcome.PERMANENT, reason, 1)
    assert len(rig.apns.requests_for(token(4))) == 1
    assert rig.invalid == []


@pytest.mark.parametrize("reason", ["Unregistered", "BadDeviceToken", "DeviceTokenNotForTopic"])
async def test_apns_token_invalid_reaches_the_plugin_once(
    rig_factory: Callable[..., Any], reason: str
) -> None:
    rig = await rig_factory()
    rig.apns.script(token(5), ApnsResponse.error(reason))
    first, second = await rig.dispatcher.send_all(
        [rig.push("ios", token(5)), rig.push("ios", token(5))]
    )
    assert first.outcome is second.outcome is Outcome.TOKEN_INVALID
    assert [(i.reason, i.token) for i in rig.invalid] == [(reason, token(5))]


@pytest.mark.parametrize(
    ("response", "outcome", "reason"),
    [
        (FcmResponse.unregistered(), Outcome.TOKEN_INVALID, "UNREGISTERED"),
        (FcmResponse.sender_id_mismatch(), Outcome.TOKEN_INVALID, "SENDER_ID_MISMATCH"),
        (FcmResponse.invalid_token(), Outcome.TOKEN_INVALID, "INVALID_ARGUMENT"),
        (FcmResponse.invalid_argument(field="message.data"), Outcome.PERMANENT, "INVALID_ARGUMENT"),
        (FcmResponse.permission_denied(), Outcome.PERMANENT, "PERMISSION_DENIED"),
        (FcmResponse.third_party_auth_error(), Outcome.PERMANENT, "THIRD_PARTY_AUTH_ERROR"),
    ],
)
async def test_fcm_final_classes(
    rig_factory: Callable[..., Any], response: FcmResponse, outcome: Outcome, reason: str
) -> None:
    rig = await rig_factory()
    rig.fcm.script("ftok", response)
    receipt = await rig.dispatcher.send(rig.push("android", "ftok"))
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (outcome, reason, 1)
    assert len(rig.invalid) == (1 if outcome is Outcome.TOKEN_INVALID else 0)


@pytest.mark.parametrize(
    "response", [FcmResponse.unavailable(), FcmResponse.internal(), FcmResponse.drop()]
)
async def test_fcm_transient_classes_are_retried(
    rig_factory: Callable[..., Any], response: FcmResponse
) -> None:
    rig = await rig_factory()
    rig.fcm.script("ftok2", response, FcmResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("android", "ftok2"))
    assert receipt.outcome is Outcome.OK and receipt.attempts == 2


async def test_retry_after_is_honoured(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    rig.fcm.script("ftok3", FcmResponse.unavailable(retry_after=1), FcmResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("android", "ftok3", deadline=5.0))
    assert receipt.outcome is Outcome.OK and receipt.attempts == 2
    first, second = rig.fcm.requests[-2:]
    assert second.at - first.at >= 1.0  # the provider asked for a second; backoff alone is 0.1


async def test_quota_exceeded_closes_the_gate_for_the_app(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    rig.fcm.script("q1", FcmResponse.quota_exceeded(retry_after=2), FcmResponse.ok())
    first = asyncio.create_task(rig.dispatcher.send(rig.push("android", "q1", deadline=5.0)))
    await rig.fcm.wait_for_requests(1)
    await asyncio.sleep(0)  # let the 429 be classified and the gate close
    while not rig.dispatcher._lanes[("p", "android")].gate_until:
        await asyncio.sleep(0.01)
    blocked = await rig.dispatcher.send(rig.push("android", "q2", deadline=0.5))
    assert (blocked.outcome, blocked.reason, blocked.attempts) == (
        Outcome.THROTTLED,
        Reason.GATE_CLOSED,
        0,
    )
    assert rig.fcm.requests_for("q2") == []
    done = await first
    assert done.outcome is Outcome.OK and done.attempts == 2
    assert rig.fcm.requests[-1].at - rig.fcm.requests[0].at >= 2.0


async def test_an_absurd_retry_after_is_cut_to_max_retry_after(
    rig_factory: Callable[..., Any],
) -> None:
    rig = await rig_factory(max_retry_after=0.3)
    rig.fcm.script("q4", FcmResponse.quota_exceeded(retry_after=99_999_999), FcmResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("android", "q4", deadline=5.0))
    # honoured as asked, the retry would fall after the deadline and the gate stay shut
    assert (receipt.outcome, receipt.attempts) == (Outcome.OK, 2)
    first, second = rig.fcm.requests_for("q4")
    assert second.at - first.at >= 0.3
    assert rig.dispatcher._lanes[("p", "android")].gate_until <= second.at


async def test_quota_without_retry_after_waits_the_configured_backoff(
    rig_factory: Callable[..., Any],
) -> None:
    rig = await rig_factory(throttle_backoff=60.0)
    rig.fcm.script("q3", FcmResponse.quota_exceeded())
    receipt = await rig.dispatcher.send(rig.push("android", "q3", deadline=1.0))
    # a 60 s back-off does not fit the 1 s deadline: no second attempt
    assert (receipt.outcome, receipt.attempts) == (Outcome.THROTTLED, 1)
    assert len(rig.fcm.requests) == 1


async def test_retries_never_start_after_the_deadline(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory(backoff_base=0.05, backoff_cap=0.05)
    rig.apns.script(token(6), ApnsResponse.error("InternalServerError"))
    push = rig.push("ios", token(6), deadline=0.6)
    receipt = await rig.dispatcher.send(push)
    assert receipt.outcome is Outcome.TRANSIENT
    assert receipt.attempts >= 2
    requests = rig.apns.requests_for(token(6))
    assert len(requests) == receipt.attempts
    assert all(r.at <= push.submitted + 0.6 + 0.05 for r in requests)  # last one may be in flight


async def test_expired_deadline_is_shed_without_a_request(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    push = rig.push("ios", token(7), deadline=0.01)
    await asyncio.sleep(0.02)
    receipt = await rig.dispatcher.send(push)
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.TRANSIENT,
        Reason.DEADLINE_EXCEEDED,
        0,
    )
    assert rig.apns.requests_for(token(7)) == []
    text = rig.dispatcher.metrics.exposition().decode()
    assert 'pushgw_pushes_shed_total{app="ios",plugin="p",reason="deadline_exceeded"} 1.0' in text


async def test_expired_provider_token_is_resigned_once(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    rig.apns.script(token(8), ApnsResponse.error("ExpiredProviderToken"), ApnsResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("ios", token(8)))
    assert receipt.outcome is Outcome.OK and receipt.attempts == 2
    jwts = {r.headers.get("authorization") for r in rig.apns.requests_for(token(8))}
    assert len(jwts) == 2


async def test_payload_limits_are_checked_before_sending(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    pad = "x" * (4096 - len('{"aps":{},"p":""}'))
    fits = Push("p", "ios", token(9), {"aps": {}, "p": pad})
    too_big = Push("p", "ios", token(10), {"aps": {}, "p": pad + "x"})
    ok, refused = await rig.dispatcher.send_all([fits, too_big])
    assert ok.outcome is Outcome.OK
    assert (refused.outcome, refused.reason, refused.attempts) == (
        Outcome.PERMANENT,
        Reason.PAYLOAD_TOO_LARGE,
        0,
    )
    assert refused.detail and "4097" in refused.detail
    assert rig.apns.requests_for(token(10)) == []


async def test_a_slow_app_does_not_delay_another(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory({"ios-slow": {"max_in_flight": 2}, "ios-fast": {}})
    for n in range(10):
        rig.apns.script(token(100 + n), ApnsResponse.ok(delay=1.0))
    finished: list[str] = []

    async def send(app: str, tok: str) -> None:
        await rig.dispatcher.send(rig.push(app, tok))
        finished.append(app)

    await asyncio.gather(
        *(send("ios-slow", token(100 + n)) for n in range(10)),
        *(send("ios-fast", token(200 + n)) for n in range(10)),
    )
    assert finished[:10] == ["ios-fast"] * 10


async def test_queue_bound_sheds_excess(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory({"ios": {"max_in_flight": 1}}, queue_size=2)
    for n in range(3):
        rig.apns.script(token(300 + n), ApnsResponse.ok(delay=0.3))
    receipts = await rig.dispatcher.send_all([rig.push("ios", token(300 + n)) for n in range(3)])
    assert [r.reason for r in receipts].count(Reason.QUEUE_FULL) == 1
    assert sum(r.ok for r in receipts) == 2


async def test_circuit_breaker_fails_fast_then_recovers(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory(circuit_breaker={"failure_threshold": 3, "reset_after": 0.3})
    rig.apns.script_all(ApnsResponse.error("ServiceUnavailable"))
    for n in range(3):
        await rig.dispatcher.send(rig.push("ios", token(400 + n), max_retries=0))
    before = len(rig.apns.requests)
    fast = await rig.dispatcher.send(rig.push("ios", token(410), max_retries=0))
    assert (fast.reason, fast.attempts) == (Reason.CIRCUIT_OPEN, 0)
    assert len(rig.apns.requests) == before
    rig.apns.clear_scripts()
    await asyncio.sleep(0.35)  # the breaker's own reset period, not synchronisation
    trial = await rig.dispatcher.send(rig.push("ios", token(411), max_retries=0))
    assert trial.ok
    assert (await rig.dispatcher.send(rig.push("ios", token(412)))).ok


def test_the_breaker_claims_its_trial_only_when_asked_and_takes_it_back() -> None:
    breaker = CircuitBreaker(threshold=2, reset_after=30.0)
    assert breaker.allow(0.0) and not breaker.rejects(0.0)  # closed: nothing to claim
    breaker.record(Outcome.TRANSIENT, 1.0)
    assert breaker.record(Outcome.TRANSIENT, 2.0)  # opened
    assert breaker.rejects(31.9) and not breaker.allow(31.9)
    assert not breaker.rejects(32.0) and not breaker.rejects(32.0)  # asking claims nothing
    assert breaker.allow(32.0)  # the trial...
    assert breaker.rejects(33.0) and not breaker.allow(33.0)  # ...is the only request
    breaker.abandon()  # its request was cancelled
    assert breaker.allow(34.0)  # the next push is the trial
    assert breaker.record(Outcome.OK, 35.0) and breaker.allow(35.0)  # closed again


async def test_a_trial_push_that_makes_no_request_leaves_the_trial_to_the_next() -> None:
    """A half-open lane's trial push that waits for a slot until its deadline, or whose
    request is cancelled, never reports: the next push is the trial, not refused forever."""

    async def answer(push: Push) -> Attempt:
        if push.token in ("holder", "cancelled"):
            await asyncio.Event().wait()  # never answered
        return Attempt(Outcome.OK, 200)

    client = ScriptedClient("android", answer)
    client.max_in_flight = 1
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(
        client, receipts, circuit_breaker={"failure_threshold": 1, "reset_after": 30.0}
    )
    lane = dispatcher._lanes[("p", "android")]
    holder = asyncio.create_task(dispatcher.send(Push("p", "android", "holder", {})))
    await client.called.wait()  # the holder's request is out: it holds the one slot
    lane.breaker.record(Outcome.TRANSIENT, time.monotonic() - 30.0)  # opened 30 s ago: due

    short = PushPolicy(deadline=0.2)
    waiting = await dispatcher.send(Push("p", "android", "waiting", {}, policy=short))
    assert (waiting.reason, waiting.attempts) == (Reason.DEADLINE_EXCEEDED, 0)
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder

    client.called.clear()
    cancelled = asyncio.create_task(dispatcher.send(Push("p", "android", "cancelled", {})))
    await client.called.wait()  # the trial's request is out...
    assert lane.breaker.rejects(time.monotonic())  # ...and the only one
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled

    trial = await dispatcher.send(Push("p", "android", "trial", {}))
    assert (trial.outcome, trial.attempts) == (Outcome.OK, 1)
    assert client.sent == ["holder", "cancelled", "trial"]
    assert not lane.breaker.rejects(time.monotonic())  # the trial closed it
    await dispatcher.close()


async def test_mass_invalidation_guard_holds_invalidations(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory(invalidation_guard_min=10)
    rig.apns.script_all(ApnsResponse.error("BadDeviceToken"))
    receipts = [await rig.dispatcher.send(rig.push("ios", token(500 + n))) for n in range(20)]
    held = [r for r in receipts if r.reason == Reason.INVALIDATION_SUSPENDED]
    assert held and all(r.outcome is Outcome.PERMANENT for r in held)
    assert len(rig.invalid) == 9  # the guard trips at the 10th of 10 invalid answers
    assert len(rig.invalid) + len(held) == 20


async def test_the_suspended_gauge_clears_when_valid_answers_release_the_guard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The guard is released by valid answers as much as by invalid ones: the gauge (and
    the log) must follow, not stay at 1 while invalidations go through again."""
    dead = Attempt(Outcome.TOKEN_INVALID, 410, "Unregistered")
    client = ScriptedClient(
        "android", lambda push: dead if push.token.startswith("dead") else Attempt(Outcome.OK, 200)
    )
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts, invalidation_guard_min=10)
    lane = dispatcher._lanes[("p", "android")]

    def suspended() -> float | None:
        return dispatcher.metrics.registry.get_sample_value(
            "pushgw_token_invalidation_suspended", {"plugin": "p", "app": "android"}
        )

    for n in range(10):
        await dispatcher.send(Push("p", "android", f"dead{n}", {}))
    assert lane.guard.tripped and suspended() == 1
    for n in range(20):  # 10 invalid of 30: no longer most of them
        assert (await dispatcher.send(Push("p", "android", f"ok{n}", {}))).ok
    assert not lane.guard.tripped
    assert suspended() == 0
    assert "token invalidation resumed for app android" in caplog.text
    receipt = await dispatcher.send(Push("p", "android", "dead-again", {}))
    assert receipt.reason == "Unregistered"  # invalidated again, as the gauge says
    assert suspended() == 0
    await dispatcher.close()


async def test_drain_finishes_in_flight_and_refuses_new(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    rig.apns.script(token(600), ApnsResponse.ok(delay=0.3))
    in_flight = asyncio.create_task(rig.dispatcher.send(rig.push("ios", token(600))))
    await rig.apns.wait_for_requests(1)
    assert await rig.dispatcher.drain(timeout=5.0)
    assert (await in_flight).ok
    late = await rig.dispatcher.send(rig.push("ios", token(601)))
    assert late.reason == Reason.SHUTTING_DOWN


def test_backoff_is_full_jitter_and_capped() -> None:
    samples = [backoff_delay(retry, 1.0, 60.0) for retry in range(12) for _ in range(50)]
    assert all(0 <= s <= 60.0 for s in samples)
    assert max(backoff_delay(0, 1.0, 60.0) for _ in range(200)) <= 1.0
    assert max(backoff_delay(10, 1.0, 60.0) for _ in range(200)) > 1.0


def test_push_ids_are_canonical_v4_uuids() -> None:
    import uuid

    from gateway.core.push import new_push_id

    ids = {new_push_id() for _ in range(2000)}
    assert len(ids) == 2000
    for value in list(ids)[:200]:
        parsed = uuid.UUID(value)
        assert str(parsed) == value and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_a_forked_child_draws_its_own_push_ids() -> None:
    from gateway.core.push import new_push_id

    parent = new_push_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report one id and leave without running pytest's teardown
        os.write(write, new_push_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child != parent
    assert child[:24] != parent[:24]  # a new random prefix, not the parent's sequence


def test_invalidation_guard_counts_a_moving_window() -> None:
    from gateway.core.tokens import InvalidationGuard

    guard = InvalidationGuard(minimum=10, ratio=0.5, window=300.0)
    for i in range(9):
        guard.record(True, now=1000.0 + i)
    assert not guard.tripped  # fewer than `minimum` sends
    guard.record(True, now=1010.0)
    assert guard.tripped
    for i in range(10):
        guard.record(False, now=1020.0 + i)
    assert not guard.tripped  # 10 invalid of 20 is not more than half
    guard.record(True, now=1030.0)
    assert guard.tripped
    # Five minutes on, the invalid sends have left the window; the valid ones follow.
    for i in range(10):
        guard.record(False, now=1330.0 + i)
    assert not guard.tripped


def test_invalidation_guard_memory_does_not_grow_with_the_rate() -> None:
    from gateway.core.tokens import InvalidationGuard

    guard = InvalidationGuard(minimum=100, ratio=0.5, window=300.0)
    for i in range(600_000):  # 1,000 sends a second for ten minutes
        guard.record(i % 3 == 0, now=i / 1000)
    assert len(guard._buckets) <= InvalidationGuard.BUCKETS + 1
    assert not guard.tripped
    assert guard._sends == sum(b[1] for b in guard._buckets)
    assert 295_000 <= guard._sends <= 300_000  # the last five minutes, within one bucket


# --- shutdown and client bugs: every accepted push still ends with a receipt ----------


class ScriptedClient:
    """A provider client whose `send` answers `answer(push)` (or raises what it raises)."""

    kind = ProviderKind.FCM
    max_in_flight = 10

    def __init__(self, app_id: str, answer: Callable[[Push], Any]) -> None:
        self.app_id = app_id
        self.answer = answer
        self.sent: list[str] = []
        self.called = asyncio.Event()
        self.closed = asyncio.Event()
        self.refresh_error: Exception | None = None

    def validate(self, push: Push) -> Attempt | None:
        return None

    async def start(self) -> None:
        pass

    async def send(self, push: Push) -> Attempt:
        self.sent.append(push.token)
        self.called.set()
        result = self.answer(push)
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, Attempt)
        return result

    async def refresh_credentials(self) -> None:
        if self.refresh_error is not None:
            raise self.refresh_error

    def ready(self) -> bool:
        return True

    async def close(self) -> None:
        self.closed.set()


def scripted_dispatcher(
    client: ScriptedClient, receipts: list[Receipt], **delivery: Any
) -> Dispatcher:
    async def sink(_push: Push, receipt: Receipt) -> None:
        receipts.append(receipt)

    async def notify(_invalid: InvalidToken) -> None:
        pass

    metrics = Metrics()
    dispatcher = Dispatcher(
        DeliveryConfig(**{**FAST, **delivery}),
        metrics,
        TokenInvalidation(None, metrics, notify),
        TokenHasher(b"k"),
        sink,
    )
    dispatcher.add_app("p", client.app_id, client)
    return dispatcher


async def test_drain_ends_pushes_waiting_to_retry_or_behind_a_closed_gate() -> None:
    quota = Attempt(
        Outcome.THROTTLED, 429, "QUOTA_EXCEEDED", retry_after=30.0, credential_wide=True
    )
    client = ScriptedClient("android", lambda push: quota)
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    retrying = asyncio.create_task(
        dispatcher.send(Push("p", "android", "t1", {}, policy=PushPolicy(deadline=50)))
    )
    await client.called.wait()  # answered: t1 now waits 30 s to retry, the gate is closed
    gated = asyncio.create_task(
        dispatcher.send(Push("p", "android", "t2", {}, policy=PushPolicy(deadline=50)))
    )
    await asyncio.sleep(0)  # one loop step: t2 runs up to the closed gate (no time passes)
    assert dispatcher._lanes[("p", "android")].pending == 2

    assert await dispatcher.drain(timeout=5.0)  # at once, not after 30 s or the timeout
    first, second = await retrying, await gated
    assert (first.outcome, first.reason, first.status, first.attempts) == (
        Outcome.TRANSIENT,
        Reason.SHUTTING_DOWN,
        429,
        1,
    )
    assert (second.outcome, second.reason, second.status, second.attempts) == (
        Outcome.TRANSIENT,
        Reason.SHUTTING_DOWN,
        None,
        0,
    )
    assert client.sent == ["t1"]  # neither is sent again once draining began
    assert sorted(r.push_id for r in receipts) == sorted([first.push_id, second.push_id])
    await dispatcher.close()


async def test_close_waits_for_the_sends_the_clients_ended() -> None:
    async def until_closed(_push: Push) -> Attempt:
        await client.closed.wait()  # as a real client: pending sends end when it closes
        return Attempt(Outcome.TRANSIENT, reason=Reason.CONNECTION_ERROR)

    client = ScriptedClient("android", until_closed)
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    task = dispatcher.submit(Push("p", "android", "t3", {}, policy=PushPolicy(deadline=50)))
    await client.called.wait()
    assert not await dispatcher.drain(timeout=0.05)  # the request is still out
    await dispatcher.close()
    # the receipt reached the sink before close() returned (the receipts writer closes next)
    assert [(r.outcome, r.reason, r.attempts) for r in receipts] == [
        (Outcome.TRANSIENT, Reason.SHUTTING_DOWN, 1)
    ]
    assert task.done() and dispatcher.in_flight == 0


@pytest.mark.parametrize("call", ["send", "refresh_credentials"])
async def test_a_provider_client_that_raises_still_gives_a_receipt(
    call: str, secrets_seen: set[str], caplog: pytest.LogCaptureFixture, register_secret: Any
) -> None:
    tok = token(700)
    secrets_seen.add(tok)
    register_secret(tok)

    def answer(push: Push) -> Attempt:
        if call == "send":
            raise ValueError(f"could not convert {push.token!r}")  # a bug quoting the token
        return Attempt(Outcome.AUTH, 403, "InvalidProviderToken")

    client = ScriptedClient("android", answer)
    client.refresh_error = RuntimeError(f"refresh failed for {tok}")
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    receipt = await dispatcher.send(Push("p", "android", tok, {}))
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.TRANSIENT,
        Reason.CLIENT_ERROR,
        1,
    )
    assert receipts == [receipt]
    assert client.sent == [tok]  # a bug is not retried
    assert dispatcher.in_flight == 0
    kind = "ValueError" if call == "send" else "RuntimeError"
    assert f"client's {call}() raised {kind}" in caplog.text
    # the autouse no_secrets_in_logs fixture checks that the token was not logged
    await dispatcher.close()


async def test_an_unparseable_retry_after_is_ignored(rig_factory: Callable[..., Any]) -> None:
    rig = await rig_factory()
    # "\u00b2" passes str.isdigit() and fails float(): it used to escape from send()
    rig.fcm.script("ftok9", FcmResponse.unavailable(retry_after="\u00b2"), FcmResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("android", "ftok9"))
    assert receipt.outcome is Outcome.OK and receipt.attempts == 2
    assert rig.receipts == [receipt]


async def test_shutdown_writes_the_receipts_of_pushes_waiting_to_retry(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    async with FcmSimulator() as fcm:
        config = base_config(
            tmp_path,
            {"sample": {"apps": {"android": fcm_app_config(fcm, tmp_path)}}},
            server={"shutdown_timeout": 5.0},
        )
        gateway = load_gateway(data=config)
        fcm.script_all(FcmResponse.unavailable(retry_after=30))
        async with running_core(gateway):
            dispatcher = gateway.runtime.dispatcher
            assert dispatcher is not None
            task = dispatcher.submit(
                Push("sample", "android", "ftok10", {"data": {}}, policy=PushPolicy(deadline=50))
            )
            await fcm.wait_for_requests(1)
        # the core stopped: the push did not wait 30 s, and its receipt is in a published file
        assert task.done()
        assert (task.result().outcome, task.result().reason) == (
            Outcome.TRANSIENT,
            Reason.SHUTTING_DOWN,
        )
        (published,) = (tmp_path / "receipts").iterdir()
        assert published.suffix == ".parquet"  # the default format
        (record,) = read_records(published)
        assert (record["status"], record["reason"], record["http_status"], record["attempts"]) == (
            "transient",
            "shutting_down",
            503,
            1,
        )


# --- a send cancelled mid-delivery (only shutdown does that) still ends with one receipt --


async def never_answered(_push: Push) -> Attempt:
    """A request the provider never answers, which closing the client does not end."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def pushes_counted(dispatcher: Dispatcher, outcome: str, reason: str) -> float | None:
    return dispatcher.metrics.registry.get_sample_value(
        "pushgw_pushes_total",
        {"plugin": "p", "provider": "fcm", "app": "android", "outcome": outcome, "reason": reason},
    )


@pytest.mark.parametrize(
    ("held", "status", "attempts"),
    [("request", None, 1), ("retry", 503, 1), ("slot", None, 0)],
)
async def test_a_cancelled_send_ends_shutting_down_and_stays_cancelled(
    held: str, status: int | None, attempts: int
) -> None:
    def answer(push: Push) -> Any:
        if held == "retry":
            return Attempt(Outcome.TRANSIENT, 503, "UNAVAILABLE", retry_after=30.0)
        return never_answered(push)

    client = ScriptedClient("android", answer)
    client.max_in_flight = 1
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    lane = dispatcher._lanes[("p", "android")]
    policy = PushPolicy(deadline=50)
    holder = None
    if held == "slot":  # another push holds the lane's one slot
        holder = asyncio.create_task(dispatcher.send(Push("p", "android", "t0", {}, policy=policy)))
        await client.called.wait()
    push = Push("p", "android", "t1", {}, policy=policy)
    task = asyncio.create_task(dispatcher.send(push))
    if held == "slot":
        await asyncio.sleep(0)  # one loop step: t1 runs up to the slot wait
        assert lane.slots.waiting == 1
    else:
        await client.called.wait()  # t1's request is out, or was answered: it waits 30 s

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(r.push_id, r.outcome, r.reason, r.status, r.attempts) for r in receipts] == [
        (push.id, Outcome.TRANSIENT, Reason.SHUTTING_DOWN, status, attempts)
    ]
    assert pushes_counted(dispatcher, "transient", "shutting_down") == 1
    still = 1 if holder is not None else 0  # the push holding the slot is still out
    assert lane.pending == dispatcher.in_flight == still
    if holder is not None:
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
    assert lane.pending == dispatcher.in_flight == 0
    assert dispatcher._idle.is_set()
    await dispatcher.close()


@pytest.mark.parametrize("final", ["ok", "shutting_down"])
async def test_a_send_cancelled_while_its_receipt_is_made_gets_no_second_one(final: str) -> None:
    ok = final == "ok"
    client = ScriptedClient(
        "android", lambda p: Attempt(Outcome.OK, 200) if ok else never_answered(p)
    )
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    in_sink = asyncio.Event()

    async def slow_sink(_push: Push, receipt: Receipt) -> None:
        receipts.append(receipt)
        if not in_sink.is_set():  # e.g. an observer still busy when shutdown cancels
            in_sink.set()
            await asyncio.Event().wait()

    dispatcher.sink = slow_sink
    task = asyncio.create_task(dispatcher.send(Push("p", "android", "t1", {})))
    if not ok:  # cancelled in flight: its shutting_down receipt is being made...
        await client.called.wait()
        task.cancel()
    async with asyncio.timeout(5):  # a guard, not a wait: the sink is entered at once
        await in_sink.wait()
    task.cancel()  # ...when a (second) cancellation lands
    with pytest.raises(asyncio.CancelledError):
        await task
    reason = None if ok else Reason.SHUTTING_DOWN
    assert [(r.outcome.value, r.reason) for r in receipts] == [
        ("ok" if ok else "transient", reason)
    ]
    assert dispatcher.in_flight == 0
    await dispatcher.close()


async def test_close_cancels_the_submitted_sends_that_outlive_the_clients() -> None:
    client = ScriptedClient("android", never_answered)  # closing it ends nothing
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    task = dispatcher.submit(Push("p", "android", "t1", {}, policy=PushPolicy(deadline=50)))
    await client.called.wait()
    assert not await dispatcher.drain(timeout=0.01)
    await dispatcher.close(timeout=0.2)
    # its receipt reached the sink before close() returned (the receipts writer closes next)
    assert task.cancelled()
    assert [(r.outcome, r.reason, r.status, r.attempts) for r in receipts] == [
        (Outcome.TRANSIENT, Reason.SHUTTING_DOWN, None, 1)
    ]
    assert dispatcher.in_flight == 0


async def test_server_shutdown_cancelling_a_push_request_still_writes_its_receipt(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    async with ApnsSimulator() as apns:
        ios = apns_app_config(apns, tmp_path, request_timeout=60.0)
        config = base_config(tmp_path, {"sample": {"apps": {"ios": ios}}})
        apns.script(token(800), ApnsResponse.ok(delay=60.0))  # answers long after the test
        gateway = load_gateway(data=config)
        server = TestServer(create_app(gateway))
        # aiohttp waits that long for the request handlers at shutdown, then cancels them
        await server.start_server(shutdown_timeout=0.05)
        body = {"app": "ios", "token": token(800), "payload": {"aps": {}}}
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(session.post(server.make_url("/sample/push"), json=body))
            await apns.wait_for_requests(1)
            await server.close()  # the handler, in the middle of its send, is cancelled
            await asyncio.gather(request, return_exceptions=True)
    receipts = tmp_path / "receipts"
    assert not list(receipts.glob("*.open"))
    records = read_records(receipts)
    assert [(r["status"], r["reason"], r["http_status"], r["attempts"]) for r in records] == [
        ("transient", "shutting_down", None, 1)
    ]
    assert gateway.runtime.metrics.registry.get_sample_value("pushgw_receipts_lost_total") == 0


# --- found by review: each test failed before its fix ------------------------------------


async def test_a_credential_wide_throttle_closes_the_gate_even_without_a_retry_left() -> None:
    """The gate belongs to the credential, not to the push that heard the answer: a push
    with no retry left (SimpleX allows one, a push may allow none) still closes it, or
    every other push of the app goes on hitting a project that is over its quota."""
    quota = Attempt(
        Outcome.THROTTLED, 429, "QUOTA_EXCEEDED", retry_after=30.0, credential_wide=True
    )
    client = ScriptedClient(
        "android", lambda push: quota if push.token == "t1" else Attempt(Outcome.OK, 200)
    )
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    first = await dispatcher.send(Push("p", "android", "t1", {}, policy=PushPolicy(max_retries=0)))
    assert (first.outcome, first.reason, first.attempts) == (Outcome.THROTTLED, "QUOTA_EXCEEDED", 1)
    second = await dispatcher.send(Push("p", "android", "t2", {}, policy=PushPolicy(deadline=5)))
    assert (second.outcome, second.reason, second.attempts) == (
        Outcome.THROTTLED,
        Reason.GATE_CLOSED,
        0,
    )
    assert client.sent == ["t1"]
    await dispatcher.close()


async def test_unknown_app_ids_never_become_metric_labels() -> None:
    """An app id comes from a client's request (a plugin passes it on): each unknown one
    must not make a new series, or a client can grow the registry without bound."""
    client = ScriptedClient("android", lambda push: Attempt(Outcome.OK, 200))
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    for n in range(3):
        receipt = await dispatcher.send(Push("p", f"client-chosen-{n}", "t", {}))
        assert (receipt.outcome, receipt.reason) == (Outcome.PERMANENT, Reason.UNKNOWN_APP)
        assert receipt.app_id == f"client-chosen-{n}"  # the receipt still says which
    text = dispatcher.metrics.exposition().decode()
    assert "client-chosen" not in text
    unknown = dispatcher.metrics.registry.get_sample_value(
        "pushgw_pushes_total",
        {
            "plugin": "p",
            "provider": "none",
            "app": "",
            "outcome": "permanent",
            "reason": "unknown_app",
        },
    )
    assert unknown == 3
    await dispatcher.close()


async def test_a_validate_that_raises_still_gives_one_receipt(
    secrets_seen: set[str], caplog: pytest.LogCaptureFixture, register_secret: Any
) -> None:
    """validate() is the client's too: a bug there (a lone surrogate in a header value,
    a payload type it did not expect) must end the push with a receipt, not escape
    send() without one."""
    tok = "feedface" * 8
    secrets_seen.add(tok)
    register_secret(tok)

    class Raising(ScriptedClient):
        def validate(self, push: Push) -> Attempt | None:
            raise ValueError(f"cannot encode {push.token!r}")  # a bug quoting the token

    client = Raising("android", lambda push: Attempt(Outcome.OK, 200))
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    receipt = await dispatcher.send(Push("p", "android", tok, {}))
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.TRANSIENT,
        Reason.CLIENT_ERROR,
        0,
    )
    assert receipts == [receipt]
    assert client.sent == []  # nothing is sent that could not be checked
    assert dispatcher.in_flight == 0
    assert "client's validate() raised ValueError" in caplog.text
    assert tok not in caplog.text
    await dispatcher.close()
