"""Review from the seat of a bouncer serving Zulip servers of many versions at once
(6.x through main), each request written as that version's server builds it
(zerver/lib/push_notifications.py, zerver/lib/remote_server.py,
zerver/management/commands/register_server.py).

The finding's test failed before its fix; the others pin shapes older servers send, so
that an answer they rely on cannot drift.
"""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import select

from plugins.zulip.tables import legacy_devices, realms
from tests.zulip.conftest import PREFIX, Env, ZulipServer, apns_token, fcm_token, realm_dict


def _realm_80dev(realm_uuid: str) -> dict[str, object]:
    """A `realms` entry as 8.0-dev servers built it: no name, org_type or bot flag."""
    return {
        "id": 2,
        "uuid": realm_uuid,
        "uuid_owner_secret": "zuliprealm_x",
        "host": "chat.example.org",
        "url": "https://chat.example.org",
        "deactivated": False,
        "date_created": 1700000000.5,
    }


async def _deactivate(env: Env, server: ZulipServer) -> None:
    # `manage.py register_server --deactivate`: a JSON `{}` body.
    resp = await env.client.post(
        PREFIX + "server/deactivate",
        data=json.dumps({}),
        headers={**server.auth, "Content-Type": "application/json"},
    )
    assert resp.status == 200, await resp.json()


# --- finding: a server that registers again after deactivation gets its realms back ----


OLD_ORG_ID = str(uuid.uuid4())
NEW_ORG_ID = str(uuid.uuid4())


@pytest.mark.zulip_config(registration="allowlist", allowlist=[OLD_ORG_ID, NEW_ORG_ID])
async def test_server_registered_again_after_deactivation_uploads_its_realms(
    db_env: Env,
) -> None:
    # docs/zulip.md: "a server deactivated by mistake registers again under a new
    # zulip_org_id". Its realms (same Zulip database, same realm UUIDs) stayed held by
    # the deactivated registration, so every upload got 400 "Duplicate registration
    # detected." -- which a Zulip 8.0+ server answers by switching push notifications
    # off for every realm (remote_server.maybe_mark_pushes_disabled) -- and its E2EE
    # calls 403 REMOTE_REALM_SERVER_MISMATCH_ERROR, for good.
    env = db_env
    old = env.server()
    old.uuid = OLD_ORG_ID
    await old.register()
    realm_uuid = await old.add_realm()
    await _deactivate(env, old)
    again = env.server(old.hostname)  # new zulip_org_id and key, same EXTERNAL_HOST
    again.uuid = NEW_ORG_ID  # allowlisted: the operator vetted it
    await again.register()
    status, body = await again.analytics([realm_dict(realm_uuid)])
    assert (status, body) == (
        200,
        {
            "result": "success",
            "msg": "",
            "realms": {realm_uuid: {"can_push": True, "expected_end_timestamp": None}},
        },
    )
    # ... and the realm now answers for the new registration.
    token = apns_token()
    assert (await again.e2ee_register(realm_uuid, token))[0] == 200
    async with env.engine.connect() as conn:
        assert len((await conn.execute(select(realms))).all()) == 1


async def test_with_open_registration_nobody_takes_over_a_deactivated_servers_realms(
    env: Env,
) -> None:
    # Anyone may register under `open`: handing a deactivated server's realms (and their
    # devices) to whoever uploads their UUIDs would let a stranger push to those devices.
    old, realm_uuid = await env.ready_server()
    await _deactivate(env, old)
    stranger = env.server(old.hostname)
    await stranger.register()
    status, body = await stranger.analytics([realm_dict(realm_uuid)])
    assert (status, body["msg"]) == (400, "Duplicate registration detected.")
    assert (await stranger.e2ee_register(realm_uuid, apns_token()))[0] == 403


async def test_an_active_servers_realm_still_cannot_be_claimed(env: Env) -> None:
    owner, realm_uuid = await env.ready_server()
    other = env.server()
    await other.register()
    status, body = await other.analytics([realm_dict(realm_uuid)])
    assert (status, body["msg"]) == (400, "Duplicate registration detected.")
    assert (await owner.e2ee_register(realm_uuid, apns_token()))[0] == 200


# --- shapes older servers send (guards) -------------------------------------------------


async def test_v6_register_by_user_uuid_then_notify_with_both_ids(env: Env) -> None:
    # 6.x registered with user_uuid only; its notify sends user_uuid and user_id,
    # no realm_uuid, no device lists, and reads only the two totals.
    server = env.server()
    await server.register()
    user_uuid, token = str(uuid.uuid4()), fcm_token()
    form = {"server_uuid": server.uuid, "user_uuid": user_uuid, "token": token, "token_kind": "2"}
    assert (await server.form("push/register", form))[0] == 200
    status, body = await server.json(
        "push/notify",
        {
            "user_uuid": user_uuid,
            "user_id": 10,
            "apns_payload": {"alert": {"title": "t", "body": "b"}, "custom": {"zulip": {}}},
            "gcm_payload": {"event": "message", "content": "hello", "content_truncated": False},
            "gcm_options": {"priority": "high"},
        },
    )
    assert status == 200, body
    assert (body["total_android_devices"], body["total_apple_devices"]) == (1, 0)
    assert body["realm"] is None
    [sent] = env.fcm.requests_for(token)
    assert sent.message["data"]["content_truncated"] == "False"


async def test_upgrade_from_user_id_registrations_to_8x(env: Env) -> None:
    # A device registered by user_id (before 6.0) is registered again by an 8.x server
    # (user_id, user_uuid and realm_uuid): one registration remains, by user_uuid, and
    # the 8.x notify reaches the device once and reports nothing deleted.
    server, realm_uuid = await env.ready_server()
    user_uuid, token = str(uuid.uuid4()), apns_token()
    assert (await server.legacy_register(token, 1, user_id=10))[0] == 200
    status, _ = await server.legacy_register(
        token, 1, user_id=10, user_uuid=user_uuid, realm_uuid=realm_uuid
    )
    assert status == 200
    status, body = await server.json(
        "push/notify",
        {
            "user_uuid": user_uuid,
            "user_id": 10,
            "realm_uuid": realm_uuid,
            "apns_payload": {"alert": {"title": "t"}, "badge": 1, "custom": {"zulip": {}}},
            "gcm_payload": {},
            "gcm_options": {},
            "android_devices": [],
            "apple_devices": [token],
        },
    )
    assert status == 200, body
    assert body["total_apple_devices"] == 1
    assert body["deleted_devices"] == {"android_devices": [], "apple_devices": []}
    assert body["realm"] == {"can_push": True, "expected_end_timestamp": None}
    assert len(env.apns.requests_for(token)) == 1
    async with env.engine.connect() as conn:
        rows = (await conn.execute(select(legacy_devices))).all()
    assert [(r.user_id, r.user_uuid) for r in rows] == [(None, user_uuid)]


async def test_v7_unregister_and_unregister_all_with_both_ids(env: Env) -> None:
    # 7.x sends both ids (it cannot tell how the device was registered), no realm_uuid.
    server = env.server()
    await server.register()
    user_uuid = str(uuid.uuid4())
    by_id, by_uuid = fcm_token(), fcm_token()
    await server.legacy_register(by_id, 2, user_id=10)
    await server.legacy_register(by_uuid, 2, user_uuid=user_uuid)
    both = {"server_uuid": server.uuid, "user_uuid": user_uuid, "user_id": "10"}
    status, body = await server.form("push/unregister", {**both, "token": by_id, "token_kind": "2"})
    assert (status, body) == (200, {"result": "success", "msg": ""})
    assert (await server.form("push/unregister/all", both))[0] == 200
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(legacy_devices))).all() == []


async def test_pre_8_analytics_uploads(env: Env) -> None:
    # 6.x/7.x: no `realms`; 8.0-dev: realms without name/org_type; neither sends
    # api_feature_level. A 4xx here makes an 8.0+ server switch push off.
    server = env.server()
    await server.register()
    base = {"realm_counts": "[]", "installation_counts": "[]", "realmauditlog_rows": "[]"}
    status, body = await server.form("server/analytics", {**base, "version": '"6.2"'})
    assert (status, body) == (200, {"result": "success", "msg": "", "realms": {}})
    realm_uuid = str(uuid.uuid4())
    status, body = await server.form(
        "server/analytics",
        {**base, "realms": json.dumps([_realm_80dev(realm_uuid)]), "version": '"8.0-dev"'},
    )
    assert status == 200, body
    assert body["realms"] == {realm_uuid: {"can_push": True, "expected_end_timestamp": None}}
