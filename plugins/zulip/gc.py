"""Garbage collection of dead registrations (specs/zulip.md §8) and its periodic service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.api import Store
from plugins.zulip import repo

__all__ = ["GcCounts", "ZulipService", "collect", "parse_duration"]

log = logging.getLogger(__name__)

GcCounts = repo.GcCounts

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `3600s` or plain seconds."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30d, 12h, 3600)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


async def collect(engine: AsyncEngine, older_than: float, *, dry_run: bool = False) -> GcCounts:
    """Delete registrations dead for longer than `older_than` seconds; a dry run only counts.

    One transaction: a dry run performs the deletes and rolls back, so its counts are
    exactly those of a real run at the same moment. Idempotent.
    """
    cutoff = repo.now_utc() - timedelta(seconds=older_than)
    async with engine.connect() as conn:
        transaction = await conn.begin()
        try:
            counts = await repo.collect_garbage(conn, cutoff)
        except BaseException:
            await transaction.rollback()
            raise
        if dry_run:
            await transaction.rollback()
        else:
            await transaction.commit()
    return counts


# Seconds before a failed periodic gc is tried again (at most `gc_interval`).
GC_RETRY = 300.0


class ZulipService:
    """Periodic garbage collection (when `gc_interval` is set) and a clean shutdown of sends."""

    name = "zulip"

    def __init__(
        self,
        engine: Callable[[], AsyncEngine],
        interval: float | None,
        older_than: float,
        on_stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._engine = engine
        self._interval = interval
        self._older_than = older_than
        self._on_stop = on_stop
        self._task: asyncio.Task[None] | None = None
        self._failed = False

    async def start(self) -> None:
        if self._interval is not None and self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        assert self._interval is not None
        while True:
            # At start too: a gateway restarted more often than the interval (deploys)
            # would otherwise never collect.
            try:
                counts = await collect(self._engine(), self._older_than)
                self._failed = False
                if counts.total:
                    log.info("zulip gc: deleted %d registrations", counts.total)
            except Exception as exc:
                self._failed = True
                log.error(
                    "zulip gc failed: %s; trying again in %g s",
                    Store.problem(exc) or type(exc).__name__,
                    self._retry_in(),
                )
            await asyncio.sleep(self._retry_in() if self._failed else self._interval)

    def _retry_in(self) -> float:
        # A failed run (nodes and workers that start together collect at once: a lock
        # timeout, a deadlock, a database read-only during a switchover) is tried again
        # soon, not a day later.
        return min(self._interval or GC_RETRY, GC_RETRY)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._on_stop is not None:
            await self._on_stop()

    def ready(self) -> bool:
        # Not the gc's state: a failed gc keeps no request from being served, and every
        # node shares the database whose trouble failed it (read-only during a
        # switchover, a missing grant), so /readyz answering 503 took them all out of
        # their balancer at once, for `GC_RETRY` after the database was writable again.
        # Shown in `status()` and logged instead.
        return True

    def status(self) -> dict[str, str]:
        """`/readyz` `service_status`: whether the periodic gc is off, ok or failing."""
        if self._interval is None:
            return {"gc": "off"}
        return {"gc": "failing" if self._failed else "ok"}
