"""Trigger profile selection (spec section 1) and content parsing (section 3)."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from plugins.marmot import tokens
from plugins.marmot.errors import Dropped, DropReason
from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import make_rumor
from plugins.marmot.tokens import MARMOT_PUSH_V1, MIP05_V1, MIP05_V1_LEGACY, TokenDecryptor
from plugins.marmot.trigger import (
    Profile,
    TriggerConfig,
    decrypt_trigger,
    parse_trigger,
    select_profile,
    split_content,
)

V_MP = ["v", "marmot-push-v1"]
V_MIP = ["v", "mip05-v1"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- profiles -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tags", "profile"),
    [
        ([V_MP], Profile.MARMOT_PUSH_V1),
        ([V_MIP], Profile.MIP05_V1),
        ([V_MIP, ["encoding", "base64"]], Profile.MIP05_V1),
        (
            [["client", "whitenoise"], V_MIP, ["encoding", "base64"], ["encoding", "base64"]],
            Profile.MIP05_V1,
        ),
        ([V_MIP, V_MIP], Profile.MIP05_V1),
        ([[], V_MIP], Profile.MIP05_V1),
    ],
)
def test_profile_accepted(tags: list[list[str]], profile: Profile) -> None:
    assert select_profile(tags) is profile


@pytest.mark.parametrize(
    ("tags", "reason"),
    [
        ([], DropReason.NO_VERSION),
        ([["encoding", "base64"]], DropReason.NO_VERSION),
        ([["v"]], DropReason.BAD_TAGS),
        ([["v", "mip05-v2"]], DropReason.UNKNOWN_VERSION),
        ([V_MIP, V_MP], DropReason.CONFLICTING_VERSION),
        ([V_MP, ["client", "x"]], DropReason.BAD_TAGS),  # marmot-push-v1: extra tag
        ([["v", "marmot-push-v1", "x"]], DropReason.BAD_TAGS),  # 2-value v tag
        ([V_MP, V_MP], DropReason.BAD_TAGS),
        ([V_MIP, ["encoding", "hex"]], DropReason.BAD_TAGS),
        ([V_MIP, ["encoding", "base64"], ["encoding", "hex"]], DropReason.BAD_TAGS),
        ([V_MIP, ["encoding"]], DropReason.BAD_TAGS),
        ([V_MIP, ["encoding", "base64", "x"]], DropReason.BAD_TAGS),
    ],
)
def test_profile_dropped(tags: list[list[str]], reason: DropReason) -> None:
    with pytest.raises(Dropped) as exc:
        select_profile(tags)
    assert exc.value.reason is reason
    assert exc.value.stage == "profile"


def test_disabled_profiles() -> None:
    with pytest.raises(Dropped) as exc:
        select_profile([V_MIP], TriggerConfig(mip05_enabled=False))
    assert exc.value.reason is DropReason.PROFILE_DISABLED
    with pytest.raises(Dropped) as exc:
        select_profile([V_MP], TriggerConfig(marmot_push_enabled=False))
    assert exc.value.reason is DropReason.PROFILE_DISABLED


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        TriggerConfig(marmot_push_max_chunks=33)
    with pytest.raises(ValueError):
        TriggerConfig(mip05_max_chunks=0)


# ---- content --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 25, 32])
def test_marmot_push_chunk_counts(n: int) -> None:
    data = os.urandom(1084 * n)
    fmt, chunks, digest = split_content(_b64(data), Profile.MARMOT_PUSH_V1)
    assert fmt is MARMOT_PUSH_V1 and len(chunks) == n and b"".join(chunks) == data
    assert digest == hashlib.sha256(data).digest()


def test_33_marmot_push_chunks_rejected_before_decoding_or_ecdh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(*_: object) -> bytes:
        raise AssertionError("ECDH must not run")

    monkeypatch.setattr(tokens, "ecdh_x", boom)
    rumor = make_rumor("00" * 32, 446, _b64(os.urandom(1084 * 33)), [V_MP])
    with pytest.raises(Dropped) as exc:
        parse_trigger(rumor)
    assert exc.value.reason is DropReason.CONTENT_TOO_LONG
    assert exc.value.stage == "content"


def test_mip05_1084_and_legacy_280() -> None:
    fmt, chunks, _ = split_content(_b64(os.urandom(1084 * 3)), Profile.MIP05_V1)
    assert fmt is MIP05_V1 and len(chunks) == 3
    fmt, chunks, _ = split_content(_b64(os.urandom(280 * 5)), Profile.MIP05_V1)
    assert fmt is MIP05_V1_LEGACY and len(chunks) == 5 and all(len(c) == 280 for c in chunks)


def test_length_multiple_of_both_uses_1084() -> None:
    fmt, chunks, _ = split_content(_b64(os.urandom(1084 * 70)), Profile.MIP05_V1)
    assert fmt is MIP05_V1 and len(chunks) == 70


@pytest.mark.parametrize(
    ("content", "profile", "config", "reason"),
    [
        ("", Profile.MIP05_V1, TriggerConfig(), DropReason.CONTENT_EMPTY),
        (
            _b64(os.urandom(280)),
            Profile.MARMOT_PUSH_V1,
            TriggerConfig(),
            DropReason.BAD_CONTENT_LENGTH,
        ),
        (
            _b64(os.urandom(1085)),
            Profile.MARMOT_PUSH_V1,
            TriggerConfig(),
            DropReason.BAD_CONTENT_LENGTH,
        ),
        (_b64(os.urandom(1085)), Profile.MIP05_V1, TriggerConfig(), DropReason.BAD_CONTENT_LENGTH),
        (
            _b64(os.urandom(280)),
            Profile.MIP05_V1,
            TriggerConfig(legacy_280=False),
            DropReason.BAD_CONTENT_LENGTH,
        ),
        (
            _b64(os.urandom(280 * 101)),
            Profile.MIP05_V1,
            TriggerConfig(),
            DropReason.TOO_MANY_CHUNKS,
        ),
        (
            _b64(os.urandom(1084 * 3)),
            Profile.MIP05_V1,
            TriggerConfig(mip05_max_chunks=2),
            DropReason.CONTENT_TOO_LONG,
        ),
        (
            _b64(os.urandom(1084 * 101)),
            Profile.MIP05_V1,
            TriggerConfig(),
            DropReason.CONTENT_TOO_LONG,
        ),
        (
            _b64(os.urandom(280 * 7)),
            Profile.MIP05_V1,
            TriggerConfig(mip05_max_chunks=2),
            DropReason.TOO_MANY_CHUNKS,
        ),
    ],
    ids=[
        "empty",
        "mp-280",
        "mp-1085",
        "mip-1085",
        "legacy-off",
        "101x280",
        "3>2",
        "101x1084",
        "7x280>2",
    ],
)
def test_content_dropped(
    content: str, profile: Profile, config: TriggerConfig, reason: DropReason
) -> None:
    with pytest.raises(Dropped) as exc:
        split_content(content, profile, config)
    assert exc.value.reason is reason


def _urlsafe_content() -> str:
    while True:
        data = os.urandom(1084)
        text = base64.urlsafe_b64encode(data).decode()
        if "-" in text or "_" in text:
            return text


@pytest.mark.parametrize(
    "content",
    [
        _urlsafe_content(),
        _b64(os.urandom(1084)).rstrip("="),  # 1084 % 3 == 1: "==" padding removed
        _b64(os.urandom(1084))[:100] + "\n" + _b64(os.urandom(1084))[100:],
        " " + _b64(os.urandom(1084)),
        _b64(os.urandom(1084)) + "====",
        "!" * 1448,
    ],
    ids=["urlsafe", "unpadded", "newline", "space", "extra-padding", "junk"],
)
def test_bad_base64(content: str) -> None:
    with pytest.raises(Dropped) as exc:
        split_content(content, Profile.MIP05_V1)
    assert exc.value.reason is DropReason.BAD_BASE64


def test_parse_and_decrypt_trigger_end_to_end() -> None:
    server = ServerKey.generate()
    chunks = [
        tokens.encrypt_token(server.pubkey, 1, b"\x01" * 32, MIP05_V1_LEGACY),
        os.urandom(280),
        tokens.encrypt_token(server.pubkey, 2, b"fcm", MIP05_V1_LEGACY),
    ]
    rumor = make_rumor("00" * 32, 446, _b64(b"".join(chunks)), [V_MIP], created_at=123)
    trigger = parse_trigger(rumor)
    assert trigger.profile is Profile.MIP05_V1 and trigger.token_format is MIP05_V1_LEGACY
    assert trigger.created_at == 123
    assert "chunks" not in repr(trigger) and "content_hash" not in repr(trigger)
    got = decrypt_trigger(trigger, TokenDecryptor(server))
    assert [t.token for t in got] == ["01" * 32, "fcm"]
