"""What both provider simulators share: lifecycle, and the record of what they received."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Generic, Protocol, Self, TypeVar


class _HasToken(Protocol):
    token: Any


R = TypeVar("R", bound=_HasToken)


class SimulatorBase(Generic[R]):
    """Base of both simulators: `async with`, `host`/`port`, and the request record
    (`requests`, `request_count`, `wait_for_requests()`).

    With `record=False` (long benchmarks) only the counter is kept, so memory stays flat.
    Subclasses implement `start()`/`stop()` and set `_host`/`_port` when bound.
    """

    _recording_noun = "requests"  # as the timeout message says it
    _recording_name = "simulator"
    _host: str
    _port: int

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def host(self) -> str:
        """The bound address (valid after `start`)."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (valid after `start`)."""
        return self._port

    @property
    def netloc(self) -> str:
        """`host:port` as a URL writes it: an IPv6 address in brackets, `[::1]:2197`."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def _init_recording(self, record: bool) -> None:
        self.record = record
        self.requests: list[R] = []
        self.request_count = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def _recorded(self, make: Callable[[], R]) -> None:
        """Count one request (and keep it, when recording); wake whoever waits for it."""
        self.request_count += 1
        if self.record:
            self.requests.append(make())
        for n, fut in self._waiters:
            if self.request_count >= n and not fut.done():
                fut.set_result(None)

    def _cancel_waiters(self) -> None:
        for _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    def requests_for(self, token: str) -> list[R]:
        """Recorded requests for one device token."""
        return [r for r in self.requests if r.token == token]

    def clear_requests(self) -> None:
        """Forget recorded requests and reset `request_count`."""
        self.requests.clear()
        self.request_count = 0

    async def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[R]:
        """Wait until at least `n` requests have arrived; return the recorded ones.

        Raises `TimeoutError` after `timeout` seconds.
        """
        if self.request_count < n:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (n, fut)
            self._waiters.append(entry)
            try:
                await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"{self._recording_name} got {self.request_count} of {n} "
                    f"{self._recording_noun} in {timeout}s"
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
        return list(self.requests)
