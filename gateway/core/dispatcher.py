"""Delivery: per-app lanes with bounded queues, concurrency limits, deadlines, the one
retry policy, credential-wide back-off gates, circuit breakers and load shedding.

Each `send()` runs in the caller's task: there is no worker pool to hop through, so
an idle gateway adds no latency, and the lane's slots are the queue (their waiters
are served in FIFO order and give up at their deadline). A lane is one plugin's app: a
slow or broken app only ever blocks its own lane.

Every push accepted by `send()` ends with a receipt, whatever happens: at shutdown
(`drain()`) the pushes waiting for a retry or behind a closed gate are woken and end
`transient`/`shutting_down`, and so does a push whose send is cancelled before its end
is decided (then the cancellation goes on); a provider client that raises (a bug:
clients classify provider trouble into an `Attempt`) ends the push
`transient`/`client_error`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from gateway.config import DeliveryConfig
from gateway.core.classify import (
    CONFIG_HINTS,
    CONFIG_REASONS,
    CREDENTIAL_HINT,
    CREDENTIAL_HINTS,
    DEAD_DEVICE_REASONS,
    bounded_reason,
)
from gateway.core.metrics import LaneMetrics, Metrics, reason_label
from gateway.core.providers import ProviderClient
from gateway.core.push import Attempt, InvalidToken, Outcome, Push, Reason, Receipt
from gateway.core.slots import DeadlineSlots
from gateway.core.tokens import InvalidationGuard, TokenInvalidation

log = logging.getLogger(__name__)

ReceiptSink = Callable[[Push, Receipt], Awaitable[None]]


class CircuitBreaker:
    """Opens after `threshold` consecutive transient failures; one trial after `reset_after` s.

    The trial is claimed (`allow`) just before its request is made, and given back
    (`abandon`) if that request is cancelled: a trial that never reports would keep the
    breaker open for good, failing every push of the lane fast until a restart.
    """

    def __init__(self, threshold: int, reset_after: float) -> None:
        self.threshold = threshold
        self.reset_after = reset_after
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_running = False

    def rejects(self, now: float) -> bool:
        """Whether a push would be refused now (open, and no trial due); claims nothing."""
        if self.opened_at is None:
            return False
        return now - self.opened_at < self.reset_after or self._trial_running

    def allow(self, now: float) -> bool:
        """Whether a request may be made now; when half-open, this one is the trial."""
        if self.rejects(now):
            return False
        if self.opened_at is not None:
            self._trial_running = True  # half-open: one request decides
        return True

    def abandon(self) -> None:
        """A request was cancelled before its outcome: a trial it was is open again."""
        self._trial_running = False

    def record(self, outcome: Outcome, now: float) -> bool:
        """Record an attempt's outcome; returns True when the breaker state changed."""
        was_open = self.opened_at is not None
        self._trial_running = False
        if outcome is Outcome.TRANSIENT:
            self.failures += 1
            if self.failures >= self.threshold:
                self.opened_at = now
        else:
            self.failures = 0
            self.opened_at = None
        return was_open != (self.opened_at is not None)


@dataclass
class Lane:
    """One plugin app's delivery state."""

    plugin: str
    app_id: str
    client: ProviderClient
    slots: DeadlineSlots
    breaker: CircuitBreaker
    guard: InvalidationGuard
    metrics: LaneMetrics
    pending: int = 0
    gate_until: float = 0.0  # monotonic time before which the credential is throttled
    # Per device token: the monotonic time before which that one device is throttled (FCM
    # QUOTA_EXCEEDED for one device's message rate, APNs TooManyRequests). Memory only,
    # at most `DEVICE_GATES_MAX` entries (`_close_device_gate`). Its keys are device tokens
    # in clear: out of the lane's repr (a debug line, a crash reporter's locals), as Push's.
    device_gates: dict[str, float] = field(default_factory=dict, repr=False)
    # For the lines that say a state ended (`_breaker_changed`, `_credential_state`):
    # the pushes that failed fast while the breaker was open, and those that ended `auth`
    # since the provider began refusing the credential.
    failed_fast: int = 0
    auth_failures: int = 0
    # `_config_state`: pushes ended permanent per configuration reason since the first,
    # and when the last one did (monotonic).
    config_failures: dict[str, int] = field(default_factory=dict)
    config_failed_at: float = 0.0


_CLIENT_FAILED = "the provider client raised an exception (see the gateway log)"
# What the mass-invalidation guard's line tells the operator to check, by provider.
_GUARD_ADVICE = {
    "apns": "check the app's APNs `environment`: `sandbox` for development builds (Xcode), "
    "`production` for TestFlight and App Store builds",
    "fcm": "check that the app's service account is of the Firebase project the apps "
    "were built with",
}
# Devices throttled at once per lane whose gate is remembered: past it, the expired ones
# and then the oldest are forgotten (a forgotten device's next push just asks again).
DEVICE_GATES_MAX = 10_000


@dataclass(slots=True)
class _Progress:
    """How far a push's delivery got: what its receipt says if its send is cancelled."""

    attempts: int = 0  # provider requests made, one still out included
    status: int | None = None  # HTTP status of the last one; None while it is out


def backoff_delay(retry: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base * 2**retry))."""
    return random.uniform(0, min(cap, base * (2**retry)))


class Dispatcher:
    """Delivers pushes to provider clients and returns their `Receipt`s."""

    # Seconds without a configuration failure after which an accepted push ends that
    # state (`_config_state`).
    config_quiet: float = 60.0

    def __init__(
        self,
        config: DeliveryConfig,
        metrics: Metrics,
        invalidation: TokenInvalidation,
        hasher: Callable[[str], str],
        sink: ReceiptSink | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.invalidation = invalidation
        self.hasher = hasher
        self.sink = sink
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = asyncio.Event()  # set by drain(): wakes retry and gate waits
        self._background: set[asyncio.Task[Receipt]] = set()
        # Token-invalid reports that outlived their push's deadline (see `_token_invalid`).
        self._reports: set[asyncio.Task[bool]] = set()
        # `cut_after()`: the pushes accepted before `_cut_before` (monotonic) end at their
        # next step; `_waits` are the retry and gate waits out meanwhile, `_requesting` the
        # tasks in a provider request, `_cut_requests` those the cut cancelled.
        self._cut_before = 0.0
        self._cut_timer: asyncio.TimerHandle | None = None
        self._waits: set[asyncio.Timeout] = set()
        self._requesting: set[asyncio.Task[object]] = set()
        self._cut_requests: set[asyncio.Task[object]] = set()
        self._stopped_pushes = 0  # accepted pushes ended transient/shutting_down

    # --- lanes ---------------------------------------------------------------

    def add_app(self, plugin: str, app_id: str, client: ProviderClient) -> None:
        cb = self.config.circuit_breaker
        slots = DeadlineSlots(client.max_in_flight)
        # A client that can carry fewer requests at once than `max_in_flight` (APNs: the
        # streams its server allows) keeps the lane's slots to that: beyond it, requests
        # would wait inside the client, unaware of their deadline (see `ProviderClient`).
        follow = getattr(client, "follow_capacity", None)
        if follow is not None:
            follow(slots.resize)
        lane = Lane(
            plugin=plugin,
            app_id=app_id,
            client=client,
            slots=slots,
            breaker=CircuitBreaker(cb.failure_threshold, cb.reset_after),
            guard=InvalidationGuard(
                self.config.invalidation_guard_min,
                self.config.invalidation_guard_ratio,
                self.config.invalidation_guard_window,
                self.config.invalidation_guard_start,
            ),
            metrics=LaneMetrics(self.metrics, plugin, client.kind.value, app_id),
        )
        self._lanes[(plugin, app_id)] = lane
        self.metrics.queue_limit.labels(plugin, client.kind.value, app_id).set(
            self.config.queue_size
        )
        # From start-up, for dashboards and alerts: 0 is "accepted" / "never closed".
        self.metrics.credential_refused.labels(plugin, client.kind.value, app_id).set(0)
        self.metrics.gate_closed_until.labels(plugin, client.kind.value, app_id).set(0)

    # --- sending -------------------------------------------------------------

    def submit(self, push: Push) -> asyncio.Task[Receipt]:
        """Deliver in the background; the task's result is the Receipt."""
        task = asyncio.create_task(self.send(push))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def send_all(self, pushes: Iterable[Push]) -> list[Receipt]:
        return list(await asyncio.gather(*(self.send(p) for p in pushes)))

    async def send(self, push: Push) -> Receipt:
        """Deliver one push, retrying within its deadline; never raises for delivery trouble."""
        lane = self._lanes.get((push.plugin, push.app_id))
        if lane is None:
            return await self._final(
                push,
                None,
                Attempt(
                    Outcome.PERMANENT,
                    reason=Reason.UNKNOWN_APP,
                    detail=f"no app {push.app_id!r} for plugin {push.plugin!r}",
                ),
                0,
            )
        if self._closing.is_set():
            self._stopped_pushes += 1
            return await self._final(
                push, lane, Attempt(Outcome.TRANSIENT, reason=Reason.SHUTTING_DOWN), 0
            )
        try:
            refused = lane.client.validate(push)
        except Exception as exc:  # a client bug, as in send(): still the one receipt
            refused = self._client_failed(lane, "validate", exc)
        if refused is not None:
            return await self._final(push, lane, refused, 0)
        if lane.pending >= self.config.queue_size:
            return await self._shed(push, lane, Reason.QUEUE_FULL, Outcome.THROTTLED, 0)
        lane.pending += 1
        self._in_flight += 1
        self._idle.clear()
        gauge = lane.metrics.in_flight
        gauge.inc()
        try:
            return await self._deliver(push, lane)
        finally:
            gauge.dec()
            lane.pending -= 1
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _deliver(self, push: Push, lane: Lane) -> Receipt:
        progress = _Progress()
        try:
            ending = await self._attempts(push, lane, progress)
        except asyncio.CancelledError:
            # Only shutdown cancels a send: aiohttp cancels the request handlers it waited
            # for, a service its sends, `close()` the submitted ones that outlived the
            # clients. Nothing accepted is lost, so the push still ends transient/
            # shutting_down (as `_stopped` ends those `drain()` wakes), then the
            # cancellation goes on; `send()`'s `finally` still counts the push out.
            await self._stopped(push, lane, progress.status, progress.attempts)
            raise
        # Outside the `try`: a push cancelled while its final receipt is being made (the
        # sink awaited) has that receipt, and must not get a second one.
        return await ending

    async def _attempts(self, push: Push, lane: Lane, progress: _Progress) -> Awaitable[Receipt]:
        """Attempt delivery, retrying within the deadline, until the push's end is decided;
        return that end not yet awaited (what makes the final receipt: see `_deliver`)."""
        policy = push.policy
        deadline = push.submitted + min(policy.deadline, self.config.max_deadline)
        max_retries = self.config.max_retries
        if policy.max_retries is not None:
            max_retries = min(policy.max_retries, max_retries)
        retries = attempts = 0
        refreshed = False
        client = lane.client
        last: int | None = None  # HTTP status of the last attempt
        while True:
            now = time.monotonic()
            if now >= deadline:
                return self._shed(
                    push, lane, Reason.DEADLINE_EXCEEDED, Outcome.TRANSIENT, attempts, last
                )
            if lane.breaker.rejects(now):  # fail fast: no wait for a slot
                return self._shed(
                    push, lane, Reason.CIRCUIT_OPEN, Outcome.TRANSIENT, attempts, last
                )
            if lane.gate_until > now:
                if lane.gate_until >= deadline:
                    return self._shed(
                        push, lane, Reason.GATE_CLOSED, Outcome.THROTTLED, attempts, last
                    )
                if not await self._pause(push, lane.gate_until - now):
                    return self._stopped(push, lane, last, attempts)
                continue
            if lane.device_gates:
                # This device was throttled on its own (its message rate): its pushes wait
                # for its back-off rather than each meet the same 429; the app's others go.
                device_until = lane.device_gates.get(push.token, 0.0)
                if device_until > now:
                    if device_until >= deadline:
                        return self._shed(
                            push, lane, Reason.GATE_CLOSED, Outcome.THROTTLED, attempts, last
                        )
                    if not await self._pause(push, device_until - now):
                        return self._stopped(push, lane, last, attempts)
                    continue
                if device_until:
                    del lane.device_gates[push.token]
            # The slots count deadlines in the loop's clock, which need not be ours: uvloop's
            # is libuv's, on macOS `mach_continuous_time` (it counts the time the machine
            # slept; `time.monotonic()` does not), days apart after a laptop slept. Unconverted,
            # every push waiting for a slot was shed at once, or waited past its deadline.
            loop_deadline = deadline - now + asyncio.get_running_loop().time()
            if not await lane.slots.acquire(loop_deadline):
                return self._shed(
                    push, lane, Reason.DEADLINE_EXCEEDED, Outcome.TRANSIENT, attempts, last
                )
            if push.submitted < self._cut_before:  # it waited for its slot through a cut
                lane.slots.release()
                return self._stopped(push, lane, last, attempts)
            started = time.monotonic()
            if lane.gate_until > started:
                # Closed while this push waited for its slot (a credential-wide 429 to the
                # push before it): the gate holds every push not yet sent, so back to it.
                lane.slots.release()
                continue
            if lane.device_gates and lane.device_gates.get(push.token, 0.0) > started:
                lane.slots.release()  # this device was throttled meanwhile: to its gate
                continue
            # Claimed here, with no await before the request: a push shed or stopped on
            # its way to a slot leaves the trial to the next one.
            if not lane.breaker.allow(started):  # another push took the trial meanwhile
                lane.slots.release()
                return self._shed(
                    push, lane, Reason.CIRCUIT_OPEN, Outcome.TRANSIENT, attempts, last
                )
            crashed = False
            # A request counts from its start (cancelled, it was still made), with no status.
            progress.attempts, progress.status = attempts + 1, None
            if attempts:
                # A retry is counted when it is made (after a backoff or an `auth`
                # refresh), as the receipt's `attempts - 1` counts it: one scheduled and
                # then shed (deadline, breaker) or stopped is no request.
                lane.metrics.retries.inc()
            sent_at = time.time()  # what a token-invalid answer is about (`observed_at`)
            # The task is what `cut_after()` ends the request by: a set entry, not an
            # `asyncio.timeout` around every request (~5 µs of a ~110 µs push).
            task = asyncio.current_task()
            assert task is not None
            self._requesting.add(task)
            try:
                attempt = await client.send(push)
            except asyncio.CancelledError:
                lane.breaker.abandon()
                if self._was_cut(task):  # the cut's, not the caller's: shutting_down
                    return self._stopped(push, lane, None, attempts + 1)
                raise
            except Exception as exc:  # a client bug: still a receipt, never retried
                if self._was_cut(task):  # a client that turned the cut into an error
                    lane.breaker.abandon()
                    return self._stopped(push, lane, None, attempts + 1)
                attempt = self._client_failed(lane, "send", exc)
                crashed = True
            finally:
                self._requesting.discard(task)
                lane.slots.release()
            if self._cut_requests:  # a client that swallowed the cut's cancellation
                self._was_cut(task)  # (the push ends at its next step all the same)
            attempts += 1
            last = progress.status = attempt.status
            finished = time.monotonic()
            self._observe_attempt(lane, attempt, finished - started)
            if lane.breaker.record(attempt.outcome, finished):
                self._breaker_changed(lane, attempt)
            outcome = attempt.outcome
            if outcome is Outcome.OK or outcome is Outcome.PERMANENT or crashed:
                return self._final(push, lane, attempt, attempts)
            if outcome is Outcome.TOKEN_INVALID:
                return self._token_invalid(push, lane, attempt, attempts, deadline, sent_at)
            if outcome is Outcome.AUTH:
                if refreshed:
                    return self._final(push, lane, attempt, attempts)
                refreshed = True
                try:
                    await client.refresh_credentials()
                except Exception as exc:
                    failed = self._client_failed(lane, "refresh_credentials", exc, last)
                    return self._final(push, lane, failed, attempts)
                continue
            # throttled or transient: the one retry policy
            delay = self._retry_delay(attempt, retries)
            if attempt.credential_wide:
                # Before the retry budget is looked at: the gate is the credential's,
                # and a push with no retry left must still close it for the others.
                if finished + delay > lane.gate_until:
                    lane.gate_until = finished + delay
                    self.metrics.gate_closed_until.labels(
                        lane.plugin, lane.client.kind.value, lane.app_id
                    ).set(time.time() + (lane.gate_until - time.monotonic()))
            elif outcome is Outcome.THROTTLED:
                # One device's rate (FCM asks to slow down to that device, with backoff):
                # its other pushes wait as long as this one, whatever its own budget.
                self._close_device_gate(lane, push.token, finished + delay)
            if retries >= max_retries:
                return self._final(push, lane, attempt, attempts)
            if finished + delay >= deadline:
                return self._final(push, lane, attempt, attempts)
            retries += 1
            if not await self._pause(push, delay):
                return self._stopped(push, lane, last, attempts)

    @staticmethod
    def _close_device_gate(lane: Lane, token: str, until: float) -> None:
        gates = lane.device_gates
        if token not in gates and len(gates) >= DEVICE_GATES_MAX:
            now = time.monotonic()
            for expired in [key for key, end in gates.items() if end <= now]:
                del gates[expired]
            while len(gates) >= DEVICE_GATES_MAX:
                del gates[next(iter(gates))]  # the oldest
        # Popped and put back: the dict's order is the order gates were last closed, so
        # a device throttled again (the busiest) is not the first one forgotten.
        gates[token] = max(gates.pop(token, 0.0), until)

    async def _pause(self, push: Push, seconds: float) -> bool:
        """Wait `seconds` (a retry's backoff, a closed gate); False when `drain()` began
        or `cut_after()` cut the push."""
        closing = self._closing
        if closing.is_set() or push.submitted < self._cut_before:
            return False
        wait = asyncio.timeout(seconds)
        self._waits.add(wait)
        try:
            async with wait:
                await closing.wait()
        except TimeoutError:
            return push.submitted >= self._cut_before
        finally:
            self._waits.discard(wait)
        return False

    async def _stopped(self, push: Push, lane: Lane, status: int | None, attempts: int) -> Receipt:
        """The final receipt of a push that was waiting to retry when shutdown began, or
        whose send was cancelled."""
        self._stopped_pushes += 1
        stopped = Attempt(Outcome.TRANSIENT, status, Reason.SHUTTING_DOWN)
        return await self._final(push, lane, stopped, attempts)

    @staticmethod
    def _client_failed(lane: Lane, call: str, exc: Exception, status: int | None = None) -> Attempt:
        # The kind of error only: a message could quote a token or a payload.
        log.error(
            "app %s: the %s client's %s() raised %s; the push ends transient/%s",
            lane.app_id,
            lane.client.kind.value,
            call,
            type(exc).__name__,
            Reason.CLIENT_ERROR,
        )
        return Attempt(Outcome.TRANSIENT, status, Reason.CLIENT_ERROR, detail=_CLIENT_FAILED)

    def _retry_delay(self, attempt: Attempt, retries: int) -> float:
        if attempt.retry_after is not None:
            # Bounded: a credential-wide throttle closes the lane's gate for this long,
            # and a provider's (or a proxy's) `Retry-After: 99999999` must not stop an
            # app's pushes until a restart.
            return min(attempt.retry_after, self.config.max_retry_after)
        if attempt.outcome is Outcome.THROTTLED and attempt.credential_wide:
            return max(
                self.config.throttle_backoff,
                backoff_delay(retries, self.config.backoff_base, self.config.backoff_cap),
            )
        return backoff_delay(retries, self.config.backoff_base, self.config.backoff_cap)

    def _breaker_changed(self, lane: Lane, attempt: Attempt) -> None:
        """The gauge and one log line per change: an outage of an hour at hundreds of
        pushes a second is two lines, its counts in them; each push is in the metrics."""
        breaker = lane.breaker
        is_open = breaker.opened_at is not None
        self.metrics.circuit_open.labels(lane.plugin, lane.app_id).set(is_open)
        provider = lane.client.kind.value
        if is_open:
            lane.failed_fast = 0
            log.warning(
                "app %s (%s): circuit breaker opened after %d consecutive transient failures "
                "(last: %s); pushes fail fast, one trial request every %g s. Check that "
                "this host reaches the provider (DNS, firewall, proxy, TLS CA) and the "
                "provider's status",
                lane.app_id,
                provider,
                breaker.failures,
                # A known reason, else `other` and the status: a proxy's made-up text
                # stays out of the log, as out of the labels.
                reason_label(attempt.reason, f"other, HTTP {attempt.status}"),
                breaker.reset_after,
            )
        else:
            log.warning(
                "app %s (%s): circuit breaker closed, the provider answers again; "
                "%d push(es) failed fast while it was open",
                lane.app_id,
                provider,
                lane.failed_fast,
            )

    def _credential_state(self, lane: Lane, outcome: Outcome, reason: str | None) -> None:
        """One line when the provider starts refusing the lane's credential (after the
        one refresh), one when it accepts it again, counting the pushes refused meanwhile."""
        if outcome is Outcome.AUTH:
            lane.auth_failures += 1
            if lane.auth_failures == 1:
                self.metrics.credential_refused.labels(
                    lane.plugin, lane.client.kind.value, lane.app_id
                ).set(1)
                log.warning(
                    "app %s (%s): the provider refuses the credential (%s); pushes end auth "
                    "until it accepts it again: %s",
                    lane.app_id,
                    lane.client.kind.value,
                    reason_label(reason),
                    CREDENTIAL_HINTS.get(reason or "", CREDENTIAL_HINT),
                )
        elif outcome is Outcome.OK:
            log.warning(
                "app %s (%s): credential accepted again; %d push(es) ended auth meanwhile",
                lane.app_id,
                lane.client.kind.value,
                lane.auth_failures,
            )
            lane.auth_failures = 0
            self.metrics.credential_refused.labels(
                lane.plugin, lane.client.kind.value, lane.app_id
            ).set(0)

    def _config_state(self, lane: Lane, outcome: Outcome, reason: str | None) -> None:
        """One line when the provider starts refusing the lane's pushes for a configuration
        reason (`CONFIG_REASONS`, one line per reason), one when they are accepted again,
        counting the pushes refused meanwhile.

        Some of the app's pushes may go on being accepted meanwhile (one wrong topic among
        several; Firebase refusing its APNs key, so its iOS devices only): the state ends
        at an accepted push only after `config_quiet` seconds without such a failure, or
        it would be two lines per refused push.
        """
        now = time.monotonic()
        if outcome is Outcome.PERMANENT and reason in CONFIG_REASONS:
            count = lane.config_failures.get(reason, 0) + 1
            lane.config_failures[reason] = count
            lane.config_failed_at = now
            if count == 1:
                hint = CONFIG_HINTS.get(reason)
                log.warning(
                    "app %s (%s): the provider refuses pushes for a configuration reason "
                    "(%s); they end permanent, not retried, until the app's configuration "
                    "is fixed%s",
                    lane.app_id,
                    lane.client.kind.value,
                    reason,
                    f": {hint}" if hint else "",
                )
        elif (
            outcome is Outcome.OK
            and lane.config_failures
            and now - lane.config_failed_at >= self.config_quiet
        ):
            log.warning(
                "app %s (%s): pushes accepted again, no configuration failure for %g s; "
                "meanwhile %s",
                lane.app_id,
                lane.client.kind.value,
                self.config_quiet,
                ", ".join(
                    f"{n} push(es) ended permanent/{name}"
                    for name, n in lane.config_failures.items()
                ),
            )
            lane.config_failures.clear()

    @staticmethod
    def _observe_attempt(lane: Lane, attempt: Attempt, seconds: float) -> None:
        lane.metrics.attempt(attempt.outcome.value).inc()
        lane.metrics.provider_latency.observe(seconds)

    async def _token_invalid(
        self,
        push: Push,
        lane: Lane,
        attempt: Attempt,
        attempts: int,
        deadline: float,
        sent_at: float,
    ) -> Receipt:
        # APNs answers 410 only for a token of its environment (a dead device's).
        dead_device = attempt.status == 410 or attempt.reason in DEAD_DEVICE_REASONS
        if self._count_in_guard(lane, invalid=True, suspect=not dead_device, reason=attempt.reason):
            held = Attempt(
                Outcome.PERMANENT,
                attempt.status,
                Reason.INVALIDATION_SUSPENDED,
                provider_id=attempt.provider_id,
                detail=f"provider said {bounded_reason(attempt.reason)}; invalidation suspended",
            )
            return await self._final(push, lane, held, attempts, record_guard=False)
        receipt = await self._final(push, lane, attempt, attempts, record_guard=False)
        invalid = InvalidToken(
            plugin=push.plugin,
            app_id=push.app_id,
            token_hash=self.hasher(push.token),
            token=push.token,
            provider=lane.client.kind,
            reason=bounded_reason(attempt.reason),
            ref=push.ref,
            token_timestamp=attempt.token_timestamp,
            observed_at=sent_at,
        )
        report = asyncio.create_task(
            self.invalidation.report(invalid, persist=push.policy.persist_token_hash)
        )
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)
        # The plugin is told before send() returns, as a rule. But the report writes to
        # the store and runs the plugin's hook: a locked table or a database that stopped
        # answering would hold the push (and its caller's HTTP answer) for as long, far
        # past its deadline. From the deadline on, the report goes on in the background
        # (`close()` waits for it); the push's end is decided already.
        await asyncio.wait((report,), timeout=max(deadline - time.monotonic(), 0.0))
        return receipt

    def _count_in_guard(
        self,
        lane: Lane,
        *,
        invalid: bool,
        proven: bool = False,
        suspect: bool = True,
        reason: str | None = None,
    ) -> bool:
        """Count one answered push in the lane's mass-invalidation guard; True while it holds.

        The gauge and the log follow every change, whichever push made it: the valid
        answers `_final` counts release the guard too, and a gauge set only on
        token-invalid answers stayed at 1 after invalidation had resumed.
        """
        guard = lane.guard
        was_tripped = guard.tripped
        guard.record(invalid, proven=proven, suspect=suspect)
        tripped = guard.tripped
        if tripped != was_tripped:
            self.metrics.invalidation_suspended.labels(lane.plugin, lane.app_id).set(tripped)
            if tripped:
                if guard.unproven:
                    how = f"no push accepted since start, {guard.minimum_start} in a row"
                else:
                    how = "most tokens"
                log.warning(
                    "token invalidation suspended for app %s (%s): %s came back invalid "
                    "(last: %s); no registration is deleted while it holds (wrong "
                    "environment or project?): %s",
                    lane.app_id,
                    lane.client.kind.value,
                    how,
                    reason_label(reason),
                    _GUARD_ADVICE.get(lane.client.kind.value, "check the app's credential"),
                )
            else:
                log.warning("token invalidation resumed for app %s", lane.app_id)
        return tripped

    async def _shed(
        self,
        push: Push,
        lane: Lane,
        reason: str,
        outcome: Outcome,
        attempts: int,
        status: int | None = None,
    ) -> Receipt:
        """End a push on the gateway's own `reason`; `status` is the HTTP status of its
        last request when it made any (receipts.md: null only when none was made)."""
        self.metrics.shed.labels(push.plugin, lane.app_id, reason).inc()
        if reason == Reason.CIRCUIT_OPEN:
            lane.failed_fast += 1
        return await self._final(push, lane, Attempt(outcome, status, reason), attempts)

    async def _final(
        self,
        push: Push,
        lane: Lane | None,
        attempt: Attempt,
        attempts: int,
        record_guard: bool = True,
    ) -> Receipt:
        provider = lane.client.kind if lane else None
        if lane is not None and record_guard and attempts:
            self._count_in_guard(lane, invalid=False, proven=attempt.outcome is Outcome.OK)
        receipt = Receipt(
            push_id=push.id,
            plugin=push.plugin,
            app_id=push.app_id,
            provider=provider,
            outcome=attempt.outcome,
            status=attempt.status,
            # A provider's reason is kept as sent, up to `REASON_MAX` characters: a
            # proxy's or a broken upstream's may be as long as its body.
            reason=bounded_reason(attempt.reason),
            attempts=attempts,
            latency=time.monotonic() - push.submitted,
            finished_at=time.time(),
            token_hash=self.hasher(push.token) if push.policy.persist_token_hash else None,
            token_timestamp=attempt.token_timestamp,
            provider_id=attempt.provider_id,
            detail=attempt.detail,
        )
        if lane is not None:
            if lane.auth_failures or receipt.outcome is Outcome.AUTH:
                self._credential_state(lane, receipt.outcome, receipt.reason)
            if lane.config_failures or receipt.outcome is Outcome.PERMANENT:
                self._config_state(lane, receipt.outcome, receipt.reason)
            lane.metrics.push(receipt.outcome.value, receipt.reason or "").inc()
            lane.metrics.push_latency.observe(receipt.latency)
        else:
            # No app label: an unknown app id is whatever a client sent (plugins pass it
            # on), and one series per value would grow the registry without bound.
            # The receipt still names it.
            self.metrics.pushes.labels(
                push.plugin, "none", "", receipt.outcome.value, reason_label(receipt.reason)
            ).inc()
        if log.isEnabledFor(logging.DEBUG):
            # The per-push detail (delivery.md), one line per receipt whichever plugin sent
            # it: its push id leads to the receipt (`pushgw receipts cat`). No token, and
            # a provider's reason only as a known label (a proxy's text stays out).
            log.debug(
                "push %s (%s, app %s): %s/%s, HTTP %s, %d attempt(s), %.1f ms",
                receipt.push_id,
                push.plugin,
                lane.app_id if lane is not None else "unknown",
                receipt.outcome.value,
                reason_label(receipt.reason, "other") or "-",
                receipt.status,
                attempts,
                receipt.latency * 1000,
            )
        if self.sink is not None:
            await self.sink(push, receipt)
        return receipt

    # --- lifecycle -----------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        await asyncio.gather(*(lane.client.start() for lane in self._lanes.values()))

    def ready(self) -> dict[str, bool]:
        return {f"{ln.plugin}/{ln.app_id}": ln.client.ready() for ln in self._lanes.values()}

    def cut_after(self, seconds: float) -> None:
        """In `seconds`, end the pushes accepted until then that are still out (in a
        provider request, waiting to retry, behind a gate or for a slot) as
        `transient`/`shutting_down`, without cancelling their callers; later pushes are
        not affected, nor is anything once `drain()` began.

        The application arms this when its shutdown begins: aiohttp waits for the request
        handlers (`server.shutdown_timeout`) and then cuts them, so that a push out to a
        provider that does not answer dropped its caller's connection without an answer.
        Cut here first, the handler answers in its protocol's terms (a retry elsewhere).
        """
        if self._cut_timer is None and not self._closing.is_set():
            self._cut_timer = asyncio.get_running_loop().call_later(seconds, self._cut)

    def _cut(self) -> None:
        self._cut_before = time.monotonic()
        if self._in_flight:
            log.warning(
                "shutdown: %d push(es) still out after the shutdown timeout; they end "
                "transient/shutting_down",
                self._in_flight,
            )
        loop_now = asyncio.get_running_loop().time()
        for wait in list(self._waits):
            if not wait.expired():  # one expiring already ends by itself
                wait.reschedule(loop_now)
        for task in list(self._requesting):
            if not task.cancelling():  # its caller is not cancelling it already
                self._cut_requests.add(task)
                task.cancel()

    def _was_cut(self, task: asyncio.Task[object]) -> bool:
        """Whether `_cut` cancelled `task`'s request; if so, the cancellation is taken
        back (`uncancel`), unless its caller cancelled it too meanwhile."""
        if task not in self._cut_requests:
            return False
        self._cut_requests.discard(task)
        return task.uncancel() == 0

    async def drain(self, timeout: float) -> bool:
        """Refuse new pushes and wait up to `timeout` s for in-flight ones; True if all ended.

        Pushes in a request, or waiting for a slot, go on; pushes waiting to retry or
        behind a closed gate end at once as `transient`/`shutting_down` (with their
        receipts), and so does any push whose attempt fails from now on: nothing waits
        for a retry once draining began.
        """
        if self._cut_timer is not None:
            self._cut_timer.cancel()  # the drain's own timeout bounds what is left
        self._closing.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            log.warning(
                "shutdown: %d pushes still in flight after %.1f s", self._in_flight, timeout
            )
            return False

    async def close(self, timeout: float = 5.0) -> None:
        """Close the provider clients, then wait up to `timeout` s for the pushes still in
        flight (their requests end `transient` with the clients) to reach their receipts,
        so that the receipts sink, closed after the dispatcher, gets them. The `submit()`
        tasks still running after that are cancelled (each push ends `shutting_down`) and
        waited for, up to `timeout` s again. Token-invalid reports that outlived their
        push (`_token_invalid`) are waited for as long, then cancelled."""
        self._closing.set()
        await asyncio.gather(
            *(lane.client.close() for lane in self._lanes.values()), return_exceptions=True
        )
        await self._wait_for_pushes(timeout)
        await self._wait_for_reports(timeout)
        if self._stopped_pushes:
            # The total, whichever way they ended: refused while draining, woken from a
            # retry wait, cut (`cut_after`) or cancelled with their caller.
            log.warning(
                "shutdown: %d accepted push(es) not delivered: they end "
                "transient/shutting_down (see the receipts)",
                self._stopped_pushes,
            )

    async def _wait_for_pushes(self, timeout: float) -> None:
        if not self._in_flight:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            stuck = list(self._background)
            log.warning(
                "shutdown: %d pushes still in flight after the provider clients closed; "
                "cancelling the %d submitted ones",
                self._in_flight,
                len(stuck),
            )
            # Left to the event loop's teardown, they would be cancelled after the
            # receipts writer closed, and their receipts lost.
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=timeout)

    async def _wait_for_reports(self, timeout: float) -> None:
        """Wait up to `timeout` s for the token-invalid reports still running (a store
        or hook slower than their push's deadline), then cancel them: the store closes
        after the dispatcher. A cancelled report leaves its token to be reported again
        at its next token-invalid answer."""
        reports = list(self._reports)
        if not reports:
            return
        _, late = await asyncio.wait(reports, timeout=timeout)
        if late:
            log.warning(
                "shutdown: %d token-invalid reports (store or plugin hook) still running "
                "after %.1f s; cancelling them",
                len(late),
                timeout,
            )
            for task in late:
                task.cancel()
            await asyncio.wait(late, timeout=timeout)
