"""Storage on SQLite and PostgreSQL: migrations of the core and plugin branches, records."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select

from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, ProviderKind
from gateway.core.store import Store, invalid_tokens
from gateway.core.tokens import TokenInvalidation

SAMPLE_MIGRATIONS = str(Path(__file__).parent / "sample_plugin" / "pushgw_sample" / "migrations")


async def table_names(store: Store) -> set[str]:
    async with store.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def test_upgrade_creates_core_and_plugin_tables(store_url: str) -> None:
    store = Store(store_url)
    try:
        await store.upgrade([SAMPLE_MIGRATIONS])
        assert {"pushgw_invalid_tokens", "sample_invalid", "alembic_version"} <= await table_names(
            store
        )
        await store.upgrade([SAMPLE_MIGRATIONS])  # idempotent
        assert await store.ping()
    finally:
        await store.close()


async def test_invalid_token_recorded_once_and_plugin_told_once(store_url: str) -> None:
    store = Store(store_url)
    told: list[InvalidToken] = []

    async def notify(invalid: InvalidToken) -> None:
        told.append(invalid)

    try:
        await store.upgrade()
        invalidation = TokenInvalidation(store, Metrics(), notify)
        invalid = InvalidToken(
            "p", "app", "ab" * 32, "secret-token", ProviderKind.FCM, "UNREGISTERED"
        )
        assert await invalidation.report(invalid)
        assert not await invalidation.report(invalid)
        # a second gateway process (no memory of the first) must not fail on the duplicate row
        assert await TokenInvalidation(store, Metrics(), notify).report(invalid)
        async with store.engine.connect() as conn:
            count = (await conn.execute(select(func.count()).select_from(invalid_tokens))).scalar()
            row = (await conn.execute(select(invalid_tokens))).one()
        assert count == 1
        assert row.token_hash == "ab" * 32 and row.reason == "UNREGISTERED"
        assert "secret-token" not in repr(row)
        assert len(told) == 2
    finally:
        await store.close()


async def test_unlinkable_invalidation_persists_nothing(store_url: str) -> None:
    store = Store(store_url)
    try:
        await store.upgrade()

        async def notify(_: InvalidToken) -> None:
            return None

        invalidation = TokenInvalidation(store, Metrics(), notify)
        await invalidation.report(InvalidToken("p", "a", "cd" * 32, "t", None, "x"), persist=False)
        async with store.engine.connect() as conn:
            count = (await conn.execute(select(func.count()).select_from(invalid_tokens))).scalar()
        assert count == 0
    finally:
        await store.close()


async def test_an_invalidation_cancelled_midway_is_handled_at_the_next_report(
    store_url: str,
) -> None:
    store = Store(store_url)
    told: list[InvalidToken] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def notify(invalid: InvalidToken) -> None:
        entered.set()
        await release.wait()  # held until the first report is cancelled
        told.append(invalid)

    try:
        await store.upgrade()
        invalidation = TokenInvalidation(store, Metrics(), notify)
        invalid = InvalidToken("p", "app", "ef" * 32, "t", ProviderKind.APNS, "Unregistered")
        first = asyncio.create_task(invalidation.report(invalid))
        await entered.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert told == []
        release.set()
        # the plugin was never told: the token is not "already handled"
        assert await invalidation.report(invalid)
        assert [t.token_hash for t in told] == ["ef" * 32]
    finally:
        await store.close()
