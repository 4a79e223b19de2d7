"""Kind-10050 inbox relay list (NIP-17), published at start only when it changed (spec section 10).

The server queries every inbox and publish relay for its newest kind-10050 event
(``{"kinds":[10050],"authors":[pk]}``, greatest ``created_at`` over all relays), compares the
normalized ``relay`` tag set with ``inbox_relays`` and, only if they differ, publishes a new list to
the inbox and publish relays. Each relay gets its own short-lived connection; NIP-42 challenges are
answered with the server key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from plugins.marmot.config import normalize_relay_url
from plugins.marmot.keys import ServerKey
from plugins.marmot.nostr import (
    Event,
    compute_event_id,
    load_json,
    parse_event,
    sign_event,
    verify_signature,
)
from plugins.marmot.relay import auth_event, relay_label, safe_text, tls_options

__all__ = ["KIND_INBOX_RELAYS", "InboxResult", "ensure_inbox_list", "fetch_newest", "publish"]

log = logging.getLogger("plugins.marmot.inbox")

KIND_INBOX_RELAYS = 10050
_ERRORS = (OSError, TimeoutError, ConnectionClosed, InvalidHandshake, InvalidURI, ValueError)


@dataclass
class InboxResult:
    """What :func:`ensure_inbox_list` did."""

    queried: int = 0  # relays that answered the query (EOSE)
    current: frozenset[str] | None = None  # normalized relay set of the newest list found
    published: bool = False
    accepted_by: list[str] = field(default_factory=list)  # relay labels that said OK true


async def _recv(ws: ClientConnection, deadline: float) -> list[Any] | None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    raw = await asyncio.wait_for(ws.recv(), remaining)
    try:
        msg = load_json(raw)
    except ValueError:
        return None
    return msg if isinstance(msg, list) and msg and isinstance(msg[0], str) else None


def _authentic(event: Event) -> bool:
    """Whether ``event.id`` is the NIP-01 hash of its fields and ``sig`` signs that id.

    The signature alone proves nothing about the fields: a relay could pair the id and signature
    of any event the server key signed (our NIP-42 AUTH events, say) with a made-up kind,
    ``created_at`` and relay tags.
    """
    try:
        expected = compute_event_id(
            event.pubkey, event.created_at, event.kind, event.tags, event.content
        )
    except ValueError:  # a string that is not UTF-8 encodable (lone surrogate)
        return False
    return expected == event.id and verify_signature(event.pubkey, event.id, event.sig)


async def _answer_auth(ws: ClientConnection, key: ServerKey, url: str, msg: list[Any]) -> bool:
    """Answer a NIP-42 challenge; whether it was one we could answer."""
    if len(msg) >= 2 and isinstance(msg[1], str) and len(msg[1]) <= 1024:
        try:
            event = auth_event(key, url, msg[1])
        except ValueError:  # a challenge that is not UTF-8 encodable
            return False
        await ws.send(json.dumps(["AUTH", event.to_dict()], separators=(",", ":")))
        return True
    return False


def _auth_required(reason: object) -> bool:
    return isinstance(reason, str) and reason.startswith("auth-required:")


async def fetch_newest(
    url: str, key: ServerKey, timeout: float = 10.0, *, ca_file: str | None = None
) -> Event | bool | None:
    """Newest valid kind-10050 event by ``key`` on one relay; None if none; False on failure."""
    sub = secrets.token_hex(8)
    flt = {"kinds": [KIND_INBOX_RELAYS], "authors": [key.pubkey_hex], "limit": 5}
    deadline = time.monotonic() + timeout
    newest: Event | None = None
    req = json.dumps(["REQ", sub, flt], separators=(",", ":"))
    # NIP-42: a relay that reads only to authenticated clients answers CLOSED "auth-required:",
    # sending its challenge before or after that; the query is sent again once, authenticated.
    authed = retried = waiting = False
    try:
        async with connect(
            url, open_timeout=timeout, close_timeout=1.0, **tls_options(url, ca_file)
        ) as ws:
            await ws.send(req)
            while True:
                msg = await _recv(ws, deadline)
                if msg is None:
                    continue
                if msg[0] == "AUTH":
                    authed = await _answer_auth(ws, key, url, msg) or authed
                    if authed and waiting:
                        waiting = False
                        await ws.send(req)
                elif (
                    msg[0] == "CLOSED"
                    and len(msg) >= 3
                    and msg[1] == sub
                    and _auth_required(msg[2])
                    and not retried
                ):
                    retried = True
                    if authed:
                        await ws.send(req)
                    else:
                        waiting = True  # until the challenge arrives (or the deadline)
                elif msg[0] == "EVENT" and len(msg) == 3 and msg[1] == sub:
                    try:
                        event = parse_event(msg[2])
                    except ValueError:
                        continue
                    if (
                        event.kind == KIND_INBOX_RELAYS
                        and event.pubkey == key.pubkey_hex
                        and _authentic(event)
                        and (newest is None or event.created_at > newest.created_at)
                    ):
                        newest = event
                elif msg[0] == "EOSE" and len(msg) >= 2 and msg[1] == sub:
                    with contextlib.suppress(*_ERRORS):
                        await ws.send(json.dumps(["CLOSE", sub]))
                    return newest
                elif msg[0] == "CLOSED" and len(msg) >= 2 and msg[1] == sub:
                    log.info(
                        "relay %s refused the 10050 query: %s",
                        relay_label(url),
                        safe_text(msg[2] if len(msg) > 2 else ""),
                    )
                    return False
    except _ERRORS as exc:
        log.info("relay %s: 10050 query failed (%s)", relay_label(url), type(exc).__name__)
        return False


async def publish(
    url: str, event: Event, key: ServerKey, timeout: float = 10.0, *, ca_file: str | None = None
) -> bool:
    """Send ``event`` to one relay and wait for its OK (answering an AUTH challenge once)."""
    deadline = time.monotonic() + timeout
    frame = json.dumps(["EVENT", event.to_dict()], separators=(",", ":"), ensure_ascii=False)
    # NIP-42: OK false "auth-required:" is retried once, authenticated; the relay's challenge
    # may come before or after that answer.
    authed = retried = waiting = False
    try:
        async with connect(
            url, open_timeout=timeout, close_timeout=1.0, **tls_options(url, ca_file)
        ) as ws:
            await ws.send(frame)
            while True:
                msg = await _recv(ws, deadline)
                if msg is None:
                    continue
                if msg[0] == "AUTH":
                    authed = await _answer_auth(ws, key, url, msg) or authed
                    if authed and waiting:
                        waiting = False
                        await ws.send(frame)
                elif msg[0] == "OK" and len(msg) >= 3 and msg[1] == event.id:
                    if msg[2] is True:
                        return True
                    reason = msg[3] if len(msg) > 3 and isinstance(msg[3], str) else ""
                    if _auth_required(reason) and not retried:
                        retried = True
                        if authed:
                            await ws.send(frame)
                        else:
                            waiting = True  # until the challenge arrives (or the deadline)
                        continue
                    log.warning(
                        "relay %s refused the 10050 list: %s", relay_label(url), safe_text(reason)
                    )
                    return False
    except _ERRORS as exc:
        log.info("relay %s: 10050 publish failed (%s)", relay_label(url), type(exc).__name__)
        return False


def relay_set(urls: Iterable[str]) -> frozenset[str]:
    return frozenset(normalize_relay_url(u) for u in urls)


def _normalized_or_raw(url: str) -> str:
    """A published URL in comparison form; as it is if unparsable (a bad port, a broken IPv6
    literal: lists written by other clients of the key are not validated). Such a URL equals no
    configured one, so the list is replaced instead of the check raising."""
    try:
        return normalize_relay_url(url)
    except ValueError:
        return url


def inbox_event(key: ServerKey, inbox_relays: Sequence[str], now: int | None = None) -> Event:
    """The kind-10050 event: one ``relay`` tag per inbox relay, empty content."""
    return sign_event(key, KIND_INBOX_RELAYS, "", [["relay", u] for u in inbox_relays], now)


async def ensure_inbox_list(
    key: ServerKey,
    inbox_relays: Sequence[str],
    publish_relays: Sequence[str] = (),
    *,
    timeout: float = 10.0,
    ca_file: str | None = None,
) -> InboxResult:
    """Query, compare, publish if changed. Raises nothing; see :class:`InboxResult`."""
    targets = list(dict.fromkeys([*inbox_relays, *publish_relays]))
    result = InboxResult()
    answers = await asyncio.gather(
        *(fetch_newest(u, key, timeout, ca_file=ca_file) for u in targets)
    )
    newest: Event | None = None
    for answer in answers:
        if answer is False:
            continue
        result.queried += 1
        if isinstance(answer, Event) and (newest is None or answer.created_at > newest.created_at):
            newest = answer
    if result.queried == 0:
        return result  # nobody answered: try again later rather than publish blindly
    wanted = relay_set(inbox_relays)
    if newest is not None:
        result.current = frozenset(
            _normalized_or_raw(t[1]) for t in newest.tags if len(t) >= 2 and t[0] == "relay"
        )
        if result.current == wanted:
            return result
    created_at = int(time.time())
    if newest is not None and created_at <= newest.created_at:
        created_at = newest.created_at + 1  # replaceable: must be newer than what relays hold
    event = inbox_event(key, inbox_relays, created_at)
    oks = await asyncio.gather(*(publish(u, event, key, timeout, ca_file=ca_file) for u in targets))
    result.accepted_by = [relay_label(u) for u, ok in zip(targets, oks, strict=True) if ok]
    result.published = bool(result.accepted_by)
    return result
