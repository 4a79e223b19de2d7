"""A running gateway for tests: plugin authors drive it over HTTP against the simulators.

async with ApnsSimulator() as apns, FcmSimulator() as fcm:
    config = base_config(tmp_path, {"myplugin": {"apps": {
        "ios": apns_app_config(apns, tmp_path), "android": fcm_app_config(fcm, tmp_path)}}})
    async with GatewayHarness(config) as gw:
        response = await gw.client.post("/my/route", json={...})
        assert apns.requests[0].json == {...}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from gateway import logs
from gateway.app import LoadedGateway, create_app, load_gateway
from gateway.testing.apns_sim import ApnsSimulator, generate_apns_auth_key
from gateway.testing.fcm_sim import FcmSimulator, make_service_account


def base_config(
    directory: Path, plugins: Mapping[str, Mapping[str, Any]], **sections: Any
) -> dict[str, Any]:
    """A complete config: SQLite and receipts under `directory`, `plugins` enabled in order."""
    config: dict[str, Any] = {
        "store": {"url": f"sqlite+aiosqlite:///{directory / 'pushgw.db'}"},
        "receipts": {"directory": str(directory / "receipts"), "hmac_key": "test-receipts-key"},
        "delivery": {"backoff_base": 0.05, "backoff_cap": 0.5},
        "plugins": {"enabled": list(plugins), **{k: dict(v) for k, v in plugins.items()}},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def apns_app_config(
    sim: ApnsSimulator, directory: Path, *, topic: str = "com.example.app", **overrides: Any
) -> dict[str, Any]:
    """An APNs app (token auth) pointed at `sim`, with a fresh .p8 key the simulator trusts."""
    key = generate_apns_auth_key()
    path = key.write_p8(directory / f"AuthKey_{key.key_id}.p8")
    sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
    return {
        "type": "apns",
        "keyfile": str(path),
        "key_id": key.key_id,
        "team_id": key.team_id,
        "topic": topic,
        "host": sim.host,
        "port": sim.port,
        "ca_file": str(sim.ca_path),
        "request_timeout": 2.0,
        **overrides,
    }


def fcm_app_config(
    sim: FcmSimulator, directory: Path, *, project_id: str = "pushgw-test", **overrides: Any
) -> dict[str, Any]:
    """An FCM app with a generated service account whose OAuth and send URLs are `sim`'s."""
    path = directory / f"service-account-{project_id}.json"
    info = make_service_account(project_id, sim.token_uri, path)
    sim.add_service_account(info)
    return {
        "type": "fcm",
        "project_id": project_id,
        "service_account_file": str(path),
        "send_url": sim.send_url_template,
        "request_timeout": 2.0,
        **overrides,
    }


class GatewayHarness:
    """Runs a whole gateway (store, dispatcher, plugin routes and services) on a test server."""

    def __init__(
        self, config: dict[str, Any], *, extra_plugins: Mapping[str, object] | None = None
    ) -> None:
        self.config = config
        self.extra_plugins = extra_plugins
        self._client: TestClient | None = None
        self.gateway: LoadedGateway | None = None

    async def __aenter__(self) -> GatewayHarness:
        self.gateway = load_gateway(data=self.config, extra_plugins=self.extra_plugins)
        app = create_app(self.gateway)
        # Requests are logged as `pushgw serve` logs them (the route, never the path),
        # so that a test of what reaches the log sees what production writes.
        settings = self.gateway.settings
        access_log = logging.getLogger("aiohttp.access") if settings.logging.access_log else None
        logs.filter_unreadable_requests()  # a client's unparsable request: one INFO line
        server = TestServer(app)
        client = TestClient(server)
        try:
            await server.start_server(
                access_log=access_log, access_log_class=logs.RouteAccessLogger
            )
            await client.start_server()  # the server is started: only the client's part
        except BaseException:
            # A failing start-up step (a plugin service, a migration...) leaves the
            # contexts that had started running: aiohttp unwinds them only on the
            # runner's cleanup, which TestClient.close() skips for a server that never
            # started. `pushgw serve` (web.run_app) does clean up; do as it does.
            try:
                runner = client.server.runner
                if runner is not None:
                    await runner.cleanup()
            finally:
                await client.close()
            raise
        self._client = client
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()

    @property
    def client(self) -> TestClient:
        assert self._client is not None, "use `async with GatewayHarness(...)`"
        return self._client

    def context(self, plugin: str) -> Any:
        """The plugin's `PluginContext` (its config, store, dispatcher)."""
        assert self.gateway is not None
        return self.gateway.contexts[plugin]
