"""How a pushgw process runs: its event loop (`server.event_loop`) and collector.

uvloop (libuv underneath) does the socket I/O and scheduling that sit between chat
servers and providers in C: a Matrix notify request took ~8 % less gateway CPU on it.
It is the default where it is installed. `asyncio` keeps the standard loop, for
debugging or platforms uvloop does not build on.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gateway.config import EventLoop

T = TypeVar("T")


def uses_uvloop(choice: EventLoop) -> bool:
    if choice == "auto":
        return importlib.util.find_spec("uvloop") is not None
    return choice == "uvloop"


def loop_factory(choice: EventLoop = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    if uses_uvloop(choice):
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: EventLoop = "auto") -> T:
    """`asyncio.run` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


# Collect the young generation after this many net allocations (CPython: 700). A push
# allocates a few dozen tracked objects and many are in flight at once: at 700 the
# collector ran every few dozen pushes, ~10 % of the CPU of an FCM push.
YOUNG_GENERATION_THRESHOLD = 10_000


def tune_gc() -> None:
    """Start-up's objects out of the collector's way; young collections less often.

    Libraries, config and clients are ~10^5 long-lived objects; a full collection over
    them pauses the event loop for tens of milliseconds (p99 latency). Frozen, they
    cost nothing while the gateway runs (`thaw_gc` lets go of them when it stops). Run
    once start-up is done.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)


def thaw_gc() -> None:
    """Undo `tune_gc`'s freeze when a gateway stops.

    Frozen objects are never collected, even once unreachable: in a process that runs
    a gateway more than once (tests, `GatewayHarness`, an embedding application), every
    stopped gateway (its apps, clients, caches, metrics) and whatever else was alive at
    its start stayed in memory for good. Thawed, the collector reclaims them. A gateway
    still running in the same process only loses the freeze's saving until its next start.
    """
    gc.unfreeze()
