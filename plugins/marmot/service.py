"""The Marmot notification-server pipeline: relay events in, content-free wake-up pushes out.

Per relay event (spec sections 5, 7, 8 and 9), in this order:

1. frame size (in :mod:`plugins.marmot.relay`, before parsing); an event outside our filter
   (another kind, or no ``p`` tag for our key), or one whose NIP-40 ``expiration`` has passed,
   is dropped before it can take a limiter token;
2. seen-wrap cache: a wrap id already verified in this process is skipped without any crypto,
   and so is a copy identical to one still queued or being unwrapped (another relay's);
3. global pre-unwrap limiter, then the bounded input queue (full: drop);
4. unwrap (checks 1-8) and trigger parsing (check 9);
5. content dedup on ``SHA-256(decoded content)``, inserted before any chunk work;
6. per chunk: encrypted-token limiter, then decryption, plaintext checks,
   device-token limiter, at most one push per (platform, token) and trigger;
7. ``dispatcher.submit(Push(...))`` with ``persist_token_hash=False``; the decrypted token is not
   kept by the plugin once the push is handed over.

Every drop is counted in ``pushgw_marmot_events_total{stage,result}``; nothing is ever answered on
Nostr, written to disk, or logged with ids, tokens or content.

Threads. Unwrapping a 32-chunk trigger costs about 2 ms of CPU (two NIP-44 decryptions of ~110 KB:
base64, HMAC, ChaCha20, SHA-256 ids, JSON) and decrypting its 32 chunks another ~2 ms (32 ECDHs).
Measured on the 2-core target (bench/marmot.py, 1,000 triggers): inline on the event loop, 214
triggers/s at 4.4 ms of gateway CPU per trigger; in one worker thread, 162 triggers/s at 6.2 ms.
The hand-offs cost more than they save: base64 and JSON hold the GIL, and every step wakes the
other thread. Hence the default ``crypto_threads: 0``: each CPU step runs inline after one yield to
the loop, so nothing waits behind more than one ~2 ms step; more threads are for hosts with idle
cores. ``crypto_processes: N`` runs both steps in N worker processes instead
(:mod:`plugins.marmot.crypto_pool`): that costs ~1 ms of CPU per trigger in pickling and pipes,
and buys the use of more cores than one. Every piece of shared state (caches, limiters, metrics)
is touched only from the event loop and needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from gateway.api import (
    CONFIG_REASONS,
    GATEWAY_REASONS,
    ApnsOptions,
    Metrics,
    Outcome,
    Push,
    PushPolicy,
    Reason,
    Receipt,
)
from plugins.marmot import crypto_pool
from plugins.marmot.config import MarmotConfig
from plugins.marmot.errors import ChunkResult, Dropped, DropReason
from plugins.marmot.inbox import ensure_inbox_list, relay_set
from plugins.marmot.keys import ServerKey
from plugins.marmot.limits import KeyedLimiter, LruSet, TtlLru
from plugins.marmot.metrics import MarmotMetrics
from plugins.marmot.nostr import GiftUnwrapper
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState
from plugins.marmot.tokens import DeviceToken, Platform, TokenDecryptor, TokenFormat
from plugins.marmot.trigger import Trigger

__all__ = ["MarmotService", "Submit"]

log = logging.getLogger("plugins.marmot")

Submit = Callable[[Push], "asyncio.Future[Receipt]"]
T = TypeVar("T")

_FCM_DATA = {"android": {"priority": "high"}, "data": {"content_available": "true"}}
_PLATFORM_LABEL = {Platform.APNS: "apns", Platform.FCM: "fcm"}
# Provider answers that mean the operator's configuration is wrong: the core's list
# (`CONFIG_REASONS`, what its dispatcher logs as such), and the answers it takes for a dead
# token that, here, point to the app: every Marmot token of a platform goes through the one
# app the operator named, so a token "not for this topic" or "of another sender" says the app's
# topic or project is not the one the members' clients registered with. `unknown_app`: the
# app named is not configured.
_CONFIG_REASONS = CONFIG_REASONS | {
    "DeviceTokenNotForTopic",
    "SENDER_ID_MISMATCH",
    "InvalidProviderToken",
    Reason.UNKNOWN_APP,
}
#: Bound on how long `stop()` lets the workers finish the events already queued (a full default
#: queue is ~4 s of inline crypto). Relays send nothing after a restart's live-only REQ, so an
#: event discarded here is a wake-up lost for good.
_DRAIN_TIMEOUT = 10.0


class MarmotService:
    """The relay listener service (`pushgw_services`): relays, queue, workers, dispatch."""

    name = "marmot"
    one_per_gateway = True  # with --workers N, one relay subscription: each trigger pushed once

    def __init__(
        self,
        config: MarmotConfig,
        metrics: MarmotMetrics,
        submit: Submit,
        *,
        plugin_name: str = "marmot",
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        connect_relays: bool = True,
    ) -> None:
        self.config = config
        self.connect_relays = connect_relays
        self.metrics = metrics
        self.submit = submit
        self.plugin_name = plugin_name
        self.clock = clock
        key: ServerKey = config.server_key
        self.pubkey_hex = key.pubkey_hex
        self._key = key
        self.unwrapper = GiftUnwrapper(
            key,
            max_event_bytes=config.max_event_bytes,
            max_age=config.max_age,
            max_future_skew=config.max_future_skew,
            clock=clock,
        )
        self.decryptor = TokenDecryptor(key)
        self.trigger_config = config.profiles.trigger_config()
        size = config.cache_size
        limits = config.rate_limits
        self.seen = LruSet(size)
        self.dedup = TtlLru(size, config.dedup_retention, monotonic)
        self.global_limiter = KeyedLimiter(
            limits.global_.per_minute, limits.global_.per_hour, 1, monotonic
        )
        self.encrypted_limiter = KeyedLimiter(
            limits.encrypted_token.per_minute, limits.encrypted_token.per_hour, size, monotonic
        )
        self.device_limiter = KeyedLimiter(
            limits.device_token.per_minute, limits.device_token.per_hour, size, monotonic
        )
        self.relay_settings = RelaySettings(
            max_event_bytes=config.max_event_bytes,
            max_age=config.max_age,
            max_future_skew=config.max_future_skew,
            backfill_on_start=config.backfill_on_start,
            ping_interval=config.ping_interval,
            ping_timeout=min(20.0, config.ping_interval),
            backoff_min=config.backoff_min,
            backoff_max=config.backoff_max,
            connect_timeout=config.connect_timeout,
            compression=config.ws_compression,
            ca_file=None if config.ca_file is None else str(config.ca_file),
        )
        self.relays = [
            RelayClient(url, key, self, self.relay_settings, clock=clock)
            for url in config.inbox_relays
        ]
        self._apns = self._apns_options()
        self._apns_payload = config.apns.payload()  # the same for every push: built once
        self._policy = PushPolicy(deadline=config.push_deadline, persist_token_hash=False)
        self._queue: asyncio.Queue[Mapping[str, Any]] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._inflight_ids: dict[str, list[Mapping[str, Any]]] = {}
        # wrap id -> its copies queued or being processed (distinct ones: forgeries aside,
        # there is one). An identical copy (another relay's, a backfill's) is a duplicate
        # before the global limiter: the limit is charged once per wrap, not once per relay.
        self._pending: dict[str, list[Mapping[str, Any]]] = {}
        self._inflight = 0
        self._inbox_task: asyncio.Task[None] | None = None
        self._running = False
        #: Seconds `stop()` waits for queued and in-flight events (tests may lower it).
        self.drain_timeout = _DRAIN_TIMEOUT
        #: Outcome of the kind-10050 check, for tests and status (None: not done yet).
        self.inbox_result: Any = None
        self.triggers_accepted = 0
        self.pushes_submitted = 0
        self.pushes_finished = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        cfg = self.config
        self._queue = asyncio.Queue(cfg.queue_size)
        if cfg.crypto_processes:
            self._pool = self._start_pool()
            # Spawned workers import the plugin first (~0.5 s): before the relays, not on the
            # first trigger.
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._pool, crypto_pool.ping)
                    for _ in range(cfg.crypto_processes)
                )
            )
        elif cfg.crypto_threads:
            self._executor = ThreadPoolExecutor(cfg.crypto_threads, "marmot-crypto")
        self._workers = [
            asyncio.create_task(self._worker(), name=f"marmot-worker-{i}")
            for i in range(cfg.concurrency)
        ]
        for relay in self.relays:
            self._set_relay_gauge(relay, None, relay.state)
            if self.connect_relays:
                relay.start()
        if cfg.publish_inbox_list and self.connect_relays:
            self._inbox_task = asyncio.create_task(self._publish_inbox(), name="marmot-10050")
        log.info(
            "marmot: listening for gift wraps to %s on %d relay(s)",
            self._key.npub,
            len(self.relays),
        )

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._inbox_task is not None:
            self._inbox_task.cancel()
            await asyncio.gather(self._inbox_task, return_exceptions=True)
            self._inbox_task = None
        await asyncio.gather(*(relay.stop() for relay in self.relays), return_exceptions=True)
        # No new events from here on. Finish those already taken in: the gateway stops services
        # before it drains the dispatcher, so their pushes still go out. Whatever the bound cuts
        # off is counted, never discarded without a trace.
        left = 0
        queue = self._queue
        if queue is not None and self._workers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.join(), self.drain_timeout)
            left = queue.qsize() + self._inflight
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        self._pending.clear()  # the queued copies die with the queue
        if left:
            self.metrics.events("shutdown", "dropped").inc(left)
            log.warning("marmot: stopped with %d event(s) not processed", left)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)
        self._queue = None

    def crypto_worker_pids(self) -> list[int]:
        """Pids of the crypto worker processes (none unless ``crypto_processes``)."""
        pool = self._pool
        # ProcessPoolExecutor lists its workers only in a private mapping.
        return sorted(getattr(pool, "_processes", None) or {}) if pool is not None else []

    def ready(self) -> bool:
        """Ready while at least one inbox relay has a live subscription."""
        return self._running and any(r.live for r in self.relays)

    def status(self) -> dict[str, Any]:
        """Per-relay state (keyed by ``scheme://host[:port]``) and queue depth."""
        return {
            "ready": self.ready(),
            "relays": {r.label: r.status() for r in self.relays},
            "queued": self._queue.qsize() if self._queue is not None else 0,
            "inflight": self._inflight,
        }

    async def wait_live(self, timeout: float = 10.0) -> None:
        """Wait until every relay is live (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while not all(r.live for r in self.relays):
            if time.monotonic() > deadline:
                raise TimeoutError("relays not live: " + repr(self.status()["relays"]))
            await asyncio.sleep(0.02)

    async def idle(self, timeout: float = 10.0) -> None:
        """Wait until no event is queued or being processed (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while (self._queue is not None and self._queue.qsize()) or self._inflight:
            if time.monotonic() > deadline:
                raise TimeoutError("marmot pipeline still busy")
            await asyncio.sleep(0.005)

    async def _publish_inbox(self) -> None:
        cfg = self.config
        wanted = relay_set(cfg.inbox_relays)
        delay = cfg.backoff_min
        for _attempt in range(6):
            result = await ensure_inbox_list(
                self._key,
                cfg.inbox_relays,
                cfg.publish_relays,
                ca_file=self.relay_settings.ca_file,
            )
            self.inbox_result = result
            if result.published:
                self.metrics.inbox_published.inc()
                log.info("marmot: published the kind-10050 inbox list to %s", result.accepted_by)
                return
            if result.queried and result.current == wanted:
                return  # unchanged: nothing to publish
            await asyncio.sleep(delay)
            delay = min(cfg.backoff_max, delay * 2)
        log.warning("marmot: could not check or publish the kind-10050 inbox list")

    # -- relay sink (event loop) ---------------------------------------------------------------

    def _count(self, stage: str, result: str) -> None:
        self.metrics.events(stage, result).inc()

    def on_oversize(self, relay: RelayClient) -> None:
        self._count("frame", "oversize")

    def on_malformed(self, relay: RelayClient) -> None:
        self._count("frame", "malformed")

    def on_unrequested(self, relay: RelayClient) -> None:
        self._count("frame", "unrequested_stored")

    def on_state(self, relay: RelayClient, old: RelayState, new: RelayState) -> None:
        self._set_relay_gauge(relay, old, new)
        self.metrics.relays_connected.set(sum(1 for r in self.relays if r.live))
        if new is RelayState.CONNECTING and old is RelayState.BACKOFF:
            self.metrics.relay_reconnects.labels(relay.label).inc()
        if new is RelayState.LIVE:
            log.info("marmot: relay %s live", relay.label)

    def _set_relay_gauge(self, relay: RelayClient, old: RelayState | None, new: RelayState) -> None:
        if old is not None:
            self.metrics.relay_state.labels(relay.label, old.value).set(0)
        self.metrics.relay_state.labels(relay.label, new.value).set(1)

    def on_event(self, relay: RelayClient, event: Mapping[str, Any]) -> None:
        """A relay delivered an EVENT (already size-checked and parsed as JSON)."""
        self._count("frame", "received")
        off_filter = self.unwrapper.off_filter(event)
        if off_filter is not None:
            # Before the global limiter: a relay that ignores our filter must not spend the
            # budget the other relays' triggers need.
            self._count(off_filter.stage, off_filter.value)
            relay.report_once("off_filter", "sent events our subscription did not ask for")
            return
        if self.unwrapper.expired(event.get("tags")):
            # NIP-40, as transponder's relay client applies it: no unwrap, no global budget.
            self._count("wrap", DropReason.WRAP_EXPIRED.value)
            return
        wrap_id = event.get("id")
        pending = self._pending.get(wrap_id) if isinstance(wrap_id, str) else None
        if isinstance(wrap_id, str) and (
            wrap_id in self.seen or (pending is not None and event in pending)
        ):
            # A copy identical to one queued or being unwrapped gets whatever that one
            # gets (verification depends on the bytes only). A different event with the
            # same id (a forgery of a real id) still goes through, so cannot suppress it.
            self._count("seen", "duplicate")
            return
        if not self.global_limiter.allow():
            self._count("global_limit", "rate_limited")
            return
        queue = self._queue
        if queue is None:
            return
        try:
            queue.put_nowait(event)
        except asyncio.QueueFull:
            self._count("global_limit", "queue_full")
            return
        if isinstance(wrap_id, str):
            self._pending.setdefault(wrap_id, []).append(event)
        self.metrics.queued.set(queue.qsize())

    # -- workers --------------------------------------------------------------------------------

    async def _cpu(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            # Inline: let ready callbacks (relay pings, provider streams, HTTP) run first,
            # so the loop is never held longer than one step (~2 ms), even in a burst.
            await asyncio.sleep(0)
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _worker(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            event = await queue.get()
            self.metrics.queued.set(queue.qsize())
            self._inflight += 1
            self.metrics.inflight.set(self._inflight)
            try:
                await self._process(event)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug of ours: never end the worker; nothing sensitive logged
                log.exception("marmot: internal error while processing an event")
                self._count("internal", "error")
            finally:
                self._unpend(event)
                self._inflight -= 1
                self.metrics.inflight.set(self._inflight)
                queue.task_done()  # stop() drains with queue.join()

    def _unpend(self, event: Mapping[str, Any]) -> None:
        """`event` is done with: its identical copies are no longer duplicates of a pending one."""
        wrap_id = event.get("id")
        if not isinstance(wrap_id, str) or wrap_id not in self._pending:
            return
        left = [copy for copy in self._pending[wrap_id] if copy is not event]
        if left:
            self._pending[wrap_id] = left
        else:
            del self._pending[wrap_id]

    async def _process(self, event: Mapping[str, Any]) -> None:
        wrap_id = event.get("id")
        if not isinstance(wrap_id, str):
            await self._handle(event)
            return
        if wrap_id in self.seen:  # verified while this copy waited in the queue
            self._count("seen", "duplicate")
            return
        attached = self._inflight_ids.get(wrap_id)
        if attached is not None:
            # The same id is being unwrapped right now (another relay's copy): wait for it.
            attached.append(event)
            return
        self._inflight_ids[wrap_id] = attached = []
        try:
            await self._handle(event)
            # If the first copy failed before its id was verified (a forgery carrying a real id),
            # the others must still get their chance.
            while attached and wrap_id not in self.seen:
                await self._handle(attached.pop(0))
        finally:
            del self._inflight_ids[wrap_id]
        for _ in attached:
            self._count("seen", "duplicate")

    async def _open(self, event: Mapping[str, Any], verified: list[str]) -> Trigger:
        """Checks 1-9 (CPU step); raises :class:`Dropped`."""
        if self._pool is None:
            return await self._cpu(
                crypto_pool.open_with, self.unwrapper, self.trigger_config, event, verified
            )
        ids, outcome = await self._in_pool(crypto_pool.open_trigger, dict(event))
        verified.extend(ids)
        if isinstance(outcome, DropReason):
            raise Dropped(outcome)
        return outcome

    async def _decrypt(
        self, chunks: list[bytes], fmt: TokenFormat
    ) -> list[DeviceToken | ChunkResult]:
        """Decryption of the allowed chunks (CPU step)."""
        if self._pool is None:
            return await self._cpu(crypto_pool.decrypt_with, self.decryptor, chunks, fmt)
        return await self._in_pool(crypto_pool.decrypt_chunks, chunks, fmt)

    def _start_pool(self) -> ProcessPoolExecutor:
        config = self.config
        setup = crypto_pool.CryptoSetup(
            secret=self._key.secret,
            max_event_bytes=config.max_event_bytes,
            max_age=config.max_age,
            max_future_skew=config.max_future_skew,
            trigger_config=self.trigger_config,
        )
        return crypto_pool.start_pool(config.crypto_processes, setup)

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in the crypto processes; a crashed pool is replaced and `fn` retried once."""
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            pool = self._pool
            assert pool is not None
            try:
                return await loop.run_in_executor(pool, fn, *args)
            except BrokenProcessPool:
                if attempt == 2:
                    raise
                log.warning("marmot: a crypto worker process died; starting new ones")
                if self._pool is pool:  # not yet replaced by another task
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = self._start_pool()
        raise AssertionError("unreachable")

    async def _handle(self, event: Mapping[str, Any]) -> None:
        verified: list[str] = []
        try:
            trigger = await self._open(event, verified)
        except Dropped as exc:
            self._count(exc.stage, exc.reason.value)
            return
        finally:
            if verified:
                self.seen.add(verified[0])
        # 10. content dedup: inserted before any chunk work, kept for the retention whatever happens
        if not self.dedup.check_and_add(trigger.content_hash):
            self._count("dedup", "duplicate")
            self.metrics.dedup_entries.set(len(self.dedup))
            return
        self.metrics.dedup_entries.set(len(self.dedup))
        self._count("trigger", "accepted")
        self.triggers_accepted += 1
        profile = trigger.profile.value
        self.metrics.chunks_per_trigger.observe(len(trigger.chunks))
        # 11. per chunk: encrypted-token limiter before any ECDH
        allowed = self._admit_chunks(trigger.chunks, profile)
        if not allowed:
            return
        results = await self._decrypt(allowed, trigger.token_format)
        pushed: set[tuple[Platform, bytes]] = set()
        counts: dict[str, int] = {}  # chunk results, counted once per trigger
        for result in results:
            if not isinstance(result, DeviceToken):
                counts[result.value] = counts.get(result.value, 0) + 1
                continue
            ident = (result.platform, result.raw)
            outcome = ChunkResult.OK.value
            if ident not in pushed:  # one push per (platform, token) and trigger
                pushed.add(ident)
                if self.device_limiter.allow(result.limiter_key()):
                    self._dispatch(result)
                else:
                    outcome = "rate_limited"
            counts[outcome] = counts.get(outcome, 0) + 1
        for outcome, count in counts.items():
            self.metrics.chunks(profile, outcome).inc(count)
        pushed.clear()  # drop the decrypted tokens now that they are handed over

    def _admit_chunks(self, chunks: tuple[bytes, ...], profile: str) -> list[bytes]:
        """The chunks to decrypt: each distinct chunk once, within its encrypted-token limit.

        A chunk repeated within one trigger is skipped before the limiter, as transponder does:
        charging every copy would let one trigger carrying a cached blob 32 times spend 32 of
        that blob's budget (and 32 ECDHs), so a few triggers from a former member would silence
        the device's real wake-ups for the rest of the window.
        """
        by_key: dict[bytes, bytes] = {}
        for chunk in chunks:
            by_key.setdefault(hashlib.sha256(chunk).digest(), chunk)
        repeats = len(chunks) - len(by_key)
        if repeats:
            self.metrics.chunks(profile, ChunkResult.DUPLICATE.value).inc(repeats)
        admitted = self.encrypted_limiter.allow_each(by_key)
        allowed = [chunk for chunk, ok in zip(by_key.values(), admitted, strict=True) if ok]
        if len(allowed) < len(by_key):
            self.metrics.chunks(profile, "rate_limited").inc(len(by_key) - len(allowed))
        return allowed

    # -- dispatch -------------------------------------------------------------------------------

    def _apns_options(self) -> ApnsOptions:
        apns = self.config.apns
        if apns.mode == "alert":
            return ApnsOptions(push_type="alert", priority=10, collapse_id=apns.collapse_id)
        return ApnsOptions(push_type="background", priority=5)

    def _dispatch(self, token: DeviceToken) -> None:
        platform = _PLATFORM_LABEL[token.platform]
        if token.platform is Platform.APNS:
            app = self.config.apns.app
            payload = self._apns_payload
        else:
            app = self.config.fcm.app
            payload = _FCM_DATA
        if app is None:
            self.metrics.pushes(platform, "no_app").inc()
            return
        push = Push(
            plugin=self.plugin_name,
            app_id=app,
            token=token.token,
            payload=payload,
            apns=self._apns,
            policy=self._policy,
        )
        task = self.submit(push)
        self.pushes_submitted += 1
        task.add_done_callback(functools.partial(self._on_receipt, platform))

    def _on_receipt(self, platform: str, task: asyncio.Future[Receipt]) -> None:
        self.pushes_finished += 1
        if task.cancelled() or task.exception() is not None:
            self.metrics.pushes(platform, "error").inc()
            return
        receipt = task.result()
        self.metrics.pushes(platform, receipt.outcome.value).inc()
        reason = receipt.reason or ""
        if reason in _CONFIG_REASONS or (receipt.status == 403 and reason not in GATEWAY_REASONS):
            # A 403's reason is labelled only when known (the provider's, or whatever
            # answered in its place, would otherwise add a series per string), else its status.
            # A gateway reason after a 403 (an APNs auth answer, refreshed, then shed at the
            # deadline) is not one: the 403 is not what ended the push.
            status = str(receipt.status)
            self.metrics.config_errors(
                Metrics.reason_label(reason, status) if reason else status
            ).inc()
        elif receipt.outcome is Outcome.TOKEN_INVALID:  # the core's classification, not a copy
            self.metrics.dead_tokens(platform).inc()
