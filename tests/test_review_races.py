"""Races: interleavings of concurrent requests, provider answers and commands that must
neither lose nor corrupt state, on SQLite and PostgreSQL.

Every interleaving is forced with `asyncio.Event`s (a provider client or repository
function held at a chosen point), never by sleeping; `asyncio.wait_for` guards only turn
a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from sqlalchemy import select

from gateway.cli import main as pushgw
from gateway.core.metrics import Metrics
from gateway.core.push import Attempt, InvalidToken, ProviderKind, Push
from gateway.core.tokens import TokenInvalidation
from gateway.testing.apns_sim import ApnsResponse
from gateway.testing.fcm_sim import FcmResponse
from plugins.zulip.crypto import token_id_of
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env, apns_token, fcm_token

# The zulip suite's fixtures: a running gateway on SQLite and on PostgreSQL.
db_env = zulip_fixtures.db_env
sims = zulip_fixtures.sims

T = TypeVar("T")
GUARD = 30.0  # seconds; only against hangs, never asserted on


async def _guarded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, GUARD)


class HeldAnswers:
    """Wraps an app's provider client: the answer for a held token is returned only once
    `release` is set (the request itself has been made and answered)."""

    def __init__(self, env: Env, app_id: str) -> None:
        lane = env.context.dispatcher._lanes[("zulip", app_id)]
        self.client = lane.client
        self.real_send = self.client.send
        self.answered = asyncio.Event()
        self.release = asyncio.Event()
        self.token: str | None = None

    def hold(self, monkeypatch: pytest.MonkeyPatch, token: str) -> None:
        self.token = token

        async def send(push: Push) -> Attempt:
            attempt = await self.real_send(push)
            if push.token == self.token:
                self.token = None  # only the first push to it
                self.answered.set()
                await self.release.wait()
            return attempt

        monkeypatch.setattr(self.client, "send", send)


def _apns_notify(token_id: str, realm_uuid: str, data: str = "AAAA") -> dict[str, Any]:
    return {
        "realm_uuid": realm_uuid,
        "push_requests": [
            {
                "token_id": token_id,
                "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
                "payload": {"push_key_id": 1, "encrypted_data": data},
            }
        ],
    }


async def _active_e2ee(env: Env) -> list[Any]:
    async with env.engine.connect() as conn:
        result = await conn.execute(select(e2ee_devices).where(e2ee_devices.c.expired_at.is_(None)))
        return list(result.all())


# --- zulip: a provider's late answer and a fresh registration ------------------------


async def test_zulip_late_token_invalid_spares_a_registration_made_after_the_request(
    db_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """APNs answers Unregistered to a push sent before the device registered its token
    again (after a reinstall, say). The answer is about the token as it was when that
    push was sent: the registration the device made afterwards must stay, or its next
    notifications are silently not sent. An answer to a later push still ends it."""
    env = db_env
    server, realm_uuid = await env.ready_server()
    token = apns_token()
    status, body = await server.e2ee_register(realm_uuid, token)
    assert status == 200, body
    env.apns.script(token, ApnsResponse.error("Unregistered"))
    held = HeldAnswers(env, "ios")
    held.hold(monkeypatch, token)
    notify = _apns_notify(token_id_of(token), realm_uuid)
    first = asyncio.ensure_future(server.json("push/e2ee/notify", notify))
    await _guarded(held.answered.wait())
    # Meanwhile the device registers again (after an app reinstall, say): the row is
    # active, registered after the held push was sent.
    status, body = await server.e2ee_register(realm_uuid, token)
    assert status == 200, body
    held.release.set()
    status, body = await _guarded(first)
    assert status == 200, body
    assert len(await _active_e2ee(env)) == 1
    # A push sent after the registration and refused: that one ends it.
    env.apns.script(token, ApnsResponse.error("Unregistered"))
    status, body = await server.json(
        "push/e2ee/notify", _apns_notify(token_id_of(token), realm_uuid, "BBBB")
    )
    assert status == 200, body
    assert body["delete_token_ids"] == [token_id_of(token)]
    assert await _active_e2ee(env) == []


async def test_zulip_late_token_invalid_spares_a_legacy_registration_made_meanwhile(
    db_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a legacy registration: FCM answers UNREGISTERED to a push sent before
    the server registered the token again; the row stays and the next notify targets it."""
    env = db_env
    server = env.server()
    await server.register()
    token = fcm_token()
    status, body = await server.legacy_register(token, 2, user_id=7)
    assert status == 200, body
    env.fcm.script(token, FcmResponse.unregistered())
    held = HeldAnswers(env, "android")
    held.hold(monkeypatch, token)
    notify = {"user_id": 7, "gcm_payload": {"event": "message"}, "android_devices": [token]}
    first = asyncio.ensure_future(server.json("push/notify", notify))
    await _guarded(held.answered.wait())
    status, body = await server.legacy_register(token, 2, user_id=7)
    assert status == 200, body
    held.release.set()
    status, body = await _guarded(first)
    assert status == 200, body
    assert body["deleted_devices"]["android_devices"] == []
    async with env.engine.connect() as conn:
        kept = (await conn.execute(select(legacy_devices.c.id))).all()
    assert len(kept) == 1


async def test_tokens_retire_spares_a_registration_made_after_the_files_receipts(
    db_env: Env, tmp_path: Path
) -> None:
    """`pushgw tokens retire FILE` run while the gateway serves: a dead-token file is made
    from receipts up to its `last_seen`; a device that registered its token since then
    keeps its registration, while one registered before is retired."""
    env = db_env
    server, realm_uuid = await env.ready_server()
    old, fresh = fcm_token(), fcm_token()
    status, body = await server.e2ee_register(realm_uuid, old, "fcm", ios_app_id=None)
    assert status == 200, body
    registered_before = time.time()
    status, body = await server.e2ee_register(realm_uuid, fresh, "fcm", ios_app_id=None)
    assert status == 200, body
    # `old` failed after both registrations, `fresh` only before its registration.
    lines = [
        {"token": old, "last_seen": time.time() + 60},
        {"token": fresh, "last_seen": registered_before - 60},
    ]
    dead = tmp_path / "dead-tokens.jsonl"
    dead.write_text(
        "".join(
            json.dumps(
                {
                    "plugin": "zulip",
                    "app_id": "android",
                    "provider": "fcm",
                    "token_hash": env.context.token_hash(line["token"]),
                    "reason": "UNREGISTERED",
                    "failures": 1,
                    "last_seen": line["last_seen"],
                }
            )
            + "\n"
            for line in lines
        )
    )
    config = tmp_path / "retire.yaml"
    config.write_text(yaml.safe_dump(env.harness.config))
    status = await asyncio.to_thread(pushgw, ["tokens", "retire", str(dead), "-c", str(config)])
    assert status == 0
    assert [row.token for row in await _active_e2ee(env)] == [fresh]


# --- gateway core: the dedup of token-invalid feedback -------------------------------


async def test_token_invalid_dedup_reports_concurrent_answers_once_and_later_ones_again() -> None:
    """Pushes to one dead token sent at once: their answers call the plugin's hook once,
    while the first call is still running. An answer to a push sent after that report
    began is news (the plugin kept a registration made after the first answer's request)
    and reaches the plugin at once, not 60 s later."""
    calls: list[float | None] = []
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hook(invalid: InvalidToken) -> None:
        calls.append(invalid.observed_at)
        entered.set()
        await release.wait()

    invalidation = TokenInvalidation(None, Metrics(), hook)
    sent = time.time()

    def answer(observed_at: float) -> InvalidToken:
        return InvalidToken(
            plugin="p",
            app_id="app",
            token_hash="ab" * 32,
            token="tok",
            provider=ProviderKind.FCM,
            reason="UNREGISTERED",
            observed_at=observed_at,
        )

    first = asyncio.ensure_future(invalidation.report(answer(sent)))
    await _guarded(entered.wait())
    assert await invalidation.report(answer(sent)) is False  # sent at once: left to the first
    release.set()
    assert await _guarded(first) is True
    assert await invalidation.report(answer(time.time() + 1)) is True  # sent after it began
    assert len(calls) == 2 and calls[0] == sent
