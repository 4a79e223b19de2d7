"""Review: an operator replacing a running Sygnal 0.17 with pushgw (docs/matrix.md).

Each test states the Sygnal behaviour (file:line in element-hq/sygnal 0.17.0) that an
existing deployment relies on, which pushgw did not reproduce (each failed before its
fix) or reproduces with the setting docs/matrix.md gives.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator, generate_apns_auth_key
from gateway.testing.fcm_sim import FcmSimulator, make_service_account
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from plugins.matrix.sygnal_config import translate_sygnal_config
from tests.matrix.conftest import NOTIFY, Post, apns_pushkey, device, notification

IOS = "com.example.ios"
ANDROID = "com.example.android"


@pytest.fixture
def sygnal_yaml(tmp_path: Path) -> dict[str, Any]:
    """A working Sygnal config (parsed YAML) with one APNs and one FCM v1 app."""
    key = generate_apns_auth_key()
    account = tmp_path / "service_account.json"
    make_service_account("example-project", "http://127.0.0.1:9/token", account)
    return {
        "http": {"bind_addresses": ["127.0.0.1"], "port": 5000},
        "apps": {
            "com.example.myapp.ios": {
                "type": "apns",
                "keyfile": str(key.write_p8(tmp_path / "AuthKey.p8")),
                "key_id": key.key_id,
                "team_id": key.team_id,
                "topic": "com.example.myapp",
            },
            "im.vector.app": {
                "type": "gcm",
                "api_version": "v1",
                "project_id": "example-project",
                "service_account_file": str(account),
            },
        },
    }


# --- configuration ------------------------------------------------------------------


def test_quoted_ports_load_as_in_sygnal(sygnal_yaml: dict[str, Any]) -> None:
    """Sygnal converts the ports with int(): `port: "5000"` (a templated config, an env
    substitution) starts Sygnal (sygnal/sygnal.py:211 `int(self.config["http"]["port"])`,
    :133 `int(promcfg["port"])`). pushgw refuses it ("http.port: expected an integer")."""
    sygnal_yaml["http"]["port"] = "5000"
    sygnal_yaml["metrics"] = {"prometheus": {"enabled": True, "port": "8000"}}
    config, _ = translate_sygnal_config(sygnal_yaml)
    assert config["server"]["port"] == 5000
    assert config["server"]["metrics_port"] == 8000


def test_empty_platform_and_push_type_mean_unset_as_in_sygnal(sygnal_yaml: dict[str, Any]) -> None:
    """Sygnal treats an empty `platform` as production and an empty `push_type` as no
    push type (sygnal/apnspushkin.py:132 `if not platform or ...`, :199 `if not
    push_type`). pushgw refuses to start: "platform: invalid platform ''" and
    "push_type: must be one of ..."."""
    app = sygnal_yaml["apps"]["com.example.myapp.ios"]
    app["platform"] = ""
    app["push_type"] = ""
    config, _ = translate_sygnal_config(sygnal_yaml)  # raises SygnalConfigError today
    assert "com.example.myapp.ios" in config["plugins"]["matrix"]["apps"]


# --- metrics ------------------------------------------------------------------------


async def test_process_metrics_for_the_sygnal_dashboard(gw: GatewayHarness, post: Post) -> None:
    """docs/matrix.md: "Sygnal's dashboard (contrib/grafana/Sygnal.json) works unchanged".
    Its CPU, Memory Usage and Open FDs panels query process_cpu_seconds_total,
    process_resident_memory_bytes, process_open_fds and process_max_fds, which Sygnal
    exports through prometheus_client's default registry (sygnal/sygnal.py:138
    `prometheus_client.start_http_server`). pushgw's registry has no process collector,
    so those panels stay empty."""
    await post(notification([device(IOS, apns_pushkey()[0])]))
    text = await (await gw.client.get("/metrics")).text()
    for family in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
    ):
        assert f"\n{family} " in text, family


async def test_requests_in_flight_label_is_sygnals(gw: GatewayHarness, post: Post) -> None:
    """Sygnal labels the gauge with the handler's class name
    (sygnal/http.py:175-177 `REQUESTS_IN_FLIGHT_GUAGE.labels(self.__class__.__name__)`),
    i.e. `sygnal_requests_in_flight{resource="V1NotifyHandler"}`; alerts and panels
    selecting that series find nothing in pushgw, which exports resource="notify"."""
    await post(notification([device(IOS, apns_pushkey()[0])]))
    text = await (await gw.client.get("/metrics")).text()
    assert 'sygnal_requests_in_flight{resource="V1NotifyHandler"} 0.0' in text


async def test_inflight_drop_counter_exported_at_zero_for_each_app(gw: GatewayHarness) -> None:
    """Sygnal creates the drop counter's child for every pushkin at start-up "so the
    counter appears in metrics even if it hasn't yet been incremented"
    (sygnal/notifications.py:191-195). pushgw creates it at the first drop, so an
    `increase(sygnal_inflight_request_limit_drop_total[5m]) > 0` alert misses the first
    drops (a series born at 1 has no increase)."""
    text = await (await gw.client.get("/metrics")).text()
    for app in (IOS, ANDROID):
        assert f'sygnal_inflight_request_limit_drop_total{{pushkin="{app}"}} 0.0' in text, app


async def test_notify_time_buckets_are_sygnals(gw: GatewayHarness, post: Post) -> None:
    """Sygnal's sygnal_notify_time has prometheus_client's default buckets
    (sygnal/http.py:64-68, no `buckets=`): ... 0.05, 0.075, 0.1, ... 0.5, 0.75, 1, 2.5,
    5, 7.5, 10. pushgw's has other bounds (no 0.075/0.75/7.5, an extra 30), so series
    such as `sygnal_notify_time_bucket{le="7.5"}` used by SLO rules disappear."""
    await post(notification([device(IOS, apns_pushkey()[0])]))
    text = await (await gw.client.get("/metrics")).text()
    for le in ("0.075", "0.75", "7.5"):
        assert f'sygnal_notify_time_bucket{{code="200",le="{le}"}}' in text, le


# --- provider answers ---------------------------------------------------------------


async def test_dead_tokens_still_rejected_when_most_tokens_are_dead(
    apns: ApnsSimulator, fcm: FcmSimulator, tmp_path: Path
) -> None:
    """Sygnal rejects every 410 Unregistered pushkey (sygnal/apnspushkin.py:90, :271-279),
    however many there are. pushgw's mass-invalidation guard would answer 502 once more
    than half of 100 sends in 5 minutes were token-invalid (docs/delivery.md); with
    `delivery.invalidation_guard_ratio: 1`, the setting docs/matrix.md gives for Sygnal's
    behaviour, every dead pushkey is rejected (a server cleaning out the pushers of
    uninstalled apps)."""
    apps = {IOS: apns_app_config(apns, tmp_path), ANDROID: fcm_app_config(fcm, tmp_path)}
    config = base_config(tmp_path, {"matrix": {"apps": apps, "notify_deadline": 3.0}})
    config["delivery"] = {**config.get("delivery", {}), "invalidation_guard_ratio": 1.0}
    async with GatewayHarness(config) as gw:
        answers = await _notify_dead_pushkeys(gw, apns)
    statuses = [status for status, _ in answers]
    first_failure = next((i for i, status in enumerate(statuses) if status != 200), None)
    assert first_failure is None, f"request #{first_failure} got {statuses[first_failure]}"
    assert [len(body["rejected"]) for _, body in answers] == [1] * len(answers)


async def _notify_dead_pushkeys(gw: GatewayHarness, apns: ApnsSimulator) -> list[tuple[int, Any]]:
    """120 notifications, 20 at a time, each to one pushkey APNs calls Unregistered."""
    apns.script_all(ApnsResponse.error("Unregistered"))
    keys = [apns_pushkey()[0] for _ in range(120)]
    answers: list[tuple[int, Any]] = []
    for start in range(0, len(keys), 20):
        batch = keys[start : start + 20]
        responses = await asyncio.gather(
            *(gw.client.post(NOTIFY, json=notification([device(IOS, key)])) for key in batch)
        )
        for response in responses:
            body = await response.text()
            answers.append((response.status, json.loads(body) if response.status == 200 else body))
    return answers


# --- msc3013_mode: off ----------------------------------------------------------------


async def test_msc3013_off_ignores_crypto_fields_like_sygnal(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    """docs/matrix.md: "`off` is Sygnal parity (crypto fields ignored)". Sygnal reads
    none of `ciphertext`/`ephemeral`/`mac`/`is_counts_only` (sygnal/notifications.py:79-102)
    and delivers such a notification. With every app `off`, pushgw still validates them
    before routing and answers 400 `Invalid encrypted notification`."""
    async with make_gateway(ios={"msc3013_mode": "off"}, android={"msc3013_mode": "off"}) as gw:
        key, _ = apns_pushkey()
        body = notification([device(IOS, key)], mac="not-msc3013", is_counts_only="yes")
        response = await gw.client.post(NOTIFY, json=body)
        assert response.status == 200, await response.text()
    assert len(apns.requests) == 1
