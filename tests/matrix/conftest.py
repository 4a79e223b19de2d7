"""Fixtures for the matrix plugin: simulators, a running gateway, notify helpers."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import (
    GatewayHarness,
    apns_app_config,
    base_config,
    fcm_app_config,
)

VECTORS = json.loads(Path("/work/shared/specs/vectors/matrix-msc3013.json").read_text("utf-8"))
NOTIFY = "/_matrix/push/v1/notify"


def apns_pushkey(seed: int | None = None) -> tuple[str, str]:
    """(base64 pushkey, lowercase hex device token) of a 32-byte APNs token.

    Random unless `seed` is given: every test then feeds the suite-wide privacy check
    (tests/test_zz_privacy.py) tokens of its own."""
    fixed = None if seed is None else bytes((seed + i) % 256 for i in range(32))
    raw = secrets.token_bytes(32) if fixed is None else fixed
    return base64.b64encode(raw).decode(), raw.hex()


def fcm_pushkey(seed: int | None = None) -> str:
    tag = secrets.token_hex(8) if seed is None else f"{seed:04d}"
    return f"fcm-token-{tag}:APA91b" + "x" * 40


def notification(devices: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "event_id": "$3957tyerfgewrf384",
        "room_id": "!slw48wfj34rtnrf:example.com",
        "type": "m.room.message",
        "sender": "@exampleuser:matrix.org",
        "sender_display_name": "Major Tom",
        "room_name": "Mission Control",
        "room_alias": "#exampleroom:matrix.org",
        "prio": "high",
        "content": {"msgtype": "m.text", "body": "I'm floating in a most peculiar way."},
        "counts": {"unread": 2, "missed_calls": 1},
    }
    base.update(fields)
    base = {k: v for k, v in base.items() if v is not ...}
    base["devices"] = devices
    return {"notification": base}


def device(app_id: str, pushkey: str, **extra: Any) -> dict[str, Any]:
    return {"app_id": app_id, "pushkey": pushkey, "pushkey_ts": 12345678, **extra}


@pytest_asyncio.fixture
async def apns() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as sim:
        yield sim


@pytest_asyncio.fixture
async def fcm() -> AsyncIterator[FcmSimulator]:
    async with FcmSimulator() as sim:
        yield sim


GatewayFactory = Callable[..., Any]


@pytest.fixture
def make_gateway(apns: ApnsSimulator, fcm: FcmSimulator, tmp_path: Path) -> Callable[..., Any]:
    """`async with make_gateway(apps=..., **plugin_options) as gw:`; default apps:
    `com.example.ios` (APNs) and `com.example.android` (FCM v1)."""

    @asynccontextmanager
    async def factory(
        apps: dict[str, dict[str, Any]] | None = None,
        ios: dict[str, Any] | None = None,
        android: dict[str, Any] | None = None,
        **options: Any,
    ) -> AsyncIterator[GatewayHarness]:
        if apps is None:
            apps = {
                "com.example.ios": apns_app_config(apns, tmp_path, **(ios or {})),
                "com.example.android": fcm_app_config(fcm, tmp_path, **(android or {})),
            }
        section = {"apps": apps, "notify_deadline": 3.0, **options}
        config = base_config(tmp_path, {"matrix": section})
        async with GatewayHarness(config) as gw:
            yield gw

    return factory


@pytest_asyncio.fixture
async def gw(make_gateway: Callable[..., Any]) -> AsyncIterator[GatewayHarness]:
    async with make_gateway() as harness:
        yield harness


Post = Callable[[Any], Awaitable[tuple[int, Any]]]


@pytest.fixture
def post(gw: GatewayHarness) -> Post:
    async def send(body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await gw.client.post(NOTIFY, data=data)
        text = await response.text()
        if response.status == 200:
            assert response.content_type == "application/json"
            return 200, json.loads(text)
        return response.status, text

    return send
