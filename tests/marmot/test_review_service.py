"""Regression tests from a review of the Marmot pipeline (limiters, shutdown).

Each test pins one bug that the older tests missed because of a lucky constant (a clock that
started at 1000.0) or an idle pipeline.
"""

from __future__ import annotations

import pytest

from plugins.marmot.keys import ServerKey
from plugins.marmot.limits import KeyedLimiter

from .helpers import apns_device, chunk_for
from .test_service import Clock, Harness, trigger

# Clock values at which the old float schedule (tat += 60/n per event) had drifted a few ulps past
# the burst tolerance by the n-th event of a burst, so it admitted only n - 1.
DRIFTING_STARTS = [0.0, 3.3, 1000.0, 12345.678, 987654.321, 1_000_000.1]


@pytest.mark.parametrize("start", DRIFTING_STARTS)
@pytest.mark.parametrize("per_minute", [7, 13, 37, 100, 600, 1000])
def test_burst_admits_exactly_the_limit(start: float, per_minute: int) -> None:
    t = [start]
    lim = KeyedLimiter(per_minute, 10**9, 1, clock=lambda: t[0])
    assert sum(lim.allow() for _ in range(per_minute + 5)) == per_minute
    # and the rate after the burst is unchanged: one more per interval, not before
    t[0] += 60 / per_minute * 0.99
    assert not lim.allow()
    t[0] += 60 / per_minute * 0.02
    assert lim.allow() and not lim.allow()


@pytest.mark.parametrize("start", DRIFTING_STARTS)
@pytest.mark.parametrize("per_hour", [7, 37, 30_000])
def test_hourly_burst_admits_exactly_the_limit(start: float, per_hour: int) -> None:
    t = [start]
    lim = KeyedLimiter(10**9, per_hour, 1, clock=lambda: t[0])
    assert sum(lim.allow() for _ in range(per_hour + 5)) == per_hour


async def test_global_limit_600_wraps_all_unwrapped_whatever_the_clock(key: ServerKey) -> None:
    """Checklist 9 with the monotonic clock at 0.0: the 600th wrap was dropped too."""
    clock = Clock()
    clock.mono = 0.0
    h = Harness(key, clock)
    await h.service.start()
    try:
        await h.run(*[{"id": f"{i:064x}", "kind": 1059} for i in range(601)])
    finally:
        await h.service.stop()
    assert h.events("wrap", "wrap_malformed") == 600
    assert h.events("global_limit", "rate_limited") == 1


@pytest.fixture
def key() -> ServerKey:
    return ServerKey.generate()


def _wraps(key: ServerKey, n: int) -> list[str]:
    return [trigger(key, [chunk_for(key, apns_device())]) for _ in range(n)]


async def test_stop_finishes_queued_and_inflight_triggers(key: ServerKey) -> None:
    """Events queued when the service stops are processed, not silently discarded.

    The gateway stops services before it drains the dispatcher, so pushes submitted while the
    service drains are still delivered (or end with a receipt).
    """
    h = Harness(key, Clock(), concurrency=1)
    await h.service.start()
    h.feed(*_wraps(key, 20))
    await h.service.stop()
    assert len(h.pushes) == 20
    assert h.events("trigger", "accepted") == 20


async def test_stop_counts_what_it_could_not_finish(key: ServerKey) -> None:
    """Past the drain bound, what is left is counted, never dropped without a trace."""
    h = Harness(key, Clock(), concurrency=1)
    h.service.drain_timeout = 0.0
    await h.service.start()
    h.feed(*_wraps(key, 20))
    await h.service.stop()
    dropped = h.events("shutdown", "dropped")
    assert dropped > 0
    # every event is accounted for: pushed, or counted as dropped at shutdown
    assert len(h.pushes) + dropped == 20
    assert h.events("internal", "error") == 0


async def test_service_restarts_after_stop(key: ServerKey) -> None:
    h = Harness(key, Clock())
    await h.service.start()
    await h.service.stop()
    await h.service.start()
    try:
        await h.run(*_wraps(key, 2))
    finally:
        await h.service.stop()
    assert len(h.pushes) == 2
