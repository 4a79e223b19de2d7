"""The on-call view: each failure an operator meets moves a metric an alert can read,
says once in the log what is wrong and what to check, and has its place in
docs/delivery.md's "Alerts and troubleshooting", whose example rules name only metrics
and labels that exist on /metrics after real traffic.

Real simulators over TLS / HTTP, real PostgreSQL (skipped when none is reachable).
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.api import Push, Receipt, hookimpl
from gateway.core.metrics import KNOWN_REASONS
from gateway.testing import make_service_account
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from tests.conftest import SAMPLE_PLUGIN_DIR

DOCS = Path(__file__).parent.parent / "docs" / "delivery.md"


def sample_plugin() -> ModuleType:
    if str(SAMPLE_PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(SAMPLE_PLUGIN_DIR))
    import pushgw_sample

    return pushgw_sample


class Raiser:
    """A plugin whose result observer fails for every push, quoting the token."""

    @hookimpl
    def pushgw_push_result(self, push: Push, receipt: Receipt) -> None:
        raise RuntimeError(f"cannot handle {push.token}")


def token() -> str:
    return secrets.token_hex(32)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Series = dict[str, list[dict[str, str]]]


def scrape(body: str) -> Series:
    series: Series = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def value(body: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def push(gw: GatewayHarness, app: str, device: str) -> dict[str, Any]:
    payload = {"data": {"k": "v"}} if app.startswith("android") else {"aps": {"alert": "x"}}
    response = await gw.client.post(
        "/sample/push", json={"app": app, "token": device, "payload": payload}
    )
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def metrics_text(gw: GatewayHarness) -> str:
    response = await gw.client.get("/metrics")
    assert response.status == 200
    return await response.text()


def lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


@pytest.fixture
def no_secrets_logged(caplog: pytest.LogCaptureFixture) -> Iterator[set[str]]:
    """Values added to the yielded set must appear in no log record of the test."""
    caplog.set_level(logging.DEBUG)
    found: set[str] = set()
    yield found
    text_ = "\n".join(r.getMessage() for r in caplog.records)
    assert not [s for s in found if s in text_]
    assert "Traceback" not in caplog.text


# --- the docs' alert rules against a real /metrics -------------------------------------


def alerts_section() -> str:
    doc = DOCS.read_text()
    start = doc.index("## Alerts and troubleshooting")
    end = doc.index("\n## ", start + 1)
    return doc[start:end]


def alert_expressions() -> list[str]:
    block = re.search(r"```yaml\n(.*?)```", alerts_section(), re.S)
    assert block, "the section has example Prometheus rules"
    rules = yaml.safe_load(block.group(1))["groups"][0]["rules"]
    return [rule["expr"] for rule in rules]


_METRIC = re.compile(r"\b(pushgw_[a-z_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"')


def check_expression(expr: str, series: Series, *, values: bool) -> list[str]:
    """What in `expr` does not exist in `series`: metric names, the labels it matches on
    or aggregates by, and (with `values`) the exact values it matches."""
    problems: list[str] = []
    names = [m.group(1) for m in _METRIC.finditer(expr)]
    by = [b.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for b in group.split(",")]
    for match in _METRIC.finditer(expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name.startswith("pushgw_marmot_"):
            continue  # the Marmot plugin's own page and tests
        found = series.get(name)
        if not found:
            problems.append(f"{name}: no such series")
            continue
        for label, op, wanted in _MATCHER.findall(matchers):
            if not any(label in s for s in found):
                problems.append(f"{name}: no label {label}")
            elif op == "=" and values and not any(s.get(label) == wanted for s in found):
                problems.append(f"{name}: no series with {label}={wanted!r}")
            elif op == "=~" and label == "reason":
                unknown = [r for r in wanted.split("|") if r not in KNOWN_REASONS]
                if unknown:
                    problems.append(f"{name}: reasons never labelled: {unknown}")
    for label in by:
        for name in names:
            if not all(label in s for s in series.get(name, [{}])):
                problems.append(f"{name}: aggregated by {label}, which it does not carry")
    return problems


def runbook_config(apns: ApnsSimulator, fcm: FcmSimulator, tmp_path: Path) -> dict[str, Any]:
    """The gateway config of the runbook's failures: a good APNs and FCM app, a
    certificate app, one for dead tokens, a wrong key id, a provider down, a deleted
    FCM service account; a plugin that raises. Shared with the dashboard review."""
    deleted = tmp_path / "deleted-sa.json"
    make_service_account("deleted-project", fcm.token_uri, deleted)  # not known to Google
    cert, key = apns.ca.issue(["client.example"])  # certificate auth: its expiry is a metric
    (tmp_path / "push-cert.pem").write_bytes(cert.read_bytes() + key.read_bytes())
    apps = {
        "ios": apns_app_config(apns, tmp_path),
        "ios-cert": {"type": "apns", "certfile": str(tmp_path / "push-cert.pem")},
        "ios-dead": apns_app_config(apns, tmp_path),
        "ios-wrongkey": apns_app_config(apns, tmp_path, key_id="WRONGKEY01"),
        "ios-down": apns_app_config(apns, tmp_path, port=closed_port()),
        "android": fcm_app_config(fcm, tmp_path),
        "android-deleted": {
            **fcm_app_config(fcm, tmp_path, project_id="other"),
            "service_account_file": str(deleted),
            "project_id": "deleted-project",
        },
    }
    return base_config(
        tmp_path,
        {"sample": {"apps": apps}, "raiser": {}},
        delivery={
            "backoff_base": 0.01,
            "backoff_cap": 0.02,
            "circuit_breaker": {"failure_threshold": 2, "reset_after": 600},
            "invalidation_guard_min": 4,
        },
    )


async def test_every_alert_rule_in_the_docs_reads_metrics_that_exist_after_real_traffic(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_secrets_logged: set[str]
) -> None:
    """Drive the failures of the runbook for real (a wrong APNs key id, a deleted FCM
    service account, a wrong topic, dead tokens past the mass-invalidation guard, a
    provider that refuses connections, a throttling provider, a plugin raising), then
    check every example rule against the /metrics those produced."""
    caplog.set_level(logging.DEBUG)
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = runbook_config(apns, fcm, tmp_path)
        async with GatewayHarness(
            config, extra_plugins={"sample": sample_plugin(), "raiser": Raiser()}
        ) as gw:
            ok, bad_topic, throttled = token(), token(), token()
            no_secrets_logged.update({ok, bad_topic, throttled})
            apns.script(bad_topic, ApnsResponse.error("BadTopic"))
            apns.script(throttled, ApnsResponse.error("TooManyRequests"))
            assert (await push(gw, "ios", ok))["outcome"] == "ok"
            assert (await push(gw, "android", ok))["outcome"] == "ok"
            assert (await push(gw, "ios", bad_topic))["outcome"] == "permanent"
            assert (await push(gw, "ios", throttled))["outcome"] == "throttled"
            for _ in range(6):
                dead = token()
                no_secrets_logged.add(dead)
                apns.script(dead, ApnsResponse.error("BadDeviceToken"))
                await push(gw, "ios-dead", dead)
            for _ in range(3):
                assert (await push(gw, "ios-wrongkey", ok))["outcome"] == "auth"
                assert (await push(gw, "android-deleted", ok))["outcome"] == "auth"
                assert (await push(gw, "ios-down", ok))["outcome"] == "transient"
            body = await metrics_text(gw)

            ready = await gw.client.get("/readyz")
            readiness = await ready.json()
            # The deleted account never got a token: that app says so; the others do not.
            assert readiness["apps"]["sample/android-deleted"] is False
            assert readiness["apps"]["sample/ios-wrongkey"] is True

    series = scrape(body)
    problems = [
        p for expr in alert_expressions() for p in check_expression(expr, series, values=True)
    ]
    # The table's own metric references: names and labels (their values need the
    # failures this test does not drive: a 500, a clock off by hours).
    table = re.findall(r"`(pushgw_[a-z_]+(?:\{[^`]*\})?)`", alerts_section())
    problems += [p for ref in table for p in check_expression(ref, series, values=False)]
    assert problems == []

    # The states this traffic opened, each in one line saying what to check.
    wrongkey = lines(caplog, "app ios-wrongkey (apns): the provider refuses the credential")
    assert len(wrongkey) == 1 and "key_id and team_id" in wrongkey[0]
    deleted_line = lines(caplog, "app android-deleted (fcm): the provider refuses the credential")
    assert len(deleted_line) == 1 and "service account" in deleted_line[0]
    down = lines(caplog, "app ios-down (apns): circuit breaker opened")
    assert len(down) == 1 and "Check that this host reaches the provider" in down[0]
    hook = lines(caplog, "plugin raiser: its pushgw_push_result hook raised RuntimeError")
    assert len(hook) == 1
    assert value(body, "pushgw_circuit_open", plugin="sample", app="ios-down") == 1
    assert value(body, "pushgw_token_invalidation_suspended", plugin="sample", app="ios-dead") == 1


# --- clock skew ----------------------------------------------------------------------


async def test_a_clock_hours_off_says_to_check_the_clock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_secrets_logged: set[str]
) -> None:
    """APNs refuses a JWT whose `iat` is over an hour old: from Apple's side, a host
    clock two hours slow. The line said only `ExpiredProviderToken`, which reads as a
    key problem; it now names the clock, and the pushes are counted as `auth`."""
    async with ApnsSimulator(clock=lambda: time.time() + 7200) as apns:
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            device = token()
            no_secrets_logged.add(device)
            for _ in range(3):
                assert (await push(gw, "ios", device))["reason"] == "ExpiredProviderToken"
            body = await metrics_text(gw)
    labels = {"plugin": "sample", "app": "ios", "outcome": "auth"}
    assert value(body, "pushgw_pushes_total", reason="ExpiredProviderToken", **labels) == 3
    refused = lines(caplog, "the provider refuses the credential (ExpiredProviderToken)")
    assert len(refused) == 1
    assert "check this host's clock" in refused[0]


# --- a plugin that raises for every push --------------------------------------------


async def test_an_observer_raising_for_every_push_is_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_secrets_logged: set[str]
) -> None:
    """A `pushgw_push_result` observer that fails for every push wrote an ERROR line
    per push, and nothing on /metrics moved: an alert could not fire, and the log
    drowned. Now every failure is counted, the first of its kind and place logged."""
    async with ApnsSimulator() as apns:
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}, "raiser": {}}
        )
        async with GatewayHarness(
            config, extra_plugins={"sample": sample_plugin(), "raiser": Raiser()}
        ) as gw:
            before = await metrics_text(gw)
            assert (
                value(
                    before,
                    "pushgw_plugin_hook_errors_total",
                    plugin="raiser",
                    hook="pushgw_push_result",
                )
                == 0
            )
            assert "pushgw_plugin_hook_errors_total" in before  # from start-up, at 0
            for _ in range(4):
                device = token()
                no_secrets_logged.add(device)
                assert (await push(gw, "ios", device))["outcome"] == "ok"
            body = await metrics_text(gw)
    errors = value(
        body, "pushgw_plugin_hook_errors_total", plugin="raiser", hook="pushgw_push_result"
    )
    assert errors == 4
    logged = lines(caplog, "its pushgw_push_result hook raised")
    assert len(logged) == 1
    assert "fix or disable the plugin" in logged[0]


# --- a database gone read-only (a failover to a standby) ------------------------------


async def _set_read_only(admin: Any, database: str, on: bool) -> None:
    async with admin.connect() as conn:
        setting = "on" if on else "off"
        await conn.execute(
            text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = {setting}')
        )
        # The setting applies to new sessions: end the gateway's pooled ones.
        await conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": database},
        )


async def test_a_read_only_database_is_one_line_and_a_counter_per_failed_record(
    tmp_path: Path,
    postgres_url: str,
    caplog: pytest.LogCaptureFixture,
    no_secrets_logged: set[str],
) -> None:
    """Each dead token the database could not record logged a full traceback (the
    statement and its parameters in it), one per token: with the database read-only
    or down, a traceback per push. Nothing on /metrics said so. Now the first failure
    is one line saying what to check, each is counted, and one line says when records
    succeed again."""
    database = postgres_url.rsplit("/", 1)[1]
    admin = create_async_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        async with ApnsSimulator() as apns:
            apns.default = ApnsResponse.error("BadDeviceToken")
            config = base_config(
                tmp_path,
                {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
                delivery={"invalidation_guard_ratio": 1},
            )
            config["store"] = {"url": postgres_url}
            async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
                before = await metrics_text(gw)
                labels = {"plugin": "sample"}
                assert value(before, "pushgw_invalid_token_record_failures_total", **labels) == 0
                await _set_read_only(admin, database, True)
                for _ in range(3):
                    device = token()
                    no_secrets_logged.add(device)
                    assert (await push(gw, "ios", device))["outcome"] == "token_invalid"
                failing = await metrics_text(gw)
                await _set_read_only(admin, database, False)
                device = token()
                no_secrets_logged.add(device)
                assert (await push(gw, "ios", device))["outcome"] == "token_invalid"
                recovered = await metrics_text(gw)
    finally:
        await _set_read_only(admin, database, False)
        await admin.dispose()
    assert value(failing, "pushgw_invalid_token_record_failures_total", **labels) == 3
    assert value(recovered, "pushgw_invalid_token_record_failures_total", **labels) == 3
    hook_labels = {"plugin": "sample", "hook": "pushgw_token_invalid"}
    assert value(failing, "pushgw_plugin_hook_errors_total", **hook_labels) == 3
    failed = lines(caplog, "could not record an invalid token")
    assert len(failed) == 1
    assert "database is up and writable" in failed[0]
    assert "read-only transaction" in failed[0]  # the driver's own words
    assert "[parameters:" not in failed[0] and "VALUES" not in failed[0]
    again = lines(caplog, "invalid tokens are recorded again")
    assert len(again) == 1 and "3 could not be recorded" in again[0]
    assert len(lines(caplog, "token-invalid hook of plugin sample failed")) == 1
