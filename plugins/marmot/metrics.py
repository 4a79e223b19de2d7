"""Prometheus metrics of the Marmot plugin (spec section 11), on the gateway's one registry.

Labels are fixed vocabularies (stage, result, profile, platform, relay state) plus the relay's
``scheme://host[:port]`` (operator configuration, never a path or query, which may carry an access
token). They never carry keys, event ids, hashes or tokens.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from gateway.api import Metrics

__all__ = ["MarmotMetrics"]


class MarmotMetrics:
    """The plugin's metric families.

    Counters changed per event or per chunk (a trigger touches ~35) are tallied children
    (`Metrics.children`): `events(stage, result).inc()`. Gauges are set directly. With
    `--workers N` every worker registers the gauges but only the first runs the service
    (`one_per_gateway`): they are summed over live workers (`livesum`), so each is one
    series without a `pid` label, and the other workers' zeros add nothing.
    """

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.events = metrics.children(
            Counter(
                "pushgw_marmot_events",
                "Relay events by pipeline stage and result (drops are counted where they happen)",
                ["stage", "result"],
                registry=r,
            )
        )
        self.chunks = metrics.children(
            Counter(
                "pushgw_marmot_chunks",
                "Encrypted token chunks by profile and result",
                ["profile", "result"],
                registry=r,
            )
        )
        self.pushes = metrics.children(
            Counter(
                "pushgw_marmot_pushes",
                "Wake-up pushes by platform and final outcome",
                ["platform", "result"],
                registry=r,
            )
        )
        self.dead_tokens = metrics.children(
            Counter(
                "pushgw_marmot_dead_tokens",
                "Pushes the provider answered with a dead token (counted only, nothing stored)",
                ["platform"],
                registry=r,
            )
        )
        self.config_errors = metrics.children(
            Counter(
                "pushgw_marmot_config_errors",
                "Provider answers that point to an operator configuration error",
                ["reason"],
                registry=r,
            )
        )
        self.relays_connected = Gauge(
            "pushgw_marmot_relays_connected",
            "Inbox relays with a live subscription (EOSE received)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.relay_state = Gauge(
            "pushgw_marmot_relay_state",
            "Per inbox relay: 1 for its current state",
            ["relay", "state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.relay_reconnects = Counter(
            "pushgw_marmot_relay_reconnects",
            "Connection attempts after a disconnect or failure",
            ["relay"],
            registry=r,
        )
        self.dedup_entries = Gauge(
            "pushgw_marmot_dedup_entries",
            "Live entries of the content-dedup map",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight = Gauge(
            "pushgw_marmot_inflight",
            "Events being unwrapped or decrypted",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queued = Gauge(
            "pushgw_marmot_queued",
            "Events waiting for a processing slot",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.chunks_per_trigger = metrics.tally(
            Histogram(
                "pushgw_marmot_chunks_per_trigger",
                "Chunks in each accepted trigger",
                buckets=(1, 2, 4, 8, 16, 25, 32, 64, 100),
                registry=r,
            )
        )
        self.inbox_published = Counter(
            "pushgw_marmot_inbox_list_published",
            "Kind-10050 inbox relay lists published (only when the relay set changed)",
            registry=r,
        )
