"""Review of the FCM delivery hot path: what the CPU savings must not change.

The answer's body is taken from the buffer when it came whole with its headers (no
chunk iterator), still bounded to `BODY_LIMIT`; the body is handed to aiohttp as a
ready `BytesPayload` (no payload-registry lookup). The bytes on the wire, the body
bound and what a refusal's answer is classified with stay the same.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web

from gateway.core import fcm
from gateway.core.push import Outcome, Push
from gateway.testing import FcmSimulator
from tests.test_review_egress_proxy import fcm_client

TOKEN = "fcm-hot-path-token-0123456789"


@pytest.fixture
async def fcm_sim() -> AsyncIterator[FcmSimulator]:
    """The OAuth token endpoint (over TLS); the sends go to `_Answer`'s server."""
    async with FcmSimulator(tls=True) as sim:
        yield sim


class _Answer:
    """An aiohttp server that records each request's raw headers and body and answers
    `status` with `body` in one write (headers and body in one segment)."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.requests: list[tuple[dict[str, str], bytes]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((dict(request.headers), await request.read()))
        return web.Response(
            status=self.status,
            body=self.body,
            headers={"Content-Type": "application/json; charset=UTF-8", **self.headers},
        )


async def _serve(answer: _Answer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/projects/{project}/messages:send", answer.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/projects/{{project_id}}/messages:send"


async def _send_to(
    answer: _Answer, fcm_sim: FcmSimulator, tmp_path: Path, payload: dict[str, Any]
) -> Any:
    runner, send_url = await _serve(answer)
    try:
        async with fcm_client(fcm_sim, tmp_path, send_url=send_url) as client:
            push = Push(plugin="test", app_id="android", token=TOKEN, payload=payload)
            assert client.validate(push) is None
            return await client.send(push)
    finally:
        await runner.cleanup()


async def test_the_request_on_the_wire_is_the_compact_utf8_message_with_its_length(
    fcm_sim: FcmSimulator, tmp_path: Path
) -> None:
    """The body as a prepared payload: the same bytes, Content-Type and Content-Length
    as the bytes aiohttp wrapped itself (UTF-8, not \\u escapes; compact separators)."""
    answer = _Answer(200, b'{"name": "projects/p/messages/1"}')
    payload = {"data": {"body": "héllo ☃ \U0001f600", "n": "1"}, "android": {"priority": "high"}}
    attempt = await _send_to(answer, fcm_sim, tmp_path, payload)
    assert (attempt.outcome, attempt.provider_id) == (Outcome.OK, "projects/p/messages/1")
    [(headers, body)] = answer.requests
    expected = json.dumps(
        {"message": {**payload, "token": TOKEN}}, ensure_ascii=False, separators=(",", ":")
    ).encode()
    assert body == expected
    assert headers["Content-Type"] == "application/json; charset=UTF-8"
    assert headers["Content-Length"] == str(len(expected))
    assert "Transfer-Encoding" not in headers


async def test_a_refusal_answered_whole_keeps_its_retry_after(
    fcm_sim: FcmSimulator, tmp_path: Path
) -> None:
    """Retry-After is read only for answers other than 200: a 429 still honours it."""
    error = {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": []}}
    answer = _Answer(429, json.dumps(error).encode(), {"Retry-After": "17"})
    attempt = await _send_to(answer, fcm_sim, tmp_path, {"data": {"k": "v"}})
    assert (attempt.outcome, attempt.status, attempt.retry_after) == (Outcome.THROTTLED, 429, 17.0)


class _Response:
    """What `_read_bounded` uses of an `aiohttp.ClientResponse`: its `content` stream and
    `close()`."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self.content = content
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _stream(parts: list[bytes], eof: bool) -> aiohttp.StreamReader:
    # The connection's side of a stream: open, flow control a no-op.
    protocol = mock.Mock(connected=True, _reading_paused=False)
    stream = aiohttp.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    for part in parts:
        stream.feed_data(part)
    if eof:
        stream.feed_eof()
    return stream


@pytest.mark.parametrize(
    ("size", "kept", "closed"),
    [(300, 300, False), (1000, 1000, True), (1001, 1000, True), (5000, 1000, True)],
    ids=["under", "at-limit", "one-over", "far-over"],
)
async def test_a_body_that_came_whole_is_still_bounded(size: int, kept: int, closed: bool) -> None:
    """The buffered path (whole body at EOF): at most `limit` bytes, and a body that
    reaches the limit closes the connection (not reused), as the chunked path does."""
    body = bytes(range(256)) * (size // 256 + 1)
    response = _Response(_stream([body[:size]], eof=True))
    raw = await fcm._read_bounded(response, 1000)  # type: ignore[arg-type]
    assert raw == body[:kept]
    assert response.closed is closed


async def test_a_body_still_arriving_is_read_to_its_end() -> None:
    """Not at EOF yet: the chunked path reads on as the rest arrives."""
    stream = _stream([b'{"name": '], eof=False)
    response = _Response(stream)

    def rest() -> None:  # runs once the reader waits for more
        stream.feed_data(b'"projects/p/messages/2"}')
        stream.feed_eof()

    asyncio.get_running_loop().call_soon(rest)
    raw = await fcm._read_bounded(response, 1000)  # type: ignore[arg-type]
    assert raw == b'{"name": "projects/p/messages/2"}'
    assert response.closed is False
