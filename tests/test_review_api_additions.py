"""Review: today's API additions as a third-party plugin author meets them.

`InvalidToken.observed_at`, `BodyTimeout` and `RepeatedLines`, used by a plugin written
from docs/plugins.md alone and importing only `gateway.api` and `gateway.testing`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from gateway.api import (
    AppConfig,
    BodyTimeout,
    ConfigModel,
    InvalidToken,
    PluginContext,
    Push,
    RepeatedLines,
    hookimpl,
)
from gateway.cli import main as pushgw
from gateway.testing import (
    ApnsResponse,
    ApnsSimulator,
    FcmResponse,
    FcmSimulator,
    GatewayHarness,
    apns_app_config,
    base_config,
    fcm_app_config,
)
from tests.conftest import install_plugin_dist, offline_apns_app

IOS_TOKEN = "ab" * 32


class Config(ConfigModel):
    apps: dict[str, AppConfig] = {}


class Plugin:
    """The plugin: `/apiuser/notify` (answers a body timeout in its own terms),
    `/apiuser/raise` (the same, with aiohttp's `raise web.HTTPRequestTimeout`),
    `/apiuser/raw` (does not catch it), and a token-invalid hook that keeps a
    registration newer than the answer and returns how many records it matched."""

    def __init__(self) -> None:
        self.registrations: dict[str, float] = {}  # token_hash -> registered at (unix)
        self.seen: list[InvalidToken] = []

    @hookimpl
    def pushgw_config_model(self) -> type[Config]:
        return Config

    @hookimpl
    def pushgw_apps(self, context: PluginContext) -> dict[str, AppConfig]:
        assert isinstance(context.config, Config)
        return context.config.apps

    @hookimpl
    def pushgw_routes(self, context: PluginContext, router: web.UrlDispatcher) -> None:
        async def notify(request: web.Request) -> web.Response:
            try:
                body = await request.json()
            except BodyTimeout:
                return web.json_response({"ok": False, "error": "slow body"}, status=408)
            receipt = await context.send(
                Push(
                    plugin=context.name,
                    app_id=body["app"],
                    token=body["token"],
                    payload={"data": {"n": "1"}} if body["app"] == "android" else {"aps": {}},
                )
            )
            return web.json_response({"ok": receipt.ok})

        async def raw(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"ok": True})

        router.add_post("/apiuser/notify", notify)

        async def raise_(request: web.Request) -> web.Response:
            try:
                await request.read()
            except BodyTimeout:
                raise web.HTTPRequestTimeout(
                    text='{"ok": false, "error": "slow body"}', content_type="application/json"
                ) from None
            return web.json_response({"ok": True})

        router.add_post("/apiuser/raw", raw)
        router.add_post("/apiuser/raise", raise_)

    @hookimpl
    def pushgw_token_invalid(self, context: PluginContext, invalid: InvalidToken) -> int:
        self.seen.append(invalid)
        registered = self.registrations.get(invalid.token_hash)
        if registered is None:
            return 0
        if invalid.observed_at is None or registered <= invalid.observed_at:
            del self.registrations[invalid.token_hash]
        return 1


# --- observed_at on live provider answers ----------------------------------------------


@pytest_asyncio.fixture
async def gw(
    tmp_path: Path, apns_simulator: ApnsSimulator, fcm_simulator: FcmSimulator
) -> AsyncIterator[tuple[GatewayHarness, Plugin]]:
    apps = {
        "ios": apns_app_config(apns_simulator, tmp_path),
        "android": fcm_app_config(fcm_simulator, tmp_path),
    }
    config = base_config(tmp_path, {"apiuser": {"apps": apps}}, server={"body_timeout": 0.3})
    plugin = Plugin()
    async with GatewayHarness(config, extra_plugins={"apiuser": plugin}) as harness:
        yield harness, plugin


@pytest.mark.parametrize(
    ("app", "token"),
    [("ios", IOS_TOKEN), ("android", "fcm-token-1")],
)
async def test_observed_at_is_the_start_of_the_request_that_got_the_answer(
    gw: tuple[GatewayHarness, Plugin],
    apns_simulator: ApnsSimulator,
    fcm_simulator: FcmSimulator,
    app: str,
    token: str,
) -> None:
    harness, plugin = gw
    apns_simulator.script(IOS_TOKEN, ApnsResponse.error("Unregistered"))
    fcm_simulator.script("fcm-token-1", FcmResponse.unregistered())
    token_hash = harness.context("apiuser").token_hash(token)
    plugin.registrations[token_hash] = 0.0  # registered long before
    before = time.time()
    response = await harness.client.post("/apiuser/notify", json={"app": app, "token": token})
    after = time.time()
    assert await response.json() == {"ok": False}
    [invalid] = plugin.seen
    assert invalid.observed_at is not None
    assert before <= invalid.observed_at <= after
    assert token_hash not in plugin.registrations  # older than the answer: forgotten


# --- observed_at and the returned count on `pushgw tokens retire` -----------------------

RETIRE_PLUGIN = """
from gateway.api import AppConfig, ConfigModel, hookimpl

REGISTRATIONS = {"%(kept)s": 2000.0, "%(dropped)s": 500.0}
SEEN = []


class Config(ConfigModel):
    apps: dict[str, AppConfig] = {}


@hookimpl
def pushgw_config_model():
    return Config


@hookimpl
def pushgw_apps(context):
    return context.config.apps


@hookimpl
def pushgw_token_invalid(context, invalid):
    SEEN.append(invalid)
    registered = REGISTRATIONS.get(invalid.token_hash)
    if registered is None:
        return 0
    if invalid.observed_at is None or registered <= invalid.observed_at:
        del REGISTRATIONS[invalid.token_hash]
    return 1
"""


async def test_tokens_retire_gives_last_seen_or_none_and_reports_unmatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    kept, dropped, nobody = "ab" * 32, "cd" * 32, "ef" * 32
    site = tmp_path / "site"
    install_plugin_dist(site, "apiuser")
    (site / "pushgw_apiuser.py").write_text(RETIRE_PLUGIN % {"kept": kept, "dropped": dropped})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "pushgw_apiuser", raising=False)
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts")},
                "plugins": {
                    "enabled": ["apiuser"],
                    "apiuser": {"apps": {"ios": offline_apns_app(tmp_path)}},
                },
            }
        )
    )
    dead = tmp_path / "dead.jsonl"
    lines = [
        {"plugin": "apiuser", "app_id": "ios", "token_hash": kept, "last_seen": 1000},
        {"plugin": "apiuser", "app_id": "ios", "token_hash": dropped},
        {"plugin": "apiuser", "app_id": "ios", "token_hash": nobody, "last_seen": 1000.5},
    ]
    dead.write_text("".join(json.dumps(line) + "\n" for line in lines))
    status = await asyncio.to_thread(
        pushgw, ["tokens", "retire", str(dead), "--config", str(config)]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    module = sys.modules["pushgw_apiuser"]
    observed = {invalid.token_hash: invalid.observed_at for invalid in module.SEEN}
    assert observed == {kept: 1000.0, dropped: None, nobody: 1000.5}
    kept_registrations = module.REGISTRATIONS
    assert kept_registrations == {kept: 2000.0}  # registered after it was seen dead
    assert "retired 3 tokens" in out
    assert "; 1 matched no registration" in out  # the count the hook returned


# --- BodyTimeout ----------------------------------------------------------------------


async def _exchange(gw: GatewayHarness, request: bytes) -> bytes:
    """Every byte the gateway answers `request` with, until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()


def _partial(path: str) -> bytes:
    """Headers announcing 100 bytes of body, and 10 of them: the rest never comes."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: pushgw\r\nContent-Type: application/json\r\n"
        f"Content-Length: 100\r\n\r\n0123456789"
    ).encode()


def _split(received: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path", ["/apiuser/notify", "/apiuser/raise"])
async def test_a_caught_body_timeout_answered_408_reaches_the_client_as_is(
    gw: tuple[GatewayHarness, Plugin], path: str
) -> None:
    """docs/plugins.md: the core answers 408 "with the handler's own answer when that is
    a 408". A handler that raised its 408 (`raise web.HTTPRequestTimeout(...)`, how
    aiohttp handlers answer errors) got the core's body instead of its own."""
    status, headers, body = _split(await _exchange(gw[0], _partial(path)))
    assert status == 408
    assert headers.get("connection", "").lower() == "close"
    assert json.loads(body) == {"ok": False, "error": "slow body"}


async def test_an_uncaught_body_timeout_is_the_core_408(
    gw: tuple[GatewayHarness, Plugin],
) -> None:
    status, headers, body = _split(await _exchange(gw[0], _partial("/apiuser/raw")))
    assert status == 408
    assert headers.get("connection", "").lower() == "close"
    assert "did not come in time" in json.loads(body)["error"]


# --- RepeatedLines ---------------------------------------------------------------------


def test_repeated_lines_keys_are_independent_and_counted() -> None:
    now = [0.0]
    repeats = RepeatedLines(clock=lambda: now[0])
    assert repeats.admit(("ios", "throttled")) == (0, 0)
    assert repeats.admit(("android", "throttled")) == (0, 0)  # another app: its own line
    assert repeats.admit(("ios", "throttled")) is None
    assert repeats.admit(("ios", "throttled"), 3) is None
    now[0] = 60.0
    assert repeats.admit(("ios", "throttled")) == (2, 4)
    assert repeats.admit(("android", "throttled")) == (0, 0)


def test_repeated_lines_is_bounded_by_max_keys() -> None:
    now = [0.0]
    repeats = RepeatedLines(clock=lambda: now[0], max_keys=4)
    for n in range(100):
        repeats.admit(("app", str(n)))
    # the four most recent are kept (still repeats), the rest went, oldest first
    assert [repeats.admit(("app", str(n))) for n in range(96, 100)] == [None] * 4
    assert repeats.admit(("app", "95")) == (0, 0)
