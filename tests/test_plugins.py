"""The plugin contract, proved by a third-party distribution found through its entry point."""

from __future__ import annotations

import gc
import inspect
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sqlalchemy import select, text

from gateway import hookspecs
from gateway.api import hookimpl
from gateway.config import ConfigError
from gateway.context import WORKER_ENV
from gateway.core.push import Outcome, Push, Receipt
from gateway.core.store import invalid_tokens
from gateway.plugins import PluginRegistry, installed_plugins
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config

APNS_TOKEN = "a1" * 32
FCM_TOKEN = "fcm-token-" + "x" * 40


def test_builtins_are_entry_point_plugins() -> None:
    names = {info.name for info in installed_plugins()}
    assert {"matrix", "zulip", "marmot", "receipts-spark"} <= names


def test_third_party_plugin_is_listed_with_its_hooks(sample_plugin_installed: str) -> None:
    info = {i.name: i for i in installed_plugins(["sample"])}["sample"]
    assert info.enabled
    assert info.distribution == "pushgw-sample"
    assert info.version == "1.0"
    assert "pushgw_routes" in info.hooks and "pushgw_token_invalid" in info.hooks


def test_every_hookspec_is_documented() -> None:
    guide = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    specs = [
        n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("pushgw_")
    ]
    assert len(specs) >= 9
    for name in specs:
        assert (getattr(hookspecs, name).__doc__ or "").strip(), f"{name} has no docstring"
        assert f"`{name}`" in guide, f"docs/plugins.md does not document {name}"


async def test_third_party_plugin_end_to_end(
    sample_plugin_installed: str, tmp_path: Path, register_secret: object
) -> None:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = base_config(
            tmp_path,
            {
                "sample": {
                    "greeting": "hi",
                    "apps": {
                        "ios": apns_app_config(apns, tmp_path, topic="org.example.sample"),
                        "android": fcm_app_config(fcm, tmp_path),
                    },
                }
            },
        )
        apns.script(APNS_TOKEN, ApnsResponse.error("Unregistered", timestamp=1_700_000_000_000))
        fcm.script(FCM_TOKEN, FcmResponse.unregistered())
        async with GatewayHarness(config) as gw:
            # the route the plugin added delivers through the core to the simulators
            ok = await gw.client.post(
                "/sample/push",
                json={"app": "ios", "token": "b2" * 32, "payload": {"aps": {"alert": "x"}}},
            )
            assert ok.status == 200
            assert await ok.json() == {"outcome": "ok", "reason": None, "greeting": "hi"}
            assert apns.requests[-1].headers["apns-topic"] == "org.example.sample"
            assert apns.requests[-1].json == {"aps": {"alert": "x"}}

            # a dead token comes back to the plugin through its hook, once
            dead = await gw.client.post(
                "/sample/push", json={"app": "ios", "token": APNS_TOKEN, "payload": {"aps": {}}}
            )
            assert (await dead.json())["outcome"] == "token_invalid"
            dead_fcm = await gw.client.post(
                "/sample/push",
                json={"app": "android", "token": FCM_TOKEN, "payload": {"data": {"k": "v"}}},
            )
            assert (await dead_fcm.json()) == {
                "outcome": "token_invalid",
                "reason": "UNREGISTERED",
                "greeting": "hi",
            }
            context = gw.context("sample")
            reported = context.state["invalid"]
            assert [(i.app_id, i.reason) for i in reported] == [
                ("ios", "Unregistered"),
                ("android", "UNREGISTERED"),
            ]
            assert reported[0].token == APNS_TOKEN
            assert reported[0].token_hash == context.token_hash(APNS_TOKEN)
            assert reported[0].token_timestamp == 1_700_000_000_000

            # the plugin's own table came from its migration branch; the core kept hashes only
            async with context.store.engine.connect() as conn:
                rows = (
                    await conn.execute(text("SELECT token_hash, reason FROM sample_invalid"))
                ).all()
                core = (await conn.execute(select(invalid_tokens.c.token_hash))).scalars().all()
            assert sorted(rows) == sorted(
                [
                    (context.token_hash(APNS_TOKEN), "Unregistered"),
                    (context.token_hash(FCM_TOKEN), "UNREGISTERED"),
                ]
            )
            assert sorted(core) == sorted(r[0] for r in rows)

            # the plugin's service runs and is reported ready
            ready = await gw.client.get("/readyz")
            body = await ready.json()
            assert ready.status == 200 and body["services"] == {"sample-ticker": True}
            assert body["apps"] == {"sample/ios": True, "sample/android": True}
        assert context.state["ticker"].running is False  # stopped at shutdown


async def test_unknown_app_is_a_permanent_receipt(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    config = base_config(tmp_path, {"sample": {}})
    async with GatewayHarness(config) as gw:
        response = await gw.client.post(
            "/sample/push", json={"app": "nope", "token": "t" * 64, "payload": {}}
        )
        assert await response.json() == {
            "outcome": "permanent",
            "reason": "unknown_app",
            "greeting": "hello",
        }


@pytest.mark.parametrize("hook", ["pushgw_routes", "pushgw_token_invalid", "pushgw_config_model"])
def test_sample_plugin_uses_only_the_public_api(hook: str) -> None:
    source = (Path(__file__).parent / "sample_plugin" / "pushgw_sample" / "__init__.py").read_text()
    imports = [
        line for line in source.splitlines() if line.startswith(("from gateway", "import gateway"))
    ]
    assert imports and all(line.startswith("from gateway.api import") for line in imports)
    assert f"def {hook}" in source


class _OncePerGateway:
    name = "listener"
    one_per_gateway = True

    def __init__(self) -> None:
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def ready(self) -> bool:
        return self.started


class _ListenerPlugin:
    def __init__(self) -> None:
        self.service = _OncePerGateway()

    @hookimpl
    def pushgw_services(self, context: object) -> list[_OncePerGateway]:
        return [self.service]


@pytest.mark.parametrize(("worker", "runs"), [("0", True), ("1", False)])
async def test_one_per_gateway_services_run_in_the_first_worker_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: str, runs: bool
) -> None:
    monkeypatch.setenv(WORKER_ENV, worker)
    plugin = _ListenerPlugin()
    async with GatewayHarness(base_config(tmp_path, {}), extra_plugins={"listener": plugin}) as gw:
        assert plugin.service.started is runs
        services = (await (await gw.client.get("/readyz")).json())["services"]
        assert services == ({"listener": True} if runs else {})


class _Observer:
    """Observes push results; `fail` makes its hook raise (a plugin bug)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.seen: list[str] = []

    def observe(self, push: Push, receipt: Receipt) -> str:
        if self.fail:
            raise RuntimeError(f"observer bug on {push.token}")
        self.seen.append(receipt.push_id)
        return "seen"


class _SyncObserver(_Observer):
    @hookimpl
    def pushgw_push_result(self, push: Push, receipt: Receipt) -> str:
        return self.observe(push, receipt)


class _AsyncObserver(_Observer):
    @hookimpl
    async def pushgw_push_result(self, push: Push, receipt: Receipt) -> str:
        return self.observe(push, receipt)


@pytest.mark.parametrize("failing_async", [False, True])
@pytest.mark.parametrize("healthy_async", [False, True])
async def test_a_failing_observer_does_not_hide_results_from_the_others(
    failing_async: bool,
    healthy_async: bool,
    caplog: pytest.LogCaptureFixture,
    register_secret: Any,
) -> None:
    register_secret("t" * 64)
    healthy = _AsyncObserver if healthy_async else _SyncObserver
    failing = _AsyncObserver if failing_async else _SyncObserver
    first, second, third = healthy(fail=False), failing(fail=True), healthy(fail=False)
    registry = PluginRegistry([], {"first": first, "broken": second, "third": third})
    push = Push("p", "app", "t" * 64, {})
    receipt = Receipt(push.id, "p", "app", None, Outcome.OK, 200, None, 1, 0.01, 0.0)
    caplog.set_level(logging.ERROR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = await registry.broadcast_async("pushgw_push_result", push=push, receipt=receipt)
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert first.seen == third.seen == [push.id]
    assert results == ["seen", "seen"]
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert "plugin broken: its pushgw_push_result hook raised RuntimeError" in caplog.text
    assert "t" * 64 not in caplog.text


class _Routes:
    """Adds `method path` routes answering `text`."""

    def __init__(self, text: str, *routes: tuple[str, str]) -> None:
        self.text, self.routes = text, routes

    @hookimpl
    def pushgw_routes(self, context: object, router: web.UrlDispatcher) -> None:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=self.text)

        for method, path in self.routes:
            router.add_route(method, path, handler)


async def test_plugins_may_share_a_path_with_other_methods(tmp_path: Path) -> None:
    plugins = {
        "p": _Routes("p", ("POST", "/shared"), ("GET", "/p")),
        "q": _Routes("q", ("GET", "/shared"), ("PUT", "/healthz")),
    }
    config = base_config(tmp_path, {name: {} for name in plugins})
    async with GatewayHarness(config, extra_plugins=plugins) as gw:
        assert await (await gw.client.post("/shared")).text() == "p"
        assert await (await gw.client.get("/shared")).text() == "q"
        assert await (await gw.client.put("/healthz")).text() == "q"
        assert (await gw.client.get("/healthz")).status == 200  # still the core's


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ([("*", "/metrics")], "plugin 'q': its route * /metrics is already a route of the core"),
        (
            [("GET", "/p/{id}")],
            "plugin 'q': its route GET /p/{id} is already a route of plugin 'p'",
        ),
        ([("*", "/p/{id}")], "plugin 'q': its route * /p/{id} is already a route of plugin 'p'"),
    ],
)
async def test_a_route_answering_a_method_of_another_owners_is_an_error(
    tmp_path: Path, routes: list[tuple[str, str]], message: str
) -> None:
    plugins = {"p": _Routes("p", ("GET", "/p/{id}")), "q": _Routes("q", *routes)}
    config = base_config(tmp_path, {name: {} for name in plugins})
    with pytest.raises(ConfigError) as failed:
        async with GatewayHarness(config, extra_plugins=plugins):
            pass
    assert str(failed.value) == message


class _AsyncHooks:
    """`async def` implementations of hooks that may not be async."""

    @hookimpl
    async def pushgw_config_model(self) -> None:
        pass

    @hookimpl
    async def pushgw_apps(self, context: object) -> None:
        pass

    @hookimpl
    async def pushgw_routes(self, context: object, router: web.UrlDispatcher) -> None:
        pass


@pytest.mark.parametrize("hook", ["pushgw_config_model", "pushgw_apps", "pushgw_routes"])
async def test_an_async_hook_that_may_not_be_is_named_and_its_coroutine_closed(
    tmp_path: Path, hook: str
) -> None:
    plugin = type("Plugin", (), {hook: getattr(_AsyncHooks, hook)})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError) as failed:
            async with GatewayHarness(
                base_config(tmp_path, {"x": {}}), extra_plugins={"x": plugin}
            ):
                pass
        message = str(failed.value)
        del failed  # its traceback's frames hold the coroutine
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert message.startswith(f"plugin 'x': its {hook} hook returned coroutine, not ")
    assert not [w for w in caught if "never awaited" in str(w.message)]


class _GeneratedServices:
    @hookimpl
    def pushgw_services(self, context: object) -> Iterator[_OncePerGateway]:
        yield _OncePerGateway()


async def test_services_may_be_any_iterable(tmp_path: Path) -> None:
    plugins = {"gen": _GeneratedServices()}
    async with GatewayHarness(base_config(tmp_path, {"gen": {}}), extra_plugins=plugins) as gw:
        services = (await (await gw.client.get("/readyz")).json())["services"]
        assert services == {"listener": True}
