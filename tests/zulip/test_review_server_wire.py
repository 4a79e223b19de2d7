"""Review (seat zulip_server_wire): requests replayed byte for byte as a Zulip server's
`requests` session sends them (`zerver/lib/remote_server.py`, `manage.py register_server`):
the body and headers come from `requests.Request(...).prepare()`, then go to the gateway."""

from __future__ import annotations

import json
import uuid
from typing import Any

import requests

from tests.zulip.conftest import Env, random_key

PREFIX = "/api/v1/remotes/"


async def _replay(env: Env, prepared: requests.PreparedRequest) -> tuple[int, dict[str, Any]]:
    assert prepared.method is not None and prepared.path_url.startswith(PREFIX)
    resp = await env.client.request(
        prepared.method, prepared.path_url, data=prepared.body, headers=dict(prepared.headers)
    )
    return resp.status, json.loads(await resp.read())


def _register_request(org_id: str, key: str, hostname: str, email: str) -> requests.PreparedRequest:
    """`manage.py register_server`: a form POST of the server's settings, no auth."""
    return requests.Request(
        "POST",
        "https://push.example.org" + PREFIX + "server/register",
        data={
            "zulip_org_id": org_id,
            "zulip_org_key": key,
            "hostname": hostname,
            "contact_email": email,
        },
        headers={"User-agent": "ZulipServer/12.0"},
    ).prepare()


async def test_a_server_with_an_internationalized_host_name_registers(env: Env) -> None:
    # Zulip's bouncer validates `hostname` with Django's URLValidator and the contact
    # address with email-validator, both of which take IDN names: such a server
    # registers with Kandra's service, and was refused here ("is not a valid hostname").
    org_id, key = str(uuid.uuid4()), random_key()
    request = _register_request(org_id, key, "chat.münchen.de:8443", "admin@münchen.de")
    assert await _replay(env, request) == (
        200,
        {"result": "success", "msg": "", "created": True},
    )
    assert await _replay(env, request) == (
        200,
        {"result": "success", "msg": "", "created": False},
    )


async def test_invalid_internationalized_names_are_still_refused(env: Env) -> None:
    status, body = await _replay(
        env, _register_request(str(uuid.uuid4()), random_key(), "chat.mün_chen.de", "a@b.org")
    )
    assert (status, body["code"], body["msg"]) == (
        400,
        "BAD_REQUEST",
        "chat.mün_chen.de is not a valid hostname",
    )
    status, body = await _replay(
        env, _register_request(str(uuid.uuid4()), random_key(), "chat.example.org", "a@mün..de")
    )
    assert (status, body["email_reason"]) == (400, "The domain name is not valid.")
