"""HTTP Basic parsing (specs/zulip.md §2) and the per-server sliding-window rate limit."""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections import OrderedDict, deque

from plugins.zulip.errors import ZulipError, unauthorized

__all__ = ["RateLimiter", "parse_basic_auth"]


def parse_basic_auth(header: str | None) -> tuple[str, str]:
    """(server uuid, server key) from an Authorization header, or Zulip's error for it."""
    if header is None:
        raise unauthorized("Missing authorization header for basic auth")
    parts = header.split()
    if len(parts) != 2:
        raise unauthorized("Invalid authorization header for basic auth")
    if parts[0].lower() != "basic":
        raise ZulipError("This endpoint requires HTTP basic authentication.")
    try:
        decoded = base64.b64decode(parts[1]).decode("utf-8")
    except (binascii.Error, ValueError):
        raise unauthorized("Invalid authorization header for basic auth") from None
    if decoded.count(":") != 1:
        raise unauthorized("Invalid authorization header for basic auth")
    role, key = decoded.split(":")
    if "@" in role:
        raise ZulipError("Must validate with valid Zulip server API key")
    return role, key


class RateLimiter:
    """At most `limit` requests per `window` seconds per key (exact sliding window).

    In memory, per gateway process: with several workers each enforces its own window.
    At most `max_keys` keys are remembered, least recently seen first out: a key whose
    window is over goes first (forgetting it changes nothing), and beyond `max_keys` the
    least recently seen key goes whatever its window (it starts a fresh one if it comes
    back). A key that keeps coming is never the least recently seen one.
    """

    def __init__(self, limit: int, window: float, max_keys: int = 100_000) -> None:
        self.limit = limit
        self.window = window
        self.max_keys = max_keys
        # Least recently seen first: a hit moves its key to the end.
        self._hits: OrderedDict[str, deque[float]] = OrderedDict()

    def hit(self, key: str, now: float | None = None) -> float | None:
        """Record a request; None when allowed, else the seconds until one is allowed."""
        now = time.monotonic() if now is None else now
        hits = self._hits.get(key)
        if hits is None:
            self._make_room(now)
            hits = self._hits[key] = deque()
        else:
            self._hits.move_to_end(key)
        horizon = now - self.window
        while hits and hits[0] <= horizon:
            hits.popleft()
        if len(hits) >= self.limit:
            return max(hits[0] + self.window - now, 0.001)
        hits.append(now)
        return None

    def _make_room(self, now: float) -> None:
        """Before a new key: forget the least recently seen keys while their window is
        over, or while `max_keys` are remembered. Each key is forgotten once: amortised
        O(1) per new key (an O(n) scan per new key, once full, was a CPU sink)."""
        horizon = now - self.window
        keys = self._hits
        while keys:
            oldest = next(iter(keys.values()))
            if len(keys) < self.max_keys and oldest and oldest[-1] > horizon:
                break
            keys.popitem(last=False)


def rate_limited(retry_after: float) -> ZulipError:
    return ZulipError(
        "API usage exceeded rate limit",
        "RATE_LIMIT_HIT",
        429,
        data={"retry-after": retry_after},
        headers={"Retry-After": str(math.ceil(retry_after))},
    )
