"""Review (seat session_security2): security of the session's own changes.

- Zulip registration with IDN host names: a name IDNA rewrites (an invisible soft hyphen
  or zero-width space, fullwidth letters, an ideographic full stop) shows as another
  server's host without being the same text; a name too long for DNS once encoded.
- `pushgw tokens ...`: argparse's usage error quoted the arguments it did not take,
  a device token among them.
- APNs GOAWAY debug data that is not APNs's `{"reason": ...}`: parsing it must not end
  the connection, whose requests Apple processed would then be sent twice.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main as pushgw
from gateway.config import ApnsAppConfig
from gateway.core.apns import ApnsClient
from gateway.core.push import ApnsOptions, Outcome, Push
from gateway.testing import ApnsResponse, ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config
from tests.zulip.conftest import Env, ZulipServer, random_key, zulip_config

# --- Zulip: IDN host names ---------------------------------------------------------------


@pytest.fixture
async def zulip(tmp_path: Path) -> AsyncIterator[Env]:
    async with (
        ApnsSimulator() as apns,
        FcmSimulator() as fcm,
        GatewayHarness(zulip_config(apns, fcm, tmp_path)) as harness,
    ):
        yield Env(harness, apns, fcm)


async def register(env: Env, hostname: str, email: str = "admin@example.org") -> Any:
    server = ZulipServer(env.client, hostname)
    return await server.form(
        "server/register",
        {
            "zulip_org_id": str(uuid.uuid4()),
            "zulip_org_key": random_key(),
            "hostname": hostname,
            "contact_email": email,
        },
        auth=False,
    )


@pytest.mark.parametrize(
    "lookalike",
    [
        "chat.exa\u00admple.org",  # soft hyphen: invisible, dropped by IDNA
        "chat.example.org\u200b",  # zero-width space: likewise
        "\uff43hat.example.org",  # fullwidth c
        "chat\u3002example.org",  # ideographic full stop: a dot to IDNA
    ],
)
async def test_a_host_name_idna_rewrites_is_refused(zulip: Env, lookalike: str) -> None:
    """Each of these is chat.example.org to DNS and shows as it on a screen; it was
    registered next to the real chat.example.org, the hostname-in-use check comparing
    text. A name is taken as IDNA writes it, as DNS and every other tool show it."""
    assert await register(zulip, "chat.example.org") == (
        200,
        {"result": "success", "msg": "", "created": True},
    )
    status, body = await register(zulip, lookalike)
    assert (status, body["code"], body["msg"]) == (
        400,
        "BAD_REQUEST",
        f"{lookalike} is not a valid hostname",
    )
    # the internationalized names of the session's change still register, any case
    assert (await register(zulip, "chat.M\u00fcnchen.de:8443"))[0] == 200


async def test_an_email_domain_idna_rewrites_is_refused(zulip: Env) -> None:
    # "münchen.de。": the trailing dot the address check refuses, as an ideographic stop
    status, body = await register(zulip, "chat.example.org", "admin@m\u00fcnchen.de\u3002")
    assert (status, body["email_reason"]) == (400, "The domain name is not valid.")


async def test_a_host_name_too_long_for_dns_once_encoded_is_refused(zulip: Env) -> None:
    """12 labels of 20 "ü": 254 characters as written, 326 in DNS (each label's punycode
    is 26): no such host can exist, and it was stored."""
    hostname = ("\u00fc" * 20 + ".") * 12 + "de"
    assert len(hostname.encode("idna")) > 253
    status, body = await register(zulip, hostname)
    assert (status, body["msg"]) == (400, f"{hostname} is not a valid hostname")
    # at the limit, ASCII: still registers (253 characters)
    assert (await register(zulip, ("a" * 62 + ".") * 4 + "d"))[0] == 200


# --- CLI: a token among the arguments a command did not take -----------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["tokens", "hash", "dQw4w9WgXcQ:APA91bH-first", "SECRET-second-token"],
        ["tokens", "hash", "-SECRET_token_starting_with_a_dash:APA91b"],  # an option to argparse
        ["tokens", "status", "a" * 64, "-SECRET_token_starting_with_a_dash"],
    ],
)
def test_tokens_commands_never_echo_an_argument(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        pushgw(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2
    assert "unrecognized arguments" in err and "give tokens on stdin" in err
    assert "SECRET" not in out + err


def test_other_commands_still_name_what_they_did_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        pushgw(["check-config", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


# --- APNs: GOAWAY debug data ------------------------------------------------------------


@pytest.fixture
async def sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as simulator:
        yield simulator


@pytest.mark.parametrize(
    "debug_data",
    [
        b"[" * 5000,  # deeper than the interpreter's recursion limit
        b'{"reason": ' * 1400,  # objects, likewise (within one frame: 16 KB)
    ],
)
async def test_goaway_debug_data_does_not_end_the_connection(
    sim: ApnsSimulator,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    debug_data: bytes,
) -> None:
    """A graceful GOAWAY naming the stream in flight: its push was processed and must be
    answered on this connection, once. Debug data nested deeper than the recursion
    limit raised RecursionError out of the connection's read (asyncio's "Fatal error on
    SSL protocol" traceback), the connection was torn down, the processed push failed
    `connection_error`, and its retry would deliver it twice."""
    caplog.set_level(logging.INFO)
    settings = apns_app_config(
        sim, tmp_path, topic="com.example.app", request_timeout=10.0, max_connections=1
    )
    client = ApnsClient("ios", ApnsAppConfig(**settings))
    await client.start()
    try:
        tok = secrets.token_hex(32)
        sim.script(tok, ApnsResponse.ok(delay=0.5))  # answered after the GOAWAY
        push = Push(
            plugin="test",
            app_id="ios",
            token=tok,
            payload={"aps": {"alert": "hi"}},
            apns=ApnsOptions(),
        )
        sending = asyncio.ensure_future(client.send(push))
        (arrived,) = await sim.wait_for_requests(1)
        for conn in list(sim._connections):
            conn.goaway(debug_data, arrived.stream_id)
        attempt = await asyncio.wait_for(sending, 30)
    finally:
        await client.close()

    assert attempt.outcome is Outcome.OK, attempt
    assert [r.status for r in sim.requests_for(tok)] == [200]  # processed once, not resent
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    goaway = [r.getMessage() for r in caplog.records if "GOAWAY" in r.getMessage()]
    assert goaway and all(len(line) < 400 for line in goaway)
