"""Growth review: state a gateway running for a year without restarts keeps.

Each structure is driven with many distinct inputs and must stay within its documented
bound, degrading to "might send a duplicate", never to "drops a push". Counts objects,
never time.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.core.push import Push
from plugins.zulip import bouncer as bouncer_module
from plugins.zulip.bouncer import Bouncer
from plugins.zulip.config import ZulipConfig
from plugins.zulip.validation import FcmPushRequest

# --- Zulip E2EE duplicate window ---------------------------------------------------------


class _Starts:
    """Stands in for `Bouncer._start`: records each send started, never finishes it."""

    def __init__(self) -> None:
        self.started = 0
        self.pending: list[asyncio.Future[Any]] = []

    def __call__(self, server_id: int, push: Push, *, apns: bool) -> asyncio.Future[Any]:
        self.started += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return future


def _bouncer() -> tuple[Bouncer, _Starts]:
    bouncer = Bouncer(SimpleNamespace(config=ZulipConfig()))  # type: ignore[arg-type]
    starts = _Starts()
    bouncer._start = starts  # type: ignore[assignment,method-assign]
    return bouncer, starts


def _request(n: int) -> FcmPushRequest:
    return FcmPushRequest(
        token_id=str(n), token_id_int=n, priority="high", push_key_id=1, encrypted_data=f"c{n}"
    )


async def test_zulip_duplicate_window_is_capped_and_never_drops_a_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every distinct push within `duplicate_window` (120 s) was remembered with its task
    and receipt: push rate x window entries, with no cap. Past the cap the oldest is
    forgotten, and every distinct push is still started."""
    monkeypatch.setattr(bouncer_module, "_RECENT_MAX", 50)
    bouncer, starts = _bouncer()
    push: Any = object()
    for n in range(500):
        assert bouncer._send_once(1, 1, _request(n), push) is not None
    assert starts.started == 500  # none dropped
    assert len(bouncer._recent) <= 50
    # a duplicate of a remembered push still joins its send
    bouncer._send_once(1, 1, _request(499), push)
    assert starts.started == 500
    # a duplicate of a forgotten one is sent again (a possible duplicate, never a loss)
    assert bouncer._send_once(1, 1, _request(0), push) is not None
    assert starts.started == 501
    assert len(bouncer._recent) <= 50
    for future in starts.pending:
        future.cancel()


# --- pushgw_invalid_tokens: one row per dead token, for ever -----------------------------


async def test_invalid_token_records_past_retention_are_swept(store_url: str) -> None:
    """Nothing read or deleted `pushgw_invalid_tokens`: every dead token of a year stayed.
    The sweep deletes records older than `store.invalid_tokens_retention`, keeps the rest,
    and is idempotent (every worker runs it)."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import insert, select

    from gateway.config.sections import StoreConfig
    from gateway.core.store import Store, invalid_tokens
    from gateway.core.tokens import sweep_invalid_tokens

    retention = StoreConfig().invalid_tokens_retention
    assert retention == 30 * 86400.0
    store = Store(store_url)
    try:
        await store.upgrade()
        now = datetime.now(UTC)
        rows = [
            {
                "plugin": "p",
                "app_id": "a",
                "token_hash": f"{n:064x}",
                "provider": "fcm",
                "reason": "UNREGISTERED",
                "invalidated_at": now - timedelta(days=days),
            }
            for n, days in enumerate([400, 31, 29, 0])
        ]
        async with store.engine.begin() as conn:
            await conn.execute(insert(invalid_tokens), rows)
        assert await sweep_invalid_tokens(store, retention) == 2
        assert await sweep_invalid_tokens(store, retention) == 0
        async with store.engine.connect() as conn:
            left = (await conn.execute(select(invalid_tokens.c.token_hash))).scalars().all()
        assert sorted(left) == [f"{2:064x}", f"{3:064x}"]
    finally:
        await store.close()
