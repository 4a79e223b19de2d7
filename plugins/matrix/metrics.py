"""Sygnal-compatible metric families (matrix.md §7) on the gateway's one registry.

Names and labels follow Sygnal so that its Grafana dashboard works unchanged. Labels
carry app names (`pushkin`) and HTTP status codes only: never a pushkey or a user id.
Provider-side families are fed from what the plugin observes around `context.send()`
(one observation per push, retries included), not from each provider request.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.api import Children

__all__ = ["SygnalMetrics", "metrics_for"]

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SygnalMetrics:
    def __init__(self, registry: CollectorRegistry, sygnal: bool = True) -> None:
        r = registry
        self.sygnal = sygnal
        self.msc3013_oversize = Counter(
            "pushgw_matrix_msc3013_oversize",
            "MSC3013 pushes sent without their ciphertext because it did not fit",
            ["pushkin"],
            registry=r,
        )
        self.msc3013_encrypted = Counter(
            "pushgw_matrix_msc3013_encrypted",
            "Pushes encrypted at the gateway (MSC3013 gateway-encrypt mode)",
            ["pushkin"],
            registry=r,
        )
        if not sygnal:
            return
        self.notifications_received = Counter(
            "sygnal_notifications_received", "Number of notification pokes received", registry=r
        )
        self.devices_received = Counter(
            "sygnal_notifications_devices_received",
            "Number of devices been asked to push",
            registry=r,
        )
        self.per_pushkin = Counter(
            "sygnal_per_pushkin_type",
            "Number of pushes sent via each type of pushkin",
            ["pushkin"],
            registry=r,
        )
        self.status_codes = Counter(
            "sygnal_pushgateway_status_codes",
            "HTTP Response Codes given on the Push Gateway API",
            ["code"],
            registry=r,
        )
        self.notify_time = Histogram(
            "sygnal_notify_time",
            "Time taken to handle /notify push gateway request",
            ["code"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "sygnal_requests_in_flight",
            "Number of HTTP requests in flight",
            ["resource"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight_drop = Counter(
            "sygnal_inflight_request_limit_drop",
            "Number of notifications dropped because the number of inflight requests"
            " exceeded the configured inflight_request_limit.",
            ["pushkin"],
            registry=r,
        )
        self.apns_request_time = Histogram(
            "sygnal_apns_request_time", "Time taken to send HTTP request to APNS", registry=r
        )
        self.apns_active = Gauge(
            "sygnal_active_apns_requests",
            "Number of APNS requests in flight",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.apns_status = Counter(
            "sygnal_apns_status_codes",
            "Number of HTTP response status codes received from APNS",
            ["pushkin", "code"],
            registry=r,
        )
        self.cert_expiry = Gauge(
            "sygnal_client_cert_expiry",
            "Expiry date of the client certificate in seconds since the epoch",
            ["pushkin"],
            registry=r,
            multiprocess_mode="max",
        )
        self.gcm_queue_time = Histogram(
            "sygnal_gcm_queue_time", "Time taken waiting for a connection to GCM", registry=r
        )
        self.gcm_request_time = Histogram(
            "sygnal_gcm_request_time", "Time taken to send HTTP request to GCM", registry=r
        )
        self.gcm_pending = Gauge(
            "sygnal_pending_gcm_requests",
            "Number of GCM requests waiting for a connection",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.gcm_active = Gauge(
            "sygnal_active_gcm_requests",
            "Number of GCM requests in flight",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.gcm_status = Counter(
            "sygnal_gcm_status_codes",
            "Number of HTTP response status codes received from GCM",
            ["pushkin", "code"],
            registry=r,
        )
        # Cached children for the per-request path (labels() validates on every call).
        self.requests_in_flight = self.in_flight.labels("notify")
        self.status_code = Children(self.status_codes)
        self.notify_time_for = Children(self.notify_time)
        self.per_pushkin_for = Children(self.per_pushkin)
        self.apns_status_for = Children(self.apns_status)
        self.gcm_status_for = Children(self.gcm_status)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, SygnalMetrics] = (
    weakref.WeakKeyDictionary()
)


def metrics_for(registry: CollectorRegistry, sygnal: bool = True) -> SygnalMetrics:
    """The plugin's metrics on `registry`, registered once per registry."""
    found = _BY_REGISTRY.get(registry)
    if found is None:
        found = _BY_REGISTRY[registry] = SygnalMetrics(registry, sygnal)
    return found
