"""Black-box: the zulip plugin's storage under truly concurrent requests, on SQLite and
PostgreSQL.

Two requests run at once against the real aiohttp app. The interleaving is forced by
wrapping repository functions with `asyncio.Event`s, so that one request is held inside
its open transaction until the other has reached a given point: no sleeps, no timing.
The `asyncio.wait_for` guards only turn a hang (a broken interleaving) into a failure.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest
from sqlalchemy import select

from plugins.zulip import repo
from plugins.zulip.tables import realms
from tests.zulip.conftest import Env, realm_dict

T = TypeVar("T")
GUARD = 60.0  # seconds; only against hangs, never asserted on


async def _guarded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, GUARD)


async def _server_id(env: Env, server_uuid: str) -> int:
    async with env.engine.connect() as conn:
        row = await repo.get_server(conn, server_uuid)
    assert row is not None
    return int(row.id)


async def test_realm_claim_race_loser_gets_duplicate_registration(
    db_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers upload the same new realm at once: exactly one of them owns it.

    A inserts the realm and is held inside its uncommitted transaction until B has passed
    the "Duplicate registration" check (which cannot see A's row yet); then A commits and
    B's insert hits the unique constraint. B must get Zulip's 400, not `can_push: true`
    for a realm it does not own.
    """
    env = db_env
    first, second = env.server(), env.server()
    await first.register()
    await second.register()
    first_id = await _server_id(env, first.uuid)
    realm_uuid = str(uuid.uuid4())
    first_claimed = asyncio.Event()  # A's realm row is inserted, not committed
    second_checked = asyncio.Event()  # B passed the duplicate check
    real_check = repo.realms_of_other_servers
    real_upsert = repo.upsert_realms

    async def check(conn: Any, server_id: int, uuids: Any) -> list[str]:
        if server_id != first_id:
            await first_claimed.wait()
        result = await real_check(conn, server_id, uuids)
        if server_id != first_id:
            second_checked.set()
        return result

    async def upsert(conn: Any, server_id: int, infos: Any, *, complete: bool) -> Any:
        rows = await real_upsert(conn, server_id, infos, complete=complete)
        if server_id == first_id:
            first_claimed.set()
            await second_checked.wait()  # hold A's transaction open
        return rows

    monkeypatch.setattr(repo, "realms_of_other_servers", check)
    monkeypatch.setattr(repo, "upsert_realms", upsert)
    (status_a, body_a), (status_b, body_b) = await _guarded(
        asyncio.gather(
            first.analytics([realm_dict(realm_uuid)]),
            second.analytics([realm_dict(realm_uuid)]),
        )
    )
    assert status_a == 200, body_a
    assert body_a["realms"] == {realm_uuid: {"can_push": True, "expected_end_timestamp": None}}
    assert (status_b, body_b["code"], body_b["msg"]) == (
        400,
        "BAD_REQUEST",
        "Duplicate registration detected.",
    ), body_b
    async with env.engine.connect() as conn:
        owners = (await conn.execute(select(realms.c.server_id))).scalars().all()
    assert owners == [first_id]


async def test_concurrent_analytics_never_lower_the_row_ids(
    db_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both uploads read the server row (ids 0) at login; the one with the lower ids
    writes last. The stored ids must stay at the highest seen, or the server would
    re-upload rows it already sent."""
    env = db_env
    server = env.server()
    await server.register()
    low_waiting = asyncio.Event()
    high_done = asyncio.Event()
    real_record = repo.record_analytics_ids

    async def record(conn: Any, row: Any, ids: Any, meta: Any) -> None:
        if ids["last_realm_count_id"] == 50:
            low_waiting.set()
            await high_done.wait()  # the low upload logged in before the high one wrote
        await real_record(conn, row, ids, meta)

    monkeypatch.setattr(repo, "record_analytics_ids", record)

    def rows(top: int) -> dict[str, Any]:
        return {
            "realm_counts": [{"id": top, "property": "x", "end_time": 1.0, "value": 1}],
            "installation_counts": [{"id": top + 1, "property": "y", "end_time": 1.0}],
            "realmauditlog_rows": [{"id": top + 2, "event_type": 1, "event_time": 1.0}],
        }

    low = asyncio.ensure_future(server.analytics([], **rows(50)))
    await _guarded(low_waiting.wait())
    status, body = await _guarded(server.analytics([], **rows(100)))
    assert status == 200, body
    high_done.set()
    status, body = await _guarded(low)
    assert status == 200, body
    status, body = await server.get("server/analytics/status")
    assert status == 200, body
    assert (
        body["last_realm_count_id"],
        body["last_installation_count_id"],
        body["last_realmauditlog_id"],
    ) == (100, 101, 102)


async def test_e2ee_register_records_the_realm_request_at_lookup(db_env: Env) -> None:
    """Spec §5.1 step 1 (and Zulip's bouncer): the realm's last request time is recorded
    right after the realm lookup, also when the registration then fails."""
    env = db_env
    server, realm_uuid = await env.ready_server()
    status, body = await server.form(
        "push/e2ee/register",
        {
            "realm_uuid": realm_uuid,
            "token_id": "+wKIhyAx/Eg=",
            "encrypted_push_registration": "AAAA",
            "bouncer_public_key": "invalid public key",
        },
    )
    assert (status, body["code"]) == (400, "INVALID_BOUNCER_PUBLIC_KEY"), body
    async with env.engine.connect() as conn:
        row = (await conn.execute(select(realms).where(realms.c.uuid == realm_uuid))).one()
    assert row.last_request_at is not None


@pytest.mark.zulip_config(legacy_api=False)
async def test_legacy_off_deleted_devices_are_unique(db_env: Env) -> None:
    """With `legacy_api: false` every listed token is reported once, as Zulip's bouncer
    does (it answers set differences), even when the request lists it twice."""
    server = db_env.server()
    await server.register()
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 1,
            "gcm_payload": {"event": "message"},
            "android_devices": ["b", "a", "b", "a"],
            "apple_devices": ["FF", "ff", "ff"],
        },
    )
    assert status == 200, body
    assert body["deleted_devices"] == {
        "android_devices": ["a", "b"],
        "apple_devices": ["FF", "ff"],
    }
