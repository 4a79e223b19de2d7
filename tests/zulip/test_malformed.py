"""Black-box: client mistakes are 4xx in Zulip's envelope, change nothing and send nothing.

A Zulip server retries 5xx (specs/zulip.md §1), so an input that crashed a handler would
be resent (and, for a notify that had already reached a provider, delivered again).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from sqlalchemy import select

from plugins.zulip.crypto import token_id_of
from plugins.zulip.tables import e2ee_devices, legacy_devices, realms, servers
from tests.zulip.conftest import (
    IOS_APP_ID,
    PREFIX,
    Env,
    ZulipServer,
    apns_token,
    fcm_token,
    realm_dict,
    registration_plaintext,
)

FORM = "application/x-www-form-urlencoded"
JSON = "application/json"
BIG = 2**70
SURROGATE = "\ud800"  # json.dumps escapes it as "\ud800": valid JSON, not valid Unicode


async def _snapshot(env: Env) -> dict[str, list[Any]]:
    # Without the realm's `last_request_at`: `push/e2ee/register` records it right after
    # the realm lookup, also when the registration is then refused (spec §5.1 step 1).
    tracked = [c for c in realms.c if c.name != "last_request_at"]
    async with env.engine.connect() as conn:
        snapshot = {
            table.name: sorted(tuple((await conn.execute(select(table))).all()), key=repr)
            for table in (servers, legacy_devices, e2ee_devices)
        }
        rows = (await conn.execute(select(*tracked))).all()
        snapshot[realms.name] = sorted(tuple(rows), key=repr)
        return snapshot


async def _post(
    server: ZulipServer, endpoint: str, data: bytes, content_type: str, *, auth: bool = True
) -> tuple[int, dict[str, Any]]:
    headers = {**(server.auth if auth else server.headers), "Content-Type": content_type}
    resp = await server.client.post(PREFIX + endpoint, data=data, headers=headers)
    assert resp.content_type == JSON
    return resp.status, await resp.json()


async def _user_with_devices(env: Env) -> tuple[ZulipServer, str, str]:
    """A server with a realm, and user 5 registered with one FCM and one APNs token."""
    server, realm = await env.ready_server()
    fcm = fcm_token()
    for data in (
        {"user_id": "5", "token": fcm, "token_kind": "2"},
        {"user_id": "5", "token": apns_token(), "token_kind": "1", "ios_app_id": IOS_APP_ID},
    ):
        status, body = await server.form("push/register", data)
        assert status == 200, body
    return server, realm, fcm


def _nothing_sent(env: Env) -> None:
    assert env.fcm.requests == []
    assert env.apns.requests == []


# --- integers beyond the columns' range --------------------------------------------------


def _analytics(realm: str, **fields: Any) -> dict[str, str]:
    data = {
        "realm_counts": "[]",
        "installation_counts": "[]",
        "realms": json.dumps([realm_dict(realm)]),
        "api_feature_level": "468",
    }
    data.update({k: json.dumps(v) for k, v in fields.items()})
    return data


@pytest.mark.parametrize(
    ("endpoint", "data", "msg"),
    [
        ("push/register", {"token_kind": "2", "user_id": str(BIG)}, "user_id is too large"),
        ("push/register", {"token_kind": "2", "user_id": str(-BIG)}, "user_id is too small"),
        ("push/register", {"token_kind": "2", "user_id": str(2**63)}, "user_id is too large"),
        ("push/unregister", {"token_kind": "2", "user_id": str(BIG)}, "user_id is too large"),
        ("push/unregister/all", {"user_id": str(BIG)}, "user_id is too large"),
        ("push/notify", {"user_id": BIG}, "user_id is too large"),
        ("push/notify", {"user_id": -BIG, "user_uuid": "u"}, "user_id is too small"),
        (
            "push/test_notification",
            {"token_kind": 2, "user_id": BIG, "base_payload": {}},
            "user_id is too large",
        ),
        ("server/analytics", {"api_feature_level": BIG}, "api_feature_level is too large"),
        ("server/analytics", {"api_feature_level": 2**31}, "api_feature_level is too large"),
        (
            "server/analytics",
            {"realm_counts": [{"id": BIG}]},
            'realm_counts[0]["id"] is too large',
        ),
        (
            "server/analytics",
            {"installation_counts": [{"id": 1}, {"id": -BIG}]},
            'installation_counts[1]["id"] is too small',
        ),
        (
            "server/analytics",
            {"realmauditlog_rows": [{"id": BIG}]},
            'realmauditlog_rows[0]["id"] is too large',
        ),
        ("server/analytics", {"org_type": BIG}, "realms[0].org_type is too large"),
        ("server/analytics", {"org_type": 2**31}, "realms[0].org_type is too large"),
    ],
)
async def test_integer_out_of_range(db_env: Env, endpoint: str, data: dict, msg: str) -> None:
    env = db_env
    server, realm, fcm = await _user_with_devices(env)
    before = await _snapshot(env)
    if endpoint == "server/analytics":
        data = dict(data)
        org_type = data.pop("org_type", None)
        fields = _analytics(realm, **data)
        if org_type is not None:
            fields["realms"] = json.dumps([realm_dict(realm, org_type=org_type)])
        status, body = await server.form(endpoint, fields)
    elif endpoint == "push/notify":
        status, body = await server.json(endpoint, data)
    elif endpoint == "push/test_notification":
        status, body = await server.json(endpoint, {"token": fcm, **data})
    else:
        status, body = await server.form(endpoint, {"token": fcm, **data})
    assert (status, body["code"], body["msg"]) == (400, "BAD_REQUEST", msg)
    assert await _snapshot(env) == before
    _nothing_sent(env)


async def test_integer_range_limits_accepted(db_env: Env) -> None:
    env = db_env
    server, realm = await env.ready_server()
    token = fcm_token()
    for user_id in (2**63 - 1, -(2**63)):
        data = {"user_id": str(user_id), "token": token, "token_kind": "2"}
        assert (await server.form("push/register", data))[0] == 200
    status, body = await server.form(
        "server/analytics",
        {
            **_analytics(realm, api_feature_level=2**31 - 1, realm_counts=[{"id": 2**63 - 1}]),
            "realms": json.dumps([realm_dict(realm, org_type=2**31 - 1)]),
        },
    )
    assert status == 200, body
    status, body = await server.get("server/analytics/status")
    assert body["last_realm_count_id"] == 2**63 - 1


async def test_registration_timestamp_out_of_range(env: Env) -> None:
    server, realm = await env.ready_server()
    token = fcm_token()
    plaintext = json.dumps({"token": token, "token_kind": "fcm", "timestamp": 10**400}).encode()
    before = await _snapshot(env)
    status, body = await server.e2ee_register(realm, token, "fcm", plaintext=plaintext)
    assert (status, body["msg"]) == (400, "Invalid encrypted_push_registration")
    assert await _snapshot(env) == before


# --- form bodies ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (FORM + "; charset=xyz", b"token=ab&token_kind=2&user_id=1"),
        # Decodes "\\ud800" to a lone surrogate.
        (FORM + "; charset=unicode_escape", b"token=\\ud800&token_kind=2&user_id=1"),
        (
            "multipart/form-data; boundary=xx",
            b'--xx\r\nContent-Disposition: form-data; name="token"\r\n'
            b"Content-Type: text/plain; charset=xyz\r\n\r\nab\r\n--xx--\r\n",
        ),
    ],
)
async def test_form_charset(env: Env, content_type: str, body: bytes) -> None:
    server, _realm, _fcm = await _user_with_devices(env)
    before = await _snapshot(env)
    status, answer = await _post(server, "push/register", body, content_type)
    assert (status, answer["code"], answer["msg"]) == (400, "BAD_REQUEST", "Malformed form body")
    newcomer = env.server()
    body = (
        f"zulip_org_id={newcomer.uuid}&zulip_org_key={newcomer.key}"
        f"&hostname={newcomer.hostname}&contact_email=admin@example.org"
    ).encode()
    status, answer = await _post(
        newcomer, "server/register", body, FORM + "; charset=xyz", auth=False
    )
    assert (status, answer["msg"]) == (400, "Malformed form body")
    assert await _snapshot(env) == before


# --- JSON that is not valid Unicode, or nested too deeply --------------------------------


def _e2ee_fcm_request(token: str, encrypted_data: str) -> dict[str, Any]:
    return {
        "token_id": token_id_of(token),
        "fcm_priority": "high",
        "payload": {"push_key_id": 1, "encrypted_data": encrypted_data},
    }


@pytest.mark.parametrize(
    "case",
    [
        "e2ee encrypted_data",
        "e2ee realm_uuid",
        "e2ee key",
        "notify android_devices",
        "notify apple_devices",
        "notify realm_uuid",
        "notify user_uuid",
        "notify gcm_payload",
        "notify gcm_options",
        "test_notification token",
        "test_notification base_payload",
    ],
)
async def test_lone_surrogates_rejected_before_sending(env: Env, case: str) -> None:
    server, realm, fcm = await _user_with_devices(env)
    e2ee_token = fcm_token()
    assert (await server.e2ee_register(realm, e2ee_token, "fcm", ios_app_id=None))[0] == 200
    notify = {"user_id": 5, "gcm_payload": {"event": "message", "content": "hi"}}
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "e2ee encrypted_data": (
            "push/e2ee/notify",
            {"realm_uuid": realm, "push_requests": [_e2ee_fcm_request(e2ee_token, SURROGATE)]},
        ),
        "e2ee realm_uuid": ("push/e2ee/notify", {"realm_uuid": SURROGATE, "push_requests": []}),
        "e2ee key": (
            "push/e2ee/notify",
            {
                "realm_uuid": realm,
                "push_requests": [_e2ee_fcm_request(e2ee_token, "abc")],
                SURROGATE: 1,
            },
        ),
        "notify android_devices": ("push/notify", {**notify, "android_devices": [SURROGATE]}),
        "notify apple_devices": ("push/notify", {**notify, "apple_devices": [SURROGATE]}),
        "notify realm_uuid": ("push/notify", {**notify, "user_uuid": "u", "realm_uuid": SURROGATE}),
        "notify user_uuid": ("push/notify", {**notify, "user_uuid": SURROGATE}),
        "notify gcm_payload": ("push/notify", {**notify, "gcm_payload": {"x": [[SURROGATE]]}}),
        "notify gcm_options": ("push/notify", {**notify, "gcm_options": {"priority": SURROGATE}}),
        "test_notification token": (
            "push/test_notification",
            {"token": SURROGATE, "token_kind": 2, "user_id": 5, "base_payload": {}},
        ),
        "test_notification base_payload": (
            "push/test_notification",
            {"token": fcm, "token_kind": 2, "user_id": 5, "base_payload": {"a": SURROGATE}},
        ),
    }
    endpoint, body = bodies[case]
    before = await _snapshot(env)
    for _ in range(2):  # as a Zulip server would retry a 5xx
        status, answer = await server.json(endpoint, body)
        assert (status, answer["code"], answer["msg"]) == (400, "BAD_REQUEST", "Malformed JSON")
    assert await _snapshot(env) == before
    _nothing_sent(env)


async def test_lone_surrogates_in_form_json_and_registration(env: Env) -> None:
    server, realm = await env.ready_server()
    before = await _snapshot(env)
    status, body = await server.analytics([realm_dict(realm, name=SURROGATE)])
    assert (status, body["msg"]) == (400, 'Argument "realms" is not valid JSON.')
    token = fcm_token()
    plaintext = json.dumps(
        {"token": SURROGATE, "token_kind": "fcm", "timestamp": int(time.time())}
    ).encode()
    status, body = await server.e2ee_register(realm, token, "fcm", plaintext=plaintext)
    assert (status, body["msg"]) == (400, "Invalid encrypted_push_registration")
    assert await _snapshot(env) == before


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("push/notify", b'{"user_id": 5, "gcm_payload": {"a": NaN}}'),
        # Literals beyond a double parse as infinity: the APNs body then cannot be encoded
        # and the push was dropped after a 200.
        ("push/notify", b'{"user_id": 5, "apns_payload": {"badge": 1e400}}'),
        ("push/e2ee/notify", b'{"realm_uuid": "x", "push_requests": [], "x": -1e400}'),
        ("push/notify", '{"user_id": 5}'.encode("utf-16")),
        ("push/notify", b'{"user_id": 5, "user_uuid": "\xed\xa0\x80"}'),  # UTF-8 of U+D800
        ("push/notify", b'{"user_id": 5, "gcm_payload": ' + b"[" * 100_000 + b"]" * 100_000),
        ("push/test_notification", b'{"token": "x", "base_payload": ' + b"[" * 100_000),
        ("push/e2ee/notify", b'{"realm_uuid": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ],
)
async def test_json_not_accepted(env: Env, endpoint: str, body: bytes) -> None:
    server, _realm, _fcm = await _user_with_devices(env)
    before = await _snapshot(env)
    status, answer = await _post(server, endpoint, body, JSON)
    assert (status, answer["code"], answer["msg"]) == (400, "BAD_REQUEST", "Malformed JSON")
    assert await _snapshot(env) == before
    _nothing_sent(env)


async def test_deeply_nested_form_json(env: Env) -> None:
    server, realm = await env.ready_server()
    deep = "[" * 100_000 + "]" * 100_000
    for field in ("realms", "realm_counts"):
        status, body = await server.form("server/analytics", {**_analytics(realm), field: deep})
        assert (status, body["msg"]) == (400, f'Argument "{field}" is not valid JSON.')
    # `version` falls back to plain text (older servers did not JSON-encode it).
    status, body = await server.form("server/analytics", {**_analytics(realm), "version": deep})
    assert status == 200, body


# --- bounded text columns (PostgreSQL enforces the lengths) ------------------------------


async def test_contact_email_too_long(db_env: Env) -> None:
    env = db_env
    server = env.server()
    email = "a" * 300 + "@example.org"
    status, body = await server.form(
        "server/register",
        {
            "zulip_org_id": server.uuid,
            "zulip_org_key": server.key,
            "hostname": server.hostname,
            "contact_email": email,
        },
        auth=False,
    )
    reason = "The email address is too long (58 characters too many)."
    assert (status, body["code"], body["email_reason"]) == (400, "BAD_REQUEST", reason)
    assert body["msg"] == f"Invalid server administrator email address: {reason}"
    assert not any((await _snapshot(env)).values())
    await server.register()
    before = await _snapshot(env)
    status, body = await server.form(
        "server/register",
        {
            "zulip_org_id": server.uuid,
            "zulip_org_key": server.key,
            "hostname": server.hostname,
            "contact_email": email,
        },
        auth=False,
    )
    assert status == 400
    assert await _snapshot(env) == before


async def test_registration_ios_app_id_too_long(db_env: Env) -> None:
    env = db_env
    server, realm = await env.ready_server()
    token = apns_token()
    before = await _snapshot(env)
    app_id = "org." + "a" * 300
    plaintext = registration_plaintext(token, "apns", app_id)
    status, body = await server.e2ee_register(realm, token, plaintext=plaintext)
    assert (status, body["msg"]) == (400, "Invalid encrypted_push_registration")
    assert await _snapshot(env) == before


# --- gcm_options are validated before the duplicate-registration cleanup -----------------


async def test_invalid_gcm_options_change_nothing(env: Env) -> None:
    server, _ = await env.ready_server()
    token, user_uuid = fcm_token(), "uuid-5"
    for ids in ({"user_id": "5"}, {"user_uuid": user_uuid}):  # the zulip/zulip#24969 duplicate
        data = {"token": token, "token_kind": "2", **ids}
        assert (await server.form("push/register", data))[0] == 200
    before = await _snapshot(env)
    assert len(before["zulip_legacy_devices"]) == 2
    status, body = await server.json(
        "push/notify", {"user_id": 5, "user_uuid": user_uuid, "gcm_options": {"priority": "x"}}
    )
    assert (status, body["msg"]) == (400, "Invalid GCM option to bouncer: priority 'x'")
    assert await _snapshot(env) == before
    _nothing_sent(env)
    status, body = await server.json("push/notify", {"user_id": 5, "user_uuid": user_uuid})
    assert (status, body["total_android_devices"]) == (200, 1)
    assert len((await _snapshot(env))["zulip_legacy_devices"]) == 1


# --- JSON values of the wrong type where a fixed set of strings is expected ---------------


def _e2ee_apns_request(token: str, push_type: Any) -> dict[str, Any]:
    return {
        "token_id": token_id_of(token),
        "http_headers": {"apns_priority": 10, "apns_push_type": push_type},
        "payload": {"push_key_id": 1, "encrypted_data": "abc"},
    }


@pytest.mark.parametrize(
    ("case", "msg"),
    [
        ("apns_push_type", "push_requests[0].http_headers.apns_push_type is not valid"),
        ("fcm_priority", "push_requests[0].fcm_priority is not valid"),
        ("gcm_options", "Invalid GCM option to bouncer: priority ['high']"),
    ],
)
async def test_unhashable_values_in_enum_fields(env: Env, case: str, msg: str) -> None:
    # A list or an object compared against a set of allowed strings raised TypeError
    # (unhashable) and the server got a 500, which it retries.
    server, realm, _fcm = await _user_with_devices(env)
    e2ee_token = fcm_token()
    assert (await server.e2ee_register(realm, e2ee_token, "fcm", ios_app_id=None))[0] == 200
    fcm_request = {**_e2ee_fcm_request(e2ee_token, "abc"), "fcm_priority": {"high": 1}}
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "apns_push_type": (
            "push/e2ee/notify",
            {"realm_uuid": realm, "push_requests": [_e2ee_apns_request(e2ee_token, ["alert"])]},
        ),
        "fcm_priority": ("push/e2ee/notify", {"realm_uuid": realm, "push_requests": [fcm_request]}),
        "gcm_options": ("push/notify", {"user_id": 5, "gcm_options": {"priority": ["high"]}}),
    }
    endpoint, body = bodies[case]
    before = await _snapshot(env)
    status, answer = await server.json(endpoint, body)
    assert (status, answer["code"], answer["msg"]) == (400, "BAD_REQUEST", msg)
    assert await _snapshot(env) == before
    _nothing_sent(env)


# --- NUL characters (PostgreSQL text cannot hold them) -----------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "register token",
        "register user_uuid",
        "register realm_uuid",
        "register query string",
        "notify user_uuid",
        "e2ee notify realm_uuid",
        "e2ee register realm_uuid",
        "analytics realm name",
        "analytics realm host",
        "registration token",
        "auth username",
    ],
)
async def test_nul_characters_rejected(db_env: Env, case: str) -> None:
    # On PostgreSQL a NUL in any bound string is a DataError: every such request was a 500
    # (retried by the server) instead of a 400 in Zulip's terms. Zulip's own data lives in
    # PostgreSQL too, so a real server never sends one.
    env = db_env
    server, realm, _fcm = await _user_with_devices(env)
    nul = "a\x00b"
    register = {"user_id": "5", "token": fcm_token(), "token_kind": "2"}
    before = await _snapshot(env)
    if case == "register token":
        status, body = await server.form("push/register", {**register, "token": nul})
        expected = (400, "BAD_REQUEST", "Malformed form body")
    elif case == "register user_uuid":
        status, body = await server.form("push/register", {**register, "user_uuid": nul})
        expected = (400, "BAD_REQUEST", "Malformed form body")
    elif case == "register realm_uuid":
        data = {**register, "user_uuid": "u5", "realm_uuid": nul}
        status, body = await server.form("push/register", data)
        expected = (400, "BAD_REQUEST", "Malformed form body")
    elif case == "register query string":
        resp = await server.client.post(
            PREFIX + "push/register?user_uuid=a%00b", data=register, headers=server.auth
        )
        status, body = resp.status, await resp.json()
        expected = (400, "BAD_REQUEST", "Malformed form body")
    elif case == "notify user_uuid":
        status, body = await server.json("push/notify", {"user_id": 5, "user_uuid": nul})
        expected = (400, "BAD_REQUEST", "Malformed JSON")
    elif case == "e2ee notify realm_uuid":
        status, body = await server.json(
            "push/e2ee/notify", {"realm_uuid": nul, "push_requests": []}
        )
        expected = (400, "BAD_REQUEST", "Malformed JSON")
    elif case == "e2ee register realm_uuid":
        status, body = await server.e2ee_register(nul, fcm_token(), "fcm", ios_app_id=None)
        expected = (400, "BAD_REQUEST", "Malformed form body")
    elif case in ("analytics realm name", "analytics realm host"):
        field = case.rsplit(" ", 1)[1]
        status, body = await server.analytics([realm_dict(realm, **{field: nul})])
        expected = (400, "BAD_REQUEST", 'Argument "realms" is not valid JSON.')
    elif case == "registration token":
        token = "fcm-\x00"
        plaintext = registration_plaintext(token, "fcm", None)
        status, body = await server.e2ee_register(realm, token, "fcm", plaintext=plaintext)
        expected = (400, "BAD_REQUEST", "Invalid encrypted_push_registration")
    else:
        raw = base64.b64encode(f"{nul}:{server.key}".encode()).decode()
        resp = await server.client.post(
            PREFIX + "push/unregister/all",
            data={"user_id": "5"},
            headers={**server.headers, "Authorization": f"Basic {raw}"},
        )
        status, body = resp.status, await resp.json()
        msg = (
            f"Zulip server auth failure: {nul} is not registered -- "
            "did you run `manage.py register_server`?"
        )
        expected = (401, "UNAUTHORIZED", msg)
    assert (status, body["code"], body["msg"]) == expected
    assert await _snapshot(env) == before
    _nothing_sent(env)


# --- a body that cannot be decoded ---------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "content_type", "msg"),
    [
        ("push/register", FORM, "Malformed form body"),
        ("push/notify", JSON, "Malformed JSON"),
    ],
)
async def test_undecodable_content_encoding(
    env: Env, endpoint: str, content_type: str, msg: str
) -> None:
    # aiohttp raises RequestPayloadError while reading a `Content-Encoding: gzip` body that
    # is not gzip: a client mistake, which was answered 500.
    server, _realm, _fcm = await _user_with_devices(env)
    before = await _snapshot(env)
    resp = await server.client.post(
        PREFIX + endpoint,
        data=b"token=ab&token_kind=2&user_id=5" if content_type == FORM else b'{"user_id": 5}',
        headers={**server.auth, "Content-Type": content_type, "Content-Encoding": "gzip"},
    )
    assert resp.content_type == JSON
    body = await resp.json()
    assert (resp.status, body["code"], body["msg"]) == (400, "BAD_REQUEST", msg)
    assert await _snapshot(env) == before
    _nothing_sent(env)


# --- hostnames with characters urlsplit silently drops ---------------------------------


@pytest.mark.parametrize(
    "hostname", ["chat.example.org\n", "chat.exa\tmple.org", "chat\r.example.org"]
)
async def test_hostname_with_tab_or_newline(env: Env, hostname: str) -> None:
    # urlsplit removes tab, CR and LF anywhere in a URL (bpo-43882), so these passed the
    # hostname check: stored with the control character, and a second server could take a
    # hostname already in use ("chat.example.org\n" next to "chat.example.org").
    first = env.server("chat.example.org")
    await first.register()
    before = await _snapshot(env)
    second = env.server()
    status, body = await second.form(
        "server/register",
        {
            "zulip_org_id": second.uuid,
            "zulip_org_key": second.key,
            "hostname": hostname,
            "contact_email": "admin@example.org",
        },
        auth=False,
    )
    assert (status, body["code"], body["msg"]) == (
        400,
        "BAD_REQUEST",
        f"{hostname} is not a valid hostname",
    )
    assert await _snapshot(env) == before
