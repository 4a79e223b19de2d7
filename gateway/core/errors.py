"""Saying what went wrong without saying what the error says."""

from __future__ import annotations

import traceback


def kind_and_place(exc: BaseException) -> str:
    """`RuntimeError at /path/plugin.py:12`: the kind of error and where it was raised,
    never its message, which could quote what the failing code was given or read (a
    token, a payload, a key, a database statement's parameters)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{where}"


class FirstSeen:
    """Which failures were seen before, so that each distinct one is logged once.

    A hook or a database that fails for every push would otherwise write a line per
    push; the count goes to a metric instead. Bounded: past `limit` keys every failure
    is news again (logged), which a misbehaving caller cannot turn into memory growth.
    """

    def __init__(self, limit: int = 1000) -> None:
        self._seen: set[tuple[str, ...]] = set()
        self._limit = limit

    def first(self, *key: str) -> bool:
        """True the first time `key` is seen (then log it)."""
        if key in self._seen:
            return False
        if len(self._seen) < self._limit:
            self._seen.add(key)
        return True
