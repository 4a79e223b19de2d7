"""Long-run review: state that must stay bounded, and loops that must survive long outages.

A gateway that runs for months without a restart, under steady load and hostile clients,
meets every input a client controls tens of thousands of times and every outage for hours.
These tests drive the structures with many distinct inputs (or failures) and check the
documented bound or the recovery; they count objects, never time.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import DeliveryConfig
from gateway.context import TokenHasher
from gateway.core import receipts as receipts_module
from gateway.core import tokens as tokens_module
from gateway.core.dispatcher import Dispatcher
from gateway.core.metrics import Metrics
from gateway.core.push import Attempt, InvalidToken, Outcome, ProviderKind, Push, Receipt
from gateway.core.receipts import ReceiptWriter, RollingFile
from gateway.core.tokens import InvalidationGuard, TokenInvalidation
from gateway.testing.harness import GatewayHarness, base_config
from plugins.marmot.limits import KeyedLimiter, LruSet, TtlLru
from plugins.matrix.routing import AppRouter
from plugins.zulip.auth import RateLimiter
from tests.conftest import configured_logging
from tests.core.test_dispatcher import ScriptedClient, token

# --- receipts: a disk full for hours -------------------------------------------------------


def _receipt() -> Receipt:
    return Receipt(
        push_id="0b3c6f0e-0000-4000-8000-00000000beef",
        plugin="longrun",
        app_id="app",
        provider=None,
        outcome=Outcome.OK,
        status=200,
        reason=None,
        attempts=1,
        latency=0.01,
        finished_at=1_735_689_600.0,
        token_hash=None,
    )


async def test_receipt_writer_survives_more_than_a_thousand_failed_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk full for ~3 h is ~1,030 failed attempts (every 10 s once backed off). The
    retry delay was `0.5 * 2 ** (failures - 1)`, whose float conversion overflows after
    1,025 failures: the writer task died with OverflowError, nothing was written again
    until a restart, and once the buffer filled every push waited for room for ever."""
    monkeypatch.setattr(receipts_module, "_RETRY_CAP", 0.0)  # no waiting between attempts
    failing = 1_100
    calls = 0

    def write_some(fd: int, data: memoryview) -> int:
        nonlocal calls
        calls += 1
        if calls <= failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)

    monkeypatch.setattr(RollingFile, "_write_some", staticmethod(write_some))
    written = asyncio.Event()
    failures = 0

    def on_write_failed() -> None:
        nonlocal failures
        failures += 1

    writer = ReceiptWriter(
        tmp_path,
        file_format="jsonl",
        on_written=lambda n: written.set(),
        on_write_failed=on_write_failed,
    )
    await writer.start()
    await writer.put(_receipt())
    waiter = asyncio.ensure_future(written.wait())
    assert writer._task is not None
    done, _ = await asyncio.wait({waiter, writer._task}, return_when=asyncio.FIRST_COMPLETED)
    try:
        assert waiter in done, f"writer task ended: {writer._task.exception()!r}"
        assert failures == failing
        assert not writer._task.done()
    finally:
        waiter.cancel()
        await writer.close()
    assert writer.lost == 0
    (published,) = tmp_path.glob("*.jsonl")
    assert len(published.read_text().splitlines()) == 1


def test_receipt_retry_delay_stays_capped_whatever_the_failure_count() -> None:
    for failures in (1, 2, 5, 20, 1_024, 1_025, 1_026, 10_000, 10**6):
        assert 0 < receipts_module._retry_delay(failures) <= receipts_module._RETRY_CAP


# --- zulip: the per-server rate limiter ----------------------------------------------------


def test_zulip_rate_limiter_holds_max_keys_under_distinct_keys() -> None:
    """`max_keys` bounded nothing: when every key was still inside its window, `_prune`
    freed nothing and the key was added anyway (and every later new key paid an O(n) scan
    of the whole dict). Open registration makes keys cheap: one server registration each."""
    limiter = RateLimiter(limit=5, window=60.0, max_keys=1_000)
    for i in range(50_000):
        assert limiter.hit(f"server-{i}", now=1_000.0 + i * 1e-4) is None
    assert len(limiter._hits) <= 1_000


def test_zulip_rate_limiter_eviction_keeps_a_busy_key_limited() -> None:
    """Eviction takes the least recently seen keys first: a server that keeps hitting its
    limit is not forgotten (which would reset its window) by a flood of new keys."""
    limiter = RateLimiter(limit=3, window=60.0, max_keys=100)
    now = 1_000.0
    for _ in range(3):
        assert limiter.hit("busy", now=now) is None
    for i in range(5_000):
        now += 1e-3
        assert limiter.hit(f"flood-{i}", now=now) is None
        if i % 10 == 0:
            assert limiter.hit("busy", now=now) is not None  # still limited
    assert len(limiter._hits) <= 100
    # its window over, the busy server is admitted again
    assert limiter.hit("busy", now=1_000.0 + 60.0 + 1.0) is None


def test_zulip_rate_limiter_forgets_keys_whose_window_is_over() -> None:
    limiter = RateLimiter(limit=5, window=10.0, max_keys=1_000)
    for i in range(500):
        limiter.hit(f"old-{i}", now=0.0)
    for i in range(600):
        limiter.hit(f"new-{i}", now=100.0)
    # the 500 old keys' windows were over: they made room before any live key went
    assert len(limiter._hits) == 600


# --- the core: many distinct pushes, tokens, reasons and app ids ---------------------------


def _series(metrics: Metrics, family: str) -> int:
    """Samples of one family in the registry (after a flush)."""
    metrics.flush()
    return sum(
        1
        for metric in metrics.registry.collect()
        if metric.name == family
        for sample in metric.samples
        if sample.name == f"{family}_total"
    )


async def test_dispatcher_state_and_metrics_stay_bounded_over_many_distinct_pushes() -> None:
    """20,000 pushes to distinct tokens, answered with a fresh reason string each (a broken
    intermediary), token-invalid for a third of them, plus pushes for 2,000 made-up app
    ids (a plugin passes the client's on): every per-push task and set is empty once they
    ended, and the metric families have a handful of series, not one per string."""
    n = 20_000

    def answer(push: Push) -> Attempt:
        i = int(push.token, 16)
        if i % 3 == 0:
            return Attempt(Outcome.TOKEN_INVALID, 410, "Unregistered")
        if i % 3 == 1:
            return Attempt(Outcome.PERMANENT, 400, f"made-up-reason-{i}")
        return Attempt(Outcome.OK, 200)

    client = ScriptedClient("android", answer)
    receipts: list[Receipt] = []
    notified = 0

    async def sink(_push: Push, receipt: Receipt) -> None:
        receipts.append(receipt)

    async def notify(_invalid: InvalidToken) -> None:
        nonlocal notified
        notified += 1

    metrics = Metrics()
    invalidation = TokenInvalidation(None, metrics, notify)
    dispatcher = Dispatcher(
        DeliveryConfig(invalidation_guard_ratio=1.0, queue_size=n),
        metrics,
        invalidation,
        TokenHasher(b"k"),
        sink,
    )
    dispatcher.add_app("p", "android", client)
    tasks = [dispatcher.submit(Push("p", "android", token(i), {})) for i in range(n)]
    tasks += [dispatcher.submit(Push("p", f"made-up-app-{i}", token(i), {})) for i in range(2_000)]
    await asyncio.gather(*tasks)
    if dispatcher._reports:
        await asyncio.wait(set(dispatcher._reports))
    assert len(receipts) == n + 2_000
    assert notified == len(range(0, n, 3))
    lane = dispatcher._lanes[("p", "android")]
    assert (dispatcher.in_flight, lane.pending, lane.slots.waiting) == (0, 0, 0)
    assert not dispatcher._background
    assert not dispatcher._reports
    assert len(invalidation._recent) <= len(range(0, n, 3))
    assert len(lane.guard._buckets) <= InvalidationGuard.BUCKETS + 1
    assert _series(metrics, "pushgw_pushes") <= 6  # ok, permanent/other, token_invalid, unknown
    assert _series(metrics, "pushgw_provider_requests") <= 3
    assert _series(metrics, "pushgw_invalid_tokens") == 1
    await dispatcher.close()


def test_token_invalidation_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_recent` (one dead token handled once) keeps at most `_RECENT_MAX` entries however
    many distinct dead tokens arrive within its minute."""
    monkeypatch.setattr(tokens_module, "_RECENT_MAX", 1_000)
    metrics = Metrics()
    calls = 0

    async def notify(_invalid: InvalidToken) -> None:
        nonlocal calls
        calls += 1

    invalidation = TokenInvalidation(None, metrics, notify)

    async def run() -> None:
        for i in range(50_000):
            invalid = InvalidToken("p", "a", f"hash-{i}", None, ProviderKind.FCM, "UNREGISTERED")
            assert await invalidation.report(invalid, persist=False)

    asyncio.run(run())
    assert calls == 50_000
    assert len(invalidation._recent) <= 1_000


def test_invalidation_guard_buckets_are_bounded_over_months() -> None:
    guard = InvalidationGuard(minimum=100, ratio=0.5, window=300.0)
    now = 0.0
    for i in range(50_000):
        now += 1.7  # ~a day, every bucket touched
        guard.record(i % 2 == 0, now=now)
    assert len(guard._buckets) <= InvalidationGuard.BUCKETS + 1
    assert guard._sends == sum(b[1] for b in guard._buckets)


# --- plugins' in-memory structures ----------------------------------------------------------


def test_marmot_caches_and_limiters_hold_their_capacity() -> None:
    seen = LruSet(1_000)
    dedup = TtlLru(1_000, ttl=3600.0, clock=lambda: 0.0)
    limiter = KeyedLimiter(5, 50, capacity=1_000, clock=lambda: 0.0)
    for i in range(50_000):
        key = f"{i:064x}"
        seen.add(key)
        assert dedup.check_and_add(key)
        assert limiter.allow(key)
    assert (len(seen), len(dedup), len(limiter)) == (1_000, 1_000, 1_000)


def test_matrix_router_cache_holds_its_size_under_distinct_app_ids() -> None:
    router = AppRouter(["com.example.*", "org.example.ios"], cache_size=512)
    for i in range(50_000):
        assert router.route(f"made.up.{i}").app is None
        assert router.route(f"com.example.{i}").app == "com.example.*"
    assert len(router._cache) <= 512


async def test_http_request_metrics_do_not_grow_with_hostile_paths_methods_and_ids(
    tmp_path: Path,
) -> None:
    """2,000 requests with a distinct path and X-Request-Id each, and methods outside the
    labelled ones: the request counter labels the route (`unmatched`), known methods (else
    `other`) and statuses, never the path."""
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        metrics = gw.gateway.runtime.metrics  # type: ignore[union-attr]
        methods = ["GET", "POST", "PROPFIND", "PURGE", "MKCOL", "REPORT", "SEARCH", "LOCK"]
        for i in range(2_000):
            response = await gw.client.request(
                methods[i % len(methods)],
                f"/devices/{i:064x}?token={i}",
                headers={"X-Request-Id": f"req-{i}"},
            )
            assert response.status in (400, 404, 405)
            response.release()
        assert _series(metrics, "pushgw_http_requests") <= 6


@pytest.fixture
def production_log() -> Iterator[io.StringIO]:
    """`logs.configure("INFO")` writing to a buffer (`configured_logging`)."""
    with configured_logging("INFO") as buffer:
        yield buffer


async def test_a_malformed_request_is_one_info_line_not_an_error_traceback(
    production_log: io.StringIO, tmp_path: Path
) -> None:
    """aiohttp logs every request its parser refuses (a bad method, a header line too
    long, bytes that are not HTTP) as ERROR "Error handling request" with a traceback: a
    hostile client writes ~20 ERROR lines into the log per connection, and an operator's
    error alerting fires on a client's mistake. One INFO line each instead."""
    requests = [
        b"X%04d / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header %04d: y\r\n\r\n",
        b"\x16\x03\x01 not http %04d\r\n\r\n",
    ]
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        server = gw.client.server
        for i in range(60):
            reader, writer = await asyncio.open_connection(server.host, server.port)
            try:
                writer.write(requests[i % len(requests)] % i)
                answer = await reader.read()  # to EOF: aiohttp logs before it closes
            finally:
                writer.close()
            assert answer.split(b" ", 2)[1] == b"400"
    lines = [line for line in production_log.getvalue().splitlines() if "aiohttp.server" in line]
    assert "Traceback" not in production_log.getvalue()
    assert not [line for line in lines if " ERROR " in line]
    assert 0 < len(lines) <= 60  # at most one line per refused request
