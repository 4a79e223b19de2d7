"""`DeadlineSlots`: a lane's concurrency limit, whose waiters give up at their deadline.

asyncio has no semaphore whose waiters carry deadlines: `asyncio.timeout_at` around
`Semaphore.acquire()` arms, and then cancels, one timer per waiting push, which cost
about a third of the dispatcher's own time per push on a saturated lane. Here a lane
keeps one timer, armed for the earliest deadline among its waiters; waiters are served
in FIFO order, and a waiter whose deadline passes is told so (`acquire` returns False)
without ever holding a slot.
"""

from __future__ import annotations

import asyncio
from collections import deque


class DeadlineSlots:
    """`limit` slots; `acquire(deadline)` waits in FIFO order until a slot or the deadline.

    Deadlines are `loop.time()` values: `time.monotonic()` on asyncio's own loop, not on
    uvloop's on macOS (libuv counts the time the machine slept there).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._free = limit
        self._waiters: deque[tuple[float, asyncio.Future[bool]]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        """Pushes waiting for a slot."""
        return sum(1 for _, future in self._waiters if not future.done())

    async def acquire(self, deadline: float) -> bool:
        """True once a slot is held (`release()` it); False if `deadline` came first."""
        if self._free > 0:  # then nobody is waiting: release() serves waiters first
            self._free -= 1
            self._waiters.clear()  # only expired or cancelled ones can be left
            return True
        loop = asyncio.get_running_loop()
        if deadline <= loop.time():
            return False
        future: asyncio.Future[bool] = loop.create_future()
        self._waiters.append((deadline, future))
        if self._timer is None or deadline < self._timer.when():
            self._arm(loop, deadline)
        try:
            return await future
        except asyncio.CancelledError:
            # Granted and cancelled in the same loop iteration: hand the slot on.
            if future.done() and not future.cancelled() and future.result():
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest waiter still waiting, else to the pool."""
        if self._free < 0:  # more held than a shrunk limit allows: this one is gone
            self._free += 1
            return
        waiters = self._waiters
        while waiters:
            _, future = waiters.popleft()
            if not future.done():  # skip the expired and the cancelled
                future.set_result(True)
                return
        self._free += 1

    def resize(self, limit: int) -> None:
        """Change the number of slots (a provider that now allows more or fewer requests
        at once): a grown limit serves waiters at once, a shrunk one as slots come back."""
        limit = max(limit, 1)
        self._free += limit - self.limit
        self.limit = limit
        waiters = self._waiters
        while self._free > 0 and waiters:
            _, future = waiters.popleft()
            if not future.done():  # skip the expired and the cancelled
                future.set_result(True)
                self._free -= 1

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """Tell every waiter past its deadline; re-arm for the earliest one left."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for deadline, future in self._waiters:
            if deadline <= now and not future.done():
                future.set_result(False)
        self._waiters = deque(w for w in self._waiters if not w[1].done())
        if self._waiters:
            earliest = min(deadline for deadline, _ in self._waiters)
            self._arm(loop, earliest)
