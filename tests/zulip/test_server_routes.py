"""Black-box: server registration, auth, rate limit, analytics (specs/zulip.md §2-§4)."""

from __future__ import annotations

import base64
import json
import uuid

import pytest
from sqlalchemy import select

from plugins.zulip.tables import realms, servers
from tests.zulip.conftest import PREFIX, Env, ZulipServer, random_key, realm_dict

AUTH_MSG_UNKNOWN = (
    "Zulip server auth failure: {u} is not registered -- did you run `manage.py register_server`?"
)


async def _raw(env: Env, headers: dict[str, str]) -> tuple[int, dict, dict]:
    resp = await env.client.post(
        PREFIX + "push/unregister/all", data={"user_id": "1"}, headers=headers
    )
    return resp.status, await resp.json(), dict(resp.headers)


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


async def test_auth_rows(env: Env) -> None:
    server = env.server()
    await server.register()
    cases = [
        ({}, 401, "Missing authorization header for basic auth"),
        ({"Authorization": "Bearer abc"}, 400, "This endpoint requires HTTP basic authentication."),
        ({"Authorization": "Basic"}, 401, "Invalid authorization header for basic auth"),
        ({"Authorization": "Basic !!!"}, 401, "Invalid authorization header for basic auth"),
        ({"Authorization": _basic("a:b:c")}, 401, "Invalid authorization header for basic auth"),
        (
            {"Authorization": _basic("me@example.org:k")},
            400,
            "Must validate with valid Zulip server API key",
        ),
        ({"Authorization": _basic(f"{uuid.uuid4()}:{server.key}")}, 401, None),
        (
            {"Authorization": _basic(f"{server.uuid}:{random_key()}")},
            401,
            f"Zulip server auth failure: key does not match role {server.uuid}",
        ),
    ]
    for headers, status, msg in cases:
        got_status, body, resp_headers = await _raw(env, headers)
        assert got_status == status, (headers, body)
        assert body["result"] == "error"
        if msg is not None:
            assert body["msg"] == msg
        if status == 401:
            assert body["code"] == "UNAUTHORIZED"
            assert resp_headers["WWW-Authenticate"] == 'Basic realm="zulip"'
        else:
            assert body["code"] == "BAD_REQUEST"
        assert resp_headers["Content-Type"].startswith("application/json")
    role = str(uuid.uuid4())
    status, body, _ = await _raw(env, {"Authorization": _basic(f"{role}:{server.key}")})
    assert body["msg"] == AUTH_MSG_UNKNOWN.format(u=role)


async def test_deactivate_then_every_call_fails(env: Env) -> None:
    server = env.server()
    await server.register()
    assert await server.form("server/deactivate") == (200, {"result": "success", "msg": ""})
    status, body = await server.get("server/analytics/status")
    assert status == 401 and body["code"] == "UNAUTHORIZED"
    assert body["msg"] == (
        "The mobile push notification service registration for your server has been deactivated"
    )
    status, body = await server.try_register()
    assert (status, body["code"]) == (401, "REALM_DEACTIVATED")


@pytest.mark.zulip_config(rate_limit_requests=5)
async def test_rate_limit(env: Env) -> None:
    one, two = env.server(), env.server()
    await one.register()
    await two.register()
    for _ in range(5):
        assert (await one.get("server/analytics/status"))[0] == 200
    resp = await env.client.get(PREFIX + "server/analytics/status", headers=one.auth)
    body = await resp.json()
    assert resp.status == 429
    assert body["code"] == "RATE_LIMIT_HIT" and body["msg"] == "API usage exceeded rate limit"
    assert 0 < body["retry-after"] <= 60
    assert int(resp.headers["Retry-After"]) >= body["retry-after"]
    assert (await two.get("server/analytics/status"))[0] == 200


async def test_register_variants(env: Env) -> None:
    server = env.server()
    assert (await server.register())["created"] is True
    assert (await server.register())["created"] is False
    twin = ZulipServer(env.client, server.hostname)
    status, body = await twin.form(
        "server/register",
        {
            "zulip_org_id": twin.uuid,
            "zulip_org_key": twin.key,
            "hostname": twin.hostname,
            "contact_email": "a@example.org",
        },
        auth=False,
    )
    assert status == 400 and body["code"] == "HOSTNAME_ALREADY_IN_USE_BOUNCER_ERROR"
    assert body["hostname"] == server.hostname
    assert body["msg"] == f"A server with hostname {server.hostname} already exists"
    data = {
        "zulip_org_id": server.uuid,
        "zulip_org_key": random_key(),
        "hostname": server.hostname,
        "contact_email": "a@example.org",
    }
    status, body = await server.form("server/register", data, auth=False)
    assert status == 400 and body["code"] == "INVALID_ZULIP_SERVER"
    # key rotation with new_org_key
    new_key = random_key()
    status, body = await server.form(
        "server/register",
        {
            "zulip_org_id": server.uuid,
            "zulip_org_key": server.key,
            "hostname": server.hostname,
            "contact_email": "a@example.org",
            "new_org_key": new_key,
        },
        auth=False,
    )
    assert status == 200 and body["created"] is False
    server.key = new_key
    assert (await server.get("server/analytics/status"))[0] == 200


@pytest.mark.parametrize(
    ("field", "value", "msg"),
    [
        ("zulip_org_id", "not-a-uuid", "Invalid UUID"),
        ("zulip_org_id", None, "Missing 'zulip_org_id' argument"),
        (
            "hostname",
            "x.example.org/path",
            "x.example.org/path contains invalid components (e.g., path, query, fragment).",
        ),
        ("hostname", "bad host", "bad host is not a valid hostname"),
        ("contact_email", "nope", None),
        ("zulip_org_key", "short", None),
    ],
)
async def test_register_errors(env: Env, field: str, value: str | None, msg: str | None) -> None:
    server = env.server()
    data = {
        "zulip_org_id": server.uuid,
        "zulip_org_key": server.key,
        "hostname": server.hostname,
        "contact_email": "a@example.org",
        field: value,
    }
    status, body = await server.form("server/register", data, auth=False)
    assert status == 400 and body["result"] == "error"
    if msg:
        assert body["msg"] == msg
    if value is None:
        assert body["code"] == "REQUEST_VARIABLE_MISSING" and body["var_name"] == field
    if field == "contact_email":
        assert body["msg"].startswith("Invalid server administrator email address: ")
        assert body["email_reason"]
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(servers))).first() is None


@pytest.mark.zulip_config(registration="closed")
async def test_registration_closed(env: Env) -> None:
    status, body = await env.server().form(
        "server/register",
        {
            "zulip_org_id": str(uuid.uuid4()),
            "zulip_org_key": random_key(),
            "hostname": "x.example.org",
            "contact_email": "a@example.org",
        },
        auth=False,
    )
    assert (status, body["msg"]) == (
        400,
        "Registration is not open on this push notification service",
    )


ALLOWED = "0b7d9d1a-8e0a-4a57-8b8f-5f3c7f0f1a11"


@pytest.mark.zulip_config(registration="allowlist", allowlist=[ALLOWED])
async def test_registration_allowlist(env: Env) -> None:
    allowed = env.server("ok.example.org")
    allowed.uuid = ALLOWED
    assert (await allowed.register())["created"] is True
    status, body = await env.server("no.example.org").form(
        "server/register",
        {
            "zulip_org_id": str(uuid.uuid4()),
            "zulip_org_key": random_key(),
            "hostname": "no.example.org",
            "contact_email": "a@example.org",
        },
        auth=False,
    )
    assert (status, body["msg"]) == (
        400,
        "Registration is not open on this push notification service",
    )


async def test_analytics(db_env: Env) -> None:
    env = db_env
    server = env.server()
    await server.register()
    assert (await server.get("server/analytics/status"))[1] == {
        "result": "success",
        "msg": "",
        "last_realm_count_id": 0,
        "last_installation_count_id": 0,
        "last_realmauditlog_id": 0,
    }
    realm_uuid = str(uuid.uuid4())
    entry = realm_dict(realm_uuid, new_key_from_the_future=True)
    status, body = await server.analytics(
        [entry],
        realm_counts=[
            {"id": 17, "property": "x", "realm": 2, "end_time": 1.0, "subgroup": None, "value": 3}
        ],
        installation_counts=[
            {"id": 4, "property": "y", "end_time": 1.0, "subgroup": None, "value": 1}
        ],
        realmauditlog_rows=[
            {
                "id": 99,
                "realm": 2,
                "event_time": 1.0,
                "backfilled": False,
                "extra_data": "{}",
                "event_type": 1,
            }
        ],
    )
    assert status == 200, body
    assert body["realms"] == {realm_uuid: {"can_push": True, "expected_end_timestamp": None}}
    assert (await server.get("server/analytics/status"))[1]["last_realm_count_id"] == 17
    assert (await server.get("server/analytics/status"))[1]["last_realmauditlog_id"] == 99
    async with env.engine.connect() as conn:
        row = (await conn.execute(select(realms))).one()
        server_row = (await conn.execute(select(servers))).one()
    assert row.uuid == realm_uuid and row.name == "Example"
    assert entry["uuid_owner_secret"] not in json.dumps([str(v) for v in row])
    assert server_row.version == "12.0" and server_row.api_feature_level == 468
    other = env.server()
    await other.register()
    status, body = await other.analytics([realm_dict(realm_uuid)])
    assert (status, body["msg"]) == (400, "Duplicate registration detected.")


@pytest.mark.parametrize(
    "fields",
    [
        {"realms": "not json"},
        {"realms": json.dumps({"a": 1})},
        {"realms": json.dumps([{"uuid": "nope"}])},
        {"realm_counts": json.dumps([{"no_id": 1}])},
        {"api_feature_level": json.dumps("x")},
    ],
)
async def test_analytics_bad_input(env: Env, fields: dict[str, str]) -> None:
    server = env.server()
    await server.register()
    status, body = await server.form("server/analytics", fields)
    assert status == 400 and body["code"] == "BAD_REQUEST", body
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(realms))).first() is None


async def test_unknown_endpoints_and_prefix(env: Env) -> None:
    server = env.server()
    await server.register()
    for path in (PREFIX + "server/billing", PREFIX + "server/register/transfer", PREFIX + "nope"):
        resp = await env.client.post(path, headers=server.auth)
        assert resp.status == 404
        assert (await resp.json())["result"] == "error"
    resp = await env.client.get("/prefix" + PREFIX + "server/analytics/status", headers=server.auth)
    assert resp.status == 404
