"""Review from the seat of a Zulip server administrator (Zulip 7 to 11) whose
`ZULIP_SERVICES_URL` points at pushgw: the registration lifecycle as
`manage.py register_server` drives it (zerver/management/commands/register_server.py),
each answer checked for what that command then shows or does.

`register_server` reports any error as `Error received from the push notification
service: "<msg>"`, so the `msg` is all its administrator gets to go on.
"""

from __future__ import annotations

from typing import Any

from plugins.zulip.crypto import token_id_of
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import (
    PREFIX,
    Env,
    ZulipServer,
    apns_token,
    fcm_token,
    random_key,
    realm_dict,
)

env = zulip_fixtures.env
sims = zulip_fixtures.sims


async def _post(env: Env, endpoint: str, data: dict[str, str]) -> tuple[int, dict[str, Any]]:
    # `register_server`'s own requests: a plain form POST, no authentication.
    resp = await env.client.post(
        PREFIX + endpoint, data=data, headers={"User-Agent": "ZulipServer/11.0"}
    )
    return resp.status, await resp.json()


# --- finding: `--registration-transfer` got "Endpoint not found" ----------------------------


async def test_registration_transfer_says_what_to_do_instead(env: Env) -> None:
    # A Zulip server reinstalled on a new machine without its old zulip-secrets.conf:
    # its new zulip_org_id finds its hostname held by the old registration. Zulip 10+'s
    # `register_server` then tells its administrator to run it again with
    # `--registration-transfer`, which POSTs `server/register/transfer` (then
    # `server/register/verify_challenge`). pushgw does not offer that flow (spec §3),
    # and answered "Endpoint not found": a dead end.
    old = env.server("chat.example.org")
    await old.register()
    new = ZulipServer(env.client, "chat.example.org")
    status, body = await new.try_register()
    assert (status, body["code"]) == (400, "HOSTNAME_ALREADY_IN_USE_BOUNCER_ERROR")

    status, body = await _post(env, "server/register/transfer", {"hostname": "chat.example.org"})
    assert status == 404 and body["result"] == "error" and body["code"] == "BAD_REQUEST"
    assert body["msg"] != "Endpoint not found"
    assert "does not offer registration transfer" in body["msg"]
    assert "pushgw zulip set-key" in body["msg"]  # what its operator runs for it
    status, again = await _post(
        env,
        "server/register/verify_challenge",
        {"hostname": "chat.example.org", "access_token": "x" * 43},
    )
    assert (status, again["msg"]) == (404, body["msg"])

    # Nothing changed hands: the old registration still authenticates, the new one
    # is still not registered.
    assert (await old.get("server/analytics/status"))[0] == 200
    status, body = await new.get("server/analytics/status")
    assert status == 401 and "is not registered" in body["msg"]


async def test_other_paths_are_still_just_unknown(env: Env) -> None:
    server = env.server()
    await server.register()
    for endpoint in ("server/billing", "server/register/transfer/more", "server/nope"):
        status, body = await server.form(endpoint)
        assert (status, body["msg"]) == (404, "Endpoint not found")
        resp = await env.client.get(PREFIX + endpoint, headers=server.auth)
        assert (resp.status, (await resp.json())["msg"]) == (404, "Endpoint not found")
    # ... and a GET of the transfer endpoint (not how register_server asks) still says
    # what to do instead.
    resp = await env.client.get(PREFIX + "server/register/transfer")
    body = await resp.json()
    assert resp.status == 404 and "pushgw zulip set-key" in body["msg"]


# --- guards: the rest of the lifecycle, as register_server drives it --------------------------


async def test_rotate_key_keeps_devices_and_refuses_the_old_key(env: Env) -> None:
    # `register_server --rotate-key`: the old key authenticates the request that sets
    # `new_org_key`. Afterwards the old key is refused everywhere (a second run with
    # stale secrets gets the admin error INVALID_ZULIP_SERVER), and every device
    # registered before keeps getting pushes under the new key.
    server, realm_uuid = await env.ready_server()
    fcm, apns = fcm_token(), apns_token()
    assert (await server.legacy_register(fcm, 2, user_id=10))[0] == 200
    assert (await server.legacy_register(apns, 1, user_id=10))[0] == 200
    e2ee = apns_token()
    assert (await server.e2ee_register(realm_uuid, e2ee))[0] == 200

    old_key, new_key = server.key, random_key()
    form = {
        "zulip_org_id": server.uuid,
        "zulip_org_key": old_key,
        "hostname": server.hostname,
        "contact_email": "admin@example.org",
    }
    status, body = await server.form(
        "server/register", {**form, "new_org_key": new_key}, auth=False
    )
    assert (status, body["created"]) == (200, False)

    status, body = await server.get("server/analytics/status")
    assert (status, body["code"]) == (401, "UNAUTHORIZED")
    assert body["msg"] == f"Zulip server auth failure: key does not match role {server.uuid}"
    status, body = await server.form("server/register", form, auth=False)
    assert (status, body["code"], body["role"]) == (400, "INVALID_ZULIP_SERVER", server.uuid)

    server.key = new_key
    assert (await server.analytics([realm_dict(realm_uuid)]))[0] == 200
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 10,
            "gcm_payload": {"event": "message"},
            "apns_payload": {"alert": "x"},
            "android_devices": [fcm],
            "apple_devices": [apns],
        },
    )
    assert status == 200, body
    assert (body["total_android_devices"], body["total_apple_devices"]) == (1, 1)
    assert body["deleted_devices"] == {"android_devices": [], "apple_devices": []}
    assert len(env.fcm.requests_for(fcm)) == 1 and len(env.apns.requests_for(apns)) == 1
    request = {
        "token_id": token_id_of(e2ee),
        "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
        "payload": {"push_key_id": 1, "encrypted_data": "AAAA"},
    }
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm_uuid, "push_requests": [request]}
    )
    assert (status, body["apple_successfully_sent_count"], body["delete_token_ids"]) == (
        200,
        1,
        [],
    )


async def test_hostname_change_frees_the_old_hostname(env: Env) -> None:
    # EXTERNAL_HOST changed, then `register_server` again: the same registration moves
    # to the new hostname (created: false), and the old one is free for another server,
    # as on Zulip's service (which checks only the hostnames servers hold now).
    server = env.server("old.example.org")
    await server.register()
    server.hostname = "new.example.org"
    assert (await server.register())["created"] is False
    assert (await server.get("server/analytics/status"))[0] == 200
    other = env.server("old.example.org")
    assert (await other.register())["created"] is True
    taken = env.server("new.example.org")
    status, body = await taken.try_register()
    assert (status, body["code"], body["hostname"]) == (
        400,
        "HOSTNAME_ALREADY_IN_USE_BOUNCER_ERROR",
        "new.example.org",
    )
