"""A lean HTTP/1.1 keep-alive client for load processes of the benchmarks.

Written by hand because a load generator must cost as little CPU as it can: on the
2-core machine the benchmarks target, the load process shares the cores with the
gateway it measures. aiohttp's client spends ~110 µs of CPU per request (connector,
request and response objects, header multidicts); this one spends a fraction of that
by sending prebuilt request bytes and reading only the status line and
Content-Length. No well-kept Python library is a load generator of that kind, and
wrk/h2load are not installable from the package registries this project uses.

It speaks what pushgw's aiohttp server answers: one request at a time per connection
(as Synapse's client does), responses with a Content-Length. Anything else is an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

_HEADER_END = b"\r\n\r\n"
_LENGTH = b"\r\ncontent-length:"


class HttpError(Exception):
    """The connection closed, or a response this client does not read."""


def post_request(url: str, body: bytes, content_type: str = "application/json") -> bytes:
    """The bytes of one keep-alive POST of `body` to `url`, built once, sent many times."""
    parts = urlsplit(url)
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\n"
        f"Host: {parts.netloc}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


P = TypeVar("P", bound=asyncio.Protocol)


async def connect(url: str, factory: Callable[[], P]) -> P:
    """A connection to `url`'s host and port, run by the protocol `factory` makes."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(
        factory, parts.hostname or "localhost", parts.port or 80
    )
    return protocol


class _Responses:
    """Splits the bytes of one connection into response statuses (Content-Length bodies)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[int]:
        """The statuses of the responses `data` completes, oldest first."""
        self._buffer += data
        statuses = []
        while (end := self._buffer.find(_HEADER_END)) >= 0:
            head = bytes(self._buffer[:end]).lower()
            at = head.find(_LENGTH)
            if at < 0:
                raise HttpError("response without Content-Length")
            line_end = head.find(b"\r\n", at + 2)
            length = int(head[at + len(_LENGTH) : line_end if line_end > 0 else None])
            total = end + len(_HEADER_END) + length
            if len(self._buffer) < total:
                break
            statuses.append(int(head[9:12]))
            del self._buffer[:total]
        return statuses


class Connection(asyncio.Protocol):
    """One keep-alive connection; `await request(raw)` gives the response status."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._responses = _Responses()
        self._waiter: asyncio.Future[int] | None = None
        self._closed: BaseException | None = None

    @classmethod
    async def open(cls, url: str) -> Connection:
        return await connect(url, cls)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = exc or HttpError("connection closed")
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._closed)

    def request(self, raw: bytes) -> asyncio.Future[int]:
        if self._closed is not None or self._transport is None:
            raise HttpError("connection closed")
        if self._waiter is not None and not self._waiter.done():
            raise HttpError("one request at a time per connection")
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(raw)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        try:
            statuses = self._responses.feed(data)
        except HttpError as exc:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            self.close()
            return
        if statuses and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(statuses[-1])

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class ClosedLoop(asyncio.Protocol):
    """One connection that sends its next request as soon as an answer ends, until `end`.

    Callbacks only, no task or future per request: the cheapest closed loop asyncio
    can run. Requests are `requests[offset]`, `requests[offset + step]`, ... (cycled).
    """

    def __init__(
        self,
        requests: list[bytes],
        offset: int,
        step: int,
        end: float,
        latencies: list[float],
        errors: dict[str, int],
        done: asyncio.Future[None],
    ) -> None:
        self._requests, self._next, self._step, self._end = requests, offset, step, end
        self._latencies, self._errors, self._done = latencies, errors, done
        self._responses = _Responses()
        self._transport: asyncio.Transport | None = None
        self._sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        now = time.perf_counter()
        if now >= self._end:
            self._transport.close()
            return
        self._sent_at = now
        self._transport.write(self._requests[self._next % len(self._requests)])
        self._next += self._step

    def data_received(self, data: bytes) -> None:
        try:
            statuses = self._responses.feed(data)
        except HttpError as exc:
            self._errors[type(exc).__name__] = self._errors.get(type(exc).__name__, 0) + 1
            assert self._transport is not None
            self._transport.close()
            return
        for status in statuses:
            self._latencies.append(time.perf_counter() - self._sent_at)
            if status != 200:
                self._errors[str(status)] = self._errors.get(str(status), 0) + 1
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
