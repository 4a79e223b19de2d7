"""The SRE's view: config/grafana-dashboard.json, the dashboard pushgw ships, charts only
what a live gateway exports. Every PromQL expression in it (panels, annotations,
template variables) is read, and each metric it names (with its _total / _bucket suffix)
and each label it filters or groups by is looked up in /metrics after real traffic
through the simulators: dead tokens, a refused credential, a closed throttle gate, an
unreachable provider, retries, an APNs certificate, a plugin raising.

No Grafana and no Prometheus: the expressions are taken apart by hand (see `Query`),
which checks names and labels, not PromQL itself.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert

from gateway.core.store import Store, invalid_tokens
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from tests.test_review_runbook import (
    Raiser,
    Series,
    metrics_text,
    push,
    runbook_config,
    sample_plugin,
    scrape,
    token,
    value,
)

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
DELIVERY = ROOT / "docs" / "delivery.md"
README = ROOT / "README.md"
# The template variables the panels filter by, each the label of its name.
VARIABLES = ("plugin", "provider", "app")
# Grafana's own variables.
BUILTIN = {"__rate_interval", "__range", "__interval"}
PROMQL_FUNCTIONS = {
    "abs", "changes", "clamp_min", "clamp_max", "histogram_quantile", "increase", "rate",
    "irate", "delta", "deriv", "label_values", "time", "max_over_time", "min_over_time",
    "avg_over_time", "vector", "scalar", "sort", "sort_desc", "timestamp",
}  # fmt: skip
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev"}
KEYWORDS = {"by", "without", "bool", "and", "or", "unless", "on", "ignoring", "offset"}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out += all_panels(panel.get("panels", []))
    return out


def expressions(board: dict[str, Any]) -> list[str]:
    exprs = [
        target["expr"]
        for panel in all_panels(board["panels"])
        for target in panel.get("targets", [])
    ]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


@dataclass
class Query:
    """One PromQL expression taken apart: the metrics it reads (each with its label
    matchers), the labels it aggregates by, the variables it uses."""

    metrics: list[tuple[str, list[tuple[str, str, str]]]] = field(default_factory=list)
    by: list[str] = field(default_factory=list)
    variables: set[str] = field(default_factory=set)
    unknown: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, expr: str) -> Query:
        q = cls()
        q.variables = set(re.findall(r"\$(\w+)", expr))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            q.by += [label.strip() for label in group.split(",") if label.strip()]
        rest = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", expr)
        rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range selectors
        pos = 0
        pattern = re.compile(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?(\s*\()?")
        while match := pattern.search(rest, pos):
            pos = match.end()
            name, braces, call = match.group(1), match.group(2), match.group(3)
            if call and not braces:
                if name not in PROMQL_FUNCTIONS | AGGREGATIONS:
                    q.unknown.append(name)
                continue
            if name in KEYWORDS:
                continue
            matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', braces or "")
            q.metrics.append((name, matchers))
        return q


def check(expr: str, series: Series, *, panel: bool = True) -> list[str]:
    """What in `expr` a live /metrics does not have; in a `panel`'s query, also each
    template variable that its metrics carry the label of and it does not apply."""
    q = Query.parse(expr)
    problems = [f"{expr}: unknown function {name}" for name in q.unknown]
    problems += [f"{expr}: no variable ${v}" for v in q.variables - set(VARIABLES) - BUILTIN]
    for name, matchers in q.metrics:
        found = series.get(name)
        if not found:
            problems.append(f"{name}: no such series")
            continue
        for label, op, wanted in matchers:
            if not all(label in s for s in found):
                problems.append(f"{name}: filtered by {label}, which it does not carry")
            elif wanted.startswith("$") and wanted != f"${label}":
                problems.append(f"{name}: {label} filtered by {wanted}")
            elif op == "=" and not any(s.get(label) == wanted for s in found):
                problems.append(f"{name}: no series with {label}={wanted!r}")
        # The template variables apply to each metric that carries their label.
        filtered = {label for label, _, wanted in matchers if wanted == f"${label}"}
        for variable in VARIABLES if panel else ():
            if all(variable in s for s in found) and variable not in filtered:
                problems.append(f"{name}: carries {variable} but ignores ${variable}")
        for label in q.by:
            if not all(label in s for s in found):
                problems.append(f"{name}: grouped by {label}, which it does not carry")
    return problems


def metrics_read(board: dict[str, Any]) -> set[str]:
    return {name for expr in expressions(board) for name, _ in Query.parse(expr).metrics}


def family(sample: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", sample)


async def traffic(tmp_path: Path) -> str:
    """/metrics after the failures an on-call engineer charts, driven for real."""
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = runbook_config(apns, fcm, tmp_path)
        plugins = {"sample": sample_plugin(), "raiser": Raiser()}
        async with GatewayHarness(config, extra_plugins=plugins) as gw:
            ok, throttled, gate = token(), token(), token()
            apns.script(throttled, ApnsResponse.error("TooManyRequests"))
            apns.script(gate, ApnsResponse.error("TooManyProviderTokenUpdates"))
            assert (await push(gw, "ios", ok))["outcome"] == "ok"
            assert (await push(gw, "android", ok))["outcome"] == "ok"
            assert (await push(gw, "ios", throttled))["outcome"] == "throttled"
            assert (await push(gw, "ios", gate))["outcome"] == "throttled"
            for _ in range(6):
                dead = token()
                apns.script(dead, ApnsResponse.error("BadDeviceToken"))
                await push(gw, "ios-dead", dead)
            for _ in range(3):
                assert (await push(gw, "ios-wrongkey", ok))["outcome"] == "auth"
                assert (await push(gw, "android-deleted", ok))["outcome"] == "auth"
                assert (await push(gw, "ios-down", ok))["outcome"] == "transient"
            body = await metrics_text(gw)
    return body


async def test_every_dashboard_query_reads_metrics_and_labels_that_exist(tmp_path: Path) -> None:
    """Each panel's, annotation's and variable's query against a live /metrics; and
    every family the core exports has a panel."""
    board = dashboard()
    body = await traffic(tmp_path)
    series = scrape(body)
    exprs = expressions(board)
    assert len(exprs) >= 20
    problems = [p for expr in exprs for p in check(expr, series)]

    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    expected = {
        "plugin": {"sample"},
        "provider": {"apns", "fcm"},
        "app": {"ios", "ios-cert", "ios-dead", "ios-wrongkey", "ios-down", "android"}
        | {"android-deleted"},
    }
    for name in VARIABLES:
        query = variables[name]["query"]["query"]
        match = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", query)
        assert match is not None, query
        assert match.group(3) == name, query  # the variable is its label's values
        problems += check(f"{match.group(1)}{match.group(2) or ''}", series, panel=False)
        values = {s[name] for s in series[match.group(1)] if name in s}
        assert values == expected[name], query  # every configured app, before any push
    for panel in all_panels(board["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert problems == []

    exported = {
        family(name)
        for name in series
        if name.startswith("pushgw_") and not name.startswith("pushgw_marmot_")
    }
    charted = {family(name) for name in metrics_read(board)}
    assert exported - charted == set()


def test_the_dashboard_is_documented() -> None:
    doc = DELIVERY.read_text()
    assert "config/grafana-dashboard.json" in doc
    assert "grafana-dashboard.json" in README.read_text()
    # Each state gauge the docs name for the on-call is on the dashboard.
    board = metrics_read(dashboard())
    for name in (
        "pushgw_credential_refused",
        "pushgw_gate_closed_until_timestamp_seconds",
        "pushgw_invalid_token_records_swept_total",
    ):
        assert name in board
        assert name in doc


def test_the_query_parser_finds_what_it_must() -> None:
    """The check above can fail: a misspelt metric, a label a family lacks, a variable
    not applied, and an unknown function are each reported."""
    series: Series = {"pushgw_x_total": [{"plugin": "p", "app": "a"}]}
    good = 'sum by (plugin) (rate(pushgw_x_total{plugin=~"$plugin", app=~"$app"}[5m]))'
    assert check(good, series) == []
    assert check(good.replace("pushgw_x_total", "pushgw_y_total"), series)
    assert check(good.replace("by (plugin)", "by (provider)"), series)
    assert check(good.replace(', app=~"$app"', ""), series)
    assert check(good.replace("rate(", "rat("), series)
    assert check('pushgw_x_total{plugin="q", app=~"$app"}', series)


async def test_push_latency_is_per_app(tmp_path: Path) -> None:
    """`pushgw_push_latency_seconds` had only plugin and provider: two apps of one plugin
    on one provider shared one histogram, so a panel filtered by app (or an SLO per
    app) could not show one app's p99. It carries `app` now, like the provider
    request histogram."""
    async with ApnsSimulator() as apns:
        apns.script(slow := token(), ApnsResponse.ok(delay=0.3))
        apps = {"fast": apns_app_config(apns, tmp_path), "slow": apns_app_config(apns, tmp_path)}
        config = base_config(tmp_path, {"sample": {"apps": apps}})
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            assert (await push(gw, "fast", token()))["outcome"] == "ok"
            assert (await push(gw, "fast", token()))["outcome"] == "ok"
            assert (await push(gw, "slow", slow))["outcome"] == "ok"
            body = await metrics_text(gw)
    name = "pushgw_push_latency_seconds_count"
    assert value(body, name, plugin="sample", provider="apns", app="fast") == 2
    assert value(body, name, plugin="sample", provider="apns", app="slow") == 1
    fast_under = value(body, "pushgw_push_latency_seconds_bucket", app="fast", le="0.25")
    slow_under = value(body, "pushgw_push_latency_seconds_bucket", app="slow", le="0.25")
    assert (fast_under, slow_under) == (2, 0)


async def test_a_refused_credential_is_a_state_on_metrics(tmp_path: Path) -> None:
    """While APNs refused an app's key, /metrics only counted pushes ending `auth`: a
    quiet app showed nothing, and no panel could say which apps are refused now. The
    state the log's two lines bracket is now a gauge, 0 from start-up."""
    async with ApnsSimulator() as apns:
        refused = token()
        apns.script(refused, ApnsResponse.error("InvalidProviderToken"))
        config = base_config(
            tmp_path, {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}}
        )
        lane = {"plugin": "sample", "provider": "apns", "app": "ios"}
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            start = await metrics_text(gw)
            assert (await push(gw, "ios", refused))["outcome"] == "auth"
            during = await metrics_text(gw)
            assert (await push(gw, "ios", token()))["outcome"] == "ok"
            after = await metrics_text(gw)
    name = "pushgw_credential_refused"
    assert "pushgw_credential_refused{" in start
    assert value(start, name, **lane) == 0
    assert value(during, name, **lane) == 1
    assert value(after, name, **lane) == 0


async def test_a_closed_throttle_gate_shows_until_when(tmp_path: Path) -> None:
    """A credential-wide throttle (APNs TooManyProviderTokenUpdates, FCM QUOTA_EXCEEDED
    for the project) closes the app's gate for a minute: every push waits or ends
    gate_closed. Nothing on /metrics said the gate was closed, nor for how long."""
    async with ApnsSimulator() as apns:
        throttled = token()
        apns.script(throttled, ApnsResponse.error("TooManyProviderTokenUpdates"))
        config = base_config(
            tmp_path,
            {"sample": {"apps": {"ios": apns_app_config(apns, tmp_path)}}},
            delivery={"throttle_backoff": 3600},
        )
        lane = {"plugin": "sample", "provider": "apns", "app": "ios"}
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            start = await metrics_text(gw)
            before = time.time()
            assert (await push(gw, "ios", throttled))["outcome"] == "throttled"
            closed = await metrics_text(gw)
            shed = await push(gw, "ios", token())
    name = "pushgw_gate_closed_until_timestamp_seconds"
    assert samples_named(start, name) == [0.0]  # from start-up: never closed
    until = value(closed, name, **lane)
    assert until > before + 3000  # closed for about the hour, in Unix time
    assert until < time.time() + 3601
    assert shed["reason"] == "gate_closed"


def samples_named(body: str, name: str) -> list[float]:
    return [
        s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == name
    ]


async def test_the_dead_token_sweep_counts_what_it_deletes(tmp_path: Path) -> None:
    """Only the sweep's failures were counted: a sweep that worked and one that found
    nothing looked the same, so a dashboard could not show the table being kept to
    `store.invalid_tokens_retention`. The records each sweep deletes are counted."""
    config = base_config(tmp_path, {"sample": {"apps": {}}})
    plugins = {"sample": sample_plugin()}
    old = {
        "plugin": "sample",
        "app_id": "ios",
        "provider": "apns",
        "reason": "BadDeviceToken",
        "invalidated_at": datetime.now(UTC) - timedelta(days=365),
    }
    store = Store(config["store"]["url"])  # no gateway yet: no sweep racing the insert
    try:
        await store.upgrade()
        async with store.engine.begin() as conn:
            await conn.execute(
                insert(invalid_tokens), [{**old, "token_hash": f"h{i}"} for i in range(3)]
            )
    finally:
        await store.close()
    async with GatewayHarness(config, extra_plugins=plugins) as gw:  # sweeps at start
        name = "pushgw_invalid_token_records_swept_total"
        async with asyncio.timeout(10):
            while not value(body := await metrics_text(gw), name):
                await asyncio.sleep(0.05)  # the sweep runs in the background
    assert value(body, name) == 3
    assert value(body, "pushgw_invalid_token_sweep_failures_total") == 0
