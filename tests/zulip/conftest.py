"""Fixtures for the zulip plugin: vectors, a running gateway with both simulators, and a
client that speaks to it the way a Zulip server does (form or JSON bodies, HTTP Basic)."""

from __future__ import annotations

import base64
import json
import secrets
import string
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from plugins.zulip.crypto import generate_bouncer_key, seal_registration, token_id_of

VECTORS = json.loads(Path("/work/shared/specs/vectors/zulip-crypto.json").read_text("utf-8"))
VECTOR = {v["id"]: v for v in VECTORS["vectors"]}
VECTOR_KEY = VECTOR["bouncer-keypair"]
IOS_APP_ID = "org.example.zulip"
PREFIX = "/api/v1/remotes/"


def apns_token() -> str:
    """A fresh APNs-shaped token (64 hex digits, upper case like zulip-flutter sends)."""
    return secrets.token_hex(32).upper()


def fcm_token() -> str:
    return "fcm-" + secrets.token_urlsafe(40)


def random_key() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(64))


class ZulipServer:
    """Drives the gateway like a Zulip server: form bodies, JSON bodies, HTTP Basic auth."""

    def __init__(self, client: Any, hostname: str | None = None) -> None:
        self.client = client
        self.uuid = str(uuid.uuid4())
        self.key = random_key()
        self.hostname = hostname or f"zulip-{self.uuid[:8]}.example.org"
        self.headers = {"User-Agent": "ZulipServer/12.0"}

    @property
    def auth(self) -> dict[str, str]:
        raw = base64.b64encode(f"{self.uuid}:{self.key}".encode()).decode()
        return {**self.headers, "Authorization": f"Basic {raw}"}

    async def form(
        self, endpoint: str, data: dict[str, Any] | None = None, *, auth: bool = True
    ) -> tuple[int, dict[str, Any]]:
        fields = {k: v for k, v in (data or {}).items() if v is not None}
        resp = await self.client.post(
            PREFIX + endpoint, data=fields, headers=self.auth if auth else self.headers
        )
        return resp.status, await resp.json()

    async def json(self, endpoint: str, body: Any) -> tuple[int, dict[str, Any]]:
        resp = await self.client.post(
            PREFIX + endpoint,
            data=json.dumps(body),
            headers={**self.auth, "Content-Type": "application/json"},
        )
        return resp.status, await resp.json()

    async def get(self, endpoint: str) -> tuple[int, dict[str, Any]]:
        resp = await self.client.get(PREFIX + endpoint, headers=self.auth)
        return resp.status, await resp.json()

    async def legacy_register(
        self, token: str, kind: int, **ids: Any
    ) -> tuple[int, dict[str, Any]]:
        """`push/register` (the legacy, unencrypted registration) of one device token."""
        data = {"token": token, "token_kind": str(kind), **{k: str(v) for k, v in ids.items()}}
        if kind == 1:
            data["ios_app_id"] = IOS_APP_ID
        return await self.form("push/register", data)

    async def register(self) -> dict[str, Any]:
        status, body = await self.try_register()
        assert status == 200, body
        return body

    async def try_register(self) -> tuple[int, dict[str, Any]]:
        """`server/register` as this server, whatever the answer."""
        return await self.form(
            "server/register",
            {
                "zulip_org_id": self.uuid,
                "zulip_org_key": self.key,
                "hostname": self.hostname,
                "contact_email": "admin@example.org",
            },
            auth=False,
        )

    async def analytics(self, realms: list[dict[str, Any]], **fields: Any) -> tuple[int, dict]:
        data = {
            "realm_counts": json.dumps(fields.pop("realm_counts", [])),
            "installation_counts": json.dumps(fields.pop("installation_counts", [])),
            "realms": json.dumps(realms),
            "version": json.dumps("12.0"),
            "api_feature_level": json.dumps(468),
        }
        data.update({k: json.dumps(v) for k, v in fields.items()})
        return await self.form("server/analytics", data)

    async def add_realm(self, realm_uuid: str | None = None) -> str:
        realm_uuid = realm_uuid or str(uuid.uuid4())
        status, body = await self.analytics([realm_dict(realm_uuid)])
        assert status == 200, body
        return realm_uuid

    async def e2ee_register(
        self,
        realm_uuid: str,
        token: str,
        kind: str = "apns",
        *,
        ios_app_id: str | None = IOS_APP_ID,
        public_key: str = VECTOR_KEY["public_key"],
        timestamp: int | None = None,
        token_id: str | None = None,
        plaintext: bytes | None = None,
    ) -> tuple[int, dict[str, Any]]:
        if plaintext is None:
            plaintext = registration_plaintext(token, kind, ios_app_id, timestamp)
        return await self.form(
            "push/e2ee/register",
            {
                "realm_uuid": realm_uuid,
                "token_id": token_id if token_id is not None else token_id_of(token),
                "encrypted_push_registration": seal_registration(public_key, plaintext),
                "bouncer_public_key": public_key,
            },
        )


def registration_plaintext(
    token: str, kind: str, ios_app_id: str | None, timestamp: int | None = None
) -> bytes:
    """As zulip-flutter builds it: token_kind, token, timestamp[, ios_app_id]."""
    data: dict[str, Any] = {
        "token_kind": kind,
        "token": token,
        "timestamp": int(time.time()) if timestamp is None else timestamp,
    }
    if ios_app_id is not None:
        data["ios_app_id"] = ios_app_id
    return json.dumps(data, separators=(",", ":")).encode()


def realm_dict(realm_uuid: str, **overrides: Any) -> dict[str, Any]:
    """A `realms` entry as a Zulip server uploads it (secrets included, never stored)."""
    return {
        "id": 2,
        "host": "chat.example.org",
        "url": "https://chat.example.org",
        "name": "Example",
        "org_type": 0,
        "date_created": 1700000000.0,
        "deactivated": False,
        "is_system_bot_realm": False,
        "authentication_methods": {"Email": True},
        "uuid": realm_uuid,
        "uuid_owner_secret": "zuliprealm_" + secrets.token_hex(16),
        **overrides,
    }


@pytest.fixture
def second_key() -> Iterator[tuple[str, str]]:
    yield generate_bouncer_key()


class Env:
    """A running gateway with the zulip plugin, both simulators and a helper to make servers."""

    def __init__(self, harness: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator) -> None:
        self.harness = harness
        self.apns = apns
        self.fcm = fcm

    @property
    def client(self) -> Any:
        return self.harness.client

    @property
    def context(self) -> Any:
        return self.harness.context("zulip")

    @property
    def engine(self) -> Any:
        return self.context.store.engine

    def server(self, hostname: str | None = None) -> ZulipServer:
        return ZulipServer(self.client, hostname)

    async def ready_server(self) -> tuple[ZulipServer, str]:
        server = self.server()
        await server.register()
        return server, await server.add_realm()


def zulip_config(
    apns: ApnsSimulator, fcm: FcmSimulator, directory: Path, **overrides: Any
) -> dict[str, Any]:
    section: dict[str, Any] = {
        "bouncer_keys": {VECTOR_KEY["public_key"]: VECTOR_KEY["private_key"]},
        "apps": {
            "ios": apns_app_config(apns, directory, topic=IOS_APP_ID),
            "android": fcm_app_config(fcm, directory),
        },
        "notify_deadline": 3.0,
        "push_deadline": 5.0,
    }
    section.update(overrides)
    return base_config(directory, {"zulip": section})


@pytest_asyncio.fixture
async def sims() -> AsyncIterator[tuple[ApnsSimulator, FcmSimulator]]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


@asynccontextmanager
async def _running(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    request: pytest.FixtureRequest,
    store_url: str | None = None,
) -> AsyncIterator[Env]:
    apns, fcm = sims
    marker = request.node.get_closest_marker("zulip_config")
    overrides = marker.kwargs if marker else {}
    config = zulip_config(apns, fcm, tmp_path, **overrides)
    if store_url is not None:
        config["store"] = {"url": store_url}
    async with GatewayHarness(config) as harness:
        yield Env(harness, apns, fcm)


@pytest_asyncio.fixture
async def env(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator], request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    """The gateway on SQLite."""
    async with _running(tmp_path, sims, request) as running:
        yield running


@pytest_asyncio.fixture
async def db_env(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    request: pytest.FixtureRequest,
    store_url: str,
) -> AsyncIterator[Env]:
    """The gateway on SQLite and on PostgreSQL (skipped with a reason when unreachable)."""
    async with _running(tmp_path, sims, request, store_url) as running:
        yield running
