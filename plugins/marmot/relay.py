"""Nostr relay client: one long-lived subscription per inbox relay (spec section 10).

Each :class:`RelayClient` keeps ``["REQ", id, {"kinds":[1059],"#p":[server],"since":S}]`` open on
one relay, reconnecting with exponential backoff and jitter. ``since`` covers the NIP-59 timestamp
window: wraps carry a ``created_at`` randomized up to 172,800 s into the past, so after a
disconnect at ``D`` the subscription asks for ``max(D, now - max_age) - 172800 - max_future_skew``
and gets back everything sent while it was away. The resulting duplicates are cheap: the service's
seen-wrap cache skips them before any cryptography, and content dedup catches re-wrapped copies.

``D`` is when the client noticed the loss. A silently dead connection is noticed by the ping within
``ping_interval`` + the ping timeout (about 50 s), well inside ``max_future_skew`` (300 s), so
triggers sent during that blind spot are still inside the window.

Message size: a relay backfills what it stored on every REQ whose window covers it, so closing the
connection over one oversize message only brings it back after the reconnect, for as long as the
two-day window covers it. Messages are therefore read as bytes and any above ``max_event_bytes``
is dropped (``frame/oversize``) before it is decoded or parsed, and the connection stays up. The
websocket library's own limit, ``max_message_bytes`` (at least 4 MiB), only bounds what a relay
can make us buffer: about ``max_queue + 2`` (6) such messages per relay. A message above even that
makes the library close with 1009; it is counted the same way and the next REQ asks for no stored
events (``limit: 0``, as on a first start), so a relay that honours the limit cannot resend it.
That skips the rest of that one backfill; a relay that ignores the limit meets the growing backoff.

Backoff: ``failures`` counts failed connections and subscriptions in a row and sets the delay. It is
reset only by a subscription that stayed live for ``backoff_max``, so a relay that answers EOSE and
then hangs up (or sends ``CLOSED``) at once cannot hold us at ``backoff_min``.

Message handling: ``EVENT`` goes to the sink; ``EOSE`` marks the relay live; ``CLOSED`` resubscribes
with backoff (``auth-required:`` first answers the relay's NIP-42 challenge); ``NOTICE`` is logged,
truncated and escaped, a few a minute at most; ``AUTH`` challenges are answered at once with a
kind-22242 event signed by the server key (inbox relays commonly restrict kind-1059 reads to the
tagged key); ``OK`` answers to our AUTH are matched by event id. Nothing is ever sent in reply
to an event. A fault (an oversize or malformed message, one for a subscription we do not have)
is logged once per connection with the relay's label, never its text: the metrics that count
it carry no relay label.

``disconnect_at`` moves only when a live subscription (after EOSE) is interrupted: a relay that
takes the REQ and drops us before EOSE never sent the backfill asked for, so the next REQ asks
for the same window again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.frames import CloseCode

from plugins.marmot.keys import ServerKey
from plugins.marmot.limits import DualRateLimiter
from plugins.marmot.nostr import KIND_GIFT_WRAP, NIP59_TIME_WINDOW, Event, load_json, sign_event

__all__ = [
    "KIND_AUTH",
    "RelayClient",
    "RelaySettings",
    "RelaySink",
    "RelayState",
    "auth_event",
    "relay_label",
    "safe_text",
    "tls_options",
]

log = logging.getLogger("plugins.marmot.relay")

KIND_AUTH = 22242
_NOTICE_MAX = 200
#: NOTICE lines logged per relay and minute (and ten times that per hour): the text
#: is the relay's to choose, so a relay repeating it must not flood the gateway's log.
NOTICES_PER_MINUTE = 5
_AUTH_REQUIRED = "auth-required:"
#: Least websocket message limit, whatever ``max_event_bytes`` is (nostr-sdk, which transponder
#: uses, caps relay messages at 5.25 MB; strfry refuses events above 64 KiB by default).
_MESSAGE_CEILING = 4 * 1024 * 1024
#: Frames the websocket library may hold before it stops reading the socket (its default is 16).
_MAX_QUEUE = 4


class RelayState(StrEnum):
    """Where a relay connection is (label of ``pushgw_marmot_relay_state``)."""

    IDLE = "idle"
    CONNECTING = "connecting"
    SUBSCRIBED = "subscribed"  # REQ sent, stored events arriving
    LIVE = "live"  # EOSE received: new events arrive as they are published
    BACKOFF = "backoff"
    STOPPED = "stopped"


def relay_label(url: str) -> str:
    """``scheme://host[:port]`` of a relay URL: safe as a metric label and in logs.

    The path and query are left out because paid relays put access tokens there.
    """
    parts = urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme.lower()}://{host.lower()}{port}"


def safe_text(value: object, limit: int = _NOTICE_MAX) -> str:
    """Attacker-controlled text made safe for a log line: truncated, non-printables escaped."""
    text = value if isinstance(value, str) else repr(value)
    return text[:limit].encode("unicode_escape").decode("ascii")


def _we_refused_a_message(exc: ConnectionClosed) -> bool:
    """Whether our websocket library closed the connection over an incoming message above
    ``max_size`` (close code 1009 sent first; not a relay's 1009 that we echoed)."""
    sent = exc.sent
    return (
        sent is not None
        and sent.code == CloseCode.MESSAGE_TOO_BIG
        and exc.rcvd_then_sent is not True
    )


def _usable_challenge(value: object) -> bool:
    """A NIP-42 challenge we can sign: a string of at most 1024 characters, encodable as UTF-8.

    JSON can carry lone surrogates (``"\\ud800"``) that no event id can hash: signing one would
    raise in the AUTH task, and after ``CLOSED auth-required:`` leave the subscription closed.
    """
    if not isinstance(value, str) or len(value) > 1024:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def auth_event(key: ServerKey, url: str, challenge: str, now: int | None = None) -> Event:
    """NIP-42 authentication event: kind 22242, ``relay`` and ``challenge`` tags, empty content."""
    return sign_event(key, KIND_AUTH, "", [["relay", url], ["challenge", challenge]], now)


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """Connection behaviour shared by every relay client (from the plugin config)."""

    max_event_bytes: int = 262_144
    max_age: int = 3600
    max_future_skew: int = 300
    backfill_on_start: bool = False
    ping_interval: float = 30.0
    ping_timeout: float = 20.0
    backoff_min: float = 1.0
    backoff_max: float = 60.0
    connect_timeout: float = 10.0
    eose_timeout: float = 15.0
    compression: bool = False
    #: Extra trust store (PEM CA certificates) for ``wss://`` relays behind a private CA.
    ca_file: str | None = None

    @property
    def max_message_bytes(self) -> int:
        """Websocket message limit. Above it the library closes the connection (1009), so it sits
        far above ``max_event_bytes``: messages in between are dropped one by one by the client,
        which keeps the connection. It stays a bound on what a relay can make us buffer."""
        return max(_MESSAGE_CEILING, 4 * self.max_event_bytes + 65_536)


def tls_options(url: str, ca_file: str | None) -> dict[str, Any]:
    """``connect()`` keywords for ``url``: for ``wss://`` with ``ca_file``, a verifying context
    trusting that file's CAs in addition to the system store (``SSL_CERT_FILE`` applies to the
    latter); nothing otherwise (the library's own default context, or plain ``ws://``)."""
    if ca_file is None or urlsplit(url).scheme.lower() != "wss":
        return {}
    context = ssl.create_default_context()
    context.load_verify_locations(cafile=ca_file)
    return {"ssl": context}


class RelaySink(Protocol):
    """Where a relay client delivers what it receives (the service)."""

    def on_event(self, relay: RelayClient, event: Mapping[str, Any]) -> None: ...

    def on_oversize(self, relay: RelayClient) -> None: ...

    def on_malformed(self, relay: RelayClient) -> None: ...

    def on_unrequested(self, relay: RelayClient) -> None: ...

    def on_state(self, relay: RelayClient, old: RelayState, new: RelayState) -> None: ...


class RelayClient:
    """Keeps one subscription for gift wraps to ``pubkey_hex`` open on one relay."""

    def __init__(
        self,
        url: str,
        key: ServerKey,
        sink: RelaySink,
        settings: RelaySettings,
        *,
        clock: Callable[[], float] = time.time,
        on_message: Callable[[RelayClient, str], None] | None = None,
    ) -> None:
        self.url = url
        self.label = relay_label(url)
        self.key = key
        self.sink = sink
        self.settings = settings
        self.clock = clock
        self.on_message = on_message
        self.state = RelayState.IDLE
        #: When the last live connection was lost (None: never connected in this process).
        self.disconnect_at: float | None = None
        self.first_attempt_at: float | None = None
        self.connects = 0
        #: Failures in a row; reset by a subscription that stayed live for ``backoff_max``.
        self.failures = 0
        self.events_received = 0
        self.backfilled = 0  # events received before EOSE (stored ones)
        self.unrequested = 0  # stored events sent although we asked for none (limit 0)
        self.authenticated = False
        self.last_since: int | None = None
        self.last_filter: dict[str, Any] | None = None
        self._sub_id = ""
        self._ws: ClientConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._challenge: str | None = None
        self._auth_answering = False  # an unprompted AUTH answer is in flight
        self._auth_pending: dict[str, asyncio.Future[bool]] = {}  # AUTH event id -> its OK
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._live_only = False
        self._eose_timer: asyncio.TimerHandle | None = None
        self._live_at: float | None = None  # monotonic time the subscription went live
        self._skip_backfill = False  # the last connection died of a message over the ceiling
        self.notice_limiter = DualRateLimiter(NOTICES_PER_MINUTE, 10 * NOTICES_PER_MINUTE)
        self._notice_budget = [0, 0]
        self._notices_not_logged = 0
        self._reported: set[str] = set()  # faults already logged on this connection
        self._tls = tls_options(url, settings.ca_file)  # built once, reused on every reconnect

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name=f"marmot-relay {self.label}")

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        for side in list(self._side_tasks):
            side.cancel()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws.close(), 2.0)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_state(RelayState.STOPPED)

    @property
    def live(self) -> bool:
        return self.state is RelayState.LIVE

    def status(self) -> dict[str, Any]:
        """Per-relay state for readiness reports (no ids, no keys)."""
        return {
            "state": self.state.value,
            "connects": self.connects,
            "consecutive_failures": self.failures,
            "authenticated": self.authenticated,
        }

    def _set_state(self, state: RelayState) -> None:
        old, self.state = self.state, state
        if old is not state:
            self.sink.on_state(self, old, state)

    # -- subscription filter --------------------------------------------------------------------

    def subscription_filter(self, now: float | None = None) -> dict[str, Any]:
        """The REQ filter for the next subscription (spec section 10)."""
        now = self.clock() if now is None else now
        s = self.settings
        flt: dict[str, Any] = {"kinds": [KIND_GIFT_WRAP], "#p": [self.key.pubkey_hex]}
        disconnect = self.disconnect_at
        first_start = disconnect is None and self.connects == 0 and self.failures == 0
        if self._skip_backfill or (first_start and not s.backfill_on_start):
            # First start: live only; a restart re-wakes nobody. After a message over the
            # websocket ceiling: live only, so a relay honouring the limit cannot resend it.
            flt["since"] = int(now) - NIP59_TIME_WINDOW
            flt["limit"] = 0
            return flt
        if first_start:
            disconnect = now
        if disconnect is None:  # never connected, but attempts failed since the first one
            disconnect = self.first_attempt_at if self.first_attempt_at is not None else now
        # A disconnect "after now" was recorded by a clock since stepped back (NTP correcting
        # a fast clock). Relays apply `since` to live events too: taken as is, it would hide
        # every new wrap whose randomized created_at lies more than 2 days - step back.
        disconnect = min(disconnect, now)
        since = max(disconnect, now - s.max_age) - NIP59_TIME_WINDOW - s.max_future_skew
        flt["since"] = max(0, int(since))
        return flt

    # -- connection loop ------------------------------------------------------------------------

    def _backoff(self) -> float:
        s = self.settings
        # The exponent is capped: 2 ** 1024 no longer converts to a float (OverflowError), and
        # ``failures`` keeps counting through a long outage (1,025 failures: 17 h at 60 s).
        doublings = min(max(0, self.failures - 1), 64)
        # Drawn from [base / 2, base], base from twice the minimum: the first retry too is
        # spread over [backoff_min, 2 x backoff_min], not all at backoff_min (every gateway
        # that lost a restarting relay would come back at once).
        base = min(s.backoff_max, 2 * s.backoff_min * (2**doublings))
        return max(s.backoff_min, random.uniform(base / 2, base))

    def _failed(self) -> None:
        """One more failure in a row, unless the subscription had been live for a while."""
        live_at, self._live_at = self._live_at, None
        if live_at is not None and time.monotonic() - live_at >= self.settings.backoff_max:
            self.failures = 0
        self.failures += 1

    async def _run(self) -> None:
        s = self.settings
        while not self._stopping:
            if self.first_attempt_at is None:
                self.first_attempt_at = self.clock()
            self._set_state(RelayState.CONNECTING)
            try:
                async with connect(
                    self.url,
                    max_size=s.max_message_bytes,
                    max_queue=_MAX_QUEUE,
                    ping_interval=s.ping_interval,
                    ping_timeout=s.ping_timeout,
                    open_timeout=s.connect_timeout,
                    close_timeout=2.0,
                    user_agent_header=None,
                    compression="deflate" if s.compression else None,
                    **self._tls,
                ) as ws:
                    self._ws = ws
                    self._reported.clear()
                    self._challenge = None
                    self._auth_answering = False
                    self.authenticated = False
                    self._auth_pending.clear()
                    await self._subscribe()
                    self.connects += 1
                    while True:
                        # bytes, text frames included: the size check comes before any decoding
                        self._handle(await ws.recv(decode=False))
            except asyncio.CancelledError:
                raise
            except ConnectionClosed as exc:
                if _we_refused_a_message(exc):
                    self._message_too_big()
                elif not self._stopping:
                    log.info("relay %s: connection lost (%s)", self.label, type(exc).__name__)
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                log.info("relay %s: connection lost (%s)", self.label, type(exc).__name__)
            except Exception:  # a bug of ours must not end the listener
                log.exception("relay %s: unexpected error; reconnecting", self.label)
            finally:
                self._ws = None
                if self._eose_timer is not None:
                    self._eose_timer.cancel()
                    self._eose_timer = None
                for side in list(self._side_tasks):
                    side.cancel()
            if self._stopping:
                break
            if self.state is RelayState.LIVE:
                # The live stream was interrupted here. Not before EOSE: the backfill asked
                # for since the last interruption never came (CLOSED already recorded its own).
                self.disconnect_at = self.clock()
            self._failed()
            self._set_state(RelayState.BACKOFF)
            await asyncio.sleep(self._backoff())

    async def _subscribe(self) -> None:
        assert self._ws is not None
        self._sub_id = secrets.token_hex(8)
        flt = self.subscription_filter()
        self.last_filter = flt
        self.last_since = flt["since"]
        self.backfilled = 0
        self._live_only = flt.get("limit") == 0
        await self._ws.send(json.dumps(["REQ", self._sub_id, flt], separators=(",", ":")))
        self._set_state(RelayState.SUBSCRIBED)
        if self._eose_timer is not None:
            self._eose_timer.cancel()
        self._eose_timer = asyncio.get_running_loop().call_later(
            self.settings.eose_timeout, self._eose_timeout, self._sub_id
        )

    def _eose_timeout(self, sub_id: str) -> None:
        self._eose_timer = None
        if sub_id == self._sub_id and self.state is RelayState.SUBSCRIBED:
            log.warning("relay %s sent no EOSE; treating the subscription as live", self.label)
            self._mark_live()

    def _mark_live(self) -> None:
        if self._eose_timer is not None:
            self._eose_timer.cancel()
            self._eose_timer = None
        self._live_at = time.monotonic()
        self._skip_backfill = False
        self._set_state(RelayState.LIVE)

    def _message_too_big(self) -> None:
        """The library closed the connection (1009) over a message above ``max_message_bytes``."""
        self.sink.on_oversize(self)
        self._skip_backfill = True
        log.warning(
            "relay %s sent a message over %d bytes; dropped it, reconnecting without backfill",
            self.label,
            self.settings.max_message_bytes,
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _send(self, message: list[Any]) -> None:
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send(json.dumps(message, separators=(",", ":"), ensure_ascii=False))

    async def _resubscribe_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self._subscribe()

    # -- messages -------------------------------------------------------------------------------

    def _handle(self, data: bytes) -> None:
        # Size first, before decoding or parsing: an EVENT frame is the event plus
        # ["EVENT","<sub id>",...]. Any oversize frame is dropped; no relay message needs more.
        if len(data) > self.settings.max_event_bytes + len(self._sub_id) + 16:
            self.sink.on_oversize(self)
            self.report_once("oversize", "sent a message over max_event_bytes")
            return
        text = data.decode("utf-8", "replace")
        if self.on_message is not None:
            self.on_message(self, text)
        try:
            msg = load_json(text)
        except ValueError:
            msg = None
        if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
            self.sink.on_malformed(self)
            self.report_once("malformed", "sent a message that is not a relay message")
            return
        kind = msg[0]
        if kind == "EVENT":
            if len(msg) != 3 or msg[1] != self._sub_id:
                # Not ours (we never leave a subscription open for the relay to stream into).
                self.report_once("foreign", "sent messages for a subscription we do not have")
                return
            if not isinstance(msg[2], dict):
                self.sink.on_malformed(self)
                self.report_once("malformed", "sent a message that is not a relay message")
                return
            self.events_received += 1
            if self.state is RelayState.SUBSCRIBED:
                if self._live_only:
                    # Stored events although we asked for none ("limit":0; nostr-relay 1.14 reads
                    # a limit of 0 as "no limit"). A first start must re-wake nobody: ignore them.
                    self.unrequested += 1
                    self.sink.on_unrequested(self)
                    self.report_once(
                        "stored", "sent stored events although we asked for none", logging.INFO
                    )
                    return
                self.backfilled += 1
            self.sink.on_event(self, msg[2])
        elif kind in ("EOSE", "CLOSED") and (len(msg) < 2 or msg[1] != self._sub_id):
            self.report_once("foreign", "sent messages for a subscription we do not have")
        elif kind == "EOSE":
            # Only a subscription waiting for it goes live. One that was CLOSED waits for its
            # resubscription: an EOSE must not revive it (it would also let the next CLOSED
            # queue another REQ, one per CLOSED/EOSE pair).
            if self.state is RelayState.SUBSCRIBED:
                self._mark_live()
        elif kind == "CLOSED":
            self._on_closed(msg[2] if len(msg) > 2 and isinstance(msg[2], str) else "")
        elif kind == "NOTICE":
            self._log_notice(msg[1] if len(msg) > 1 else "")
        elif kind == "AUTH":
            if len(msg) >= 2 and _usable_challenge(msg[1]):
                # Each answer costs a signature: one per new challenge and one at a time, so an
                # AUTH flood cannot make us sign per frame. A challenge that arrives meanwhile is
                # kept; CLOSED "auth-required:" answers the newest one.
                fresh = msg[1] != self._challenge
                self._challenge = msg[1]
                if fresh and not self._auth_answering:
                    self._auth_answering = True
                    self._authenticate(resubscribe=False)
        elif kind == "OK" and len(msg) >= 3 and isinstance(msg[1], str):
            fut = self._auth_pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                accepted = msg[2] is True
                if not accepted:
                    detail = msg[3] if len(msg) > 3 else ""
                    log.warning("relay %s refused our AUTH: %s", self.label, safe_text(detail))
                fut.set_result(accepted)

    def report_once(self, fault: str, what: str, level: int = logging.WARNING) -> None:
        """Log that this relay ``what`` (our words, never its text), once per ``fault`` and
        connection: the metrics that count the fault carry no relay label, so only this line
        tells the operator which relay it is, and a relay repeating it must not flood the log."""
        if fault not in self._reported:
            self._reported.add(fault)
            log.log(
                level,
                "relay %s %s (dropped; not logged again on this connection)",
                self.label,
                what,
            )

    def _log_notice(self, text: object) -> None:
        """Log a NOTICE unless this relay has used up its lines; the next line logged says how
        many were left out meanwhile."""
        limiter = self.notice_limiter
        if not limiter.admit(self._notice_budget, limiter.clock()):
            self._notices_not_logged += 1
            return
        left_out, self._notices_not_logged = self._notices_not_logged, 0
        note = f" ({left_out} earlier NOTICEs not logged)" if left_out else ""
        log.info("relay %s NOTICE: %s%s", self.label, safe_text(text), note)

    def _on_closed(self, reason: str) -> None:
        if self.state is RelayState.BACKOFF:
            # This subscription is already closed and its resubscription pending: a repeated
            # CLOSED must not queue another REQ (it would leave an orphan subscription open).
            return
        if self.state is RelayState.LIVE:
            self.disconnect_at = self.clock()  # the live stream was interrupted here
        self._failed()
        self._set_state(RelayState.BACKOFF)
        if reason.startswith(_AUTH_REQUIRED) and self._challenge is not None:
            log.info("relay %s requires authentication; answering its challenge", self.label)
            self._authenticate(resubscribe=True)
            return
        log.info("relay %s closed the subscription: %s", self.label, safe_text(reason))
        self._spawn(self._resubscribe_later(self._backoff()))

    def _authenticate(self, *, resubscribe: bool) -> None:
        # The challenge now: the task may start after more AUTH frames were read, and the
        # answer is to the challenge that asked for it.
        assert self._challenge is not None
        self._spawn(self._auth_flow(self._challenge, resubscribe))

    async def _auth_flow(self, challenge: str, resubscribe: bool) -> None:
        event = auth_event(self.key, self.url, challenge)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        earlier = self._auth_pending.get(event.id)
        if earlier is not None:
            fut = earlier  # the same AUTH is already waiting for its OK: share it
        self._auth_pending[event.id] = fut
        await self._send(["AUTH", event.to_dict()])
        try:
            # Some relays never answer AUTH with OK: after a while, assume it worked.
            accepted = await asyncio.wait_for(fut, 5.0)
        except TimeoutError:
            accepted = True
        finally:
            # Two AUTHs for one challenge within a second are the same event: pop only ours.
            if self._auth_pending.get(event.id) is fut:
                del self._auth_pending[event.id]
            if not resubscribe:
                self._auth_answering = False
        self.authenticated = self.authenticated or accepted
        if resubscribe:
            await self._resubscribe_later(0 if accepted else self._backoff())
