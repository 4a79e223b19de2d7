"""The gateway's one Prometheus registry and the core's metrics.

Labels carry plugin names, app ids, providers, outcomes and reasons: never a token,
a user id or anything a client sent.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any, overload

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway.core import classify
from gateway.core.push import GATEWAY_REASONS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The `reason` label's vocabulary: the gateway's own reasons and the providers' documented
# ones. A provider reason is otherwise passed through as sent (receipts keep it), and
# whatever answers in the provider's place (a proxy, a new error, a broken intermediary)
# would make one series per string it sends. Anything else is counted as `other`.
_GOOGLE_RPC_CODES = frozenset(
    {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)
_FCM_ERROR_CODES = frozenset(
    {
        "UNSPECIFIED_ERROR",
        "INVALID_ARGUMENT",
        "UNREGISTERED",
        "SENDER_ID_MISMATCH",
        "QUOTA_EXCEEDED",
        "UNAVAILABLE",
        "INTERNAL",
        "THIRD_PARTY_AUTH_ERROR",
        "APNS_AUTH_ERROR",
    }
)
KNOWN_REASONS: frozenset[str] = frozenset(
    {"", "oauth_token_error"}
    | GATEWAY_REASONS
    | classify.APNS_TOKEN_INVALID
    | classify.APNS_AUTH
    | classify.APNS_PERMANENT
    | classify.APNS_TRANSIENT
    | {classify.APNS_THROTTLED_TOKEN, classify.APNS_THROTTLED_CREDENTIAL}
    | _GOOGLE_RPC_CODES
    | _FCM_ERROR_CODES
)
OTHER_REASON = "other"


def reason_label(reason: str | None, other: str = OTHER_REASON) -> str:
    """`reason` as a label value: itself when known (`KNOWN_REASONS`), else `other`."""
    reason = reason or ""
    return reason if reason in KNOWN_REASONS else other


# From sub-millisecond answers (a simulator, a provider next door, a push refused or shed
# before any request) to a push retried until `delivery.max_deadline` (60 s by default):
# a push that ends between 30 and 60 s must not land in +Inf only.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class Metrics:
    """Core metric families on one registry; plugins register theirs on `registry`."""

    content_type = CONTENT_TYPE_LATEST
    # For plugins (they see `gateway.api.Metrics`): a provider reason as a label value.
    reason_label = staticmethod(reason_label)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self._tallies: list[Tally | HistogramTally] = []
        r.register(_FlushOnCollect(self))
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds...:
        # what dashboards (Sygnal's among them) chart for any Prometheus-instrumented
        # service. With several workers they are not exported: prometheus-client's
        # multi-process mode cannot add them up across processes.
        ProcessCollector(registry=r)
        self.http_requests = Counter(
            "pushgw_http_requests",
            "HTTP requests handled",
            ["route", "method", "status"],
            registry=r,
        )
        self.pushes = Counter(
            "pushgw_pushes",
            "Pushes that reached a final outcome",
            ["plugin", "provider", "app", "outcome", "reason"],
            registry=r,
        )
        self.attempts = Counter(
            "pushgw_provider_requests",
            "Requests made to providers",
            ["plugin", "provider", "app", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "pushgw_push_retries",
            # Counted when made, so that it adds up to the receipts' `attempts - 1`.
            "Retries made: provider requests after a push's first",
            ["plugin", "provider", "app"],
            registry=r,
        )
        self.shed = Counter(
            "pushgw_pushes_shed",
            "Pushes the gateway ended without a further attempt (deadline passed, queue full, "
            "circuit open, gate closed)",
            ["plugin", "app", "reason"],
            registry=r,
        )
        self.invalid_tokens = Counter(
            "pushgw_invalid_tokens",
            "Tokens reported invalid to their plugin",
            ["plugin", "provider", "app"],
            registry=r,
        )
        self.push_latency = Histogram(
            "pushgw_push_latency_seconds",
            "Submission to final outcome",
            ["plugin", "provider", "app"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.provider_latency = Histogram(
            "pushgw_provider_request_seconds",
            "One provider request",
            ["plugin", "provider", "app"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pushgw_pushes_in_flight",
            "Pushes accepted and not yet final",
            ["plugin", "provider", "app"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.circuit_open = Gauge(
            "pushgw_circuit_open",
            "1 while an app's circuit breaker is open",
            ["plugin", "app"],
            registry=r,
            multiprocess_mode="max",
        )
        self.invalidation_suspended = Gauge(
            "pushgw_token_invalidation_suspended",
            "1 while the mass-invalidation guard holds an app's invalidations",
            ["plugin", "app"],
            registry=r,
            multiprocess_mode="max",
        )
        self.credential_refused = Gauge(
            "pushgw_credential_refused",
            "1 while the provider refuses an app's credential even after the one refresh "
            "(pushes end auth), 0 once it accepts it again",
            ["plugin", "provider", "app"],
            registry=r,
            multiprocess_mode="max",
        )
        self.gate_closed_until = Gauge(
            "pushgw_gate_closed_until_timestamp_seconds",
            "Until when (Unix time) an app's credential-wide throttle gate is closed (FCM "
            "QUOTA_EXCEEDED for the project, APNs TooManyProviderTokenUpdates): closed while "
            "it is after time()",
            ["plugin", "provider", "app"],
            registry=r,
            multiprocess_mode="max",
        )
        self.hook_errors = Counter(
            "pushgw_plugin_hook_errors",
            "Plugin hooks that raised while the core called them (the first of each kind and "
            "place is logged)",
            ["plugin", "hook"],
            registry=r,
        )
        self.token_record_failures = Counter(
            "pushgw_invalid_token_record_failures",
            "Invalid tokens whose keyed hash could not be recorded (the database down or "
            "read-only); the plugin's hook still ran",
            ["plugin"],
            registry=r,
        )
        self.token_sweep_failures = Counter(
            "pushgw_invalid_token_sweep_failures",
            "Hourly sweeps of old invalid-token records that failed (the database down or "
            "read-only); the next one tries again an hour later",
            registry=r,
        )
        self.token_records_swept = Counter(
            "pushgw_invalid_token_records_swept",
            "Invalid-token records the hourly sweep deleted, past store.invalid_tokens_retention",
            registry=r,
        )
        self.start_time = Gauge(
            "pushgw_start_time_seconds",
            "When this gateway started (Unix time; the latest of its workers'): changes() "
            "over it counts restarts, with one worker or several",
            registry=r,
            multiprocess_mode="max",
        )
        self.queue_limit = Gauge(
            "pushgw_queue_limit",
            "Pushes an app's lane holds (waiting or in a request) before it sheds new ones "
            "queue_full (delivery.queue_size, summed over workers); compare "
            "pushgw_pushes_in_flight with it",
            ["plugin", "provider", "app"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.apns_certificate_expiry = Gauge(
            "pushgw_apns_certificate_expiry_timestamp_seconds",
            "When an APNs app's certificate (certificate auth) expires (Unix time): APNs "
            "refuses an expired one; alert on this minus time() (docs/delivery.md)",
            ["plugin", "app"],
            registry=r,
            multiprocess_mode="min",
        )
        self.receipts_written = Counter(
            "pushgw_receipts_written", "Receipt records written", registry=r
        )
        self.receipt_write_failures = Counter(
            "pushgw_receipt_write_failures",
            "Failed attempts to write or publish receipt files (retried with backoff)",
            registry=r,
        )
        self.receipts_lost = Counter(
            "pushgw_receipts_lost",
            "Accepted receipt records never written: writing still failed at shutdown",
            registry=r,
        )
        self.receipt_files_published = Counter(
            "pushgw_receipt_files_published",
            "Receipt files published, by format (with receipts.format parquet, a jsonl "
            "file is one whose conversion failed)",
            ["format"],
            registry=r,
        )
        for file_format in ("jsonl", "parquet"):  # both series from the start, for alerts
            self.receipt_files_published.labels(file_format)

    @overload
    def tally(self, child: Histogram) -> HistogramTally: ...
    @overload
    def tally(self, child: Counter | Gauge) -> Tally: ...

    def tally(self, child: Any) -> Tally | HistogramTally:
        """A tally of `child` (a labelled child), flushed with the others."""
        tally: Tally | HistogramTally
        tally = HistogramTally(child) if isinstance(child, Histogram) else Tally(child)
        self._tallies.append(tally)
        return tally

    def children(self, metric: Any) -> Children:
        """Cached children of a labelled `metric`, each one a tally (hot paths)."""
        return Children(metric, wrap=self.tally)

    def flush(self) -> None:
        """Move every tally into its Prometheus child (event-loop thread).

        Collecting the registry does this first; with several workers, whose /metrics
        read every worker's files, the gateway also flushes every second.
        """
        for tally in self._tallies:
            tally.flush()

    def exposition(self) -> bytes:
        """Prometheus text for this process, or for all workers in multi-process mode.

        In multi-process mode call `flush()` first, on the event-loop thread.
        """
        if os.environ.get(MULTIPROC_ENV):
            collected = CollectorRegistry()
            multiprocess.MultiProcessCollector(collected)
            return generate_latest(collected)
        return generate_latest(self.registry)


class Children:
    """Cached `metric.labels(...)` children for hot paths.

    prometheus-client validates label values on every `labels()` call (microseconds
    each); `Children(metric)(*values)` resolves each distinct combination once.
    `Metrics.children(metric)` gives the same, with each child a tally.
    """

    def __init__(self, metric: Any, wrap: Any = None) -> None:
        self._metric = metric
        self._wrap = wrap
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._metric.labels(*values)
            if self._wrap is not None:
                child = self._wrap(child)
            self._children[values] = child
        return child


class Tally:
    """A counter or gauge child whose changes add up in memory until `flush()`.

    Event-loop thread only. prometheus-client takes a lock per change (and, with several
    workers, writes a memory-mapped file): a push changes five metrics, a measurable
    share of what the dispatcher costs per push. Here a change is one float addition.
    """

    __slots__ = ("child", "pending")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.pending = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.pending += amount

    def dec(self, amount: float = 1.0) -> None:
        self.pending -= amount

    def flush(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, 0.0
            self.child.inc(pending)


class HistogramTally:
    """A histogram child whose observations are bucketed in memory until `flush()`.

    Flushing adds the counts to the child's own buckets and sum: prometheus-client has
    no public call that adds many observations at once (see `Tally` for why).
    """

    __slots__ = ("bounds", "child", "counts", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose upper bound is >= value, as Histogram.observe picks it.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        if not any(self.counts):
            return
        counts, self.counts = self.counts, [0] * len(self.bounds)
        total, self.total = self.total, 0.0
        self.child._sum.inc(total)
        for bucket, count in zip(self.child._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class _FlushOnCollect(Collector):
    """Registered first on the registry, so every collection sees the tallies flushed."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Any]:
        self._metrics.flush()
        return ()


class LaneMetrics:
    """The metric children of one (plugin, app) lane, resolved once, changed as tallies.

    `labels()` costs several microseconds per call; a push touches five families, so
    the hot path uses these cached children instead.
    """

    def __init__(self, metrics: Metrics, plugin: str, provider: str, app: str) -> None:
        self.plugin, self.provider, self.app = plugin, provider, app
        self.in_flight = metrics.tally(metrics.in_flight.labels(plugin, provider, app))
        self.provider_latency = metrics.tally(
            metrics.provider_latency.labels(plugin, provider, app)
        )
        self.push_latency = metrics.tally(metrics.push_latency.labels(plugin, provider, app))
        self.retries = metrics.retries.labels(plugin, provider, app)  # rare: no tally
        self._attempts = metrics.children(metrics.attempts)
        self._pushes = metrics.children(metrics.pushes)

    def attempt(self, outcome: str) -> Tally:
        return self._attempts(  # type: ignore[no-any-return]
            self.plugin, self.provider, self.app, outcome
        )

    def push(self, outcome: str, reason: str) -> Tally:
        """The `pushgw_pushes` tally of `outcome`; `reason` as sent (`reason_label` bounds it)."""
        return self._pushes(  # type: ignore[no-any-return]
            self.plugin, self.provider, self.app, outcome, reason_label(reason)
        )
