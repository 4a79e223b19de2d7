"""TEST DOUBLE: a scripted websocket "relay" for behaviour no well-behaved relay shows.

The real relay used by the integration tests (PyPI nostr-relay) validates signatures and sizes
before storing, never answers ``CLOSED auth-required:``, and never sends garbage frames. This
double lets a test send exactly the frames it wants (hostile ones included) and see what the
client sends back. It is not a relay: no storage, no filters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed


class ScriptedRelay:
    """Accepts connections; records every client message; the test pushes frames with send()."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.connections: list[ServerConnection] = []
        self._server: Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ScriptedRelay:
        self._server = await serve(self._handler, "127.0.0.1", 0, max_size=None)
        self.port = next(iter(self._server.sockets)).getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handler(self, ws: ServerConnection) -> None:
        self.connections.append(ws)
        with contextlib.suppress(ConnectionClosed):  # the client may hang up any way it likes
            async for message in ws:
                try:
                    self.received.put_nowait(json.loads(message))
                except ValueError:
                    self.received.put_nowait(["<unparsable>", message])

    async def expect(self, kind: str, timeout: float = 10.0) -> list[Any]:
        """The next client message of type ``kind`` (others are skipped)."""
        while True:
            msg = await asyncio.wait_for(self.received.get(), timeout)
            if msg and msg[0] == kind:
                return msg

    async def send(self, frame: str | list[Any], conn: int = -1) -> None:
        text = frame if isinstance(frame, str) else json.dumps(frame, separators=(",", ":"))
        await self.connections[conn].send(text)
