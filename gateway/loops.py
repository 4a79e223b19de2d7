"""Which asyncio event loop a pushgw process runs on (`server.event_loop`).

uvloop (libuv underneath) roughly halves the cost of socket I/O and scheduling, which
is most of what a gateway does between providers and chat servers; it is the default
where it is installed. `asyncio` keeps the standard loop, for debugging or platforms
uvloop does not build on.
"""

from __future__ import annotations

import asyncio
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
