"""Data-retention review: what pushgw keeps about a device or a person, and its erasure.

Each test checks a row of docs/privacy.md ("Data kept"): after the erasure path the page
names, nothing about the device (its token, the token's hashes) or the person (a server
administrator's address) is left in any table of the database, except what the page
says stays.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, inspect, select, text, update

from gateway.context import TokenHasher
from gateway.core.store import Store, invalid_tokens
from gateway.core.tokens import sweep_invalid_tokens
from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness
from plugins.zulip import gc, repo
from plugins.zulip.tables import e2ee_devices, realms, servers
from plugins.zulip.tables import metadata as zulip_metadata
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env, apns_token, fcm_token, zulip_config

db_env = zulip_fixtures.db_env
sims = zulip_fixtures.sims

ROOT = Path(__file__).resolve().parent.parent
PRIVACY = ROOT / "docs" / "privacy.md"
RETENTION = timedelta(days=30).total_seconds()
EMAIL = "admin@example.org"  # what ZulipServer.register sends as contact_email


async def _everything(engine: Any) -> str:
    """Every value of every row of every table, as one text to search."""
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda sync: inspect(sync).get_table_names())
        rows = [
            repr(tuple(row))
            for name in names
            for row in (await conn.execute(text(f'SELECT * FROM "{name}"'))).all()
        ]
    return "\n".join(rows)


def _traces(env: Env, token: str, apns: bool) -> list[str]:
    """The forms of `token` a table could hold: itself, keyed hash, comparison key."""
    return [token, token.lower(), env.context.token_hash(token), repo.token_key(token, apns)]


async def _assert_forgotten(env: Env, *values: str) -> None:
    stored = (await _everything(env.engine)).lower()
    left = [v for v in values if v.lower() in stored]
    assert not left, "still stored after erasure"


async def _age(env: Env, table: Any, column: Any, days: int = 31) -> None:
    """Move a date back past the retention, as if that much time had passed."""
    async with env.engine.begin() as conn:
        await conn.execute(
            update(table)
            .where(column.is_not(None))
            .values({column.name: repo.now_utc() - timedelta(days=days)})
        )


async def test_legacy_unregister_and_unregister_all_leave_nothing_of_the_tokens(
    db_env: Env,
) -> None:
    env = db_env
    server = env.server()
    await server.register()
    ios, android = apns_token(), fcm_token()
    assert (await server.legacy_register(ios, 1, user_id=7))[0] == 200
    assert (await server.legacy_register(android, 2, user_id=7))[0] == 200
    data = {"token": ios, "token_kind": "1", "user_id": "7"}
    assert (await server.form("push/unregister", data))[0] == 200
    await _assert_forgotten(env, *_traces(env, ios, True))
    assert android in await _everything(env.engine)  # the other device is still registered
    assert (await server.form("push/unregister/all", {"user_id": "7"}))[0] == 200
    await _assert_forgotten(env, *_traces(env, android, False))


async def test_server_deactivation_then_gc_leaves_neither_tokens_nor_its_contact(
    db_env: Env,
) -> None:
    env = db_env
    server, realm = await env.ready_server()
    ios, android = apns_token(), fcm_token()
    assert (await server.e2ee_register(realm, ios))[0] == 200
    assert (await server.legacy_register(android, 2, user_id=3, realm_uuid=realm))[0] == 200
    assert EMAIL in await _everything(env.engine)
    assert await server.form("server/deactivate") == (200, {"result": "success", "msg": ""})
    # Within the retention, gc keeps everything (the operator may still look into it).
    await gc.collect(env.engine, RETENTION)
    assert ios in await _everything(env.engine)
    await _age(env, servers, servers.c.deactivated_at)
    counts = await gc.collect(env.engine, RETENTION)
    assert (counts.e2ee_of_deactivated_servers, counts.legacy_of_deactivated_servers) == (1, 1)
    await _assert_forgotten(env, *_traces(env, ios, True), *_traces(env, android, False), EMAIL)
    # What docs/privacy.md says stays: the server's row (UUID, hostname, key hash), so that
    # its calls keep failing as deactivated.
    async with env.engine.connect() as conn:
        row = (await conn.execute(select(servers).where(servers.c.uuid == server.uuid))).one()
    assert row.deactivated_at is not None and row.contact_email == ""
    status, body = await server.form("push/unregister/all", {"user_id": "3"})
    assert status == 401 and "deactivated" in body["msg"]


async def test_realm_deletion_then_gc_leaves_nothing_of_its_devices(db_env: Env) -> None:
    env = db_env
    server, realm = await env.ready_server()
    ios = apns_token()
    assert (await server.e2ee_register(realm, ios))[0] == 200
    assert (await server.analytics([]))[0] == 200  # the realm is no longer uploaded
    await _age(env, realms, realms.c.locally_deleted_at)
    counts = await gc.collect(env.engine, RETENTION)
    assert counts.e2ee_of_gone_realms == 1
    await _assert_forgotten(env, *_traces(env, ios, True))


async def test_expired_e2ee_registration_is_kept_until_the_retention_then_gone(
    db_env: Env,
) -> None:
    env = db_env
    server, realm = await env.ready_server()
    ios = apns_token()
    assert (await server.e2ee_register(realm, ios))[0] == 200
    async with env.engine.begin() as conn:
        await repo.expire_e2ee_by_token(conn, ios, apns=True)
    await gc.collect(env.engine, RETENTION)
    assert ios in await _everything(env.engine)  # expired today: within the retention
    await _age(env, e2ee_devices, e2ee_devices.c.expired_at)
    assert (await gc.collect(env.engine, RETENTION)).e2ee_expired == 1
    await _assert_forgotten(env, *_traces(env, ios, True))


class _Seen(logging.Handler):
    """Sets an event when a record whose message matches `pattern` is emitted."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.pattern.search(record.getMessage()):
            self.event.set()


async def test_gc_runs_by_default_when_the_gateway_starts(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> None:
    """With no `gc_interval` in the file, a restarted gateway erases what is past the
    retention: nobody has to remember to schedule `pushgw zulip gc`."""
    apns, fcm = sims
    async with GatewayHarness(zulip_config(apns, fcm, tmp_path)) as harness:
        env = Env(harness, apns, fcm)
        server, realm = await env.ready_server()
        ios = apns_token()
        assert (await server.e2ee_register(realm, ios))[0] == 200
        traces = _traces(env, ios, True)
        assert (await server.form("server/deactivate"))[0] == 200
        await _age(env, servers, servers.c.deactivated_at)
    seen = _Seen(r"zulip gc: deleted 1 registrations")
    logger = logging.getLogger("plugins.zulip.gc")
    logger.addHandler(seen)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with GatewayHarness(zulip_config(apns, fcm, tmp_path)) as harness:
            await asyncio.wait_for(seen.event.wait(), 30)
            await _assert_forgotten(Env(harness, apns, fcm), *traces, EMAIL)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)


async def test_a_failed_gc_is_tried_again_soon_not_a_day_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nodes and workers that start together collect at once; one that fails (a lock
    timeout) shows `gc: failing` in /readyz until gc succeeds, so it must not wait a whole
    gc_interval."""
    calls: list[dict[str, str]] = []  # the service's status as each run starts
    retried = asyncio.Event()

    async def collect(_engine: Any, _older_than: float) -> repo.GcCounts:
        calls.append(service.status())
        if len(calls) == 1:
            raise TimeoutError
        retried.set()
        return repo.GcCounts()

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(gc, "GC_RETRY", 0.01)
    service = gc.ZulipService(lambda: None, 86400.0, 30 * 86400.0)  # type: ignore[arg-type,return-value]
    await service.start()
    try:
        await asyncio.wait_for(retried.wait(), 30)
        # the retry found the first run's failure shown in /readyz, the node still ready
        assert calls == [{"gc": "ok"}, {"gc": "failing"}]
        assert service.ready()
    finally:
        await service.stop()


async def test_invalid_token_records_are_swept_after_the_retention(store: Store) -> None:
    await store.upgrade()
    now = datetime.now(UTC)
    old, fresh = secrets.token_hex(32), secrets.token_hex(32)
    async with store.engine.begin() as conn:
        for token_hash, age in ((old, timedelta(days=31)), (fresh, timedelta(days=1))):
            await conn.execute(
                insert(invalid_tokens).values(
                    plugin="matrix",
                    app_id="ios",
                    token_hash=token_hash,
                    provider="apns",
                    reason="Unregistered",
                    invalidated_at=now - age,
                )
            )
    assert await sweep_invalid_tokens(store, RETENTION) == 1
    async with store.engine.connect() as conn:
        left = (await conn.execute(select(invalid_tokens.c.token_hash))).scalars().all()
    assert left == [fresh]


def test_token_hash_is_keyed_and_a_new_key_unlinks_old_hashes() -> None:
    token = secrets.token_hex(32)
    key = secrets.token_bytes(32)
    digest = TokenHasher(key)(token)
    assert digest == hmac.new(key, token.encode(), hashlib.sha256).hexdigest()
    assert digest != hashlib.sha256(token.encode()).hexdigest()  # not the bare hash
    assert TokenHasher(secrets.token_bytes(32))(token) != digest  # rotation: another hash


@pytest.mark.parametrize("key", [None, "an-operator-secret"])
async def test_the_public_default_hmac_key_is_warned_about(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    key: str | None,
) -> None:
    apns, fcm = sims
    config = zulip_config(apns, fcm, tmp_path)
    if key is None:
        del config["receipts"]["hmac_key"]
    else:
        config["receipts"]["hmac_key"] = key
    caplog.set_level(logging.WARNING, logger="gateway.app")
    async with GatewayHarness(config):
        pass
    warned = [r for r in caplog.records if "receipts.hmac_key is not set" in r.getMessage()]
    assert len(warned) == (1 if key is None else 0)
    assert all(r.levelno == logging.WARNING for r in warned)


def test_every_table_is_in_the_data_kept_page() -> None:
    page = PRIVACY.read_text("utf-8")
    assert "## Data kept" in page
    assert "(docs/privacy.md)" in (ROOT / "README.md").read_text("utf-8")
    tables = [invalid_tokens.name, *zulip_metadata.tables]
    missing = [name for name in tables if f"`{name}`" not in page]
    assert not missing, f"tables not in docs/privacy.md: {missing}"
    for documented in ("receipts.hmac_key", "invalid_tokens_retention", "gc_interval"):
        assert documented in page
