"""Following one push end to end as the on-call does: "my phone never got message X".

What an operator has is the log (at its documented levels), /metrics and the receipts
(`pushgw receipts cat`). For the same traffic they must tell the same story: a receipt's
`http_status` is the last provider answer whenever a request was made (docs/receipts.md),
the retry counter adds up to the receipts' `attempts - 1` (what the Spark report calls
`retries`), the per-push detail at DEBUG (docs/delivery.md) names the push id its receipt
carries, and no token reaches any of them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest

from gateway.core.push import Attempt, Outcome, Push, PushPolicy, Reason, Receipt
from gateway.receipt_files import read_records
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from plugins.marmot.keys import ServerKey
from tests.core.test_dispatcher import ScriptedClient, scripted_dispatcher
from tests.marmot.helpers import apns_device, chunk_for
from tests.marmot.test_service import Clock, Harness, trigger

NOTIFY = "/_matrix/push/v1/notify"
UNAVAILABLE = Attempt(Outcome.TRANSIENT, 503, "UNAVAILABLE")


def retries_counted(metrics: Any, app: str) -> float:
    value = metrics.registry.get_sample_value(
        "pushgw_push_retries_total", {"plugin": "p", "provider": "fcm", "app": app}
    )
    return value or 0.0


def dispatcher_debug(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.core.dispatcher" and r.levelno == logging.DEBUG
    ]


# --- breaker-open after retries: the receipt, the counter, the DEBUG line ---------------


async def test_breaker_opened_by_a_pushs_retries_its_receipt_keeps_the_last_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two 503s open the breaker (threshold 2): the push that made them ends
    `circuit_open` with `attempts: 2`, so its `http_status` is the last answer's 503,
    not null ("null when none was made"); the one retry it made is counted once, not
    also the retry it scheduled and never made."""
    caplog.set_level(logging.DEBUG, logger="gateway.core.dispatcher")
    client = ScriptedClient("android", lambda push: UNAVAILABLE)
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(
        client, receipts, circuit_breaker={"failure_threshold": 2, "reset_after": 60}
    )
    try:
        receipt = await dispatcher.send(Push("p", "android", "tok-breaker", {}))
        fast = await dispatcher.send(Push("p", "android", "tok-breaker-2", {}))
    finally:
        await dispatcher.close()
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.TRANSIENT,
        Reason.CIRCUIT_OPEN,
        2,
    )
    assert receipt.status == 503
    assert (fast.reason, fast.attempts, fast.status) == (Reason.CIRCUIT_OPEN, 0, None)
    made = sum(max(r.attempts - 1, 0) for r in receipts)
    assert made == 1
    assert retries_counted(dispatcher.metrics, "android") == made
    # The per-push detail names the push id: the line leads to its receipt.
    lines = dispatcher_debug(caplog)
    mine = [line for line in lines if receipt.push_id in line]
    assert len(mine) == 1 and "circuit_open" in mine[0] and "2 attempt" in mine[0]
    assert any(fast.push_id in line for line in lines)
    assert not any("tok-breaker" in line for line in lines)


async def test_deadline_passed_waiting_for_a_slot_to_retry_keeps_the_last_answer() -> None:
    """A push answered 503 waits (Retry-After) to retry, then for a slot another push
    holds, until its deadline: it ends `deadline_exceeded` after one request, whose 503
    its receipt keeps; the retry it never made is not counted."""
    release = asyncio.Event()

    async def answer(push: Push) -> Attempt:
        if push.token == "holder":
            await release.wait()
            return Attempt(Outcome.OK, 200)
        return Attempt(Outcome.TRANSIENT, 503, "UNAVAILABLE", retry_after=0.2)

    client = ScriptedClient("android", answer)
    client.max_in_flight = 1
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    try:
        late = asyncio.create_task(
            dispatcher.send(Push("p", "android", "late", {}, policy=PushPolicy(deadline=0.6)))
        )
        while client.sent != ["late"]:  # its first request answered; now backing off
            client.called.clear()
            await client.called.wait()
        holder = asyncio.create_task(dispatcher.send(Push("p", "android", "holder", {})))
        while "holder" not in client.sent:  # the holder has the lane's one slot
            client.called.clear()
            await client.called.wait()
        receipt = await late
        release.set()
        await holder
    finally:
        release.set()
        await dispatcher.close()
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.TRANSIENT,
        Reason.DEADLINE_EXCEEDED,
        1,
    )
    assert receipt.status == 503
    assert retries_counted(dispatcher.metrics, "android") == 0


async def test_a_failed_credential_refresh_keeps_the_auth_answers_status() -> None:
    """A 401 is answered with a refresh that raises (a client bug): the push ends
    `client_error` after one request, and its receipt keeps that request's 401."""
    client = ScriptedClient("android", lambda push: Attempt(Outcome.AUTH, 401, "UNAUTHENTICATED"))
    client.refresh_error = RuntimeError("boom")
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    try:
        receipt = await dispatcher.send(Push("p", "android", "tok-auth", {}))
    finally:
        await dispatcher.close()
    assert (receipt.outcome, receipt.reason, receipt.attempts, receipt.status) == (
        Outcome.TRANSIENT,
        Reason.CLIENT_ERROR,
        1,
        401,
    )


async def test_an_auth_retry_is_counted_as_the_retry_its_receipt_shows() -> None:
    """`auth` refreshes once and retries at once: a second request, `attempts: 2` in the
    receipt, so one retry in `pushgw_push_retries_total` too."""
    answers = iter([Attempt(Outcome.AUTH, 401, "UNAUTHENTICATED"), Attempt(Outcome.OK, 200)])
    client = ScriptedClient("android", lambda push: next(answers))
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    try:
        receipt = await dispatcher.send(Push("p", "android", "tok-auth-ok", {}))
    finally:
        await dispatcher.close()
    assert (receipt.outcome, receipt.attempts) == (Outcome.OK, 2)
    assert retries_counted(dispatcher.metrics, "android") == 1


# --- Marmot: a gateway reason after a 403 is no configuration error -----------------------


async def test_marmot_counts_no_config_error_for_a_push_shed_after_a_403() -> None:
    """An APNs 403 auth answer (a stale provider token) is refreshed and retried; if the
    deadline passes (or shutdown comes) first, the receipt is the gateway's own reason
    with the last answer's 403. That is no configuration error of the app: counting it
    as `config_errors_total{reason="deadline_exceeded"}` sends the on-call after a
    topic or certificate that is fine."""
    key = ServerKey.generate()
    h = Harness(key, Clock())
    h.outcome = lambda p: (Outcome.TRANSIENT, Reason.DEADLINE_EXCEEDED, 403)
    await h.service.start()
    try:
        await h.run(trigger(key, [chunk_for(key, apns_device())]))
    finally:
        await h.service.stop()
    assert h.sample("pushgw_marmot_pushes_total", platform="apns", result="transient") == 1
    configured = [
        s
        for metric in h.registry.collect()
        if metric.name == "pushgw_marmot_config_errors"
        for s in metric.samples
        if s.name.endswith("_total")
    ]
    assert configured == []


async def test_marmot_still_counts_a_provider_403_as_a_config_error() -> None:
    """The provider's own 403 (a reason not documented, so labelled by its status)
    stays a configuration error."""
    key = ServerKey.generate()
    h = Harness(key, Clock())
    h.outcome = lambda p: (Outcome.PERMANENT, "SomethingNew", 403)
    await h.service.start()
    try:
        await h.run(trigger(key, [chunk_for(key, apns_device())]))
    finally:
        await h.service.stop()
    assert h.sample("pushgw_marmot_config_errors_total", reason="403") == 1


# --- Matrix end to end: notify -> retries -> receipt file, metrics and log agree ----------


async def test_matrix_notify_traced_to_its_receipt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, register_secret: Any
) -> None:
    """A Synapse notify whose APNs push is answered 500, 503, 503 and opens the breaker:
    the homeserver gets 502; the receipt file says 2 requests, last 503, `circuit_open`;
    the retry counter says 1; the DEBUG line names the receipt's push id; neither the
    device token nor the pushkey is in the log."""
    caplog.set_level(logging.DEBUG)
    raw = secrets.token_bytes(32)
    pushkey = base64.b64encode(raw).decode()
    register_secret(raw.hex())
    register_secret(pushkey)
    async with ApnsSimulator() as apns:
        apns.script(
            raw.hex(),
            ApnsResponse.error("InternalServerError"),
            ApnsResponse.error("ServiceUnavailable"),
        )
        config = base_config(
            tmp_path,
            {"matrix": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
            delivery={"circuit_breaker": {"failure_threshold": 2, "reset_after": 60}},
            receipts={"format": "jsonl"},
        )
        async with GatewayHarness(config) as gw:
            body = {
                "notification": {
                    "event_id": "$X",
                    "room_id": "!r:example.org",
                    "counts": {"unread": 1},
                    "devices": [{"app_id": "ios", "pushkey": pushkey}],
                }
            }
            response = await gw.client.post(NOTIFY, json=body)
            assert response.status == 502
            metrics = gw.gateway.runtime.metrics
            metrics.flush()
            retries = metrics.registry.get_sample_value(
                "pushgw_push_retries_total", {"plugin": "matrix", "provider": "apns", "app": "ios"}
            )
    (record,) = read_records(tmp_path / "receipts")
    assert (record["status"], record["reason"], record["attempts"], record["http_status"]) == (
        "transient",
        "circuit_open",
        2,
        503,
    )
    assert record["provider"] == "apns" and record["app_id"] == "ios"
    assert retries == record["attempts"] - 1
    assert any(record["push_id"] in line for line in dispatcher_debug(caplog))
    assert raw.hex() not in caplog.text and pushkey not in caplog.text
