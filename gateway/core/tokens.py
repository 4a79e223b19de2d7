"""The one token-invalidation path.

A provider's token-invalid answer (via the dispatcher) and an operator's dead-token
file (`pushgw tokens retire`) both end here: the token's keyed hash is recorded
(unless the push forbids persisted linkage), the invalidation is counted, and the
owning plugin's `pushgw_token_invalid` hook is called once per token.

Also the mass-invalidation guard (specs/providers.md §1): when most tokens of one
app come back invalid, the app is misconfigured (wrong APNs environment, wrong
Firebase project) and invalidating would wipe every registration, so it is held.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from sqlalchemy.dialects import postgresql, sqlite

from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken
from gateway.core.store import Store, invalid_tokens

log = logging.getLogger(__name__)

NotifyPlugin = Callable[[InvalidToken], Awaitable[None]]

# Invalidations remembered so that concurrent pushes to one dead token call the hook
# once. Short, so that a token registered again and dead again is reported again.
_RECENT_MAX = 100_000
_RECENT_SECONDS = 60.0


class InvalidationGuard:
    """Holds invalidations while > `ratio` of >= `minimum` sends in `window` s were invalid.

    Sends are counted in `BUCKETS` time buckets rather than remembered one by one: at
    thousands of pushes a second, a 300 s window of individual sends would be millions of
    entries. The window therefore moves in steps of `window / BUCKETS` (5 s by default).
    """

    BUCKETS = 60

    def __init__(self, minimum: int = 100, ratio: float = 0.5, window: float = 300.0) -> None:
        self.minimum = minimum
        self.ratio = ratio
        self.window = window
        self._width = window / self.BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket number, sends, invalid]
        self._sends = 0
        self._invalid = 0

    def record(self, invalid: bool, now: float | None = None) -> None:
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

    @property
    def tripped(self) -> bool:
        n = self._sends
        return n >= self.minimum and self._invalid > self.ratio * n


class TokenInvalidation:
    """Records invalid tokens and tells their owning plugin, once per token."""

    def __init__(self, store: Store | None, metrics: Metrics, notify: NotifyPlugin) -> None:
        self._store = store
        self._metrics = metrics
        self._notify = notify
        self._recent: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    async def report(self, invalid: InvalidToken, *, persist: bool = True) -> bool:
        """Handle one invalid token; False when it was already handled recently."""
        key = (invalid.plugin, invalid.app_id, invalid.token_hash)
        now = time.monotonic()
        while self._recent and (
            len(self._recent) >= _RECENT_MAX or next(iter(self._recent.values())) < now
        ):
            self._recent.popitem(last=False)
        if key in self._recent:
            return False
        self._recent[key] = now + _RECENT_SECONDS
        provider = invalid.provider.value if invalid.provider else "none"
        self._metrics.invalid_tokens.labels(invalid.plugin, provider, invalid.app_id).inc()
        if persist and self._store is not None:
            await self._record(invalid)
        try:
            await self._notify(invalid)
        except Exception:
            # A plugin bug must not lose the delivery result; the record above stays.
            log.exception("token-invalid hook of plugin %s failed", invalid.plugin)
        return True

    async def _record(self, invalid: InvalidToken) -> None:
        assert self._store is not None
        values = {
            "plugin": invalid.plugin,
            "app_id": invalid.app_id,
            "token_hash": invalid.token_hash,
            "provider": invalid.provider.value if invalid.provider else None,
            "reason": invalid.reason,
            "invalidated_at": datetime.now(UTC),
        }
        insert = postgresql.insert if self._store.dialect == "postgresql" else sqlite.insert
        stmt = insert(invalid_tokens).values(**values).on_conflict_do_nothing()
        try:
            async with self._store.engine.begin() as conn:
                await conn.execute(stmt)
        except Exception:
            log.exception("could not record an invalid token for plugin %s", invalid.plugin)
