"""Idempotency review: retries and duplicates from chat servers, relays and operators
(identical registrations, re-run retires, Marmot events from several relays) neither
lose nor needlessly duplicate anything, on SQLite and PostgreSQL where it matters."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import func, select

from gateway.cli import _load
from gateway.cli import main as pushgw
from gateway.context import CommandContext
from gateway.token_commands import cmd_tokens_retire
from plugins.marmot.keys import ServerKey
from plugins.zulip import repo
from plugins.zulip.tables import e2ee_devices, legacy_devices, realms, servers
from tests.marmot.helpers import apns_device, chunk_for
from tests.marmot.test_service import Clock as MarmotClock
from tests.marmot.test_service import Harness as MarmotHarness
from tests.marmot.test_service import trigger as marmot_trigger
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env, apns_token, fcm_token

db_env = zulip_fixtures.db_env
sims = zulip_fixtures.sims


def _dead_line(env: Env, token: str, last_seen: float) -> str:
    return json.dumps(
        {
            "plugin": "zulip",
            "app_id": "android",
            "provider": "fcm",
            "token_hash": env.context.token_hash(token),
            "reason": "UNREGISTERED",
            "failures": 1,
            "last_seen": last_seen,
        }
    )


GUARD = 60.0  # seconds; only against hangs, never asserted on


async def _retire(
    env: Env, tmp_path: Path, lines: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    dead = tmp_path / "dead-tokens.jsonl"
    dead.write_text("".join(line + "\n" for line in lines))
    config = tmp_path / "retire.yaml"
    config.write_text(yaml.safe_dump(env.harness.config))
    status = await asyncio.to_thread(pushgw, ["tokens", "retire", str(dead), "-c", str(config)])
    out, err = capsys.readouterr()
    return status, out, err


async def test_retire_again_says_the_e2ee_registration_is_already_gone(
    db_env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator re-runs `pushgw tokens retire` with the same file: the E2EE
    registration the first run expired is not "matched" again (it is expired, kept only
    until gc): the second summary says the token matched no registration."""
    env = db_env
    server, realm_uuid = await env.ready_server()
    token = fcm_token()
    status, body = await server.e2ee_register(realm_uuid, token, "fcm", ios_app_id=None)
    assert status == 200, body
    lines = [_dead_line(env, token, time.time() + 60)]
    status, out, err = await _retire(env, tmp_path, lines, capsys)
    assert status == 0, err
    assert out.startswith("retired 1 token in ") and "matched no registration" not in out, out
    status, out, err = await _retire(env, tmp_path, lines, capsys)
    assert status == 0, err
    assert out.startswith("retired 1 token in ") and out.endswith(
        "; 1 matched no registration\n"
    ), out
    assert "1 token matched no registration of their plugin" in err


# SQLite has one writer at a time: node B would wait for node A's write lock (held
# here by the test), so the overlap inside the hook exists on PostgreSQL only.
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_two_nodes_retiring_one_file_at_once_both_succeed(
    db_env: Env,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two gateway nodes sharing one database run `pushgw tokens retire` on the same file
    at once. Node A is held inside its hook's open transaction (its rows updated, not
    committed) until node B has started forgetting the same token: neither errors, both
    exit 0, and every registration of the file is gone exactly once."""
    env = db_env
    server, realm_uuid = await env.ready_server()
    tokens = [fcm_token() for _ in range(3)]
    for token in tokens:
        status, body = await server.e2ee_register(realm_uuid, token, "fcm", ios_app_id=None)
        assert status == 200, body
    legacy = apns_token()
    status, body = await server.legacy_register(legacy, 1, user_uuid="u-1")
    assert status == 200, body
    lines = [_dead_line(env, token, time.time() + 60) for token in tokens]
    lines.append(
        json.dumps(
            {
                "plugin": "zulip",
                "app_id": "ios",
                "provider": "apns",
                "token_hash": env.context.token_hash(legacy),
                "reason": "Unregistered",
                "last_seen": time.time() + 60,
            }
        )
    )
    dead = tmp_path / "dead-tokens.jsonl"
    dead.write_text("".join(sorted(line + "\n" for line in lines)))
    config = tmp_path / "retire.yaml"
    config.write_text(yaml.safe_dump(env.harness.config))

    a_inside = asyncio.Event()  # node A expired the first token's rows, uncommitted
    b_arrived = asyncio.Event()  # node B is about to expire the same rows
    real_expire = repo.expire_e2ee_by_token
    calls = 0

    async def expire(conn: Any, *args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:  # node A, first token
            done = await real_expire(conn, *args, **kwargs)
            a_inside.set()
            await asyncio.wait_for(b_arrived.wait(), GUARD)
            return done
        if not b_arrived.is_set():  # node B, first token: A holds it
            b_arrived.set()
        return await real_expire(conn, *args, **kwargs)

    monkeypatch.setattr(repo, "expire_e2ee_by_token", expire)

    async def node(wait: asyncio.Event | None) -> int:
        if wait is not None:
            await asyncio.wait_for(wait.wait(), GUARD)
        args = argparse.Namespace(file=str(dead), config=str(config))
        context = CommandContext(args.config, lambda _path: _load(args))
        return await cmd_tokens_retire(args, context)

    statuses = await asyncio.wait_for(asyncio.gather(node(None), node(a_inside)), GUARD)
    out, err = capsys.readouterr()
    assert statuses == [0, 0], err
    assert "not retired" not in out + err
    assert out.count("retired 4 tokens in ") == 2, out
    async with env.engine.connect() as conn:
        live = await conn.scalar(
            select(func.count())
            .select_from(e2ee_devices)
            .where(e2ee_devices.c.expired_at.is_(None))
        )
        kept = await conn.scalar(select(func.count()).select_from(legacy_devices))
    assert (live, kept) == (0, 0)


# --- zulip: a server's retries of its registrations -----------------------------------


async def _count(env: Env, table: Any) -> int:
    async with env.engine.connect() as conn:
        return int(await conn.scalar(select(func.count()).select_from(table)) or 0)


async def test_identical_registrations_at_once_make_one_row_each(db_env: Env) -> None:
    """A Zulip server retrying after a timeout while its first request still runs: the
    same server/register, server/analytics, e2ee/register and push/register twice at
    once each get 200, and each makes one row."""
    env = db_env
    server = env.server()
    first, second = await asyncio.gather(server.try_register(), server.try_register())
    assert {first[0], second[0]} == {200}, (first, second)
    assert sorted([first[1]["created"], second[1]["created"]]) == [False, True]
    realm_uuid = str(uuid.uuid4())
    uploads = await asyncio.gather(
        *(server.analytics([zulip_fixtures.realm_dict(realm_uuid)]) for _ in range(2))
    )
    assert [status for status, _ in uploads] == [200, 200], uploads
    assert all(body["realms"][realm_uuid]["can_push"] for _, body in uploads)
    token = apns_token()
    answers = await asyncio.gather(*(server.e2ee_register(realm_uuid, token) for _ in range(2)))
    assert [status for status, _ in answers] == [200, 200], answers
    legacy = fcm_token()
    answers = await asyncio.gather(
        *(server.legacy_register(legacy, 2, user_uuid="u-1", user_id=7) for _ in range(2))
    )
    assert [status for status, _ in answers] == [200, 200], answers
    assert await _count(env, servers) == 1
    assert await _count(env, realms) == 1
    assert await _count(env, e2ee_devices) == 1
    assert await _count(env, legacy_devices) == 1


# --- marmot: one wrap from several relays ---------------------------------------------


@pytest.fixture
def marmot_key() -> ServerKey:
    return ServerKey.generate()


async def test_copies_from_several_relays_take_the_global_limit_once(marmot_key: ServerKey) -> None:
    """Every inbox relay delivers each wrap; the copies come in before the first one is
    unwrapped (they arrive within milliseconds). The global limit is charged once per
    wrap (docs/marmot.md): with a budget of two wraps, two triggers each delivered by
    three relays are both pushed, instead of the copies spending the second's token."""
    h = MarmotHarness(
        marmot_key,
        MarmotClock(),
        inbox_relays=["wss://a.invalid", "wss://b.invalid", "wss://c.invalid"],
        rate_limits={"global": {"per_minute": 2, "per_hour": 100}},
    )
    first, second = apns_device(), apns_device()
    wraps = [
        marmot_trigger(marmot_key, [chunk_for(marmot_key, device)]) for device in (first, second)
    ]
    await h.service.start()
    try:
        for wrap in wraps:
            for relay in h.service.relays:
                h.service.on_event(relay, json.loads(wrap))
        await h.service.idle()
    finally:
        await h.service.stop()
    assert sorted(h.tokens()) == sorted([first.token, second.token])
    assert h.events("global_limit", "rate_limited") == 0
    assert h.events("seen", "duplicate") == 4  # two copies of each, never unwrapped
    assert h.events("trigger", "accepted") == 2


async def test_a_relay_resending_a_queued_wrap_is_not_queued_twice(marmot_key: ServerKey) -> None:
    """A relay that reconnects while the wrap it sent is still queued sends it again in
    its backfill: the identical copy takes neither a queue slot nor the global limit,
    and the wrap is pushed once; the pending copies are forgotten when it is done."""
    h = MarmotHarness(marmot_key, MarmotClock(), queue_size=1, concurrency=1)
    device = apns_device()
    wrap = json.loads(marmot_trigger(marmot_key, [chunk_for(marmot_key, device)]))
    await h.service.start()
    try:
        h.feed(wrap, dict(wrap))  # the queue holds one: the copy must not need a slot
        await h.service.idle()
        assert h.service._pending == {}
        h.feed(wrap)  # later: the seen-wrap cache
        await h.service.idle()
    finally:
        await h.service.stop()
    assert h.tokens() == [device.token]
    assert h.events("global_limit", "queue_full") == 0
    assert h.events("seen", "duplicate") == 2
