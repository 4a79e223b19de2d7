"""The service pipeline without relays: events are fed as a relay client would deliver them.

Checks the order of spec section 5 (frame, seen, global limiter, unwrap, profile, dedup, chunks),
the limiters of section 8, dedup of section 7 and the dispatch of section 9 (Push objects handed to
a fake dispatcher). Real relays and simulators are in test_integration.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from gateway.api import Metrics, Outcome, Push, Receipt
from plugins.marmot import nip44
from plugins.marmot.config import MarmotConfig
from plugins.marmot.keys import ServerKey
from plugins.marmot.metrics import MarmotMetrics
from plugins.marmot.nostr import make_rumor, sign_event
from plugins.marmot.service import MarmotService
from plugins.marmot.tokens import MARMOT_PUSH_V1, MIP05_V1, MIP05_V1_LEGACY, encrypt_token

from .conftest import MARMOT, VECTOR_NOW
from .helpers import (
    V_MARMOT,
    V_MIP05,
    Device,
    apns_device,
    chunk_for,
    content_of,
    decoy_for,
    fcm_device,
    our_wrap,
    padding_chunk,
    sdk_wrap,
    tags_for,
)

NOW = 1_800_000_000


class Clock:
    def __init__(self, wall: float = NOW) -> None:
        self.wall = wall
        self.mono = 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class Harness:
    """A started service with a recording fake dispatcher."""

    def __init__(self, key: ServerKey, clock: Clock, **overrides: Any) -> None:
        self.key = key
        self.clock = clock
        self.gateway_metrics = Metrics()
        self.registry = self.gateway_metrics.registry
        self.pushes: list[Push] = []
        self.outcome: Callable[[Push], tuple[Outcome, str | None, int | None]] = lambda p: (
            Outcome.OK,
            None,
            200,
        )
        section: dict[str, Any] = {
            "server_secret_key": key.secret.hex(),
            "inbox_relays": ["wss://relay.invalid"],
            "apps": {
                "ios": {"type": "apns", "certfile": __file__},
                "android": {"type": "fcm", "service_account_file": __file__},
            },
            "apns": {"app": "ios"},
            "fcm": {"app": "android"},
            "queue_size": 5000,
        }
        section.update(overrides)
        self.config = MarmotConfig.model_validate(section)
        self.metrics = MarmotMetrics(self.gateway_metrics)
        self.service = MarmotService(
            self.config,
            self.metrics,
            self._submit,
            clock=lambda: clock.wall,
            monotonic=lambda: clock.mono,
            connect_relays=False,
        )

    def _submit(self, push: Push) -> asyncio.Future[Receipt]:
        self.pushes.append(push)
        outcome, reason, status = self.outcome(push)
        fut: asyncio.Future[Receipt] = asyncio.get_running_loop().create_future()
        fut.set_result(
            Receipt(
                push_id=push.id,
                plugin=push.plugin,
                app_id=push.app_id,
                provider=None,
                outcome=outcome,
                status=status,
                reason=reason,
                attempts=1,
                latency=0.0,
                finished_at=time.time(),
                token_hash=None,
            )
        )
        return fut

    def feed(self, *events: str | dict[str, Any]) -> None:
        relay = self.service.relays[0]
        for event in events:
            self.service.on_event(relay, json.loads(event) if isinstance(event, str) else event)

    async def run(self, *events: str | dict[str, Any]) -> None:
        self.feed(*events)
        await self.service.idle()
        await asyncio.sleep(0)  # receipt callbacks

    async def run_once(self, *events: str | dict[str, Any]) -> None:
        """Start the service, run `events` through it, stop it."""
        await self.service.start()
        try:
            await self.run(*events)
        finally:
            await self.service.stop()

    def events(self, stage: str, result: str) -> float:
        v = self.registry.get_sample_value(
            "pushgw_marmot_events_total", {"stage": stage, "result": result}
        )
        return v or 0.0

    def chunks(self, result: str, profile: str = "marmot-push-v1") -> float:
        v = self.registry.get_sample_value(
            "pushgw_marmot_chunks_total", {"profile": profile, "result": result}
        )
        return v or 0.0

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def tokens(self) -> list[str]:
        return [p.token for p in self.pushes]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def key() -> ServerKey:
    return ServerKey.generate()


@pytest.fixture
async def h(key: ServerKey, clock: Clock) -> Any:
    harness = Harness(key, clock)
    await harness.service.start()
    yield harness
    await harness.service.stop()


def trigger(key: ServerKey, chunks: list[bytes], profile: str = "marmot-push-v1", **kw: Any) -> str:
    kw.setdefault("created_at", NOW)
    return our_wrap(key, content_of(chunks), tags_for(profile), **kw)


# ---- happy paths and dispatch ---------------------------------------------------------------


@pytest.mark.parametrize("profile", ["marmot-push-v1", "mip05-v1"])
async def test_derived_gift_wrap_vectors(profile: str, server_key: ServerKey) -> None:
    """Checklist 4: exactly one silent APNs push to cdcd..cd; the padding chunk is counted."""
    clock = Clock(VECTOR_NOW)
    h = Harness(server_key, clock)
    await h.run_once(MARMOT["derived_gift_wraps"][profile]["gift_wrap"])
    assert [f"/3/device/{p.token}" for p in h.pushes] == [
        MARMOT["derived_gift_wraps"][profile]["expected_results"][0]["apns_path"]
    ]
    push = h.pushes[0]
    assert push.token == "cd" * 32
    assert push.app_id == "ios" and push.plugin == "marmot"
    assert push.payload == {"aps": {"content-available": 1}}
    assert (push.apns.push_type, push.apns.priority) == ("background", 5)
    assert push.policy.persist_token_hash is False
    assert push.policy.deadline == 30.0
    assert h.chunks("ok", profile) == 1 and h.chunks("decrypt_failed", profile) == 1
    assert h.events("trigger", "accepted") == 1


@pytest.mark.parametrize("profile", ["marmot-push-v1", "mip05-v1"])
async def test_nostr_sdk_wrap_with_decoys_and_padding(
    h: Harness, key: ServerKey, profile: str
) -> None:
    fmt = MARMOT_PUSH_V1 if profile == "marmot-push-v1" else MIP05_V1
    ios, android = apns_device(), fcm_device()
    chunks = [
        chunk_for(key, ios, fmt),
        padding_chunk(fmt),
        chunk_for(key, android, fmt),
        decoy_for(apns_device(), fmt),
    ]
    await h.run(sdk_wrap(key, content_of(chunks), tags_for(profile), created_at=NOW))
    assert sorted(h.tokens()) == sorted([ios.token, android.token])
    fcm = next(p for p in h.pushes if p.app_id == "android")
    assert fcm.payload == {"android": {"priority": "high"}, "data": {"content_available": "true"}}
    assert h.chunks("ok", profile) == 2 and h.chunks("decrypt_failed", profile) == 2
    assert h.sample("pushgw_marmot_pushes_total", platform="apns", result="ok") == 1
    assert h.sample("pushgw_marmot_pushes_total", platform="fcm", result="ok") == 1
    assert h.sample("pushgw_marmot_chunks_per_trigger_count") == 1


async def test_legacy_280_byte_chunks(h: Harness, key: ServerKey) -> None:
    dev = apns_device()
    chunks = [chunk_for(key, dev, MIP05_V1_LEGACY), padding_chunk(MIP05_V1_LEGACY)]
    await h.run(our_wrap(key, content_of(chunks), [V_MIP05], created_at=NOW))
    assert h.tokens() == [dev.token]


async def test_same_device_twice_in_one_trigger_is_pushed_once(h: Harness, key: ServerKey) -> None:
    dev = fcm_device()
    await h.run(trigger(key, [chunk_for(key, dev), chunk_for(key, dev)]))
    assert h.tokens() == [dev.token]
    assert h.chunks("ok") == 2


async def test_plaintext_checks_skip_only_the_bad_chunk(h: Harness, key: ServerKey) -> None:
    """Checklist 10: platform 3, token_len 0, non-UTF-8 FCM: skipped; the rest is pushed."""
    good = apns_device()
    chunks = [
        encrypt_token(key.pubkey, 3, b"x" * 32, MARMOT_PUSH_V1),
        encrypt_token(key.pubkey, 1, b"", MARMOT_PUSH_V1),
        encrypt_token(key.pubkey, 2, b"\xff\xfe not utf-8", MARMOT_PUSH_V1),
        chunk_for(key, good),
    ]
    await h.run(trigger(key, chunks))
    assert h.tokens() == [good.token]
    for result in ("invalid_platform", "invalid_length", "invalid_encoding", "ok"):
        assert h.chunks(result) == 1, result


async def test_unrouted_platform_is_counted_not_pushed(key: ServerKey, clock: Clock) -> None:
    h = Harness(key, clock, apps={"ios": {"type": "apns", "certfile": __file__}}, fcm={"app": None})
    await h.run_once(trigger(key, [chunk_for(key, fcm_device())]))
    assert h.pushes == []
    assert h.sample("pushgw_marmot_pushes_total", platform="fcm", result="no_app") == 1


async def test_alert_mode(key: ServerKey, clock: Clock) -> None:
    h = Harness(
        key,
        clock,
        apns={
            "app": "ios",
            "mode": "alert",
            "alert_title": "T",
            "alert_body": "B",
            "collapse_id": "marmot",
            "custom": {"k": "v"},
        },
    )
    await h.run_once(trigger(key, [chunk_for(key, apns_device())]))
    (push,) = h.pushes
    assert push.payload == {
        "k": "v",
        "aps": {"alert": {"title": "T", "body": "B"}, "mutable-content": 1, "sound": "default"},
    }
    assert (push.apns.push_type, push.apns.priority, push.apns.collapse_id) == (
        "alert",
        10,
        "marmot",
    )


async def test_dead_tokens_and_config_errors_are_counted(h: Harness, key: ServerKey) -> None:
    answers = {
        "Unregistered": (Outcome.TOKEN_INVALID, "Unregistered", 410),
        "DeviceTokenNotForTopic": (Outcome.TOKEN_INVALID, "DeviceTokenNotForTopic", 400),
        "UNREGISTERED": (Outcome.TOKEN_INVALID, "UNREGISTERED", 404),
    }
    devices = {
        "Unregistered": apns_device(),
        "DeviceTokenNotForTopic": apns_device(),
        "UNREGISTERED": fcm_device(),
    }
    by_token = {d.token: answers[name] for name, d in devices.items()}
    h.outcome = lambda p: by_token[p.token]
    await h.run(trigger(key, [chunk_for(key, d) for d in devices.values()]))
    assert h.sample("pushgw_marmot_dead_tokens_total", platform="apns") == 1
    assert h.sample("pushgw_marmot_dead_tokens_total", platform="fcm") == 1
    assert h.sample("pushgw_marmot_config_errors_total", reason="DeviceTokenNotForTopic") == 1
    assert h.sample("pushgw_marmot_pushes_total", platform="apns", result="token_invalid") == 2


# ---- drops at each stage ----------------------------------------------------------------------


def hostile(key: ServerKey, case: str, now: int = NOW) -> str | dict[str, Any]:
    """An event that must be dropped at the stage ``HOSTILE[case]`` names (rumor time ``now``)."""
    sender = ServerKey.generate()

    def wrap(seal_json: str, kind: int = 1059, tags: list[list[str]] | None = None) -> Any:
        wrapper = ServerKey.generate()
        conv = nip44.conversation_key(wrapper.secret, key.pubkey)
        tags = [["p", key.pubkey_hex]] if tags is None else tags
        return sign_event(wrapper, kind, nip44.encrypt(seal_json, conv), tags, now - 99).to_dict()

    def seal(rumor_json: str, kind: int = 13, tags: list[list[str]] | None = None) -> str:
        conv = nip44.conversation_key(sender.secret, key.pubkey)
        return sign_event(
            sender, kind, nip44.encrypt(rumor_json, conv), tags or [], now - 50
        ).to_json()

    content = content_of([chunk_for(key, apns_device())])
    rumor = make_rumor(sender.pubkey_hex, 446, content, [V_MARMOT], now).to_json()
    good = json.loads(trigger(key, [chunk_for(key, apns_device())], created_at=now))
    flipped = ("0" if good["sig"][0] != "0" else "1") + good["sig"][1:]
    if case == "wrap_bad_sig":
        return good | {"sig": flipped}
    if case == "wrap_bad_id":
        return good | {"created_at": good["created_at"] + 1}
    if case == "wrap_kind":
        return wrap("{}", kind=4)
    if case == "wrap_two_p":
        return wrap("{}", tags=[["p", key.pubkey_hex], ["p", key.pubkey_hex]])
    if case == "wrap_other_p":
        return wrap("{}", tags=[["p", ServerKey.generate().pubkey_hex]])
    if case == "wrap_malformed":
        return {"id": "x", "kind": 1059}
    if case == "seal_kind":
        return wrap(seal(rumor, kind=14))
    if case == "seal_tags":
        return wrap(seal(rumor, tags=[["p", key.pubkey_hex]]))
    if case == "seal_bad_sig":
        bad_seal = json.loads(seal(rumor))
        bad_seal["sig"] = ("0" if bad_seal["sig"][0] != "0" else "1") + bad_seal["sig"][1:]
        return wrap(json.dumps(bad_seal))
    if case == "rumor_signed":
        return wrap(seal(sign_event(sender, 446, content, [V_MARMOT], now).to_json()))
    if case == "rumor_pubkey_mismatch":
        other = make_rumor(ServerKey.generate().pubkey_hex, 446, content, [V_MARMOT], now)
        return wrap(seal(other.to_json()))
    if case == "rumor_kind":
        return wrap(seal(make_rumor(sender.pubkey_hex, 445, content, [V_MARMOT], now).to_json()))
    if case == "rumor_bad_id":
        return wrap(seal(json.dumps(json.loads(rumor) | {"id": "00" * 32})))
    if case == "stale":
        return trigger(key, [chunk_for(key, apns_device())], created_at=now - 3601)
    if case == "future":
        return trigger(key, [chunk_for(key, apns_device())], created_at=now + 301)
    if case == "no_version":
        return our_wrap(key, content, [], created_at=now)
    if case == "bad_tags":
        return our_wrap(key, content, [V_MARMOT, ["x", "y"]], created_at=now)
    if case == "bad_encoding":
        return our_wrap(key, content, [V_MIP05, ["encoding", "hex"]], created_at=now)
    if case == "bad_base64":
        return our_wrap(key, content.rstrip("="), [V_MARMOT], created_at=now)
    raise AssertionError(case)


HOSTILE = {
    "wrap_bad_sig": ("wrap", "wrap_bad_sig"),
    "wrap_bad_id": ("wrap", "wrap_bad_id"),
    "wrap_kind": ("wrap", "wrap_kind"),
    "wrap_two_p": ("wrap", "wrap_recipient"),
    "wrap_other_p": ("wrap", "wrap_recipient"),
    "wrap_malformed": ("wrap", "wrap_malformed"),
    "seal_kind": ("seal", "seal_kind"),
    "seal_tags": ("seal", "seal_tags"),
    "seal_bad_sig": ("seal", "seal_bad_sig"),
    "rumor_signed": ("rumor", "rumor_signed"),
    "rumor_pubkey_mismatch": ("rumor", "rumor_pubkey_mismatch"),
    "rumor_kind": ("rumor", "rumor_kind"),
    "rumor_bad_id": ("rumor", "rumor_bad_id"),
    "stale": ("fresh", "stale"),
    "future": ("fresh", "future"),
    "no_version": ("profile", "no_version"),
    "bad_tags": ("profile", "bad_tags"),
    "bad_encoding": ("profile", "bad_tags"),
    "bad_base64": ("content", "bad_base64"),
}


async def test_hostile_events_are_dropped_and_counted(h: Harness, key: ServerKey) -> None:
    """Checklist 5-7: each dropped at its stage, no push, and the pipeline keeps working."""
    for case, (stage, result) in HOSTILE.items():
        before = h.events(stage, result)
        await h.run(hostile(key, case))
        assert h.events(stage, result) == before + 1, case
        assert h.pushes == [], case
    dev = apns_device()
    await h.run(trigger(key, [chunk_for(key, dev)]))
    assert h.tokens() == [dev.token]
    assert h.events("internal", "error") == 0


@pytest.mark.parametrize("delta", [-3599, 299])
async def test_freshness_edges_accepted(h: Harness, key: ServerKey, delta: int) -> None:
    await h.run(trigger(key, [chunk_for(key, apns_device())], created_at=NOW + delta))
    assert len(h.pushes) == 1


async def test_33_chunks_rejected_before_any_chunk_work(h: Harness, key: ServerKey) -> None:
    chunks = [padding_chunk() for _ in range(33)]
    await h.run(trigger(key, chunks))
    assert h.events("content", "content_too_long") == 1  # bounded before decoding
    assert len(h.service.encrypted_limiter) == 0
    assert (
        h.registry.get_sample_value(
            "pushgw_marmot_chunks_total", {"profile": "marmot-push-v1", "result": "decrypt_failed"}
        )
        is None
    )


# ---- dedup and the seen-wrap cache ------------------------------------------------------------


async def test_rewrapped_content_is_pushed_once_within_retention(
    h: Harness, key: ServerKey, clock: Clock
) -> None:
    """Checklist 8: same content, new wrap and seal keys -> one push; after 301 s -> another."""
    dev = apns_device()
    content = content_of([chunk_for(key, dev)])
    await h.run(our_wrap(key, content, [V_MARMOT], created_at=NOW))
    await h.run(sdk_wrap(key, content, [V_MARMOT], created_at=NOW))
    assert h.tokens() == [dev.token]
    assert h.events("dedup", "duplicate") == 1
    clock.advance(301)
    await h.run(our_wrap(key, content, [V_MARMOT], created_at=int(clock.wall)))
    assert h.tokens() == [dev.token, dev.token]


async def test_same_wrap_from_two_relays_is_unwrapped_once(h: Harness, key: ServerKey) -> None:
    wrap = trigger(key, [chunk_for(key, apns_device())])
    h.feed(wrap, wrap)  # both queued before either is processed
    await h.service.idle()
    await h.run(wrap)  # and a third copy later: a cache hit
    assert len(h.pushes) == 1
    assert h.events("seen", "duplicate") == 2
    assert h.events("dedup", "duplicate") == 0  # never unwrapped a second time


async def test_forged_copy_of_a_real_id_does_not_suppress_it(h: Harness, key: ServerKey) -> None:
    wrap = json.loads(trigger(key, [chunk_for(key, apns_device())]))
    forged = dict(wrap, content=wrap["content"][:-8] + "AAAAAAA=")
    h.feed(forged, wrap)
    await h.service.idle()
    assert len(h.pushes) == 1
    assert h.events("wrap", "wrap_bad_id") == 1
    assert wrap["id"] in h.service.seen


# ---- limiters -----------------------------------------------------------------------------------


async def test_global_limiter_601st_wrap_dropped_before_unwrap(h: Harness) -> None:
    junk = [{"id": f"{i:064x}", "kind": 1059} for i in range(601)]
    await h.run(*junk)
    assert h.events("global_limit", "rate_limited") == 1
    assert h.events("wrap", "wrap_malformed") == 600


async def test_queue_full_drops(key: ServerKey, clock: Clock) -> None:
    h = Harness(key, clock, queue_size=2, concurrency=1)
    await h.run_once(*[{"id": f"{i:064x}"} for i in range(5)])
    assert h.events("global_limit", "queue_full") >= 2


async def test_same_encrypted_chunk_241st_skipped_before_ecdh(key: ServerKey, clock: Clock) -> None:
    h = Harness(key, clock, rate_limits={"device_token": {"per_minute": 1000, "per_hour": 9999}})
    await h.service.start()
    try:
        same = chunk_for(key, apns_device())
        for _ in range(241):
            await h.run(trigger(key, [same, padding_chunk()]))  # padding makes each content new
    finally:
        await h.service.stop()
    assert len(h.pushes) == 240
    assert h.chunks("rate_limited") == 1
    assert h.chunks("decrypt_failed") == 241  # the padding chunks: the limited one never decrypted


async def test_241_distinct_chunks_for_one_device_241st_not_pushed(
    h: Harness, key: ServerKey
) -> None:
    dev = fcm_device()
    for _ in range(241):
        await h.run(trigger(key, [chunk_for(key, dev)]))
    assert len(h.pushes) == 240
    assert h.chunks("rate_limited") == 1 and h.chunks("ok") == 240


# ---- privacy ---------------------------------------------------------------------------------


async def test_logs_and_metrics_carry_no_secrets(
    h: Harness, key: ServerKey, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    dev = Device(2, b"fcm-secret-device-token-value")
    wrap = json.loads(trigger(key, [chunk_for(key, dev)]))
    await h.run(wrap, hostile(key, "seal_kind"), hostile(key, "stale"))
    assert h.tokens() == [dev.token]
    exposition = "\n".join(f"{s.name}{s.labels}" for m in h.registry.collect() for s in m.samples)
    text = caplog.text + exposition
    for secret in (dev.token, dev.raw.hex(), wrap["id"], wrap["content"][:40], key.secret.hex()):
        assert secret not in text
    assert repr(h.pushes[0]).count(dev.token) == 0
