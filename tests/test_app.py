"""The application: health, readiness, metrics, graceful shutdown, receipts on disk."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from gateway.app import _request_middleware, create_app, load_gateway
from gateway.context import TokenHasher
from gateway.core.metrics import Metrics
from gateway.loops import YOUNG_GENERATION_THRESHOLD
from gateway.receipt_files import published_files, read_records
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config

TOKEN = "c3" * 32


async def test_health_ready_and_metrics(tmp_path: Path) -> None:
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        health = await gw.client.get("/healthz")
        assert health.status == 200 and await health.json() == {"status": "ok"}
        ready = await gw.client.get("/readyz")
        assert ready.status == 200 and (await ready.json())["store"] is True
        metrics = await gw.client.get("/metrics")
        assert metrics.status == 200
        assert metrics.headers["Content-Type"].startswith("text/plain")
        text = await metrics.text()
        assert 'pushgw_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in text
        assert "# TYPE pushgw_pushes_total counter" in text
        assert health.headers["X-Request-Id"]


async def test_request_id_is_echoed(tmp_path: Path) -> None:
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        response = await gw.client.get("/healthz", headers={"X-Request-Id": "abc123"})
        assert response.headers["X-Request-Id"] == "abc123"


@pytest.mark.parametrize(
    "given",
    ["abc] ERROR forged log line", "a\tb", "x" * 65, "caf\u00e9", ""],
    ids=["spaces-and-brackets", "control-character", "too-long", "not-ascii", "empty"],
)
async def test_a_request_id_that_is_no_plain_token_is_replaced(tmp_path: Path, given: str) -> None:
    """The client's id goes into every log line of the request and back into the
    response: one that could forge a log prefix, or could not be written back, is
    replaced by the gateway's own."""
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        headers = {"X-Request-Id": given.encode("utf-8").decode("latin-1")}
        response = await gw.client.get("/healthz", headers=headers)
    assert response.status == 200
    rid = response.headers["X-Request-Id"]
    assert rid != given and len(rid) == 16 and int(rid, 16) >= 0


async def test_generated_request_ids_are_distinct(tmp_path: Path) -> None:
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        ids = [(await gw.client.get("/healthz")).headers["X-Request-Id"] for _ in range(5)]
    assert len(set(ids)) == 5
    assert all(len(rid) == 16 and int(rid, 16) >= 0 for rid in ids)


async def test_unknown_route_is_a_404_not_a_500(tmp_path: Path) -> None:
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        response = await gw.client.post("/nope", data=b"\xff\x00")
        assert response.status == 404


async def test_metrics_on_their_own_port(tmp_path: Path, unused_tcp_port: int) -> None:
    config = base_config(tmp_path, {}, server={"metrics_port": unused_tcp_port})
    async with GatewayHarness(config) as gw:
        assert (await gw.client.get("/metrics")).status == 404
        async with gw.client.session.get(f"http://127.0.0.1:{unused_tcp_port}/metrics") as resp:
            assert resp.status == 200
            assert "pushgw_pushes_total" in await resp.text()


async def test_readyz_reports_an_unreachable_store(tmp_path: Path) -> None:
    config = base_config(tmp_path, {})
    config["store"] = {"url": "postgresql+asyncpg://nobody@127.0.0.1:1/none", "auto_upgrade": False}
    async with GatewayHarness(config) as gw:
        ready = await gw.client.get("/readyz")
        assert ready.status == 503
        assert (await ready.json())["store"] is False


async def test_shutdown_drains_in_flight_pushes_and_flushes_receipts(
    sample_plugin_installed: str, tmp_path: Path
) -> None:
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path,
            {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
            server={"shutdown_timeout": 5.0},
        )
        apns.script(TOKEN, ApnsResponse.ok(delay=0.5))
        gateway = load_gateway(data=config)
        client = TestClient(TestServer(create_app(gateway)))
        await client.start_server()
        pending = asyncio.create_task(
            client.post("/sample/push", json={"app": "ios", "token": TOKEN, "payload": {"aps": {}}})
        )
        await apns.wait_for_requests(1)
        dispatcher = gateway.runtime.dispatcher
        assert dispatcher is not None and dispatcher.in_flight == 1
        await client.server.close()  # shutdown starts while the push is in flight
        response = await pending
        assert (await response.json())["outcome"] == "ok"
        await client.close()
    files = published_files(tmp_path / "receipts")
    assert [f.suffix for f in files] == [".parquet"]  # the default format
    assert not list((tmp_path / "receipts").glob("*.open"))
    records = read_records(tmp_path / "receipts")
    assert len(records) == 1
    record = records[0]
    assert record["status"] == "ok" and record["plugin"] == "sample" and record["app_id"] == "ios"
    assert record["token_hash"] == TokenHasher(b"test-receipts-key")(TOKEN)
    assert TOKEN not in json.dumps(records)  # Parquet compresses: the values, then the bytes
    assert TOKEN.encode() not in files[0].read_bytes()
    assert set(record) == {
        "v",
        "ts",
        "push_id",
        "plugin",
        "app_id",
        "provider",
        "status",
        "http_status",
        "reason",
        "attempts",
        "latency_ms",
        "token_hash",
    }


async def test_start_up_tunes_the_collector(tmp_path: Path) -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        async with GatewayHarness(base_config(tmp_path, {})):
            assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > 0  # start-up's objects left out of collections
    finally:
        gc.set_threshold(*before)


async def test_http_methods_outside_the_standard_ones_share_one_label() -> None:
    """The method is the client's: aiohttp's pure-Python parser (AIOHTTP_NO_EXTENSIONS,
    or no C extension for the platform) accepts any token, so labelling by it as sent
    would let a client grow the registry without bound."""
    metrics = Metrics()
    middleware = _request_middleware(metrics)

    async def not_found(_request: web.Request) -> web.StreamResponse:
        raise web.HTTPNotFound()

    for method in ("GET", "FOO1", "FOO2", "BREW"):
        with pytest.raises(web.HTTPNotFound):
            await middleware(make_mocked_request(method, "/nope"), not_found)
    methods: dict[str, float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "pushgw_http_requests_total":
                method = sample.labels["method"]
                methods[method] = methods.get(method, 0.0) + sample.value
    assert methods == {"GET": 1.0, "other": 3.0}
