"""Review from the seat of transponder parity (marmot-protocol/transponder 0.2.0, the reference
MIP-05 server): what a transponder client sends, fed to our Marmot plugin, must be handled as
transponder handles it, unless docs/marmot.md §8 records the difference as deliberate.

Wraps are built with nostr-sdk (the same rust-nostr that mdk and transponder use) where it can
build them, and with the project's vector-verified builders otherwise.
"""

from __future__ import annotations

import nostr_sdk
import pytest

from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import gift_wrap, make_rumor, seal_rumor
from tests.marmot.helpers import (
    V_MARMOT,
    apns_device,
    chunk_for,
    content_of,
    fcm_device,
)
from tests.marmot.test_service import NOW, Clock, Harness


@pytest.fixture
def key() -> ServerKey:
    return ServerKey.generate()


def sdk_wrap_with_tags(key: ServerKey, content: str, extra_tags: list[list[str]]) -> str:
    """A marmot-push-v1 trigger wrapped by nostr-sdk with `extra_tags` on the gift wrap, as
    rust-nostr's `GiftWrapBuilder::extra_tags` / `::expiration` put them there."""
    sender = nostr_sdk.Keys.generate()
    rumor = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(446), content)
        .tags([nostr_sdk.Tag.parse(V_MARMOT)])
        .custom_created_at(nostr_sdk.Timestamp.from_secs(NOW))
        .finalize_unsigned(sender.public_key())
    )
    wrap = nostr_sdk.nip59_make_gift_wrap(
        sender,
        nostr_sdk.PublicKey.from_bytes(key.pubkey),
        rumor,
        extra_tags=[nostr_sdk.Tag.parse(t) for t in extra_tags],
    )
    return str(wrap.as_json())


# ---- NIP-40: an expired gift wrap wakes nobody ----------------------------------------------


async def test_an_expired_gift_wrap_is_dropped_before_the_global_limiter(key: ServerKey) -> None:
    """transponder receives wraps through nostr-relay-pool 0.44, which drops every event whose
    NIP-40 `expiration` tag lies in the past (`relay/inner.rs`: `if event.is_expired() {
    return Err(Error::EventExpired) }`) before the processor sees it. A sender that gives its
    trigger an expiration (rust-nostr `GiftWrapBuilder::expiration`) means "not after this";
    pushgw ignored the tag and woke the devices of a trigger its sender had declared dead, e.g.
    when a relay that does not implement NIP-40 backfilled it after a reconnect. The drop
    comes before the global limiter: an expired wrap costs no unwrap and no budget."""
    dev = apns_device()
    expired = sdk_wrap_with_tags(
        key, content_of([chunk_for(key, dev)]), [["expiration", str(NOW - 1)]]
    )
    fresh = apns_device()
    later = sdk_wrap_with_tags(
        key, content_of([chunk_for(key, fresh)]), [["expiration", str(NOW + 3600)]]
    )
    # a global budget of one wrap: the expired one must not take it
    h = Harness(key, Clock(), rate_limits={"global": {"per_minute": 1, "per_hour": 1}})
    await h.run_once(expired, later)
    assert h.tokens() == [fresh.token]
    assert h.events("wrap", "wrap_expired") == 1
    assert h.events("global_limit", "rate_limited") == 0


@pytest.mark.parametrize(
    "tags",
    [
        [["expiration", str(NOW)]],  # expires at this second: rust-nostr's `expiration < now`
        [["expiration", "soon"]],  # not a timestamp: rust-nostr reads no expiration
        [["expiration"]],
        [["expiration", "not-a-number"], ["expiration", str(NOW - 10)]],  # the first one counts
    ],
    ids=["now", "unparsable", "no-value", "first-tag-counts"],
)
async def test_a_wrap_transponder_does_not_consider_expired_is_pushed(
    key: ServerKey, tags: list[list[str]]
) -> None:
    """The same reading as rust-nostr's `Tags::expiration()`: the first `expiration` tag, as
    an unsigned integer; expired only when strictly before now. Anything else is pushed, as
    transponder pushes it."""
    dev = fcm_device()
    h = Harness(key, Clock())
    await h.run_once(our_wrap_with_tags(key, content_of([chunk_for(key, dev)]), tags))
    assert h.tokens() == [dev.token]
    assert h.events("wrap", "wrap_expired") == 0


def our_wrap_with_tags(key: ServerKey, content: str, extra_tags: list[list[str]]) -> str:
    sender = ServerKey.generate()
    rumor = make_rumor(sender.pubkey_hex, 446, content, [V_MARMOT], NOW)
    seal = seal_rumor(rumor, sender, key.pubkey_hex)
    return gift_wrap(seal, key.pubkey_hex, extra_tags=extra_tags).to_json()
