"""What an operator scraping /metrics relies on: label values bounded by configuration
or a fixed vocabulary (never whatever a provider or a proxy answered), and gauges that
come out right when `pushgw serve --workers N` aggregates its workers' files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api import Metrics, Outcome
from gateway.core.metrics import MULTIPROC_ENV
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from plugins.marmot.keys import ServerKey
from tests.conftest import SAMPLE_PLUGIN_DIR
from tests.marmot.helpers import apns_device, chunk_for
from tests.marmot.test_service import Clock, Harness, trigger

REPO = Path(__file__).resolve().parent.parent


def sample_plugin() -> ModuleType:
    if str(SAMPLE_PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(SAMPLE_PLUGIN_DIR))
    import pushgw_sample

    return pushgw_sample


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


# --- provider reasons in pushgw_pushes_total ---------------------------------------------


async def test_unknown_provider_reasons_do_not_become_label_values(
    tmp_path: Path, register_secret: object
) -> None:
    """APNs' `reason` (FCM's errorCode / status) went into `pushgw_pushes_total{reason}` as
    sent: an intermediary, a proxy or a new provider error answering with a fresh string
    per request made one series per string, forever. Reasons outside the known
    vocabulary are now counted as `other`; the receipt still carries what was sent."""
    plugin = sample_plugin()
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        async with GatewayHarness(config, extra_plugins={"sample": plugin}) as gw:
            for i in range(3):
                token = f"{i + 10:02x}" * 32
                register_secret(token)  # type: ignore[operator]
                apns.script(token, ApnsResponse(400, f"ProxyError{i}x"))
                resp = await gw.client.post(
                    "/sample/push", json={"app": "ios", "token": token, "payload": {"aps": {}}}
                )
                assert (await resp.json())["reason"] == f"ProxyError{i}x"
            text = await (await gw.client.get("/metrics")).text()
    assert "ProxyError" not in text
    pushes = {
        (labels["outcome"], labels["reason"]): value
        for labels, value in samples(text, "pushgw_pushes_total")
        if labels["plugin"] == "sample"
    }
    assert pushes == {("permanent", "other"): 3.0}


def test_known_reasons_keep_their_label_value() -> None:
    for reason in ("", "BadDeviceToken", "UNREGISTERED", "INVALID_ARGUMENT", "queue_full"):
        assert Metrics.reason_label(reason) == reason
    assert Metrics.reason_label("DefinitelyNotAnApnsReason") == "other"


# --- Marmot's config-error counter -------------------------------------------------------


async def test_marmot_config_errors_do_not_label_unknown_403_reasons() -> None:
    """`pushgw_marmot_config_errors_total{reason}` counts every 403, labelled with the
    provider's reason as sent: the same unbounded label. An unknown reason of a 403 is
    now labelled with the status."""
    h = Harness(ServerKey.generate(), Clock())
    await h.service.start()
    try:
        h.outcome = lambda push: (Outcome.PERMANENT, "SomeProxyReason", 403)
        await h.run(trigger(h.key, [chunk_for(h.key, apns_device())]))
        assert h.sample("pushgw_marmot_config_errors_total", reason="SomeProxyReason") == 0
        assert h.sample("pushgw_marmot_config_errors_total", reason="403") == 1
    finally:
        await h.service.stop()


# --- Marmot's gauges with several workers ------------------------------------------------

# One worker of `pushgw serve --workers 2`: every worker loads the plugin (and so its
# metric families); only the first runs the relay service (`one_per_gateway`).
WORKER = """
import sys
from gateway.api import Metrics
from plugins.marmot.metrics import MarmotMetrics

marmot = MarmotMetrics(Metrics())
if sys.argv[1] == "0":
    marmot.relays_connected.set(2)
    marmot.relay_state.labels("wss://relay.example", "live").set(1)
    marmot.dedup_entries.set(5)
    marmot.inflight.set(1)
    marmot.queued.set(3)
"""


def test_marmot_gauges_aggregate_across_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Marmot gauges had no multiprocess_mode (prometheus-client's default `all`): with
    `--workers 2` each came out once per worker with a `pid` label the docs do not
    show, and the second worker, which runs no relay service, exported
    `pushgw_marmot_relays_connected{pid=...} 0` for as long as the gateway ran: the
    documented alert `relays_connected == 0` fired with every relay connected."""
    directory = tmp_path / "multiproc"
    directory.mkdir()
    env = {**os.environ, MULTIPROC_ENV: str(directory)}
    for index in ("0", "1"):
        subprocess.run(
            [sys.executable, "-c", WORKER, index], env=env, cwd=REPO, check=True, timeout=60
        )
    monkeypatch.setenv(MULTIPROC_ENV, str(directory))
    text = Metrics().exposition().decode()
    assert samples(text, "pushgw_marmot_relays_connected") == [({}, 2.0)]
    assert samples(text, "pushgw_marmot_relay_state") == [
        ({"relay": "wss://relay.example", "state": "live"}, 1.0)
    ]
    assert samples(text, "pushgw_marmot_dedup_entries") == [({}, 5.0)]
    assert samples(text, "pushgw_marmot_inflight") == [({}, 1.0)]
    assert samples(text, "pushgw_marmot_queued") == [({}, 3.0)]
