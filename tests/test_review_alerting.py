"""The pager's view: the alert rules pushgw ships (config/alerts.yml, the example of
docs/delivery.md) read metrics a live gateway exports, and each rule added here fires
in a failure the simulators (or a real PostgreSQL) produce.

No Prometheus server: each rule's expression is evaluated by hand over the samples of
/metrics (`increase` as the difference of two scrapes, `changes` over successive
scrapes), which checks the metrics and their values, not PromQL itself. That every
metric and label the rules name exists after real traffic is checked by
tests/test_review_runbook.py over the same rules.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.config.sections import DeliveryConfig
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from tests.test_review_runbook import push, sample_plugin

ROOT = Path(__file__).parent.parent
RULES = ROOT / "config" / "alerts.yml"
DOCS = ROOT / "docs" / "delivery.md"
# Metrics the rules read that Prometheus and the blackbox exporter make, not pushgw.
EXTERNAL = {"up", "probe_success"}


def rules() -> dict[str, dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return {rule["alert"]: rule for group in loaded["groups"] for rule in group["rules"]}


def expr(alert: str) -> str:
    return str(rules()[alert]["expr"])


def samples(body: str, name: str, **labels: str) -> list[float]:
    return [
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def total(body: str, name: str, **labels: str) -> float:
    return sum(samples(body, name, **labels))


async def scrape(gw: GatewayHarness) -> str:
    response = await gw.client.get("/metrics")
    assert response.status == 200
    return await response.text()


def test_the_shipped_rules_file_is_the_docs_example() -> None:
    """docs/delivery.md showed example rules an operator had to copy out of a page; the
    rules now ship as a file Prometheus loads, and the page shows that file."""
    doc = DOCS.read_text()
    section = doc[doc.index("## Alerts and troubleshooting") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == yaml.safe_load(RULES.read_text())
    names = list(rules())
    assert len(names) == len(set(names))
    for rule in rules().values():
        outside = {
            m.group(1)
            for m in re.finditer(r"\b([a-z_][a-z0-9_]*)\{", rule["expr"])
            if not m.group(1).startswith("pushgw_")
        }
        assert outside <= EXTERNAL, rule["alert"]
    # What the pager needs has a rule: saturation, restarts, the sweep, the database.
    for alert in ("PushgwQueueSaturated", "PushgwRestarting", "PushgwTokenSweepFailing"):
        assert alert in names


async def test_a_lane_filling_up_is_seen_before_it_sheds(tmp_path: Path) -> None:
    """`pushgw_pushes_in_flight` alone cannot say how full a lane is: its limit
    (`delivery.queue_size`) was nowhere on /metrics, so the only saturation alert was
    pushes already shed. `pushgw_queue_limit` gives the denominator."""
    rule = expr("PushgwQueueSaturated")
    assert "pushgw_pushes_in_flight" in rule and "pushgw_queue_limit" in rule
    threshold = float(rule.rsplit(">", 1)[1])
    async with ApnsSimulator() as apns:
        apns.default = ApnsResponse.ok(delay=1.0)  # a provider slower than the pushes
        config = base_config(
            tmp_path,
            {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
            delivery={"queue_size": 4},
        )
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            idle = await scrape(gw)
            lane = {"plugin": "sample", "app": "ios"}
            assert total(idle, "pushgw_queue_limit", **lane) == 4
            assert total(idle, "pushgw_pushes_in_flight", **lane) == 0
            pending = [
                asyncio.create_task(push(gw, "ios", secrets.token_hex(32))) for _ in range(4)
            ]
            await apns.wait_for_requests(4)
            full = await scrape(gw)
            ratio = total(full, "pushgw_pushes_in_flight", **lane) / total(
                full, "pushgw_queue_limit", **lane
            )
            assert ratio > threshold  # the alert fires before anything is shed
            assert total(full, "pushgw_pushes_shed_total", reason="queue_full") == 0
            shed = await push(gw, "ios", secrets.token_hex(32))
            assert shed["outcome"] == "throttled"
            assert [r["outcome"] for r in await asyncio.gather(*pending)] == ["ok"] * 4
            after = await scrape(gw)
    assert total(after, "pushgw_pushes_in_flight", **lane) == 0  # and clears
    assert total(after, "pushgw_pushes_shed_total", reason="queue_full", **lane) == 1


async def _set_read_only(admin: Any, database: str, on: bool) -> None:
    async with admin.connect() as conn:
        setting = "on" if on else "off"
        await conn.execute(
            text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = {setting}')
        )


async def test_a_failing_dead_token_sweep_is_counted(tmp_path: Path, postgres_url: str) -> None:
    """The hourly sweep of old dead-token records failed with one log line and nothing
    on /metrics: with the database read-only (a failover to a standby) the records
    piled up and no alert could say so. Each failed sweep is now counted, from 0."""
    rule = expr("PushgwTokenSweepFailing")
    assert "pushgw_invalid_token_sweep_failures_total" in rule
    database = postgres_url.rsplit("/", 1)[1]
    config = base_config(tmp_path, {"sample": {"apps": {}}})
    config["store"] = {"url": postgres_url}
    plugins = {"sample": sample_plugin()}
    async with GatewayHarness(config, extra_plugins=plugins) as gw:  # migrates
        healthy = await scrape(gw)
    assert samples(healthy, "pushgw_invalid_token_sweep_failures_total") == [0]
    admin = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        await _set_read_only(admin, database, True)
        config["store"] = {"url": postgres_url, "auto_upgrade": False}
        async with GatewayHarness(config, extra_plugins=plugins) as gw:  # sweeps at start
            async with asyncio.timeout(10):
                while not total(
                    body := await scrape(gw), "pushgw_invalid_token_sweep_failures_total"
                ):
                    await asyncio.sleep(0.05)  # the sweep runs in the background
    finally:
        await _set_read_only(admin, database, False)
        await admin.dispose()
    # increase(...) over the two runs' scrapes: 0 then 1.
    assert total(body, "pushgw_invalid_token_sweep_failures_total") == 1


async def test_restarts_show_on_metrics_whatever_the_worker_count(tmp_path: Path) -> None:
    """With `--workers N` prometheus-client exports no `process_start_time_seconds`,
    so a gateway crash-looping under systemd showed on no metric. Each start now sets
    `pushgw_start_time_seconds` (one series, the latest worker's in multi-process
    mode), and `changes()` over it counts the restarts."""
    rule = expr("PushgwRestarting")
    match = re.fullmatch(r"changes\((\w+)\[\w+\]\) > (\d+)", rule)
    assert match is not None
    metric, limit = match.group(1), int(match.group(2))
    config = base_config(tmp_path, {"sample": {"apps": {}}})
    seen: list[float] = []
    for _ in range(limit + 2):
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            values = samples(await scrape(gw), metric)
        assert len(values) == 1
        seen.append(values[0])
    assert all(later > earlier for earlier, later in itertools.pairwise(seen))
    changes = sum(1 for earlier, later in itertools.pairwise(seen) if later != earlier)
    assert changes > limit


async def test_latency_buckets_cover_sub_millisecond_to_the_deadline(tmp_path: Path) -> None:
    """The histograms stopped at 30 s while a push may retry for `max_deadline` (60 s by
    default): every push ending between 30 and 60 s fell in +Inf, so a p99 alert could
    not tell a deadline-long push from a hung one. The smallest bucket was 1 ms, above
    a simulator's or a nearby provider's answer."""
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            assert (await push(gw, "ios", secrets.token_hex(32)))["outcome"] == "ok"
            body = await scrape(gw)
    for family in ("pushgw_push_latency_seconds", "pushgw_provider_request_seconds"):
        bounds = {
            float(sample.labels["le"])
            for fam in text_string_to_metric_families(body)
            for sample in fam.samples
            if sample.name == f"{family}_bucket"
        }
        finite = sorted(b for b in bounds if b != float("inf"))
        assert finite, family
        assert finite[0] < 0.001, family
        assert finite[-1] >= DeliveryConfig().max_deadline, family
