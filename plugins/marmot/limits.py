"""In-memory caches and rate limiters (spec sections 7 and 8). Nothing here is ever persisted.

All structures are bounded LRUs: when full, the oldest entry goes, and nothing ever blocks. Keys are
hashes or event ids; they live only in this process's memory. Not thread-safe: the service touches
them from the event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

__all__ = ["DualRateLimiter", "KeyedLimiter", "LruSet", "TtlLru"]

Clock = Callable[[], float]
_NS = 1_000_000_000


class LruSet:
    """A set of at most ``capacity`` keys, least recently added evicted first (seen-wrap cache)."""

    __slots__ = ("_d", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def add(self, key: Hashable) -> None:
        d = self._d
        if key in d:
            d.move_to_end(key)
            return
        d[key] = None
        if len(d) > self.capacity:
            d.popitem(last=False)


class TtlLru:
    """Keys kept for ``ttl`` seconds from insertion, never longer; at most ``capacity`` of them.

    Used for content dedup: :meth:`check_and_add` is the only operation. An entry's lifetime is
    fixed at insertion (a duplicate does not extend it), whatever happens to the trigger.
    """

    __slots__ = ("_d", "capacity", "clock", "ttl")

    def __init__(self, capacity: int, ttl: float, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self._d: OrderedDict[Hashable, float] = OrderedDict()  # key -> expiry, insertion order

    def __len__(self) -> int:
        return len(self._d)

    def _expire(self, now: float) -> None:
        d = self._d
        while d:
            key, expiry = next(iter(d.items()))
            if expiry > now:
                break
            del d[key]

    def check_and_add(self, key: Hashable) -> bool:
        """True if ``key`` is new (and now recorded); False if it is a live duplicate."""
        now = self.clock()
        self._expire(now)
        if key in self._d:
            return False
        self._d[key] = now + self.ttl
        if len(self._d) > self.capacity:
            self._d.popitem(last=False)  # the oldest live entry: processing never blocks
        return True


class DualRateLimiter:
    """``per_minute`` and ``per_hour`` token buckets (GCRA), burst equal to each limit.

    Same semantics as a ``governor`` quota ``per_minute(n)``: n events at once, then one every
    60/n seconds. An event is admitted only if both rates allow it, and then counts against both.
    """

    __slots__ = ("_burst", "_interval", "clock")

    def __init__(self, per_minute: int, per_hour: int, clock: Clock = time.monotonic) -> None:
        if per_minute < 1 or per_hour < 1:
            raise ValueError("rate limits must be >= 1")
        # The schedule is kept in integer nanoseconds. In float seconds, adding 60/n once per
        # event drifts a few ulps over a burst, enough to refuse the n-th event at some clock
        # values (600/min admitted 599 with the clock at 0.0). In integers the burst is exactly
        # n however the interval was rounded.
        self._interval = (
            max(1, round(60 * _NS / per_minute)),
            max(1, round(3600 * _NS / per_hour)),
        )
        # GCRA: admit while tat - now <= tolerance; tolerance = (burst - 1) * interval
        self._burst = ((per_minute - 1) * self._interval[0], (per_hour - 1) * self._interval[1])
        self.clock = clock

    def admit(self, state: list[int], now: float) -> bool:
        """Try to admit one event against ``state`` ([tat_minute, tat_hour], in ns); update on
        success. ``now`` is in seconds, from ``clock``."""
        i0, i1 = self._interval
        now_ns = round(now * _NS)
        t0 = max(state[0], now_ns)
        t1 = max(state[1], now_ns)
        if t0 - now_ns > self._burst[0] or t1 - now_ns > self._burst[1]:
            return False
        state[0] = t0 + i0
        state[1] = t1 + i1
        return True


class KeyedLimiter:
    """A :class:`DualRateLimiter` per key, keys in an LRU of ``capacity`` (evicted keys reset)."""

    __slots__ = ("_states", "capacity", "limiter")

    def __init__(
        self, per_minute: int, per_hour: int, capacity: int, clock: Clock = time.monotonic
    ) -> None:
        self.limiter = DualRateLimiter(per_minute, per_hour, clock)
        self.capacity = capacity
        self._states: OrderedDict[Hashable, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def allow(self, key: Hashable = None) -> bool:
        return self.allow_each((key,))[0]

    def allow_each(self, keys: Iterable[Hashable]) -> list[bool]:
        """`allow(key)` for each key in turn, at one instant (the chunks of one trigger)."""
        now = self.limiter.clock()
        states = self._states
        get, admit, capacity = states.get, self.limiter.admit, self.capacity
        out = []
        for key in keys:
            state = get(key)
            if state is None:
                state = states[key] = [0, 0]
                if len(states) > capacity:
                    states.popitem(last=False)
            else:
                states.move_to_end(key)
            out.append(admit(state, now))
        return out
