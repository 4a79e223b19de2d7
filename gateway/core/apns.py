"""APNs provider client: one app's credential, connections and request classification.

Built on aioapns 4 (connection pool, HTTP/2 protocol, stream accounting), with the
workarounds of specs/providers.md §4.1 applied through subclasses:

- `_ApnsProtocol` (subclass of `APNsTLSClientProtocol`) carries the configured host
  and port (`APNS_SERVER`/`APNS_PORT`, set per client), a one-hour inactivity time,
  one stream until the server's SETTINGS allow more, and its own request/response
  path. aioapns's path cannot omit or send unknown push types (location,
  pushtotalk, widgets), cannot send `apns-expiration: 0`, encodes bodies
  non-compactly (so the size checked is not the size sent), never returns HTTP/2
  flow-control credit for response DATA (the connection stalls after 64 KiB of
  error bodies), raises instead of waiting when the send window is short, leaks
  per-stream state on every 200, and leaves bodiless errors and RST_STREAM hanging
  with their stream slot taken. Here a stream resolves when it ends or is reset,
  and a send abandoned by its timeout resets its stream and PINGs the connection
  (closed when the PING goes unanswered: a server or path that stopped answering).
  A GOAWAY retires the connection: the requests above its last stream id, and those
  refused with RST_STREAM REFUSED_STREAM, were not processed and are sent again at
  once (RFC 9113 section 8.7), while those at or below it keep waiting for their
  answers (aioapns, and h2 itself, dropped the connection at once: those were retried
  and could be delivered twice).
- `_StreamSlots` (subclass of `ChannelPool`) follows SETTINGS_MAX_CONCURRENT_STREAMS
  correctly in both directions.
- `_ApnsPool` (subclass of `APNsBaseConnectionPool`) creates connections with one
  shared JWT header provider (`_ProviderToken`), optionally through an HTTP CONNECT
  proxy, queues on the least loaded connection when all are full (no busy-poll),
  drops a connection from the pool as soon as it starts closing, and tolerates double
  discards.

Every send is bounded by `request_timeout`; the pool makes one attempt, without
aioapns's sleep after a failed connect: retries belong to the dispatcher.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

import jwt
from aioapns.common import NotificationRequest, NotificationResult
from aioapns.connection import (
    APNsBaseClientProtocol,
    APNsBaseConnectionPool,
    APNsTLSClientProtocol,
    AuthorizationHeaderProvider,
    ChannelPool,
)
from aioapns.exceptions import ConnectionClosed
from aioapns.exceptions import ConnectionError as ApnsConnectionError
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_private_key,
)
from h2.connection import ConnectionInputs, ConnectionState
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    PingAckReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import H2Error, NoAvailableStreamIDError
from hpack import NeverIndexedHeaderTuple

from gateway.config import ApnsAppConfig
from gateway.config.apps import topic_refusal
from gateway.core.classify import APNS_RECONNECT, classify_apns
from gateway.core.http import (
    ca_bundle,
    parse_retry_after,
    printable,
    proxy_label,
    resolve_proxy,
    ssl_context,
)
from gateway.core.push import Attempt, Outcome, ProviderKind, Push, Reason

log = logging.getLogger(__name__)

PRODUCTION_HOST = "api.push.apple.com"
SANDBOX_HOST = "api.sandbox.push.apple.com"
DEFAULT_PORT = 443

PAYLOAD_LIMIT = 4096
VOIP_PAYLOAD_LIMIT = 5120
COLLAPSE_ID_LIMIT = 64
# Streams per connection, when the server allows more. h2 scans every open stream of
# a connection for each new request, so a few connections with a hundred streams each
# cost less CPU than one with a thousand (and Apple recommends several connections).
MAX_STREAMS = 128
IDLE_SECONDS = 3600.0  # aioapns closes idle connections after 10 s; Apple wants them kept
# The most of an answer's body kept: APNs's are under 100 bytes (`{"reason": ...}`). A
# longer one (a proxy's, a broken upstream's, tens of megabytes or never ending) was
# kept whole, the connection's window given back as it came: the stream is answered
# with what came so far and reset instead.
BODY_LIMIT = 16 * 1024

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~-]+")  # path-safe; APNs tokens are hex
# Far above any device token (32 bytes, 64 hex digits, today), far below the header
# sizes HTTP/2 servers accept (commonly 8 to 64 KiB): a `:path` over a server's limit
# makes it close the connection, failing every push in flight on it, at every retry.
MAX_TOKEN_LENGTH = 1024


# --- provider token (JWT) ---------------------------------------------------------------


class _ProviderToken(AuthorizationHeaderProvider):
    """The one ES256 provider token of a (key, team), shared by every connection.

    Re-signed when older than `RESIGN_AFTER` (checked on use), and by `refresh()`:
    forced after an `ExpiredProviderToken` answer to the current token, otherwise
    only when older than `MIN_INTERVAL` (APNs answers TooManyProviderTokenUpdates
    to tokens replaced more often than every 20 minutes). A forced re-sign too comes
    at most once per `MIN_INTERVAL`: when the token it signed is expired at once as
    well, this host's clock is over an hour off Apple's, and a token signed for every
    push would only turn the answers into TooManyProviderTokenUpdates, hiding the clock.
    """

    RESIGN_AFTER = 45 * 60.0
    MIN_INTERVAL = 20 * 60.0

    def __init__(
        self,
        key: str | ec.EllipticCurvePrivateKey,
        key_id: str,
        team_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(key, str):  # PEM text
            loaded = load_pem_private_key(key.encode(), password=None)
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise ValueError("the APNs signing key must be an EC (P-256) key")
            key = loaded
        self._key = key
        self._key_id = key_id
        self._team_id = team_id
        # What the token stands for: apps that sign with the same key for the same team
        # share one token (`share_provider_tokens`), whichever file holds the key.
        self.identity: tuple[bytes, str, str] = (
            key.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo),
            key_id,
            team_id,
        )
        self._clock = clock
        self.generation = 0
        self.issued_at = 0.0
        self.signatures = 0
        self._expired_generation = -1
        self._forced_at = float("-inf")
        self._header = ""
        self._sign()

    def _sign(self) -> None:
        now = self._clock()
        token = jwt.encode(
            {"iss": self._team_id, "iat": int(now)},
            self._key,
            algorithm="ES256",
            headers={"kid": self._key_id},
        )
        self._header = f"bearer {token}"
        self.issued_at = now
        self.generation += 1
        self.signatures += 1

    def get_header(self) -> str:
        if self._clock() - self.issued_at >= self.RESIGN_AFTER:
            self._sign()
        return self._header

    def expired(self, generation: int) -> None:
        """APNs said ExpiredProviderToken to a request signed with `generation`."""
        self._expired_generation = max(self._expired_generation, generation)

    def refresh(self) -> bool:
        """Re-sign if allowed (see class doc); True when a new token was signed."""
        now = self._clock()
        if now - self.issued_at >= self.MIN_INTERVAL:
            self._sign()
            return True
        if self._expired_generation == self.generation and now - self._forced_at >= (
            self.MIN_INTERVAL
        ):
            self._forced_at = now
            self._sign()
            return True
        return False


def share_provider_tokens(clients: Iterable[object]) -> None:
    """Give the APNs clients (not yet started) whose apps sign with the same key for the
    same team one provider token between them.

    specs/providers.md §2.3: one JWT per (key, team) for all connections. A team key
    serves every app of the team, production and sandbox alike; a token signed per app
    multiplied the signatures APNs sees for the key (`TooManyProviderTokenUpdates`), and
    a re-sign forced by `ExpiredProviderToken` on one app left the others' tokens old.
    """
    tokens: dict[tuple[bytes, str, str], _ProviderToken] = {}
    for client in clients:
        if isinstance(client, ApnsClient) and client._auth is not None:
            client._auth = tokens.setdefault(client._auth.identity, client._auth)


# --- HTTP/2 protocol ----------------------------------------------------------------------


class _Request(NotificationRequest):
    """An aioapns request carrying what its own fields cannot express."""

    __slots__ = ("body", "expiration", "push_type_name")

    def __init__(
        self,
        push: Push,
        body: bytes,
        push_type: str | None,
        priority: int | None,
    ) -> None:
        opts = push.apns
        super().__init__(
            device_token=push.token,
            message=push.payload,  # type: ignore[arg-type]  # unused: `body` is sent
            notification_id=push.id,
            priority=priority,
            collapse_key=opts.collapse_id,
            apns_topic=opts.topic,
        )
        self.body = body
        self.expiration = opts.expiration
        self.push_type_name = push_type


class _Result(NotificationResult):
    __slots__ = ("retry_after",)

    def __init__(
        self,
        notification_id: str,
        status: str,
        description: str | None = None,
        timestamp: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(notification_id, status, description, timestamp)
        self.retry_after = retry_after


class StreamResetError(Exception):
    """The server reset the request's stream (RST_STREAM)."""


class NotProcessedError(ConnectionClosed):
    """The server did not process the request: its stream was refused (RST_STREAM
    REFUSED_STREAM) or is above a GOAWAY's last stream id. Safe to send again."""


def _code_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"code {code}"


# APNs's debug data is `{"reason": "Shutdown"}`: anything much longer is not APNs's, and
# is not parsed (a GOAWAY frame may carry up to our SETTINGS_MAX_FRAME_SIZE of it).
_GOAWAY_DATA_LIMIT = 512


def _goaway_reason(data: bytes | None) -> str:
    """APNs's `{"reason": ...}` in a GOAWAY's debug data, printable and bounded."""
    if not data or len(data) > _GOAWAY_DATA_LIMIT:
        return ""
    try:
        reason = json.loads(data).get("reason")
    # RecursionError: `[[[[...` nested deeper than the interpreter's limit. Raised here,
    # it ended the connection's read with a traceback, and the requests Apple had
    # processed below the GOAWAY's last stream failed `connection_error`: sent twice.
    except (ValueError, AttributeError, RecursionError):
        return ""
    return printable(reason[:64]) if isinstance(reason, str) else ""


class _Stream:
    __slots__ = ("body", "future", "headers", "notification_id")

    def __init__(self, notification_id: str, future: asyncio.Future[NotificationResult]) -> None:
        self.notification_id = notification_id
        self.future = future
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.body: bytes = b""


class _StreamSlots(ChannelPool):
    """aioapns's per-connection stream semaphore, fixed for a bound that changes while
    streams are open (SETTINGS_MAX_CONCURRENT_STREAMS moves between 1 and 500+ on APNs).

    aioapns clamps the releases that should hand out new slots to the *old* bound, so a
    grown bound is never used, and on Python 3.11 a count made negative by a shrunk bound
    passes `locked()` as free (streams beyond the peer's limit: a protocol error).
    """

    @property
    def bound(self) -> int:
        return self._bound_value

    @bound.setter
    def bound(self, new_bound: int) -> None:
        self._value += new_bound - self._bound_value
        self._bound_value = new_bound
        while self._value > 0 and any(not w.done() for w in self._waiters or ()):
            self._wake_up_next()

    def locked(self) -> bool:
        return self._value <= 0 or super().locked()

    def release(self) -> None:
        self._value = min(self._value + 1, self._bound_value)
        if self._value > 0:
            self._wake_up_next()

    def destroy(self, exc: Exception) -> None:
        """Fail the sends waiting for a stream (the connection was lost) with `exc`.

        aioapns pops the waiters off the queue first, and `Semaphore.acquire` then fails
        removing its own: the send raised ValueError instead of `exc`, which the
        dispatcher ends `client_error` and never retries. Each waiter removes itself.
        """
        for waiter in self._waiters or ():
            if not waiter.done():
                waiter.set_exception(exc)


class _ApnsProtocol(APNsTLSClientProtocol):
    """aioapns protocol with our host/port, long idle time and request path (module doc)."""

    APNS_SERVER = PRODUCTION_HOST
    APNS_PORT = DEFAULT_PORT
    INACTIVITY_TIME = IDLE_SECONDS  # type: ignore[assignment]
    # Seconds the PING sent after a request timed out may go unanswered before the
    # connection is taken for dead and closed.
    PING_TIMEOUT = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, _Stream] = {}
        self._window_waiters: list[asyncio.Future[None]] = []
        # aioapns assumes 1000 streams until the server's SETTINGS arrive; APNs allows one
        # on a fresh token-auth connection, and opening more is a protocol error.
        self.free_channels = _StreamSlots(1)
        self._flush_scheduled = False
        self._last_write = 0.0
        self._retired = False  # out of the pool; closes when its last stream ends
        self._ping_sent: float | None = None  # loop time of the PING not yet answered
        self._ping_timer: asyncio.TimerHandle | None = None
        self.on_capacity: Callable[[], None] | None = None  # set by the pool
        # h2 takes no frame after a GOAWAY it received (python-hyper/h2#1181): the answers
        # to the streams the server still processes would be a protocol error. The
        # connection stays open on our side instead; `on_connection_terminated` retires it.
        machine = self.conn.state_machine
        machine._transitions = {  # type: ignore[misc]
            **machine._transitions,
            (ConnectionState.CLIENT_OPEN, ConnectionInputs.RECV_GOAWAY): (
                None,
                ConnectionState.CLIENT_OPEN,
            ),
        }
        # Huffman coding saves a third of the header bytes and costs ~100 µs of CPU per
        # request in pure-Python hpack: on a provider link, CPU is the scarcer resource.
        self.conn.encoder.encode = partial(self.conn.encoder.encode, huffman=False)  # type: ignore[method-assign]
        # Every header we send is built here from values `_prepare` checked (hex token,
        # topic, lowercase names): h2 re-validating and normalising them costs ~10 % of
        # the CPU of a push. Inbound validation stays on: the answers are the provider's.
        self.conn.config.validate_outbound_headers = False
        self.conn.config.normalize_outbound_headers = False

    # Writes are coalesced: `flush()` (called by aioapns and below after every frame
    # h2 queues) schedules one write per loop iteration, so the requests and acks of
    # one iteration share a TLS record and a system call. The idle timer is re-armed
    # lazily: aioapns cancelled and re-created it on every write.

    def flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._write_pending)

    def _write_pending(self) -> None:
        self._flush_scheduled = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        data = self.conn.data_to_send()
        if data:
            self._last_write = self.loop.time()
            transport.write(data)

    def refresh_inactivity_timer(self) -> None:
        self._last_write = self.loop.time()
        if self.inactivity_timer is None:
            self.inactivity_timer = self.loop.call_later(self.INACTIVITY_TIME, self._idle_check)

    def _idle_check(self) -> None:
        idle = self.loop.time() - self._last_write
        if idle >= self.INACTIVITY_TIME:
            self.inactivity_timer = None
            self.close()
        else:
            self.inactivity_timer = self.loop.call_later(
                self.INACTIVITY_TIME - idle, self._idle_check
            )

    def retire(self) -> None:
        """Take no new request, and close once the streams still open have ended.

        After an answer in `APNS_RECONNECT` the retry must go to another connection,
        while the other requests on this one may still get their answers: closing at
        once would fail them `transient`, and their retries could deliver twice.
        """
        self._retired = True
        if self.on_connection_lost is not None:
            self.on_connection_lost(self)  # out of the pool (the pool tolerates repeats)
        # The sends waiting for a stream here were not sent: another connection takes
        # them now, rather than after this one's slowest answer.
        self.free_channels.destroy(NotProcessedError("connection retired"))
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self._retired and not self._streams:
            self.close()

    def on_connection_terminated(self, event: ConnectionTerminated) -> None:
        """GOAWAY: the requests above its last stream id were not processed (sent again
        by the pool, on another connection); those at or below it still get their
        answers here, and the connection closes after the last of them (or when the
        server closes it: they then end `connection_error`)."""
        last = event.last_stream_id or 0
        code = _code_name(event.error_code or 0)
        reason = _goaway_reason(event.additional_data)
        refused = NotProcessedError(f"GOAWAY from APNs ({code} {reason}): not processed")
        self.free_channels.destroy(refused)  # sends waiting for a stream here go elsewhere
        dropped = [sid for sid in self._streams if sid > last]
        for stream_id in dropped:
            stream = self._streams.pop(stream_id)
            self.free_channels.release()
            if not stream.future.done():
                stream.future.set_exception(refused)
        log.log(
            logging.INFO if event.error_code == ErrorCodes.NO_ERROR else logging.WARNING,
            "APNs sent GOAWAY (%s%s, last stream %d): %d requests not processed are sent "
            "again on another connection, %d still wait for their answers on this one",
            code,
            f" {reason}" if reason else "",
            last,
            len(dropped),
            len(self._streams),
        )
        self._wake_senders()
        self.retire()

    def check_alive(self) -> None:
        """A request timed out: PING the server, and close the connection when the
        PING goes unanswered for `PING_TIMEOUT` (a hung server, a path dropping
        everything: TCP alone notices that only after a quarter of an hour, and every
        push meanwhile timed out on this connection, its retries too)."""
        if self._ping_sent is not None or self.transport is None or self.transport.is_closing():
            return
        try:
            self.conn.ping(b"pushgw\x00\x00")
        except H2Error:  # the connection is closing: nothing to check
            return
        self._ping_sent = self.loop.time()
        self.flush()
        self._ping_timer = self.loop.call_later(self.PING_TIMEOUT, self._ping_unanswered)

    def _ping_unanswered(self) -> None:
        self._ping_timer = None
        if self._ping_sent is None or self.transport is None:
            return
        log.warning(
            "APNs connection did not answer a PING within %g s: closing it "
            "(%d requests on it end connection_error)",
            self.PING_TIMEOUT,
            len(self._streams),
        )
        if self.on_connection_lost is not None:
            self.on_connection_lost(self)
        # Not a TLS shutdown, which would wait on a peer that no longer answers.
        self.transport.abort()

    def _ping_answered(self) -> None:
        self._ping_sent = None
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None

    def on_remote_settings_changed(self, changed_settings: Any) -> None:
        limit = self.conn.remote_settings.max_concurrent_streams
        self.free_channels.bound = max(1, min(limit, MAX_STREAMS))
        if self.on_capacity is not None:
            self.on_capacity()

    async def send_notification(self, request: NotificationRequest) -> NotificationResult:
        assert isinstance(request, _Request)
        stream_id = await self.free_channels.acquire()
        if self._retired:  # a GOAWAY came while this send waited for a stream
            self.free_channels.release()
            raise NotProcessedError("connection retired")
        if self.transport is None or self.transport.is_closing():
            self.free_channels.release()
            raise ConnectionClosed("connection closing")
        nid = request.notification_id
        # Values unique to one request are never-indexed literals: indexing them would
        # evict the JWT and topic from the HPACK table, which then stay one byte each.
        headers: list[tuple[str, str] | NeverIndexedHeaderTuple] = [
            (":method", "POST"),
            (":scheme", "https"),
            NeverIndexedHeaderTuple(":path", f"/3/device/{request.device_token}"),
            ("host", _authority(self.APNS_SERVER)),
            NeverIndexedHeaderTuple("apns-id", nid),
        ]
        topic = request.apns_topic or self.apns_topic
        if topic:
            headers.append(("apns-topic", topic))
        if request.push_type_name is not None:
            headers.append(("apns-push-type", request.push_type_name))
        if request.expiration is not None:
            headers.append(("apns-expiration", str(request.expiration)))
        if request.priority is not None:
            headers.append(("apns-priority", str(request.priority)))
        if request.collapse_key is not None:
            headers.append(("apns-collapse-id", request.collapse_key))
        if self.auth_provider is not None:
            headers.append(("authorization", self.auth_provider.get_header()))

        future: asyncio.Future[NotificationResult] = self.loop.create_future()
        self._streams[stream_id] = _Stream(nid, future)
        try:
            body = request.body
            self.conn.send_headers(stream_id, headers, end_stream=not body)
            sent = 0
            while sent < len(body):
                # As much as the windows and the frame size allow (usually all of it at
                # once): a server may grant a stream less window than a payload, and
                # more only as DATA arrives, so waiting for room for the whole body
                # could wait for ever.
                size = min(
                    len(body) - sent,
                    self.conn.local_flow_control_window(stream_id),
                    self.conn.max_outbound_frame_size,
                )
                if size > 0:
                    end = sent + size
                    self.conn.send_data(stream_id, body[sent:end], end_stream=end == len(body))
                    sent = end
                    continue
                self.flush()
                waiter: asyncio.Future[None] = self.loop.create_future()
                self._window_waiters.append(waiter)
                await waiter
                if future.done():
                    # Answered, reset by the server, or the connection lost, while we
                    # waited (`_finish`, `connection_lost` woke us): that is this send's
                    # answer (an error is retrieved here). A server may answer before the
                    # whole request (RFC 9113 section 8.1), so the rest of the body is
                    # not sent: our half of the stream is closed instead.
                    if future.exception() is None:
                        self._cancel_stream(stream_id)
                    return await future
            self.flush()
            return await future
        finally:
            if self._streams.pop(stream_id, None) is not None:
                # Abandoned (timeout, cancellation, local error): free the stream slot.
                self.free_channels.release()
                self._cancel_stream(stream_id)
                self._close_if_retired()
                self.check_alive()

    def _cancel_stream(self, stream_id: int) -> None:
        """RST_STREAM CANCEL: we send no more on this stream (the server may have closed it)."""
        if self.transport is not None and not self.transport.is_closing():
            try:
                self.conn.reset_stream(stream_id, ErrorCodes.CANCEL)
                self.flush()
            except H2Error:
                pass

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except H2Error as exc:
            log.warning("APNs connection protocol error (%s); closing", type(exc).__name__)
            self.close()
            return
        for event in events:
            if isinstance(event, ResponseReceived):
                stream = self._streams.get(event.stream_id)  # type: ignore[arg-type]
                if stream is not None:
                    stream.headers = event.headers  # type: ignore[assignment]
            elif isinstance(event, DataReceived):
                sid: int = event.stream_id  # type: ignore[assignment]
                self.conn.acknowledge_received_data(event.flow_controlled_length, sid)  # type: ignore[arg-type]
                stream = self._streams.get(sid)
                if stream is not None:
                    stream.body += event.data  # type: ignore[operator]
                    if len(stream.body) > BODY_LIMIT:
                        stream.body = stream.body[:BODY_LIMIT]
                        self._finish(sid)
                        self._cancel_stream(sid)
            elif isinstance(event, StreamEnded):
                self._finish(event.stream_id)  # type: ignore[arg-type]
            elif isinstance(event, StreamReset):
                self._finish(event.stream_id, reset=int(event.error_code))  # type: ignore[arg-type]
            elif isinstance(event, WindowUpdated):
                self._wake_senders()
            elif isinstance(event, RemoteSettingsChanged):
                self.on_remote_settings_changed(event.changed_settings)  # type: ignore[arg-type]
                self._wake_senders()
            elif isinstance(event, ConnectionTerminated):
                self.on_connection_terminated(event)
            elif isinstance(event, PingAckReceived):
                self._ping_answered()
        self._close_if_retired()  # its last stream ended (answered or reset) in this read
        if self.transport is not None and not self.transport.is_closing():
            self.flush()

    def _wake_senders(self) -> None:
        if not self._window_waiters:  # the usual case, on every answer
            return
        waiters, self._window_waiters = self._window_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _finish(self, stream_id: int, reset: int | None = None) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        self.free_channels.release()
        if stream.future.done():
            return
        if reset is not None:
            code = _code_name(reset)
            stream.future.set_exception(
                NotProcessedError(f"stream refused by APNs ({code}): not processed")
                if reset == ErrorCodes.REFUSED_STREAM
                else StreamResetError(f"stream reset by APNs ({code})")
            )
            # Its sender may be waiting for window to send the body, which no longer comes.
            self._wake_senders()
            return
        status = ""
        retry_after = None
        for name, value in stream.headers or ():
            if name == b":status":
                status = value.decode("latin-1")
            elif name == b"retry-after":
                retry_after = parse_retry_after(value)
        reason = timestamp = None
        if status != "200" and stream.body:
            try:
                data = json.loads(stream.body)
            except ValueError:
                data = None
            if isinstance(data, Mapping):
                reason = data.get("reason") if isinstance(data.get("reason"), str) else None
                ts = data.get("timestamp")
                timestamp = ts if isinstance(ts, int) else None
        stream.future.set_result(
            _Result(stream.notification_id, status, reason, timestamp, retry_after)
        )
        # Its sender may be waiting for window to send the body, which is now not needed.
        self._wake_senders()

    def close(self) -> None:
        # Out of the pool at once: `connection_lost`, which aioapns waits for, comes only
        # after the TLS shutdown round trip, and every send picking this connection
        # meanwhile failed at once (after a GOAWAY: a burst of retries, maybe an open
        # circuit breaker) instead of opening a new connection.
        if self.on_connection_lost is not None:
            self.on_connection_lost(self)
        super().close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ping_answered()  # no PING timer outlives the connection
        streams, self._streams = self._streams, {}
        closed = ConnectionClosed(str(exc) if exc else "connection closed")
        closed.__cause__ = exc  # a TLS alert stays readable (`_certificate_alert`)
        for stream in streams.values():
            if not stream.future.done():
                stream.future.set_exception(closed)
        self._wake_senders()  # each finds its stream's answer is `closed`, and raises it
        super().connection_lost(exc)


# --- connection pool ----------------------------------------------------------------------


class _ConnectionHeld(Exception):
    """A send that waited for a connection while another send's attempt was refused with
    a certificate alert: it ends on that refusal, not with one more TLS handshake."""


class _ApnsPool(APNsBaseConnectionPool):
    """aioapns pool creating `_ApnsProtocol` connections with a shared JWT provider."""

    def __init__(
        self,
        *,
        protocol_class: type[_ApnsProtocol],
        topic: str | None,
        max_connections: int,
        ssl_context: ssl.SSLContext,
        auth: AuthorizationHeaderProvider | None,
        proxy: str | None,
    ) -> None:
        super().__init__(topic=topic, max_connections=max_connections, max_connection_attempts=1)
        self._opening = asyncio.Lock()
        self.protocol_class = protocol_class
        self.ssl_context = ssl_context
        self.auth = auth
        self.proxy = urlsplit(proxy) if proxy else None
        self.on_capacity: Callable[[], None] | None = None  # `streams()` may have changed
        # False while no connection may be opened (APNs refused the app's certificate
        # moments ago): a send that waited for another's attempt ends `_ConnectionHeld`.
        self.may_connect: Callable[[], bool] = lambda: True

    def streams(self) -> int:
        """Requests the pool can carry at once: the stream bound of each open connection
        (what its server's SETTINGS allow), and one for each connection it may still open
        (a fresh connection allows one until those SETTINGS come)."""
        bounds = sum(
            c.free_channels.bound for c in self.connections if isinstance(c, _ApnsProtocol)
        )
        return bounds + max(self.max_connections - len(self.connections), 0)

    def _capacity_changed(self) -> None:
        if self.on_capacity is not None:
            self.on_capacity()

    async def create_connection(self) -> APNsBaseClientProtocol:
        host = self.protocol_class.APNS_SERVER
        port = self.protocol_class.APNS_PORT
        factory = partial(
            self.protocol_class,
            self.apns_topic,  # type: ignore[arg-type]
            self.loop,
            self.discard_connection,  # type: ignore[arg-type]
            self.auth,
        )
        if self.proxy is None:
            _, protocol = await self.loop.create_connection(
                factory, host=host, port=port, ssl=self.ssl_context
            )
        else:
            sock = await _connect_tunnel(self.loop, self.proxy, host, port)
            try:
                _, protocol = await self.loop.create_connection(
                    factory, sock=sock, ssl=self.ssl_context, server_hostname=host
                )
            except BaseException:
                sock.close()
                raise
        # HTTP/2 over TLS is negotiated by ALPN (RFC 9113 section 3.2). A server that did
        # not select h2 (an HTTP/1.1 endpoint, a wrong host or port) was sent the HTTP/2
        # preface regardless: it answered in HTTP/1.1, which h2 buffers silently, and
        # the send failed as a bare "connection closed" (or timed out, when the server
        # kept the connection open) after the provider JWT had gone out. Refuse it here,
        # before any request, with an error that says what is wrong.
        ssl_object = protocol.transport.get_extra_info("ssl_object") if protocol.transport else None
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if alpn != "h2":
            protocol.close()
            raise ConnectionError(
                f"APNs server {_authority(host)}:{port} did not negotiate HTTP/2 "
                f"(ALPN h2; got {alpn!r})"
            )
        return protocol

    async def acquire(self) -> APNsBaseClientProtocol:
        for connection in self.connections:
            if not connection.is_busy:
                return connection
        if len(self.connections) < self.max_connections:
            # One opening at a time: concurrent callers would otherwise fall into
            # aioapns's busy-poll (and its WARNING per send) while the first connects.
            async with self._opening:
                for connection in self.connections:
                    if not connection.is_busy:
                        return connection
                if len(self.connections) < self.max_connections:
                    if not self.may_connect():
                        raise _ConnectionHeld("no connection opened: certificate refused")
                    # Opened here, not by aioapns's acquire(), which turns every failure
                    # into a bare ConnectionError: the OSError says what went wrong.
                    try:
                        connection = await self.create_connection()
                    except OSError:
                        raise
                    except Exception as exc:
                        raise ApnsConnectionError(type(exc).__name__) from exc
                    self.connections.append(connection)
                    if isinstance(connection, _ApnsProtocol):
                        connection.on_capacity = self._capacity_changed
                    self._capacity_changed()
                    return connection
        # All connections full: queue on the least loaded one's stream semaphore instead
        # of aioapns's 10 ms busy-poll, which also logs a WARNING per waiting send.
        return min(self.connections, key=lambda c: len(c.free_channels._waiters or ()))

    def discard_connection(self, connection: APNsBaseClientProtocol) -> None:
        # aioapns raises ValueError when a connection is discarded twice.
        if connection in self.connections:
            self.connections.remove(connection)
            self._capacity_changed()

    def close(self) -> None:
        # A copy: closing a connection discards it from `connections` at once.
        for connection in list(self.connections):
            connection.close()

    async def send_notification(self, request: NotificationRequest) -> NotificationResult:
        """One attempt. aioapns's loop sleeps a fixed second after a failed connect even
        on its last attempt, holding the lane slot, and reports only MaxAttemptsExceeded:
        here the failure itself ends the send at once (the dispatcher owns retries)."""
        try:
            return await self._send_once(request)
        except NotProcessedError:
            # Not processed by the server (RFC 9113 section 8.7): sent again at once, once,
            # on another connection after a GOAWAY (that one takes no new request). Not
            # a retry: nothing reached Apple; a second refusal ends `connection_error`.
            return await self._send_once(request)

    async def _send_once(self, request: NotificationRequest) -> NotificationResult:
        connection = await self.acquire()
        try:
            result = await connection.send_notification(request)
        except NoAvailableStreamIDError:
            connection.close()  # its stream ids are used up: the next send opens another
            raise
        if result.description in APNS_RECONNECT and isinstance(connection, _ApnsProtocol):
            connection.retire()  # the retry opens (or takes) another connection
        return result


def _authority(host: str) -> str:
    """`host` as a URL or a `host` header writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


async def _connect_tunnel(
    loop: asyncio.AbstractEventLoop, proxy: SplitResult, host: str, port: int
) -> socket.socket:
    """Open a TCP connection through an HTTP CONNECT proxy; TLS is started by the caller.

    Hand-written because aioapns's own proxy support only recognises a literal
    "HTTP/1.1 200 Connect" in the first chunk, never reports a refusal (the send
    hangs), has no proxy authentication, and lets two transports share one socket.
    Every error names the proxy (host and port only, never its credentials), so that
    an operator reading `connection_error` looks at the proxy, not at Apple.
    """
    label = proxy_label(proxy.geturl())
    try:
        infos = await loop.getaddrinfo(
            proxy.hostname, proxy.port or 80, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
    except socket.gaierror as exc:
        raise ConnectionError(f"proxy {label} did not resolve ({exc})") from exc
    sock: socket.socket | None = None
    error: OSError = OSError(f"proxy {label} did not resolve")
    for family, kind, proto, _, address in infos:
        candidate = socket.socket(family, kind, proto)
        candidate.setblocking(False)
        try:
            await loop.sock_connect(candidate, address)
        except OSError as exc:
            candidate.close()
            error = ConnectionError(f"proxy {label} unreachable ({exc})")
            continue
        except BaseException:
            candidate.close()
            raise
        sock = candidate
        break
    if sock is None:
        raise error
    try:
        target = f"{_authority(host)}:{port}"
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
        if proxy.username is not None:
            user_pass = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}"
            lines.append(
                f"Proxy-Authorization: Basic {base64.b64encode(user_pass.encode()).decode()}"
            )
        await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = await loop.sock_recv(sock, 4096)
            if not chunk:
                raise ConnectionError(f"proxy {label} closed the connection during CONNECT")
            if len(answer) > 16384:
                raise ConnectionError(f"proxy {label} answered CONNECT with over 16 KiB")
            answer += chunk
        status_line = answer.split(b"\r\n", 1)[0]
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or parts[1] != b"200":
            raise ConnectionError(
                f"proxy {label} refused CONNECT to {target}: "
                + printable(status_line[:80].decode("latin-1"))
            )
    except BaseException:
        sock.close()
        raise
    return sock


# --- client -------------------------------------------------------------------------------


def _refusal(reason: str, detail: str) -> Attempt:
    return Attempt(Outcome.PERMANENT, reason=reason, detail=detail)


def _encoded_body(
    payload: Mapping[str, Any], push_type: str | None, max_bytes: int | None
) -> bytes | tuple[str, str]:
    """The bytes an APNs push's `payload` is sent as, or (reason, detail) of its refusal:
    not UTF-8 JSON (a lone surrogate, NaN, a value JSON has no form for), or over the
    limit (`max_bytes`, else 4096 bytes, 5120 for `voip`)."""
    try:
        body = _encode(payload).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # nesting deeper than the stack
        return Reason.INVALID_PAYLOAD, f"APNs payload is not JSON-encodable ({type(exc).__name__})"
    limit = max_bytes or (VOIP_PAYLOAD_LIMIT if push_type == "voip" else PAYLOAD_LIMIT)
    if len(body) > limit:
        return Reason.PAYLOAD_TOO_LARGE, f"APNs payload is {len(body)} bytes, limit {limit}"
    return body


def payload_problem(
    payload: Mapping[str, Any], push_type: str | None = None, max_bytes: int | None = None
) -> str | None:
    """What the core would refuse in an APNs push's `payload` sent with `push_type`
    (`PushPolicy.max_payload_bytes` as `max_bytes`), or None: the check every APNs push's
    body gets before it is sent, in words safe for a log (a size, an error's kind, never
    content). For a plugin to run on a payload it builds from its configuration at start-up.
    """
    if not isinstance(payload, Mapping):
        return "APNs payload must be a JSON object"
    body = _encoded_body(payload, push_type, max_bytes)
    return body[1] if isinstance(body, tuple) else None


class ApnsClient:
    """`ProviderClient` for one APNs app (token or certificate auth)."""

    kind = ProviderKind.APNS

    def __init__(
        self,
        app_id: str,
        config: ApnsAppConfig,
        *,
        proxy: str | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.app_id = app_id
        self.config = config
        # More sends than the connections' streams would wait inside the pool, where the
        # wait eats their request timeout: let them queue in the dispatcher's lane instead.
        # The ceiling; `follow_capacity` keeps the lane to the streams the server allows.
        self.max_in_flight = min(config.max_in_flight, config.max_connections * MAX_STREAMS)
        sandbox = config.environment == "sandbox"
        self.host = config.host or (SANDBOX_HOST if sandbox else PRODUCTION_HOST)
        self.port = config.port or DEFAULT_PORT
        self._timeout = config.request_timeout
        self._default_push_type = config.push_type
        self._ca_file = ca_bundle(config.ca_file, ca_file)
        self._proxy = resolve_proxy(proxy, f"https://{self.host}:{self.port}")
        if self._proxy is not None and urlsplit(self._proxy).scheme not in ("http", ""):
            raise ValueError("only http:// CONNECT proxies are supported for APNs")
        self._auth: _ProviderToken | None = None
        if config.keyfile is not None:
            assert config.key_id and config.team_id
            # The loader `check-config` uses too (CredentialError when it does not load).
            self._auth = _ProviderToken(config.signing_key(), config.key_id, config.team_id)
        # APNs refuses an expired certificate at the TLS handshake: every connection
        # attempt failed `connection_error`, retried, then opened the circuit breaker,
        # whose line points at the network. Past this time pushes end at once instead.
        expires = config.certificate_expires()
        self._certificate_expires = expires.timestamp() if expires is not None else None
        # A TLS certificate alert from APNs (see `_certificate_refused`).
        self._certificate_alert = ""
        self._certificate_refused_until = 0.0
        self._pool: _ApnsPool | None = None
        self._capacity_listener: Callable[[int], None] | None = None

    # ProviderClient ------------------------------------------------------------------

    async def start(self) -> None:
        if self._pool is not None:
            return
        context = ssl_context(self._ca_file, alpn=["h2"])
        if self.config.certfile is not None:
            self.config.load_certificate(context)  # the loader `check-config` uses too
        protocol = type(
            "ApnsProtocol",
            (_ApnsProtocol,),
            {"APNS_SERVER": self.host, "APNS_PORT": self.port},
        )
        self._pool = _ApnsPool(
            protocol_class=protocol,
            topic=self.config.topic,
            max_connections=self.config.max_connections,
            ssl_context=context,
            auth=self._auth,
            proxy=self._proxy,
        )
        self._pool.on_capacity = self._capacity_changed
        self._pool.may_connect = lambda: self._refused_certificate() is None

    def follow_capacity(self, listener: Callable[[int], None]) -> None:
        """Call `listener` with the number of requests the connections can carry at once,
        now and whenever it changes (the dispatcher sizes the lane's slots by it).

        APNs says how many streams a connection may carry (SETTINGS_MAX_CONCURRENT_STREAMS:
        one on a fresh token-auth connection, then hundreds; fewer from a provider under
        load). Sends beyond it waited inside the pool, past their push's deadline and into
        their request timeout: a slow but healthy provider then timed out whole bursts,
        and the timeouts opened the circuit breaker. In the lane they wait deadline-aware.
        """
        self._capacity_listener = listener
        self._capacity_changed()

    def _capacity_changed(self) -> None:
        if self._capacity_listener is None:
            return
        pool = self._pool
        streams = pool.streams() if pool is not None else self.config.max_connections
        self._capacity_listener(max(1, min(self.max_in_flight, streams)))

    def ready(self) -> bool:
        return self._pool is not None

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
            await asyncio.sleep(0)  # let connection_lost fail pending sends

    async def refresh_credentials(self) -> None:
        if self._auth is not None and self._auth.refresh():
            log.info("APNs provider token re-signed for app %s", self.app_id)

    def validate(self, push: Push) -> Attempt | None:
        expired = self._expired_certificate() or self._refused_certificate()
        if expired is not None:
            return expired
        _, refusal = self._prepare(push)
        return refusal

    async def send(self, push: Push) -> Attempt:
        pool = self._pool
        if pool is None:
            return Attempt(
                Outcome.TRANSIENT, reason=Reason.CONNECTION_ERROR, detail="client not started"
            )
        request, refusal = self._prepare(push)
        if refusal is not None:
            return refusal
        assert request is not None
        expired = self._expired_certificate() or self._refused_certificate()
        if expired is not None:
            return expired
        generation = self._auth.generation if self._auth is not None else 0
        try:
            async with asyncio.timeout(self._timeout):
                result = await pool.send_notification(request)
        except TimeoutError:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.TIMEOUT,
                provider_id=push.id,
                detail=f"no APNs answer within {self._timeout:g} s",
            )
        except _ConnectionHeld:
            return self._refused_certificate() or _refusal(
                Reason.CERTIFICATE_REFUSED, self._certificate_alert
            )
        except (
            ConnectionClosed,
            ApnsConnectionError,
            StreamResetError,
            OSError,
            H2Error,
        ) as exc:
            alert = _certificate_alert(exc) if self.config.certfile is not None else None
            if alert is not None:
                return self._certificate_refused(alert)
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.CONNECTION_ERROR,
                provider_id=push.id,
                detail=_describe(exc),
            )
        try:
            status = int(result.status)
        except ValueError:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.CONNECTION_ERROR,
                provider_id=push.id,
                detail="APNs answer without a status",
            )
        attempt = classify_apns(
            status,
            result.description,
            timestamp=result.timestamp,
            retry_after=getattr(result, "retry_after", None),
            apns_id=push.id,
        )
        if attempt.reason == "ExpiredProviderToken" and self._auth is not None:
            self._auth.expired(generation)
        return attempt

    # helpers -------------------------------------------------------------------------

    def _expired_certificate(self) -> Attempt | None:
        """The refusal of every push once the app's certificate has expired (see __init__)."""
        if self._certificate_expires is None or time.time() < self._certificate_expires:
            return None
        expired_on = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self._certificate_expires))
        return _refusal(
            Reason.CERTIFICATE_EXPIRED,
            f"the app's APNs certificate expired on {expired_on}: renew it",
        )

    def _certificate_refused(self, alert: str) -> Attempt:
        """APNs refused the app's certificate at the TLS handshake with `alert`: the
        certificate, not the network. Remembered for `CERTIFICATE_REFUSED_HOLD` seconds,
        during which pushes end the same way without a connection attempt (one TLS
        handshake per push to Apple, refused each time, helps nobody)."""
        self._certificate_alert = alert
        self._certificate_refused_until = time.monotonic() + CERTIFICATE_REFUSED_HOLD
        return self._refused_certificate() or _refusal(Reason.CERTIFICATE_REFUSED, alert)

    def _refused_certificate(self) -> Attempt | None:
        if time.monotonic() >= self._certificate_refused_until:
            return None
        return _refusal(
            Reason.CERTIFICATE_REFUSED,
            f"APNs refused the app's certificate at the TLS handshake (TLS alert "
            f"{self._certificate_alert}): check its certfile",
        )

    @property
    def provider_token(self) -> _ProviderToken | None:
        """The shared JWT provider (None with certificate auth); for tests and metrics."""
        return self._auth

    def _prepare(self, push: Push) -> tuple[_Request | None, Attempt | None]:
        """The request for `push`, or its refusal, built once per push: by `validate`,
        then reused by `send` at each attempt (the JSON encoding of the payload was
        most of the work, done twice per push and once more per retry). Built again
        when the push's payload, token, options, policy or id is another object than
        the one it was built from; a payload changed in place is not seen (a plugin
        hands its payload over with the push)."""
        prepared = push.prepared
        if isinstance(prepared, _Prepared) and prepared.fits(self, push):
            return prepared.request, prepared.refusal
        request, refusal = self._build(push)
        push.prepared = _Prepared(self, push, request, refusal)
        return request, refusal

    def _build(self, push: Push) -> tuple[_Request | None, Attempt | None]:
        opts = push.apns
        payload = push.payload
        if not isinstance(payload, Mapping):
            return None, _refusal(Reason.INVALID_PAYLOAD, "APNs payload must be a JSON object")
        if not _TOKEN_RE.fullmatch(push.token):
            return None, _refusal(Reason.INVALID_PAYLOAD, "device token has invalid characters")
        if len(push.token) > MAX_TOKEN_LENGTH:
            return None, _refusal(
                Reason.INVALID_PAYLOAD, f"device token longer than {MAX_TOKEN_LENGTH} characters"
            )
        push_type = opts.push_type if opts.push_type is not None else self._default_push_type
        body = _encoded_body(payload, push_type, push.policy.max_payload_bytes)
        if isinstance(body, tuple):
            return None, _refusal(*body)
        for name, value in (
            ("apns-topic", opts.topic),
            ("apns-push-type", push_type),
            ("apns-collapse-id", opts.collapse_id),
        ):
            if value is not None and not _is_header_value(value):
                return None, _refusal(
                    Reason.INVALID_PAYLOAD,
                    f"{name} is empty, padded, or has control or unencodable characters",
                )
        # After the check above: a lone surrogate (not printable) has no UTF-8 form.
        if opts.collapse_id is not None and len(opts.collapse_id.encode()) > COLLAPSE_ID_LIMIT:
            return None, _refusal(
                Reason.INVALID_PAYLOAD, f"apns-collapse-id longer than {COLLAPSE_ID_LIMIT} bytes"
            )
        # The topic the request names; None leaves it to a certificate's own (unknown here).
        mismatch = topic_refusal(push_type, opts.topic or self.config.topic)
        if mismatch is not None:
            return None, _refusal(Reason.INVALID_PAYLOAD, mismatch)
        if opts.priority is not None and opts.priority not in (1, 5, 10):
            return None, _refusal(Reason.INVALID_PAYLOAD, "apns-priority must be 1, 5 or 10")
        if opts.expiration is not None and opts.expiration < 0:
            return None, _refusal(Reason.INVALID_PAYLOAD, "apns-expiration must not be negative")
        priority = opts.priority
        if priority in (None, 10) and _is_background(push_type, payload):
            # Apple: 10 (also what an omitted header means) is an error for a background
            # push, which the device then never delivers to the app.
            priority = 5
        return _Request(push, body, push_type, priority), None


class _Prepared:
    """What `ApnsClient._prepare` built from a push, and the objects it built it from."""

    __slots__ = ("apns", "client", "payload", "policy", "push_id", "refusal", "request", "token")

    def __init__(
        self, client: ApnsClient, push: Push, request: _Request | None, refusal: Attempt | None
    ) -> None:
        self.client = client
        self.payload = push.payload
        self.token = push.token
        self.apns = push.apns
        self.policy = push.policy
        self.push_id = push.id
        self.request = request
        self.refusal = refusal

    def fits(self, client: ApnsClient, push: Push) -> bool:
        # Identity, not equality: comparing payloads would cost what encoding does.
        return (
            self.client is client
            and self.payload is push.payload
            and self.token is push.token
            and self.apns is push.apns
            and self.policy is push.policy
            and self.push_id is push.id
        )


def _is_background(push_type: str | None, payload: Mapping[str, Any]) -> bool:
    """A background push: so declared, or, without a push-type header, an `aps` that only
    asks to wake the app (content-available, no alert, badge or sound), which is how
    APNs infers the type."""
    if push_type is not None:
        return push_type == "background"
    aps = payload.get("aps")
    return (
        isinstance(aps, Mapping)
        and bool(aps.get("content-available"))
        and not any(key in aps for key in ("alert", "badge", "sound"))
    )


def _is_header_value(value: str) -> bool:
    """Non-empty, printable, no surrounding whitespace: what h2's outbound validation
    (switched off in `_ApnsProtocol`) would have enforced for values plugins choose."""
    return bool(value) and value.isprintable() and value.strip() == value


# TLS alerts (OpenSSL's reason names) by which a server refuses the client's certificate.
_CERTIFICATE_ALERTS = {
    "SSLV3_ALERT_BAD_CERTIFICATE": "bad_certificate",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "unsupported_certificate",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "certificate_revoked",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "certificate_expired",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "certificate_unknown",
    "TLSV1_ALERT_UNKNOWN_CA": "unknown_ca",
    "TLSV1_ALERT_ACCESS_DENIED": "access_denied",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "certificate_required",
}
# How long pushes end `certificate_refused` without a connection after such an alert.
CERTIFICATE_REFUSED_HOLD = 60.0


def _certificate_alert(exc: BaseException) -> str | None:
    """The certificate alert (`unknown_ca`, ...) the server sent, if `exc` or one of its
    causes is the TLS error of receiving one; None for anything else (our own check of
    the server's certificate failing is `CERTIFICATE_VERIFY_FAILED`, not an alert)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLError):
            alert = _CERTIFICATE_ALERTS.get(getattr(current, "reason", None) or "")
            if alert is not None:
                return alert
        current = current.__cause__ or current.__context__
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text[:160]}" if text else name
