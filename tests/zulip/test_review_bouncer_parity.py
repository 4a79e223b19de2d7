"""Parity review against Zulip's own push bouncer (zulip/zulip `zilencer/`) as a
self-hosted Zulip server drives it (specs/zulip.md §1, §2, §4).

Each test that names a finding first failed against the code it fixes; the others pin
what a real Zulip server sends, so that the answer it relies on cannot drift.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from plugins.zulip.tables import servers
from tests.zulip.conftest import PREFIX, Env, ZulipServer, random_key


def _register_form(server: ZulipServer, **overrides: str) -> dict[str, str]:
    return {
        "zulip_org_id": server.uuid,
        "zulip_org_key": server.key,
        "hostname": server.hostname,
        "contact_email": "admin@example.org",
        **overrides,
    }


async def _hostnames(env: Env) -> list[str]:
    async with env.engine.connect() as conn:
        return [r.hostname for r in (await conn.execute(select(servers.c.hostname))).all()]


# --- server/register: the wrong-key error carries Zulip's `role` data field --------------


async def test_register_with_wrong_key_names_the_role_like_zulip(env: Env) -> None:
    # Zulip raises InvalidZulipServerKeyError, whose data_fields are ["role"]: its JSON
    # error body is {"result", "msg", "code": "INVALID_ZULIP_SERVER", "role": <uuid>}
    # (zilencer/auth.py InvalidZulipServerError). pushgw left `role` out.
    server = env.server()
    await server.register()
    form = _register_form(server, zulip_org_key=random_key())
    status, body = await server.form("server/register", form, auth=False)
    assert (status, body) == (
        400,
        {
            "result": "error",
            "msg": f"Zulip server auth failure: key does not match role {server.uuid}",
            "code": "INVALID_ZULIP_SERVER",
            "role": server.uuid,
        },
    )


# --- server/register: IPv6 literal hostnames -------------------------------------------


@pytest.mark.parametrize("hostname", ["[2001:db8::5]", "[2001:db8::5]:8443", "[::1]"])
async def test_register_accepts_an_ipv6_literal_hostname(env: Env, hostname: str) -> None:
    # `manage.py register_server` sends EXTERNAL_HOST as `hostname`; Zulip's bouncer
    # checks it with Django's URLValidator on "http://" + hostname, which accepts a
    # bracketed IPv6 literal with or without a port (zilencer/views.py
    # register_remote_server). pushgw answered "... is not a valid hostname", so a
    # server whose EXTERNAL_HOST is an IPv6 address could not register at all.
    server = env.server(hostname)
    status, body = await server.try_register()
    assert (status, body) == (200, {"result": "success", "msg": "", "created": True})
    assert await _hostnames(env) == [hostname]
    # The registered server then works like any other.
    assert (await server.get("server/analytics/status"))[0] == 200


@pytest.mark.parametrize(
    "hostname",
    [
        "[2001:db8::zz]",  # not an address
        "[192.0.2.7]",  # brackets hold IPv6 only
        "[fe80::1%eth0]",  # zone ids are local to one host (Django refuses them too)
        "[2001:db8::5",  # unbalanced
        "2001:db8::5",  # unbracketed: the last group would be a port
    ],
)
async def test_register_still_refuses_bad_ip_literals(env: Env, hostname: str) -> None:
    server = env.server(hostname)
    status, body = await server.try_register()
    assert status == 400 and body["code"] == "BAD_REQUEST", body
    assert body["msg"] == f"{hostname} is not a valid hostname"
    assert await _hostnames(env) == []


# --- what `manage.py register_server` really sends (guards) -----------------------------


async def test_register_server_deactivate_sends_an_empty_json_body(env: Env) -> None:
    # `register_server --deactivate` calls send_json_to_push_bouncer("POST",
    # "server/deactivate", {}): a JSON body `{}`, not the empty form specs/zulip.md §1
    # lists (zerver/management/commands/register_server.py).
    server = env.server()
    await server.register()
    resp = await env.client.post(
        PREFIX + "server/deactivate",
        data=json.dumps({}),
        headers={**server.auth, "Content-Type": "application/json"},
    )
    assert (resp.status, await resp.json()) == (200, {"result": "success", "msg": ""})
    status, body = await server.get("server/analytics/status")
    assert (status, body["code"]) == (401, "UNAUTHORIZED")
