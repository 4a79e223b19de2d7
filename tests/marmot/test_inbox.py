"""Kind-10050 inbox list check against a hostile relay (spec section 10), with a scripted relay."""

from __future__ import annotations

import asyncio
from typing import Any

from plugins.marmot.inbox import KIND_INBOX_RELAYS, ensure_inbox_list, fetch_newest, inbox_event
from plugins.marmot.keys import ServerKey
from plugins.marmot.relay import auth_event

from .scripted_relay import ScriptedRelay


def forged_list(key: ServerKey, url: str, relays: list[str], created_at: int) -> dict[str, Any]:
    """A "kind-10050 event" that reuses the id and signature of a real event signed by ``key``
    (here the NIP-42 AUTH event a relay receives from us), with other fields swapped in: the
    signature is valid for the id, but the id is not the hash of these fields."""
    real = auth_event(key, url, "challenge").to_dict()
    return dict(
        real,
        kind=KIND_INBOX_RELAYS,
        created_at=created_at,
        tags=[["relay", r] for r in relays],
    )


async def _answer_query(relay: ScriptedRelay, event: dict[str, Any]) -> None:
    req = await relay.expect("REQ")
    await relay.send(["EVENT", req[1], event])
    await relay.send(["EOSE", req[1]])


async def test_fetch_newest_ignores_an_event_whose_id_does_not_match_its_fields() -> None:
    key = ServerKey.generate()
    async with ScriptedRelay() as relay:
        forged = forged_list(key, relay.url, ["wss://attacker.example"], 4_000_000_000)
        _, newest = await asyncio.gather(
            _answer_query(relay, forged), fetch_newest(relay.url, key, timeout=5)
        )
    assert newest is None  # a relay cannot make up a list "signed" by the server key


async def test_forged_list_neither_suppresses_nor_skews_the_publication() -> None:
    key = ServerKey.generate()
    async with ScriptedRelay() as relay:
        # The forged list claims exactly the configured set, so a believer would not publish.
        forged = forged_list(key, relay.url, [relay.url], 4_000_000_000)

        async def relay_side() -> dict[str, Any]:
            await _answer_query(relay, forged)
            published = await relay.expect("EVENT")
            await relay.send(["OK", published[1]["id"], True, ""])
            return published[1]

        published, result = await asyncio.gather(
            relay_side(), ensure_inbox_list(key, [relay.url], timeout=5)
        )
    assert result.published
    assert published["kind"] == KIND_INBOX_RELAYS
    assert published["created_at"] < 4_000_000_000


async def test_a_malformed_url_in_our_own_list_is_replaced_not_fatal() -> None:
    """The newest list is genuinely ours (another client of the operator's key may have written
    it) but a relay tag is not a parsable URL: it differs from the config, so publish; the check
    itself "raises nothing" (a raise would end the publication task silently)."""
    key = ServerKey.generate()
    async with ScriptedRelay() as relay:
        ours = inbox_event(key, ["wss://[not-an-ipv6", "wss://relay.example:99999"], 1_700_000_000)

        async def relay_side() -> dict[str, Any]:
            await _answer_query(relay, ours.to_dict())
            published = await relay.expect("EVENT")
            await relay.send(["OK", published[1]["id"], True, ""])
            return published[1]

        published, result = await asyncio.gather(
            relay_side(), ensure_inbox_list(key, [relay.url], timeout=5)
        )
    assert result.published and result.queried == 1
    assert published["tags"] == [["relay", relay.url]]
