"""`DeadlineSlots`: a lane's concurrency limit, whose waiters give up at their deadline.

asyncio has no semaphore whose waiters carry deadlines: `asyncio.timeout_at` around
`Semaphore.acquire()` arms, and then cancels, one timer per waiting push, which cost
about a third of the dispatcher's own time per push on a saturated lane. Here a lane
keeps one timer, armed for the earliest deadline among its waiters; waiters are served
in FIFO order, and a waiter whose deadline passes is told so (`acquire` returns False)
without ever holding a slot. The waiters' deadlines are also kept in a heap, so the timer
only ever looks at the waiters it expires: pushes whose deadlines are spread over time
expire one by one, and a scan of the whole queue at each of them cost quadratic time in
the queue's length, on the event loop, when a lane was most loaded.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
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
        # (deadline, arrival, future): the same waiters by deadline; entries of waiters
        # already served or cancelled are dropped when they reach the top.
        self._deadlines: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._arrivals = itertools.count()
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
            self._deadlines.clear()
            return True
        loop = asyncio.get_running_loop()
        if deadline <= loop.time():
            return False
        future: asyncio.Future[bool] = loop.create_future()
        self._waiters.append((deadline, future))
        heapq.heappush(self._deadlines, (deadline, next(self._arrivals), future))
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
                if len(self._deadlines) > 2 * len(waiters) + 64:
                    self._compact_deadlines()
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
        """Tell the waiters past their deadline; re-arm for the earliest one left."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines = self._deadlines
        while deadlines and (deadlines[0][0] <= now or deadlines[0][2].done()):
            _, _, future = heapq.heappop(deadlines)
            if not future.done():
                future.set_result(False)  # release() skips it in the FIFO
        if len(self._waiters) > 2 * len(deadlines) + 64:
            # Mostly expired: each waiter is in the heap until it is served, so at least
            # half of the FIFO is dead; dropping them costs what their expiry did.
            self._waiters = deque(w for w in self._waiters if not w[1].done())
        if deadlines:
            self._arm(loop, deadlines[0][0])

    def _compact_deadlines(self) -> None:
        """Drop the heap entries of served waiters, once they are most of it (they would
        otherwise stay until their deadline: under a burst, a second copy of the queue)."""
        self._deadlines = [entry for entry in self._deadlines if not entry[2].done()]
        heapq.heapify(self._deadlines)
