"""Performance review of the APNs hot path: each push's JSON body is encoded once, by
`validate`, and the same request is reused by every attempt (the first and its retries).
No timing here (bench/ measures): these tests count encodes through real deliveries to
the APNs simulator, and pin that the bytes sent and the refusals are what they were."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ApnsAppConfig, DeliveryConfig
from gateway.context import TokenHasher
from gateway.core import apns
from gateway.core.apns import ApnsClient
from gateway.core.dispatcher import Dispatcher
from gateway.core.metrics import Metrics
from gateway.core.push import ApnsOptions, InvalidToken, Outcome, Push, PushPolicy, Reason
from gateway.core.tokens import TokenInvalidation
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import apns_app_config

FAST = {"backoff_base": 0.01, "backoff_cap": 0.02}
MakeClient = Callable[..., ApnsClient]


def token(n: int) -> str:
    return f"{n:064x}"


def compact(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many times the APNs client encoded each payload (by the payload's id)."""
    counts: Counter[int] = Counter()
    real = apns._encode

    def counting(payload: Any) -> str:
        counts[id(payload)] += 1
        return real(payload)

    monkeypatch.setattr(apns, "_encode", counting)
    return counts


@pytest.fixture
async def sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as simulator:
        yield simulator


@pytest.fixture
async def make_client(sim: ApnsSimulator, tmp_path: Path) -> AsyncIterator[MakeClient]:
    clients: list[ApnsClient] = []

    def make(app_id: str = "ios", **overrides: Any) -> ApnsClient:
        config = ApnsAppConfig(**apns_app_config(sim, tmp_path, **overrides))
        client = ApnsClient(app_id, config)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def dispatcher(make_client: MakeClient) -> AsyncIterator[Dispatcher]:
    async def notify(_: InvalidToken) -> None:
        return None

    metrics = Metrics()
    dispatcher = Dispatcher(
        DeliveryConfig(**FAST), metrics, TokenInvalidation(None, metrics, notify), TokenHasher(b"k")
    )
    dispatcher.add_app("p", "ios", make_client())
    await dispatcher.start()
    yield dispatcher
    await dispatcher.close()


async def test_a_push_is_encoded_once_through_a_delivery_with_retries(
    sim: ApnsSimulator, dispatcher: Dispatcher, encodes: Counter[int]
) -> None:
    # Two transient answers, then accepted: three requests, one encoding.
    tok = token(1)
    sim.script(tok, ApnsResponse.error("InternalServerError"), ApnsResponse(503), ApnsResponse.ok())
    payload = {"aps": {"alert": {"title": "héllo", "body": "x" * 50}, "badge": 3}, "k": [1, 2]}
    receipt = await dispatcher.send(Push("p", "ios", tok, payload))
    assert (receipt.outcome, receipt.attempts) == (Outcome.OK, 3)
    assert encodes[id(payload)] == 1
    # The same bytes on the wire at every attempt: compact UTF-8 JSON.
    assert [r.body for r in sim.requests] == [compact(payload)] * 3
    assert [r.headers["apns-id"] for r in sim.requests] == [receipt.push_id] * 3


async def test_a_push_changed_between_attempts_is_built_again(
    sim: ApnsSimulator, make_client: MakeClient, encodes: Counter[int]
) -> None:
    client = make_client()
    await client.start()
    first = {"aps": {"alert": "one"}}
    push = Push("p", "ios", token(2), first)
    assert client.validate(push) is None
    assert (await client.send(push)).outcome is Outcome.OK
    # A new payload, token or options object: what is sent follows it, encoded once.
    second = {"aps": {"alert": "two"}}
    push.payload = second
    push.token = token(3)
    push.apns = ApnsOptions(collapse_id="c2", priority=5)
    assert (await client.send(push)).outcome is Outcome.OK
    assert (await client.send(push)).outcome is Outcome.OK
    assert (encodes[id(first)], encodes[id(second)]) == (1, 1)
    one, two, three = sim.requests
    assert (one.body, one.token) == (compact(first), token(2))
    assert (two.body, two.token, two.headers.get("apns-collapse-id")) == (
        compact(second),
        token(3),
        "c2",
    )
    assert (three.body, three.headers["apns-priority"]) == (compact(second), "5")
    # A copy made with `replace` is a new push: built for itself, nothing carried over.
    third = {"aps": {"alert": "three"}}
    copy = dataclasses.replace(push, payload=third)
    assert copy.prepared is None
    assert (await client.send(copy)).outcome is Outcome.OK
    assert sim.requests[-1].body == compact(third)


async def test_a_push_built_by_one_client_is_built_again_by_another(
    sim: ApnsSimulator, make_client: MakeClient
) -> None:
    # The app's default push type is the client's: another client's request is not reused.
    voip = make_client("voip", push_type="voip", topic="com.example.app.voip")
    alert = make_client("alert")
    await voip.start()
    await alert.start()
    push = Push("p", "x", token(4), {"aps": {"alert": "hi"}}, apns=ApnsOptions(push_type=None))
    assert voip.validate(push) is None
    assert (await alert.send(push)).outcome is Outcome.OK
    (request,) = sim.requests
    assert request.headers["apns-topic"] == "com.example.app"
    assert "apns-push-type" not in request.headers


@pytest.mark.parametrize(
    ("payload", "reason", "detail"),
    [
        ({"aps": {}, "x": "a" * 4100}, Reason.PAYLOAD_TOO_LARGE, "APNs payload is 4117 bytes"),
        ({"aps": {}, "x": math.nan}, Reason.INVALID_PAYLOAD, "not JSON-encodable (ValueError)"),
    ],
)
async def test_refusals_are_unchanged_and_encoded_once(
    sim: ApnsSimulator,
    dispatcher: Dispatcher,
    make_client: MakeClient,
    encodes: Counter[int],
    payload: dict[str, Any],
    reason: str,
    detail: str,
) -> None:
    receipt = await dispatcher.send(Push("p", "ios", token(5), payload))
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (Outcome.PERMANENT, reason, 0)
    assert receipt.detail is not None and detail in receipt.detail
    assert apns.payload_problem(payload, "alert") == receipt.detail
    assert encodes[id(payload)] == 2  # the dispatcher's validate, then payload_problem
    # A client asked to send what it refused (no dispatcher in between) refuses the same.
    client = make_client()
    await client.start()
    push = Push("p", "ios", token(5), payload, policy=PushPolicy(max_payload_bytes=None))
    refused = client.validate(push)
    assert refused is not None and (refused.reason, refused.detail) == (reason, receipt.detail)
    assert await client.send(push) == refused
    assert encodes[id(payload)] == 3
    assert sim.requests == []


async def test_many_pushes_sharing_one_payload_each_send_their_own_request(
    sim: ApnsSimulator, dispatcher: Dispatcher, encodes: Counter[int]
) -> None:
    # A plugin may hand the same payload object to many pushes (one per device): each
    # push keeps its own token and id, and is encoded once.
    payload = {"aps": {"content-available": 1}}
    background = ApnsOptions(push_type="background")
    pushes = [Push("p", "ios", token(10 + n), payload, apns=background) for n in range(5)]
    receipts = await dispatcher.send_all(pushes)
    assert all(r.outcome is Outcome.OK for r in receipts)
    assert encodes[id(payload)] == 5
    sent = {(r.token, r.headers["apns-id"]) for r in sim.requests}
    assert sent == {(p.token, p.id) for p in pushes}
    assert all(r.headers["apns-priority"] == "5" for r in sim.requests)  # background
