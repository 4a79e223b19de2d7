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


class Connection(asyncio.Protocol):
    """One keep-alive connection; `await request(raw)` gives the response status."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[int] | None = None
        self._closed: BaseException | None = None

    @classmethod
    async def open(cls, url: str) -> Connection:
        parts = urlsplit(url)
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(
            cls, parts.hostname or "localhost", parts.port or 80
        )
        return protocol

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
        self._buffer += data
        end = self._buffer.find(_HEADER_END)
        if end < 0:
            return
        head = bytes(self._buffer[:end]).lower()
        at = head.find(_LENGTH)
        if at < 0:
            self._fail(HttpError("response without Content-Length"))
            return
        line_end = head.find(b"\r\n", at + 2)
        length = int(head[at + len(_LENGTH) : line_end if line_end > 0 else None])
        total = end + len(_HEADER_END) + length
        if len(self._buffer) < total:
            return
        status = int(head[9:12])
        del self._buffer[:total]
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(status)

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
