"""End to end with independent components: PyPI nostr-relay, nostr-sdk gift wraps, the simulators.

The gateway runs whole (GatewayHarness: store, dispatcher, receipts, the marmot service); triggers
are published to a real nostr-relay process and the APNs/FCM simulators say exactly which devices
were woken. Checklist items 11-14 of the spec.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.receipt_files import read_records
from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import make_rumor, verify_signature
from plugins.marmot.tokens import MARMOT_PUSH_V1, MIP05_V1, MIP05_V1_LEGACY

from .gw import MarmotGateway, marmot_gateway
from .helpers import (
    V_MARMOT,
    V_MIP05,
    Device,
    NostrRelayProcess,
    apns_device,
    chunk_for,
    content_of,
    decoy_for,
    fcm_device,
    our_wrap,
    padding_chunk,
    publish,
    publish_many,
    query,
    sdk_wrap,
    tags_for,
)
from .scripted_relay import ScriptedRelay
from .test_service import hostile

pytestmark = pytest.mark.slow


async def wait_pushed(gw: MarmotGateway, apns: int, fcm: int, timeout: float = 20.0) -> None:
    if apns:
        await gw.apns.wait_for_requests(apns, timeout)
    if fcm:
        await gw.fcm.wait_for_requests(fcm, timeout)
    await gw.service.idle()
    await asyncio.sleep(0.3)  # anything extra would show up now


def pushed_tokens(gw: MarmotGateway) -> list[str]:
    return sorted([r.token for r in gw.apns.requests] + [r.token or "" for r in gw.fcm.requests])


# Unwrap and decryption inline on the event loop (default), and in a worker process.
CRYPTO_MODES = pytest.mark.parametrize(
    "crypto", [{}, {"crypto_processes": 1}], ids=["inline", "worker-process"]
)


@CRYPTO_MODES
async def test_live_triggers_of_both_profiles_and_all_sizes(
    nostr_relay: NostrRelayProcess, tmp_path: Path, crypto: dict[str, Any]
) -> None:
    """1 and 19 chunks by nostr-sdk, 32 by our builder (nostr-sdk cannot), decoys and padding."""
    async with marmot_gateway(tmp_path, [nostr_relay.url], **crypto) as gw:
        key = gw.key
        expected: list[Device] = []
        # 1 chunk, marmot-push-v1, nostr-sdk
        one = apns_device()
        expected.append(one)
        wraps = [sdk_wrap(key, content_of([chunk_for(key, one)]), [V_MARMOT])]
        # 19 chunks, mip05-v1, nostr-sdk: 3 of ours, real tokens of other users, padding
        mine = [apns_device(), fcm_device(), fcm_device()]
        expected += mine
        chunks = [chunk_for(key, d, MIP05_V1) for d in mine]
        chunks += [decoy_for(fcm_device(), MIP05_V1) for _ in range(8)]
        chunks += [padding_chunk(MIP05_V1) for _ in range(8)]
        wraps.append(sdk_wrap(key, content_of(chunks), tags_for("mip05-v1")))
        # 32 chunks, marmot-push-v1: the seal is > 65,535 bytes, our builder
        many = [apns_device() for _ in range(4)] + [fcm_device() for _ in range(4)]
        expected += many
        chunks = [chunk_for(key, d) for d in many] + [padding_chunk() for _ in range(24)]
        big = our_wrap(key, content_of(chunks), [V_MARMOT])
        assert len(big) > 100_000
        wraps.append(big)
        # legacy 280-byte mip05 chunks
        legacy = fcm_device()
        expected.append(legacy)
        chunks = [chunk_for(key, legacy, MIP05_V1_LEGACY), padding_chunk(MIP05_V1_LEGACY)]
        wraps.append(sdk_wrap(key, content_of(chunks), [V_MIP05]))
        await publish_many(nostr_relay.url, wraps)

        n_apns = sum(1 for d in expected if d.platform == 1)
        await wait_pushed(gw, n_apns, len(expected) - n_apns)
        assert pushed_tokens(gw) == sorted(d.token for d in expected)
        for request in gw.apns.requests:
            assert request.status == 200
            assert request.headers["apns-push-type"] == "background"
            assert request.headers["apns-priority"] == "5"
            assert request.json == {"aps": {"content-available": 1}}
        for request in gw.fcm.requests:
            assert request.message["data"] == {"content_available": "true"}
            assert request.message["android"] == {"priority": "high"}
            assert "notification" not in request.message
        assert gw.metric("pushgw_marmot_chunks_total", profile="marmot-push-v1", result="ok") == 9
        assert gw.metric("pushgw_marmot_chunks_total", profile="mip05-v1", result="ok") == 4
        assert (
            gw.metric("pushgw_marmot_chunks_total", profile="mip05-v1", result="decrypt_failed")
            == 17
        )
        assert gw.metric("pushgw_marmot_events_total", stage="trigger", result="accepted") == 4
        assert gw.metric("pushgw_marmot_relays_connected") == 1

        ready = await gw.harness.client.get("/readyz")
        body = await ready.json()
        assert ready.status == 200 and body["services"] == {"marmot": True}
        metrics = await (await gw.harness.client.get("/metrics")).text()
        live = f'pushgw_marmot_relay_state{{relay="{nostr_relay.url}",state="live"}} 1.0'
        assert live in metrics


@CRYPTO_MODES
async def test_hostile_and_replayed_events_through_the_relay(
    nostr_relay: NostrRelayProcess, tmp_path: Path, crypto: dict[str, Any]
) -> None:
    """What a relay does carry (valid outer signature): each dropped at its stage, then a push."""
    async with marmot_gateway(tmp_path, [nostr_relay.url], max_age=3600, **crypto) as gw:
        key = gw.key
        now = int(time.time())
        events = {
            case: hostile(key, case, now)
            for case in (
                "seal_kind",
                "seal_tags",
                "rumor_pubkey_mismatch",
                "rumor_kind",
                "rumor_signed",
                "no_version",
                "bad_base64",
            )
        }
        events["stale"] = our_wrap(
            key, content_of([chunk_for(key, apns_device())]), [V_MARMOT], created_at=now - 3700
        )
        for event in events.values():
            assert await publish(nostr_relay.url, event) == ""
        dev = fcm_device()
        content = content_of([chunk_for(key, dev)])
        first = sdk_wrap(key, content, [V_MARMOT])
        assert await publish(nostr_relay.url, first) == ""
        await wait_pushed(gw, 0, 1)
        # replays: the same wrap again (the relay refuses a duplicate), and re-wrapped content
        assert "duplicate" in await publish(nostr_relay.url, first)
        assert await publish(nostr_relay.url, sdk_wrap(key, content, [V_MARMOT])) == ""
        assert await publish(nostr_relay.url, our_wrap(key, content, [V_MARMOT])) == ""
        await asyncio.sleep(0.5)
        await gw.service.idle()
        assert pushed_tokens(gw) == [dev.token]
        expected = {
            ("seal", "seal_kind"): 1,
            ("seal", "seal_tags"): 1,
            ("rumor", "rumor_pubkey_mismatch"): 1,
            ("rumor", "rumor_kind"): 1,
            ("rumor", "rumor_signed"): 1,
            ("profile", "no_version"): 1,
            ("content", "bad_base64"): 1,
            ("fresh", "stale"): 1,
            ("dedup", "duplicate"): 2,
        }
        for (stage, result), n in expected.items():
            assert gw.metric("pushgw_marmot_events_total", stage=stage, result=result) == n, result
        assert gw.service.ready()


async def test_a_killed_crypto_worker_is_replaced_and_nothing_is_lost(
    nostr_relay: NostrRelayProcess, tmp_path: Path
) -> None:
    async with marmot_gateway(tmp_path, [nostr_relay.url], crypto_processes=1) as gw:
        key = gw.key

        def trigger(device: Device) -> str:
            return our_wrap(key, content_of([chunk_for(key, device)]), [V_MARMOT])

        first, second = fcm_device(), apns_device()
        assert await publish(nostr_relay.url, trigger(first)) == ""
        await wait_pushed(gw, 0, 1)
        (pid,) = gw.service.crypto_worker_pids()
        os.kill(pid, signal.SIGKILL)
        assert await publish(nostr_relay.url, trigger(second)) == ""
        await wait_pushed(gw, 1, 1)
        assert pushed_tokens(gw) == sorted([first.token, second.token])
        (replacement,) = gw.service.crypto_worker_pids()
        assert replacement != pid
        assert gw.metric("pushgw_marmot_events_total", stage="internal", result="error") == 0


async def test_hostile_frames_do_not_break_the_listener(tmp_path: Path) -> None:
    """TEST DOUBLE relay: frames no real relay would forward. Each counted; the listener lives."""
    async with (
        ScriptedRelay() as relay,
        marmot_gateway(
            tmp_path, [relay.url], wait_live=False, publish_inbox_list=False, max_event_bytes=65_536
        ) as gw,
    ):
        req = await relay.expect("REQ")
        sub = req[1]
        assert req[2]["kinds"] == [1059] and req[2]["#p"] == [gw.key.pubkey_hex]
        assert req[2]["limit"] == 0
        await relay.send(["EOSE", sub])
        await gw.service.wait_live()
        key = gw.key
        now = int(time.time())
        good = json.loads(our_wrap(key, content_of([chunk_for(key, apns_device())]), [V_MARMOT]))
        bad_sig = dict(good, sig=("1" if good["sig"][0] == "0" else "0") + good["sig"][1:])
        wrong_kind = hostile(key, "wrap_kind", now)
        rumor_only = json.loads(make_rumor(key.pubkey_hex, 446, "", [V_MARMOT]).to_json())
        frames: list[Any] = [
            "not json at all",
            "{}",
            "[]",
            "[1,2,3]",
            ["EVENT", sub, "a string"],
            ["EVENT", "some-other-sub", good],
            ["EVENT", sub, bad_sig],
            ["EVENT", sub, wrong_kind],
            ["EVENT", sub, rumor_only],
            ["EVENT", sub, {"id": good["id"], "kind": 1059, "content": "x" * 70_000}],
            ["EVENT", sub, dict(good, tags=[["p", key.pubkey_hex, "extra"]])],
            ["NOTICE", "\x1b[31mred\nmultiline " + "x" * 10_000],
            ["OK", "ff" * 32, True, ""],
            ["EOSE", "unknown"],
            ["UNKNOWN"],
            '["EVENT","' + sub + '",{"id":"a","id":"b"}]',
        ]
        for frame in frames:
            await relay.send(frame)
        dev = apns_device()
        last = our_wrap(key, content_of([chunk_for(key, dev)]), [V_MARMOT])
        await relay.send(f'["EVENT","{sub}",{last}]')
        await gw.apns.wait_for_requests(1, 10)
        await gw.service.idle()
        assert [r.token for r in gw.apns.requests] == [dev.token]
        m = gw.metric
        assert m("pushgw_marmot_events_total", stage="frame", result="malformed") == 6
        assert m("pushgw_marmot_events_total", stage="frame", result="oversize") == 1
        assert m("pushgw_marmot_events_total", stage="wrap", result="wrap_bad_sig") == 1
        assert m("pushgw_marmot_events_total", stage="wrap", result="wrap_kind") == 1
        assert m("pushgw_marmot_events_total", stage="wrap", result="wrap_malformed") == 1
        assert m("pushgw_marmot_events_total", stage="wrap", result="wrap_bad_id") == 1
        assert m("pushgw_marmot_events_total", stage="internal", result="error") == 0
        assert gw.service.relays[0].connects == 1  # never dropped the connection
        assert gw.service.ready()


async def test_auth_required_gets_a_nip42_answer_and_a_resubscription(tmp_path: Path) -> None:
    async with (
        ScriptedRelay() as relay,
        marmot_gateway(tmp_path, [relay.url], wait_live=False, publish_inbox_list=False) as gw,
    ):
        first = await relay.expect("REQ")
        await relay.send(["AUTH", "challenge-123"])
        proactive = await relay.expect("AUTH")
        await relay.send(["OK", proactive[1]["id"], True, ""])
        await relay.send(["CLOSED", first[1], "auth-required: this relay only serves its users"])
        answer = (await relay.expect("AUTH"))[1]
        assert answer["kind"] == 22242 and answer["pubkey"] == gw.key.pubkey_hex
        assert answer["tags"] == [["relay", relay.url], ["challenge", "challenge-123"]]
        assert verify_signature(answer["pubkey"], answer["id"], answer["sig"])
        await relay.send(["OK", answer["id"], True, ""])
        again = await relay.expect("REQ")
        assert again[1] != first[1] and again[2]["#p"] == [gw.key.pubkey_hex]
        assert "limit" not in again[2]  # a resubscription backfills the window
        await relay.send(["EOSE", again[1]])
        await gw.service.wait_live()
        status = gw.service.status()["relays"][relay.url]
        assert status["authenticated"] is True and status["state"] == "live"


async def test_inbox_list_published_once_and_restart_rewakes_nobody(
    nostr_relay: NostrRelayProcess, tmp_path: Path
) -> None:
    key = ServerKey.generate()
    dev = apns_device()
    async with marmot_gateway(tmp_path / "a", [nostr_relay.url], key=key) as gw:
        for _ in range(100):
            if gw.service.inbox_result is not None:
                break
            await asyncio.sleep(0.05)
        assert gw.service.inbox_result.published
        assert gw.metric("pushgw_marmot_inbox_list_published_total") == 1
        await publish(nostr_relay.url, sdk_wrap(key, content_of([chunk_for(key, dev)]), [V_MARMOT]))
        await wait_pushed(gw, 1, 0)
    lists = await query(nostr_relay.url, {"kinds": [10050], "authors": [key.pubkey_hex]})
    assert len(lists) == 1 and lists[0]["tags"] == [["relay", nostr_relay.url]]
    assert lists[0]["content"] == ""
    # the gateway restarts: same relays, same key
    async with marmot_gateway(tmp_path / "b", [nostr_relay.url], key=key) as gw2:
        for _ in range(100):
            if gw2.service.inbox_result is not None:
                break
            await asyncio.sleep(0.05)
        assert not gw2.service.inbox_result.published  # unchanged: not published again
        await asyncio.sleep(0.5)
        assert gw2.apns.requests == []  # the stored trigger is not pushed again (live-only start)
        # nostr-relay 1.14 sends stored events despite "limit":0; the client ignores them
        assert gw2.metric("pushgw_marmot_events_total", stage="frame", result="unrequested_stored")
    assert await query(nostr_relay.url, {"kinds": [10050], "authors": [key.pubkey_hex]}) == lists


async def test_nothing_linkable_on_disk_or_in_receipts(
    nostr_relay: NostrRelayProcess, tmp_path: Path
) -> None:
    """Checklist 14: after real pushes, no token, content, content hash or event id on disk."""
    import hashlib
    import logging

    logging.getLogger().setLevel(logging.DEBUG)
    gateway_dir = tmp_path / "gw"
    gateway_dir.mkdir()
    key = ServerKey.generate()
    devices = [apns_device(), fcm_device()]
    chunks = [chunk_for(key, d, MARMOT_PUSH_V1) for d in devices]
    raw = b"".join(chunks)
    wrap = json.loads(sdk_wrap(key, content_of(chunks), [V_MARMOT]))
    async with marmot_gateway(gateway_dir, [nostr_relay.url], key=key) as gw:
        await publish(nostr_relay.url, wrap)
        await wait_pushed(gw, 1, 1)
    files = [p for p in gateway_dir.rglob("*") if p.is_file()]
    receipts = [p for p in files if "receipts" in p.parts]
    assert receipts, "the receipts sink wrote nothing"
    lines = [record for p in receipts for record in read_records(p)]
    assert len(lines) == 2 and all(r["plugin"] == "marmot" for r in lines)
    assert all(r.get("token_hash") is None for r in lines)
    secrets_ = [
        *(d.token for d in devices),
        *(d.raw.hex() for d in devices),
        wrap["id"],
        hashlib.sha256(raw).hexdigest(),
        content_of(chunks)[:64],
    ]
    for path in files:
        if path.suffix in (".p8", ".json") and "receipts" not in path.parts:
            continue  # credentials the test wrote for the simulators
        if path.name == "marmot-server.key":
            continue
        data = path.read_bytes()
        if path in receipts:  # Parquet compresses: look at the values too
            data += json.dumps(read_records(path)).encode()
        for secret in secrets_:
            assert secret.encode() not in data, (path.name, secret[:8])
