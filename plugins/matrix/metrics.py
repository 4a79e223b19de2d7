"""Sygnal-compatible metric families (matrix.md §7) on the gateway's one registry.

Names and labels follow Sygnal so that its Grafana dashboard works unchanged. Labels
carry app names (`pushkin`) and HTTP status codes only: never a pushkey or a user id.
Provider-side families are fed from what the plugin observes around `context.send()`
(one observation per push, retries included), not from each provider request.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.api import Children, Metrics

__all__ = ["NOTIFY_RESOURCE", "SygnalMetrics", "metrics_for"]

# `resource` of sygnal_requests_in_flight: Sygnal labels it with its handler's class name.
NOTIFY_RESOURCE = "V1NotifyHandler"


class SygnalMetrics:
    """The families, registered once, and the handles the request path changes.

    Hot-path handles are tallies (`gateway.api.Metrics.tally`): a notify request
    changes about ten of these, and prometheus-client's own calls take a lock each (a
    memory-mapped file write with several workers).
    """

    def __init__(self, metrics: Metrics, sygnal: bool = True) -> None:
        r = metrics.registry
        self.sygnal = sygnal
        self.msc3013_oversize = metrics.children(
            Counter(
                "pushgw_matrix_msc3013_oversize",
                "MSC3013 pushes sent without their ciphertext because it did not fit",
                ["pushkin"],
                registry=r,
            )
        )
        self.msc3013_encrypted = metrics.children(
            Counter(
                "pushgw_matrix_msc3013_encrypted",
                "Pushes encrypted at the gateway (MSC3013 gateway-encrypt mode)",
                ["pushkin"],
                registry=r,
            )
        )
        if not sygnal:
            return
        self.notifications_received = metrics.tally(
            Counter(
                "sygnal_notifications_received",
                "Number of notification pokes received",
                registry=r,
            )
        )
        self.devices_received = metrics.tally(
            Counter(
                "sygnal_notifications_devices_received",
                "Number of devices been asked to push",
                registry=r,
            )
        )
        self.per_pushkin = metrics.children(
            Counter(
                "sygnal_per_pushkin_type",
                "Number of pushes sent via each type of pushkin",
                ["pushkin"],
                registry=r,
            )
        )
        self.status_code = metrics.children(
            Counter(
                "sygnal_pushgateway_status_codes",
                "HTTP Response Codes given on the Push Gateway API",
                ["code"],
                registry=r,
            )
        )
        # prometheus-client's default buckets, as Sygnal's (SLO rules select them by `le`)
        self.notify_time = metrics.children(
            Histogram(
                "sygnal_notify_time",
                "Time taken to handle /notify push gateway request",
                ["code"],
                registry=r,
            )
        )
        self.requests_in_flight = metrics.tally(
            Gauge(
                "sygnal_requests_in_flight",
                "Number of HTTP requests in flight",
                ["resource"],
                registry=r,
                multiprocess_mode="livesum",
            ).labels(NOTIFY_RESOURCE)
        )
        # Rare: no tally. Its children are created for every app at start-up
        # (`touch_apps`), as Sygnal does, so that the series exist at 0 before any drop.
        self.inflight_drop = Children(
            Counter(
                "sygnal_inflight_request_limit_drop",
                "Number of notifications dropped because the number of inflight requests"
                " exceeded the configured inflight_request_limit.",
                ["pushkin"],
                registry=r,
            )
        )
        self.apns_request_time = metrics.tally(
            Histogram(
                "sygnal_apns_request_time", "Time taken to send HTTP request to APNS", registry=r
            )
        )
        self.apns_active = metrics.tally(
            Gauge(
                "sygnal_active_apns_requests",
                "Number of APNS requests in flight",
                registry=r,
                multiprocess_mode="livesum",
            )
        )
        self.apns_status = metrics.children(
            Counter(
                "sygnal_apns_status_codes",
                "Number of HTTP response status codes received from APNS",
                ["pushkin", "code"],
                registry=r,
            )
        )
        self.cert_expiry = Gauge(
            "sygnal_client_cert_expiry",
            "Expiry date of the client certificate in seconds since the epoch",
            ["pushkin"],
            registry=r,
            multiprocess_mode="max",
        )
        # Sygnal's GCM queue families: registered for its dashboard; the core's lanes
        # queue instead, and report that in pushgw_* families.
        Histogram("sygnal_gcm_queue_time", "Time taken waiting for a connection to GCM", registry=r)
        Gauge(
            "sygnal_pending_gcm_requests",
            "Number of GCM requests waiting for a connection",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.gcm_request_time = metrics.tally(
            Histogram(
                "sygnal_gcm_request_time", "Time taken to send HTTP request to GCM", registry=r
            )
        )
        self.gcm_active = metrics.tally(
            Gauge(
                "sygnal_active_gcm_requests",
                "Number of GCM requests in flight",
                registry=r,
                multiprocess_mode="livesum",
            )
        )
        self.gcm_status = metrics.children(
            Counter(
                "sygnal_gcm_status_codes",
                "Number of HTTP response status codes received from GCM",
                ["pushkin", "code"],
                registry=r,
            )
        )

    def touch_apps(self, names: Iterable[str]) -> None:
        """Export the per-app families that Sygnal creates at start-up, at 0."""
        if not self.sygnal:
            return
        for name in names:
            self.inflight_drop(name)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, SygnalMetrics] = (
    weakref.WeakKeyDictionary()
)


def metrics_for(metrics: Metrics, sygnal: bool = True) -> SygnalMetrics:
    """The plugin's metrics on the gateway's registry, registered once per registry."""
    found = _BY_REGISTRY.get(metrics.registry)
    if found is None:
        found = _BY_REGISTRY[metrics.registry] = SygnalMetrics(metrics, sygnal)
    return found
