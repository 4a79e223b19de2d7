"""Started `ApnsClient`s against the APNs simulator, for the tests that drive one directly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gateway.config import ApnsAppConfig
from gateway.core.apns import ApnsClient
from gateway.testing import ApnsSimulator
from gateway.testing.harness import apns_app_config

MakeClient = Callable[..., Awaitable[ApnsClient]]


@asynccontextmanager
async def started_clients(
    sim: ApnsSimulator, directory: Path, **defaults: Any
) -> AsyncIterator[MakeClient]:
    """`make(**overrides)`: a started client of app `ios` (token auth, a fresh key the
    simulator trusts; `defaults`, then `overrides`, over the harness's settings), each
    closed on the way out."""
    clients: list[ApnsClient] = []

    async def make(**overrides: Any) -> ApnsClient:
        settings = apns_app_config(sim, directory, **{**defaults, **overrides})
        client = ApnsClient("ios", ApnsAppConfig(**settings))
        await client.start()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            await client.close()
