"""Review (overload): a provider slower than the chat servers, or one that asks the
gateway to back off for a long time. The lane is the queue: bounded, deadline-aware,
and every accepted push ends with one receipt."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from gateway.core.push import Attempt, Outcome, Push, PushPolicy, Reason, Receipt
from gateway.core.slots import DeadlineSlots
from gateway.testing.apns_sim import ApnsResponse
from tests.core.test_dispatcher import (  # noqa: F401  (rig_factory is a fixture)
    ScriptedClient,
    rig_factory,
    scripted_dispatcher,
    token,
)

QUOTA = Attempt(Outcome.THROTTLED, 429, "QUOTA_EXCEEDED", retry_after=30.0, credential_wide=True)


async def test_pushes_queued_for_a_slot_do_not_pass_a_gate_closed_meanwhile() -> None:
    """A credential-wide 429 closes the gate for every push not yet sent, also those
    already waiting for one of the lane's slots: they wait behind the gate or, when it
    outlasts their deadline, end throttled/gate_closed without a request."""
    answer_first = asyncio.Event()

    async def answer(push: Push) -> Attempt:
        if push.token == "first":
            await answer_first.wait()
            return QUOTA
        return Attempt(Outcome.OK, 200)

    client = ScriptedClient("android", answer)
    client.max_in_flight = 1  # type: ignore[misc]
    receipts: list[Receipt] = []
    dispatcher = scripted_dispatcher(client, receipts)
    lane = dispatcher._lanes[("p", "android")]
    first = asyncio.create_task(
        dispatcher.send(Push("p", "android", "first", {}, policy=PushPolicy(deadline=50)))
    )
    await client.called.wait()
    queued = [
        asyncio.create_task(
            dispatcher.send(Push("p", "android", f"q{n}", {}, policy=PushPolicy(deadline=5)))
        )
        for n in range(3)
    ]
    while lane.slots.waiting < 3:  # each runs up to the slot the first push holds
        await asyncio.sleep(0)
    answer_first.set()  # 429 QUOTA_EXCEEDED, Retry-After 30 s: past their deadline
    results = await asyncio.gather(*queued)
    assert [(r.outcome, r.reason, r.attempts) for r in results] == [
        (Outcome.THROTTLED, Reason.GATE_CLOSED, 0)
    ] * 3
    assert client.sent == ["first"]  # the provider saw nothing more from the credential
    assert await dispatcher.drain(timeout=5.0)
    assert (await first).reason == Reason.SHUTTING_DOWN
    assert len(receipts) == 4
    await dispatcher.close()


async def test_a_slow_apns_server_with_few_streams_queues_in_the_lane(
    rig_factory: Callable[..., Any],  # noqa: F811
) -> None:
    """APNs allowing two streams per connection, answering in 0.2 s: a burst larger than
    it can take within the deadline waits in the lane, where pushes whose deadline
    passes end deadline_exceeded without a request. It used to wait inside the client:
    requests went out after their push's deadline, or timed out in bulk there (the
    server was never asked), and the timeouts opened the circuit breaker."""
    rig = await rig_factory({"ios": {"max_connections": 1, "request_timeout": 2.0}})
    rig.apns.set_max_concurrent_streams(2)
    rig.apns.script_all(ApnsResponse.ok(delay=0.2))
    pushes = [rig.push("ios", token(n), deadline=3.0) for n in range(60)]
    receipts = await rig.dispatcher.send_all(pushes)
    kinds = Counter((r.outcome, r.reason, r.attempts) for r in receipts)
    assert set(kinds) <= {(Outcome.OK, None, 1), (Outcome.TRANSIENT, Reason.DEADLINE_EXCEEDED, 0)}
    shed = kinds[(Outcome.TRANSIENT, Reason.DEADLINE_EXCEEDED, 0)]
    assert shed > 0  # 60 x 0.2 s over two streams does not fit in 3 s
    assert len(rig.apns.requests) == len(receipts) - shed  # no request for a shed push
    assert rig.dispatcher._lanes[("p", "ios")].breaker.opened_at is None
    assert len(rig.receipts) == len(pushes)  # one receipt each


async def test_resized_slots_serve_waiters_when_grown_and_absorb_releases_when_shrunk() -> None:
    slots = DeadlineSlots(2)
    later = asyncio.get_running_loop().time() + 30
    assert await slots.acquire(later) and await slots.acquire(later)
    waiters = [asyncio.create_task(slots.acquire(later)) for _ in range(3)]
    await asyncio.sleep(0)
    slots.resize(4)  # the provider allows more: two waiters served at once
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]
    slots.resize(1)  # four held, one allowed: three releases are absorbed
    for _ in range(3):
        slots.release()
    await asyncio.sleep(0)
    assert not waiters[2].done() and slots.waiting == 1
    slots.release()  # now the one held goes to the waiter
    assert await waiters[2]
