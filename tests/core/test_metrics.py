"""Metric tallies: what a scrape shows equals what direct prometheus-client calls show."""

from __future__ import annotations

import math
import re

from prometheus_client import generate_latest

from gateway.core.metrics import LaneMetrics, Metrics

# Bucket bounds themselves, values between them, zero and past the last bound.
LATENCIES = [0.0, 0.001, 0.0010001, 0.0025, 0.004, 0.05, 0.3, 1.0, 7.5, 30.0, 31.0, 1e9]


def direct(metrics: Metrics) -> None:
    """The same changes as `tallied`, made straight on the Prometheus children."""
    metrics.retries.labels("p", "fcm", "android")  # a lane resolves it up front
    for value in LATENCIES:
        metrics.provider_latency.labels("p", "fcm", "android").observe(value)
        metrics.push_latency.labels("p", "fcm", "android").observe(value * 2)
        metrics.attempts.labels("p", "fcm", "android", "ok").inc()
        metrics.pushes.labels("p", "fcm", "android", "ok", "").inc()
    gauge = metrics.in_flight.labels("p", "fcm", "android")
    gauge.inc()
    gauge.inc()
    gauge.dec()


def tallied(metrics: Metrics) -> LaneMetrics:
    lane = LaneMetrics(metrics, "p", "fcm", "android")
    for value in LATENCIES:
        lane.provider_latency.observe(value)
        lane.push_latency.observe(value * 2)
        lane.attempt("ok").inc()
        lane.push("ok", "").inc()
    lane.in_flight.inc()
    lane.in_flight.inc()
    lane.in_flight.dec()
    return lane


PROCESS_SAMPLE = re.compile(r"(# (HELP|TYPE) )?process_")


def samples(metrics: Metrics) -> list[str]:
    # Without the `_created` timestamps, which differ between two registries, and the
    # process_* samples, which describe this process at the moment of each scrape
    # (its CPU time moves on between the two).
    text = generate_latest(metrics.registry).decode()
    return [
        line
        for line in text.splitlines()
        if "_created" not in line and not PROCESS_SAMPLE.match(line)
    ]


def test_a_scrape_shows_exactly_what_direct_calls_show() -> None:
    expected, actual = Metrics(), Metrics()
    direct(expected)
    tallied(actual)
    assert samples(actual) == samples(expected)
    assert any("pushgw_provider_request_seconds_bucket" in s for s in samples(actual))


def test_tallies_wait_for_a_flush_and_are_not_counted_twice() -> None:
    metrics = Metrics()
    lane = LaneMetrics(metrics, "p", "fcm", "android")
    lane.attempt("ok").inc()
    lane.provider_latency.observe(0.2)
    child = metrics.attempts.labels("p", "fcm", "android", "ok")
    assert child._value.get() == 0  # not yet in the child ...
    metrics.flush()
    assert child._value.get() == 1  # ... now it is
    metrics.flush()
    assert child._value.get() == 1
    sample = metrics.registry.get_sample_value  # collecting flushes too
    lane.attempt("ok").inc()
    assert (
        sample(
            "pushgw_provider_requests_total",
            {"plugin": "p", "provider": "fcm", "app": "android", "outcome": "ok"},
        )
        == 2
    )
    assert (
        sample(
            "pushgw_provider_request_seconds_count",
            {"plugin": "p", "provider": "fcm", "app": "android"},
        )
        == 1
    )
    assert math.isclose(
        sample(
            "pushgw_provider_request_seconds_sum",
            {"plugin": "p", "provider": "fcm", "app": "android"},
        )
        or 0,
        0.2,
    )


def test_two_tallies_of_one_child_add_up() -> None:
    metrics = Metrics()
    first = LaneMetrics(metrics, "a", "apns", "ios")
    second = LaneMetrics(metrics, "a", "apns", "ios")  # the same in-flight child
    first.in_flight.inc()
    second.in_flight.inc()
    second.in_flight.dec()
    value = metrics.registry.get_sample_value(
        "pushgw_pushes_in_flight", {"plugin": "a", "provider": "apns", "app": "ios"}
    )
    assert value == 1


def test_plugins_apps_of_one_name_are_series_of_their_own() -> None:
    """Plugins name their apps on their own, and the example config gives three plugins
    the same app names: a lane's gauges are labelled by plugin too. Before, one lane's
    closed breaker (0) overwrote another's open one (1) in `pushgw_circuit_open`."""
    metrics = Metrics()
    a, b = LaneMetrics(metrics, "a", "apns", "ios"), LaneMetrics(metrics, "b", "apns", "ios")
    a.in_flight.inc()
    a.attempt("ok").inc()
    metrics.circuit_open.labels("a", "ios").set(1)
    metrics.circuit_open.labels("b", "ios").set(0)
    metrics.invalidation_suspended.labels("b", "ios").set(1)
    metrics.invalidation_suspended.labels("a", "ios").set(0)
    b.provider_latency.observe(0.5)
    sample = metrics.registry.get_sample_value
    assert sample("pushgw_circuit_open", {"plugin": "a", "app": "ios"}) == 1
    assert sample("pushgw_circuit_open", {"plugin": "b", "app": "ios"}) == 0
    assert sample("pushgw_token_invalidation_suspended", {"plugin": "b", "app": "ios"}) == 1
    labels = {"provider": "apns", "app": "ios"}
    assert sample("pushgw_pushes_in_flight", {"plugin": "a", **labels}) == 1
    assert sample("pushgw_pushes_in_flight", {"plugin": "b", **labels}) == 0
    assert sample("pushgw_provider_requests_total", {"plugin": "a", **labels, "outcome": "ok"}) == 1
    assert sample("pushgw_provider_request_seconds_count", {"plugin": "b", **labels}) == 1
    assert sample("pushgw_provider_request_seconds_count", {"plugin": "a", **labels}) == 0
