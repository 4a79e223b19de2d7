"""Clock steps: the wall clock stepped by NTP, a VM or laptop resumed from suspend.

Deadlines, backoff, rate limits, dedup windows and caches must count in one monotonic
clock; only what is exchanged with others (receipt `ts`, JWT `iat`, Nostr `created_at`,
APNs expiration, stored times) may read the wall clock, and then a step must not hold
or drop pushes. Every step here is simulated by replacing the clock the module reads;
nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from gateway.core.dispatcher import Dispatcher
from gateway.core.push import (
    Attempt,
    Outcome,
    Push,
    PushPolicy,
)
from gateway.core.tokens import InvalidationGuard
from plugins.marmot.keys import ServerKey
from plugins.marmot.limits import KeyedLimiter, TtlLru
from plugins.marmot.nostr import NIP59_TIME_WINDOW
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState
from plugins.zulip.auth import RateLimiter
from tests.core.test_dispatcher import ScriptedClient, scripted_dispatcher
from tests.marmot.test_config_limits import _Sink

HOUR = 3600.0
DAY = 86400.0


# --- dispatcher: the slot wait and the loop's clock ------------------------------------------


class _HeldClient(ScriptedClient):
    """One slot; the first push holds it until `release` is set."""

    max_in_flight = 1

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        super().__init__("android", self._answer)

    async def _answer(self, push: Push) -> Attempt:
        if len(self.sent) == 1:  # `send` recorded this push before asking
            self.holding.set()
            await self.release.wait()
        return Attempt(Outcome.OK, status=200)


@contextlib.asynccontextmanager
async def _started_with_loop_clock_off(
    offset: float, client: _HeldClient
) -> AsyncIterator[Dispatcher]:
    """A started dispatcher on a loop whose `time()` is `offset` from `time.monotonic()`;
    the held push released and the clock restored on the way out."""
    loop = asyncio.get_running_loop()
    real = type(loop).time
    loop.time = lambda: real(loop) + offset  # type: ignore[method-assign]
    try:
        dispatcher = scripted_dispatcher(client, [])
        await dispatcher.start()
        try:
            yield dispatcher
        finally:
            client.release.set()
            await dispatcher.close()
    finally:
        del loop.time


@pytest.mark.parametrize("offset", [3 * DAY, -3 * DAY])
async def test_a_push_waiting_for_a_slot_is_not_shed_when_the_loop_clock_is_not_time_monotonic(
    offset: float,
) -> None:
    """uvloop's `loop.time()` is libuv's clock: on macOS `mach_continuous_time`, which
    counts the time the machine slept, where `time.monotonic()` (`mach_absolute_time`)
    does not. After a laptop has slept for days, the two differ by days. Push deadlines
    are `time.monotonic()` values; the lane's slots compared them with `loop.time()`, so
    every push that had to wait for a slot was shed at once as `deadline_exceeded`
    (loop clock ahead), or waited past its deadline (loop clock behind)."""
    client = _HeldClient()
    async with _started_with_loop_clock_off(offset, client) as dispatcher:
        first = dispatcher.submit(Push("p", "android", "f1", {"data": {"k": "v"}}))
        await client.holding.wait()
        second = dispatcher.submit(Push("p", "android", "f2", {"data": {"k": "v"}}))
        for _ in range(20):  # let the second push reach the slot wait (or be shed)
            await asyncio.sleep(0)
        assert not second.done(), (await second).reason
        client.release.set()
        one, two = await first, await second
    assert (one.outcome, two.outcome) == (Outcome.OK, Outcome.OK), two.reason
    assert client.sent == ["f1", "f2"]


@pytest.mark.parametrize("offset", [3 * DAY, -3 * DAY])
async def test_a_push_waiting_for_a_slot_is_shed_at_its_deadline_whatever_the_loop_clock(
    offset: float,
) -> None:
    """The other half: with the loop clock behind `time.monotonic()`, the slot timer was
    armed `offset` too late and a push whose deadline passed while every slot was busy
    waited for days (its caller's HTTP answer with it) instead of ending at its deadline."""
    client = _HeldClient()
    async with _started_with_loop_clock_off(offset, client) as dispatcher:
        first = dispatcher.submit(Push("p", "android", "f1", {"data": {"k": "v"}}))
        await client.holding.wait()
        # Submitted long enough ago that its 1 s deadline is 10 ms away.
        late = Push("p", "android", "f2", {"data": {"k": "v"}}, policy=PushPolicy(deadline=1))
        late.submitted = time.monotonic() - 0.99
        # A guard, not a timing assert: the bug made this wait `offset` seconds.
        shed = await asyncio.wait_for(dispatcher.send(late), 30)
        client.release.set()
        await first
    assert (shed.outcome, shed.reason, shed.attempts) == (
        Outcome.TRANSIENT,
        "deadline_exceeded",
        0,
    )
    assert client.sent == ["f1"]


# --- marmot: the relay subscription window after a backward step -----------------------------


@pytest.mark.parametrize("step", [HOUR, DAY])
async def test_a_relay_resubscribing_after_the_clock_stepped_back_still_gets_every_new_wrap(
    step: float,
) -> None:
    """The subscription was interrupted while the wall clock ran `step` ahead (recorded as
    `disconnect_at`); NTP then stepped it back. `since` was `disconnect_at - 2 days - skew`,
    that is `step` later than the real disconnect: relays apply `since` to live events
    too, and a new gift wrap whose NIP-59 randomized `created_at` lies more than
    `2 days - step` back was never sent to us (with `step` one day, about half of the
    triggers, for as long as the subscription lasted)."""
    real_now = 1_800_000_000.0
    wall = [real_now + step]  # the clock runs `step` ahead
    settings = RelaySettings()
    client = RelayClient("ws://r", ServerKey.generate(), _Sink(), settings, clock=lambda: wall[0])
    client.connects = 1
    client.state = RelayState.LIVE
    client._on_closed("error: shutting down")  # the relay closed our live subscription
    try:
        assert client.disconnect_at == real_now + step
        wall[0] = real_now  # NTP steps the clock back to the truth
        since = client.subscription_filter()["since"]
    finally:
        await client.stop()
    # A wrap sent now, with created_at randomized close to the full two days back:
    oldest_new_wrap = int(real_now) - NIP59_TIME_WINDOW + 1
    assert since <= oldest_new_wrap
    assert since == int(real_now) - NIP59_TIME_WINDOW - settings.max_future_skew


# --- what is already right: monotonic where it must be ---------------------------------------


def _step_wall_clock(monkeypatch: pytest.MonkeyPatch, by: float) -> None:
    """Step `time.time` (and only it) by `by` seconds from here on."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + by)


@pytest.mark.parametrize("by", [-DAY, DAY])
def test_zulip_rate_limit_and_invalidation_guard_ignore_wall_clock_steps(
    monkeypatch: pytest.MonkeyPatch, by: float
) -> None:
    limiter = RateLimiter(limit=2, window=60.0)
    assert limiter.hit("k") is None and limiter.hit("k") is None
    guard = InvalidationGuard(minimum=4, ratio=0.5, window=300.0)
    for _ in range(4):
        guard.record(True)
    assert guard.tripped
    _step_wall_clock(monkeypatch, by)
    assert limiter.hit("k") is not None  # still limited: neither bypassed nor held for ever
    assert guard.tripped


@pytest.mark.parametrize("by", [-DAY, DAY])
def test_marmot_default_limiters_and_dedup_ignore_wall_clock_steps(
    monkeypatch: pytest.MonkeyPatch, by: float
) -> None:
    dedup = TtlLru(10, ttl=60.0)
    limiter = KeyedLimiter(per_minute=1, per_hour=10, capacity=10)
    assert dedup.check_and_add("x") and limiter.allow("t")
    _step_wall_clock(monkeypatch, by)
    assert not dedup.check_and_add("x")  # the window neither ended early nor lasts a day
    assert not limiter.allow("t")
