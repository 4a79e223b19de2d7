"""The one token-invalidation path.

A provider's token-invalid answer (via the dispatcher) and an operator's dead-token
file (`pushgw tokens retire`) both end here: the token's keyed hash is recorded
(unless the push forbids persisted linkage), the invalidation is counted, and the
owning plugin's `pushgw_token_invalid` hook is called once per token. What became of
each token is returned (`Outcome`) for callers that report it (the CLI); a failure to
record or a failing plugin hook never raises, so that live delivery goes on.

Also the mass-invalidation guard (specs/providers.md §1): when most tokens of one
app come back invalid, the app is misconfigured (wrong APNs environment, wrong
Firebase project) and invalidating would wipe every registration, so it is held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from gateway.core.errors import FirstSeen, kind_and_place
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken
from gateway.core.store import Store, invalid_tokens

log = logging.getLogger(__name__)

NotifyPlugin = Callable[[InvalidToken], Awaitable[object]]

REASON_LENGTH = 64  # pushgw_invalid_tokens.reason is String(64)

# Invalidations remembered so that concurrent pushes to one dead token call the hook
# once. Short, so that a token registered again and dead again is reported again; and
# an answer to a request sent after the last report began is reported at once: it is
# news about registrations that report left alone (made after its answer's request).
_RECENT_MAX = 100_000
_RECENT_SECONDS = 60.0


class InvalidationGuard:
    """Holds invalidations while > `ratio` of >= `minimum` sends in `window` s were invalid.

    Sends are counted in `BUCKETS` time buckets rather than remembered one by one: at
    thousands of pushes a second, a 300 s window of individual sends would be millions of
    entries. The window therefore moves in steps of `window / BUCKETS` (5 s by default).

    Until one send of the app has come back valid, `start` invalid answers in a row trip
    it too (at most `minimum`; never with `ratio` 1): a wrong APNs environment or
    Firebase project at fewer than `minimum` sends per window (a small deployment) never
    reached the ratio rule, and every registration was deleted, one per push. A valid
    answer proves the credential's environment or project: from then on, only the ratio
    rule applies. A dead device's answer (APNs 410 `Unregistered`, FCM `UNREGISTERED`:
    the provider knows the token, so never what a wrong environment or project gives)
    counts in the ratio rule only: a healthy app meets some at every restart.
    """

    BUCKETS = 60

    def __init__(
        self, minimum: int = 100, ratio: float = 0.5, window: float = 300.0, start: int = 10
    ) -> None:
        self.minimum = minimum
        self.ratio = ratio
        self.window = window
        # Invalid answers before the first valid one; None once a valid one came.
        self._unproven: int | None = 0 if ratio < 1 else None
        self._start = min(start, minimum)
        self._width = window / self.BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket number, sends, invalid]
        self._sends = 0
        self._invalid = 0

    def record(
        self,
        invalid: bool,
        now: float | None = None,
        *,
        proven: bool = True,
        suspect: bool = True,
    ) -> None:
        """Count one answered send; `proven=False` for a valid one that does not show the
        credential works (a connection error, a refused payload): only an accepted push
        ends the start rule. `suspect=False` for an invalid one that a wrong environment
        or project never gives (a dead device's): not counted by the start rule."""
        now = time.monotonic() if now is None else now
        number = int(now // self._width)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != number:
            buckets.append([number, 0, 0])
            oldest = number - self.BUCKETS  # buckets before it are wholly outside the window
            while buckets[0][0] <= oldest:
                _, sends, invalids = buckets.popleft()
                self._sends -= sends
                self._invalid -= invalids
        bucket = buckets[-1]
        bucket[1] += 1
        self._sends += 1
        if invalid:
            bucket[2] += 1
            self._invalid += 1
            if self._unproven is not None and suspect:
                self._unproven += 1
        elif proven:
            self._unproven = None

    @property
    def minimum_start(self) -> int:
        """Invalid answers in a row, before any valid one, that trip the guard."""
        return self._start

    @property
    def unproven(self) -> bool:
        """Tripped because no send has come back valid yet (see the class docstring)."""
        return self._unproven is not None and self._unproven >= self._start

    @property
    def tripped(self) -> bool:
        n = self._sends
        return (n >= self.minimum and self._invalid > self.ratio * n) or self.unproven


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `TokenInvalidation.handle` did with one invalid token.

    `handled` is False when the token was handled recently (nothing was done again).
    `record_error` / `hook_error` say, in one line without the token, why its keyed hash
    could not be recorded / why the owning plugin's hook failed. `found` is what the hook
    returned when it was a number: how many of the plugin's records the token matched
    (None: the plugin does not say). A dead-token file's hash that matches no record was
    made under another `receipts.hmac_key`, or names a token already forgotten.
    """

    handled: bool
    record_error: str | None = None
    hook_error: str | None = None
    found: int | None = None

    @property
    def complete(self) -> bool:
        """Recorded (when asked to) and told to the plugin, without an error."""
        return self.handled and self.record_error is None and self.hook_error is None


def describe_error(exc: BaseException) -> str:
    """One line for an error: a database error's driver message, without SQL or parameters."""
    cause: BaseException = exc
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        cause = exc.orig
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__


class TokenInvalidation:
    """Records invalid tokens and tells their owning plugin, once per token."""

    def __init__(self, store: Store | None, metrics: Metrics, notify: NotifyPlugin) -> None:
        self._store = store
        self._metrics = metrics
        self._notify = notify
        # key -> (monotonic expiry, unix time its report began)
        self._recent: OrderedDict[tuple[str, str, str], tuple[float, float]] = OrderedDict()
        # Records failed in a row (the database down or read-only): the first is logged,
        # the others counted, and the first success after them says how many.
        self._record_failures = 0
        self._hook_failures = FirstSeen()  # a failing hook's line, once per kind and place

    async def report(self, invalid: InvalidToken, *, persist: bool = True) -> bool:
        """Handle one invalid token; False when it was already handled recently."""
        return (await self.handle(invalid, persist=persist)).handled

    async def handle(self, invalid: InvalidToken, *, persist: bool = True) -> Outcome:
        """Handle one invalid token and say what happened; never raises for the store or hook."""
        key = (invalid.plugin, invalid.app_id, invalid.token_hash)
        now = time.monotonic()
        while self._recent and (
            len(self._recent) >= _RECENT_MAX or next(iter(self._recent.values()))[0] < now
        ):
            self._recent.popitem(last=False)
        previous = self._recent.get(key)
        if previous is not None and (
            invalid.observed_at is None or invalid.observed_at <= previous[1]
        ):
            return Outcome(handled=False)
        self._recent.pop(key, None)  # re-inserted last: the order is by expiry
        self._recent[key] = (now + _RECENT_SECONDS, time.time())
        provider = invalid.provider.value if invalid.provider else "none"
        self._metrics.invalid_tokens.labels(invalid.plugin, provider, invalid.app_id).inc()
        record_error = hook_error = None
        found: int | None = None
        try:
            if persist and self._store is not None:
                record_error = await self._record(invalid)
            result = await self._notify(invalid)
            if isinstance(result, int) and not isinstance(result, bool):
                found = result
        except asyncio.CancelledError:
            # Not handled after all (shutdown cancelled the send): the token is not
            # "recently handled", so its next failure records it and tells the plugin.
            self._recent.pop(key, None)
            raise
        except Exception as exc:
            # A plugin bug must not lose the delivery result; the record above stays.
            # The kind and place of the error, never the error itself: its message may
            # quote what the hook was given or used (a database error quotes its
            # statement's parameters), and handlers without pushgw's formatter print it
            # (logging's last resort in CLI commands, an embedding application's own).
            self._metrics.hook_errors.labels(invalid.plugin, "pushgw_token_invalid").inc()
            where = kind_and_place(exc)
            if self._hook_failures.first(invalid.plugin, where):
                log.error(
                    "token-invalid hook of plugin %s failed: %s; the plugin may still hold the "
                    "token (later failures at that place are counted in "
                    "pushgw_plugin_hook_errors_total, not logged)",
                    invalid.plugin,
                    where,
                )
            hook_error = describe_error(exc)
        return Outcome(handled=True, record_error=record_error, hook_error=hook_error, found=found)

    async def _record(self, invalid: InvalidToken) -> str | None:
        """Record the keyed hash; the error in one line when it could not be recorded."""
        assert self._store is not None
        values = {
            "plugin": invalid.plugin,
            "app_id": invalid.app_id,
            "token_hash": invalid.token_hash,
            "provider": invalid.provider.value if invalid.provider else None,
            # provider reasons are passed through as sent: cut to the column, never refused
            "reason": invalid.reason[:REASON_LENGTH] if invalid.reason else invalid.reason,
            "invalidated_at": datetime.now(UTC),
        }
        insert = postgresql.insert if self._store.dialect == "postgresql" else sqlite.insert
        stmt = insert(invalid_tokens).values(**values).on_conflict_do_nothing()
        try:
            async with self._store.engine.begin() as conn:
                await conn.execute(stmt)
        except Exception as exc:
            self._record_failed(invalid.plugin, exc)
            return describe_error(exc)
        if self._record_failures:
            log.warning(
                "invalid tokens are recorded again; %d could not be recorded meanwhile "
                "(their plugins were told)",
                self._record_failures,
            )
            self._record_failures = 0
        return None

    def _record_failed(self, plugin: str, exc: Exception) -> None:
        """Count a failed record; log the first of a run in one line (no traceback: a
        database error's text quotes its statement's parameters, and with the database
        down every dead token would add one)."""
        self._metrics.token_record_failures.labels(plugin).inc()
        self._record_failures += 1
        if self._record_failures > 1:
            return
        cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        log.error(
            "could not record an invalid token for plugin %s (%s): %s; the plugin is still "
            "told. Check that the database is up and writable (/readyz `store`); further "
            "failures are counted in pushgw_invalid_token_record_failures_total until a "
            "record succeeds",
            plugin,
            type(cause).__name__,
            describe_error(exc).partition(": ")[2] or "no message",
        )


# How often `sweep_invalid_tokens` runs while the core runs (`running_core`).
SWEEP_INTERVAL = 3600.0


async def sweep_invalid_tokens(store: Store, older_than: float) -> int:
    """Delete the records of tokens invalidated more than `older_than` s ago; how many.

    Each record only says that a token's keyed hash was found dead (the plugin was told
    then, and the provider answers again if the token is ever used again): without this
    sweep `pushgw_invalid_tokens` grew by every dead token for as long as the gateway ran.
    Idempotent, so every node may run it (the first of its workers does: `running_core`).

    Then a passive checkpoint (SQLite): what was deleted since the last one, by the sweep
    or by any plugin (an unregistered device's token in clear), leaves the database files
    within the hour even on a gateway too quiet to reach SQLite's own checkpoints.
    """
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
    async with store.engine.begin() as conn:
        result = await conn.execute(
            delete(invalid_tokens).where(invalid_tokens.c.invalidated_at < cutoff)
        )
    await store.checkpoint(truncate=False)
    return result.rowcount or 0


async def sweep_invalid_tokens_forever(
    store: Store,
    older_than: float,
    on_failure: Callable[[], object] | None = None,
    on_swept: Callable[[int], object] | None = None,
) -> None:
    """`sweep_invalid_tokens` now and every `SWEEP_INTERVAL` s; the records each sweep
    deletes are counted by `on_swept` (the core's
    `pushgw_invalid_token_records_swept_total`), a failure (the database down) is
    logged, in one line, counted by `on_failure` (the core's
    `pushgw_invalid_token_sweep_failures_total`), and the next sweep tries again."""
    while True:
        try:
            swept = await sweep_invalid_tokens(store, older_than)
            if on_swept is not None:
                on_swept(swept)
        except Exception as exc:
            log.warning("could not sweep old invalid-token records: %s", describe_error(exc))
            if on_failure is not None:
                on_failure()
        await asyncio.sleep(SWEEP_INTERVAL)
