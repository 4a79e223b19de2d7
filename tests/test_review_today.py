"""Review of the day's changes: what a hostile or broken client makes the gateway log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gateway.testing.harness import GatewayHarness, base_config
from tests.conftest import configured_logging


async def _raw(host: str, port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()  # the server answers 400 and closes
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /devices/{secret} HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET /devices/{secret} HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET /devices/{secret} HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    ],
    ids=["bad-header", "bad-version", "bad-length"],
)
async def test_an_unparsable_request_with_the_access_log_on_is_one_info_line(
    tmp_path: Path, register_secret: object, request_head: bytes
) -> None:
    """With `logging.access_log: true`, a request aiohttp cannot parse made
    `RouteAccessLogger` raise (aiohttp's `match_info` asserts on the request of its
    error handler): an ERROR "Unhandled exception" traceback per hostile connection,
    the very thing the day's `UnreadableBodyFilter` change set out to end, and no
    access line for the 400."""
    secret = "c0ffee11" * 8
    register_secret(secret)  # type: ignore[operator]
    config = base_config(tmp_path, {}, logging={"access_log": True})
    with configured_logging("INFO") as buffer:
        async with GatewayHarness(config) as gw:
            server = gw.client.server
            answer = await _raw(
                str(server.host),
                int(server.port or 0),
                request_head.replace(b"{secret}", secret.encode()),
            )
    written = buffer.getvalue()
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert "Traceback" not in written and "Unhandled exception" not in written
    assert " ERROR " not in written
    assert "a request could not be parsed" in written
    assert '"UNKNOWN unmatched HTTP/1.0" 400 ' in written  # the access line of the 400
    assert secret not in written


def test_rehash_tokens_without_the_zulip_plugin_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pushgw zulip rehash-tokens` with the plugin disabled read the plugin's context
    unchecked: "its command 'zulip' raised KeyError", status 1, where its sibling
    commands (`gc`) say in one line that the plugin is not enabled, status 2."""
    from gateway.cli import main

    config = tmp_path / "pushgw.yaml"
    config.write_text(
        json.dumps(
            {
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "hmac_key": "k"},
                "plugins": {"enabled": []},
            }
        )
    )
    try:
        status: object = main(["-c", str(config), "zulip", "rehash-tokens"])
    except SystemExit as exit_:  # how the plugin's sibling commands end (`_config`)
        status = exit_.code
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert err == "pushgw zulip: the zulip plugin is not enabled in this configuration\n"
