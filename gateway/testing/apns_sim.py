"""A fake APNs provider API: HTTP/2 over TLS, scriptable per device token.

Written directly on asyncio + the `h2` state machine (server side) because no
maintained Python library serves HTTP/2 with per-stream control: the simulator
must be able to answer one stream with HEADERS+END_STREAM and no body, reset a
single stream, or send GOAWAY with a JSON reason in the middle of a connection,
and ASGI servers / aiohttp hide exactly those frames.

Behaviour (specs/providers.md §2, §6.1):

- TLS 1.2+ with a certificate from `SimulatorCA` naming Apple's hosts,
  `localhost`, `127.0.0.1` and `::1`. ALPN `h2` is offered but not required (aioapns
  sends no ALPN): every TLS connection speaks HTTP/2 directly.
- SETTINGS_MAX_CONCURRENT_STREAMS is advertised (default 1000, changeable at
  run time with `set_max_concurrent_streams`), DATA is acknowledged for flow
  control, and the initial windows are large.
- `POST /3/device/<token>` answers `:status` + `apns-id` (echoed or generated);
  200 has an empty body, errors a JSON body `{"reason": ...}` (plus
  `"timestamp"` with 410).

Checks, in this order (the first failure answers):

1. method not POST → 405 `MethodNotAllowed`; path not `/3/device/...` → 404 `BadPath`;
2. with `client_certificates`, a client certificate that is expired or not issued by
   `ca` fails the TLS handshake with its TLS alert (as Apple's does); a request on a
   connection without one and without `authorization` → 403 `MissingProviderToken`;
   token auth, when `jwt_keys` is set: 403 `MissingProviderToken` /
   `InvalidProviderToken` (also an `iat` more than `jwt_max_future` seconds ahead of
   the simulator's clock) / `ExpiredProviderToken` (`iat` over `jwt_max_age` old);
   with `token_update_interval` set, 429 `TooManyProviderTokenUpdates` to a new
   token for a key whose previous token came less than that many seconds before;
3. device token: empty → 400 `MissingDeviceToken`; not even-length hex of at
   least 32 characters → 400 `BadDeviceToken`; a token given to `add_device` for
   the other environment (sandbox vs production) → 400 `BadDeviceToken`;
4. headers: repeated `apns-*`/`authorization` header → `DuplicateHeaders`;
   missing `apns-topic` with token auth → `MissingTopic`; topic outside
   `topics` → `TopicDisallowed`; unknown `apns-push-type` → `InvalidPushType`;
   a topic with a push type's suffix (`.voip`, `.complication`, ...) and another
   `apns-push-type` → `InvalidPushType`; such a push type (`voip`, ...) to a topic
   without its suffix → `DeviceTokenNotForTopic`; `apns-priority` not 1/5/10, or 10 (or
   none) with `apns-push-type: background` → `BadPriority`; non-integer `apns-expiration` →
   `BadExpirationDate`; `apns-collapse-id` over 64 bytes → `BadCollapseId`;
   `apns-id` not a UUID → `BadMessageId`;
5. payload: empty → 400 `PayloadEmpty`; over 4096 bytes (5120 for `voip`) →
   413 `PayloadTooLarge`; not a JSON object → 400 `INVALID_JSON_REASON`;
6. the scripted answer for the token (see `script`), else `default`.

Every request that reaches step 1 is recorded in `requests` (unless
`record=False`), with the answer it got.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import base64
import binascii
import contextlib
import json
import re
import ssl
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, StreamClosedError
from h2.settings import SettingCodes, Settings
from hpack import hpack as hpack_module
from hyperframe.frame import GoAwayFrame

from gateway.testing.certs import APNS_HOSTNAMES, SimulatorCA
from gateway.testing.simulator import SimulatorBase

__all__ = [
    "APNS_PUSH_TYPES",
    "APNS_REASON_STATUS",
    "ApnsAuthKey",
    "ApnsRequest",
    "ApnsResponse",
    "ApnsSimulator",
    "Fault",
    "generate_apns_auth_key",
]

Fault = Literal["no_body", "reset", "drop", "goaway"]
_FAULTS = frozenset({"no_body", "reset", "drop", "goaway"})

#: Apple's `apns-push-type` values (`widgets` is recent).
APNS_PUSH_TYPES = frozenset(
    {
        "alert",
        "background",
        "location",
        "voip",
        "complication",
        "fileprovider",
        "mdm",
        "liveactivity",
        "pushtotalk",
        "widgets",
    }
)

#: The status Apple sends with each documented reason (specs/providers.md §2.2).
APNS_REASON_STATUS: dict[str, int] = {
    "BadCollapseId": 400,
    "BadDeviceToken": 400,
    "BadExpirationDate": 400,
    "BadMessageId": 400,
    "BadPriority": 400,
    "BadTopic": 400,
    "DeviceTokenNotForTopic": 400,
    "DuplicateHeaders": 400,
    "IdleTimeout": 400,
    "InvalidPushType": 400,
    "MissingDeviceToken": 400,
    "MissingTopic": 400,
    "PayloadEmpty": 400,
    "TopicDisallowed": 400,
    "BadCertificate": 403,
    "BadCertificateEnvironment": 403,
    "ExpiredProviderToken": 403,
    "Forbidden": 403,
    "InvalidProviderToken": 403,
    "MissingProviderToken": 403,
    "UnrelatedKeyIdInToken": 403,
    "BadEnvironmentKeyIdInToken": 403,
    "BadPath": 404,
    "MethodNotAllowed": 405,
    "ExpiredToken": 410,
    "Unregistered": 410,
    "PayloadTooLarge": 413,
    "TooManyProviderTokenUpdates": 429,
    "TooManyRequests": 429,
    "InternalServerError": 500,
    "ServiceUnavailable": 503,
    "Shutdown": 503,
}

# Reason used when an error status is scripted without one.
_DEFAULT_REASONS: dict[int, str] = {
    403: "Forbidden",
    404: "BadPath",
    405: "MethodNotAllowed",
    410: "Unregistered",
    413: "PayloadTooLarge",
    429: "TooManyRequests",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}

_PAYLOAD_LIMIT = 4096
_VOIP_PAYLOAD_LIMIT = 5120
_PATH_PREFIX = "/3/device/"
_HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2}){16,}")
_UUID_RE = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
_INT_RE = re.compile(r"-?[0-9]+")
# The topic Apple requires for each push type that has its own: `<bundle id><suffix>`.
# Such a topic carries only that type: APNs answers `InvalidPushType` to any other
# `apns-push-type` sent to it (an `alert` or `background` push to a VoIP topic, say).
_SUFFIX_PUSH_TYPES = {
    ".voip": "voip",
    ".complication": "complication",
    ".push-type.liveactivity": "liveactivity",
    ".voip-ptt": "pushtotalk",
    ".location-query": "location",
    ".pushkit.fileprovider": "fileprovider",
    ".push-type.widgets": "widgets",
}
_TOPIC_SUFFIXES = tuple(_SUFFIX_PUSH_TYPES)
# ... and the other way round: such a push type sent to any other topic (`voip` to the
# bundle id itself) is answered `DeviceTokenNotForTopic`, as Apple answers it.
_PUSH_TYPE_SUFFIXES = {kind: suffix for suffix, kind in _SUFFIX_PUSH_TYPES.items()}
_CHECKED_HEADERS = frozenset(
    {
        "authorization",
        "apns-id",
        "apns-topic",
        "apns-push-type",
        "apns-priority",
        "apns-expiration",
        "apns-collapse-id",
    }
)
_JWT_CACHE_LIMIT = 10_000
# The environment each of Apple's hosts serves, read from the request's `:authority`
# when the simulator is not given one (aioapns names Apple's host there).
_HOST_ENVIRONMENTS = {
    "api.push.apple.com": "production",
    "api.sandbox.push.apple.com": "sandbox",
    "api.development.push.apple.com": "sandbox",
}
Environment = Literal["production", "sandbox"]
_INITIAL_WINDOW = 1 << 24  # 16 MiB per stream and for the connection
# Inbound header validation is off: the simulator checks what APNs checks
# itself, and h2's per-character validation costs ~15 % of a request. Outbound too:
# the simulator's own answers are built from constants.
_H2_CONFIG = H2Configuration(
    client_side=False,
    header_encoding="utf-8",
    validate_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)

_huffman_cache: dict[bytes, bytes] = {}
_HUFFMAN_CACHE_LIMIT = 4096


def _install_huffman_cache() -> None:
    """Memoise hpack's pure-Python Huffman decoder (process wide, idempotent).

    h2 clients send `authorization` as a never-indexed literal, so the same
    ~180-byte JWT is Huffman-decoded on every request, which is the biggest
    single cost of serving a request. Decoding is a pure function of the
    input bytes, so a bounded cache changes nothing but speed (errors are not
    cached). It also speeds up h2 clients in the same process.
    """
    if getattr(hpack_module.decode_huffman, "_pushgw_cached", False):
        return
    original = hpack_module.decode_huffman

    def decode_huffman(huffman_string: bytes | bytearray | memoryview | None) -> bytes:
        if not huffman_string:
            return b""
        key = bytes(huffman_string)
        hit = _huffman_cache.get(key)
        if hit is None:
            hit = original(key)
            if len(_huffman_cache) >= _HUFFMAN_CACHE_LIMIT:
                _huffman_cache.clear()
            _huffman_cache[key] = hit
        return hit

    decode_huffman._pushgw_cached = True  # type: ignore[attr-defined]
    hpack_module.decode_huffman = decode_huffman


@dataclass(frozen=True, slots=True)
class ApnsResponse:
    """One scripted APNs answer.

    - `status`: HTTP status; 200 answers with an empty body.
    - `reason`: error reason for the JSON body (defaults per status: 410
      `Unregistered`, 429 `TooManyRequests`, 500 `InternalServerError`, ...;
      a 400 must name its reason).
    - `timestamp`: ms since the epoch for 410 (default: now).
    - `delay`: seconds to wait before answering (other streams keep flowing).
    - `fault`: `"no_body"` (error status with END_STREAM on HEADERS and no
      DATA), `"reset"` (RST_STREAM), `"drop"` (abort the TCP connection),
      `"goaway"` (GOAWAY carrying `{"reason": reason or "Shutdown"}`, then close).
    - `error_code`: the RST_STREAM error code of the `"reset"` fault (default
      INTERNAL_ERROR; REFUSED_STREAM says the request was not processed, CANCEL ...).
    """

    status: int = 200
    reason: str | None = None
    timestamp: int | None = None
    delay: float = 0.0
    fault: Fault | None = None
    error_code: int = ErrorCodes.INTERNAL_ERROR

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in _FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; expected one of {sorted(_FAULTS)}")
        if (
            self.status != 200
            and self.reason is None
            and self.fault in (None, "no_body")
            and self.status not in _DEFAULT_REASONS
        ):
            raise ValueError(f"status {self.status} needs an explicit reason")
        if self.delay < 0:
            raise ValueError("delay must be >= 0")

    @classmethod
    def ok(cls, *, delay: float = 0.0) -> ApnsResponse:
        """A 200."""
        return cls(200, delay=delay)

    @classmethod
    def error(
        cls, reason: str, *, timestamp: int | None = None, delay: float = 0.0
    ) -> ApnsResponse:
        """An error answer with Apple's status for `reason` (e.g. `error("Unregistered")` → 410)."""
        try:
            status = APNS_REASON_STATUS[reason]
        except KeyError:
            raise ValueError(
                f"unknown APNs reason {reason!r}; build ApnsResponse directly"
            ) from None
        return cls(status, reason, timestamp=timestamp, delay=delay)

    @classmethod
    def faulty(
        cls,
        fault: Fault,
        *,
        status: int = 500,
        reason: str | None = None,
        delay: float = 0.0,
        error_code: int = ErrorCodes.INTERNAL_ERROR,
    ) -> ApnsResponse:
        """A fault: `faulty("reset")`, `faulty("no_body", status=410)`, `faulty("goaway")`,
        `faulty("reset", error_code=ErrorCodes.REFUSED_STREAM)`."""
        return cls(status, reason, delay=delay, fault=fault, error_code=error_code)


@dataclass(slots=True)
class ApnsRequest:
    """One request the simulator received, with the answer it decided.

    `at` is `time.monotonic()` when the request was complete. `status`/`reason`
    are what was (or, for a delayed answer, will be) sent; for the `reset`,
    `drop` and `goaway` faults no status reaches the client and `fault` says so.
    """

    token: str
    headers: dict[str, str]
    body: bytes
    json: dict[str, Any] | None
    status: int
    reason: str | None
    at: float
    connection_id: int
    stream_id: int = 0
    fault: str | None = None


@dataclass(frozen=True, slots=True)
class ApnsAuthKey:
    """A generated APNs token-auth key: `.p8` PEM content plus its ids."""

    key_id: str
    team_id: str
    private_key_pem: str
    public_key: ec.EllipticCurvePublicKey

    def write_p8(self, path: str | Path) -> Path:
        """Write the private key as an Apple-style `AuthKey_<kid>.p8` file (mode 0600)."""
        p = Path(path)
        p.write_text(self.private_key_pem)
        p.chmod(0o600)
        return p


def _random_id(n: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    raw = uuid.uuid4().bytes + uuid.uuid4().bytes
    return "".join(alphabet[b % len(alphabet)] for b in raw[:n])


def generate_apns_auth_key(key_id: str | None = None, team_id: str | None = None) -> ApnsAuthKey:
    """Generate a P-256 key in Apple's `.p8` format (PKCS#8 PEM) with 10-character ids."""
    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return ApnsAuthKey(
        key_id=key_id or _random_id(10),
        team_id=team_id or _random_id(10),
        private_key_pem=pem,
        public_key=private.public_key(),
    )


KeyLike = str | bytes | ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey | ApnsAuthKey


def _load_public_key(key: KeyLike) -> ec.EllipticCurvePublicKey:
    if isinstance(key, ApnsAuthKey):
        return key.public_key
    if isinstance(key, ec.EllipticCurvePublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.public_key()
    data = key.encode() if isinstance(key, str) else key
    loaded: Any
    if b"PRIVATE KEY" in data:
        loaded = serialization.load_pem_private_key(data, password=None).public_key()
    else:
        loaded = serialization.load_pem_public_key(data)
    if not isinstance(loaded, ec.EllipticCurvePublicKey):
        raise ValueError("APNs keys are P-256 EC keys")
    return loaded


def _b64url(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


class _Stream:
    __slots__ = ("body", "headers", "raw_headers")

    def __init__(self, raw_headers: list[tuple[str, str]]) -> None:
        self.raw_headers = raw_headers
        self.headers = dict(raw_headers)
        self.body = bytearray()


class _AlertingTLS(asyncio.sslproto.SSLProtocol):
    """asyncio's server-side TLS, sending the TLS alert of a failed handshake.

    asyncio closes the socket at once when the handshake fails, with the alert OpenSSL
    wrote for the client (`unknown_ca`, `certificate_expired`, `bad_certificate`, ...)
    still unsent: the client saw a connection reset, a network fault. Apple sends the
    alert; so does the simulator. (Private asyncio API, the simulator's only use of it:
    the `SSLProtocol` of Python 3.11+.)
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, app: asyncio.Protocol, context: ssl.SSLContext
    ) -> None:
        super().__init__(loop, app, context, None, server_side=True)  # type: ignore[arg-type]

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        if handshake_exc is not None:
            with contextlib.suppress(Exception):
                self._process_outgoing()  # type: ignore[attr-defined]
        super()._on_handshake_complete(handshake_exc)  # type: ignore[misc]


class _ApnsConnection(asyncio.Protocol):
    """One client connection: drives an h2 server state machine."""

    def __init__(self, sim: ApnsSimulator, connection_id: int) -> None:
        self.sim = sim
        self.id = connection_id
        self.h2 = H2Connection(config=_H2_CONFIG)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.pending_bodies: dict[int, bytes] = {}
        self.timers: set[asyncio.TimerHandle] = set()
        # Delayed answers by stream id (a graceful GOAWAY drops those above its last id).
        self.answers: dict[int, asyncio.TimerHandle] = {}
        self.last_stream_id: int | None = None  # set by a graceful GOAWAY
        self.stalled = False  # `ApnsSimulator.stall_all`
        self.closed = False
        self.alpn: str | None = None
        self.client_certificate = False  # the client presented one (and it verified)

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is not an asyncio.Transport subclass, so no isinstance
        self.transport = cast(asyncio.Transport, transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.alpn = ssl_object.selected_alpn_protocol()
            self.client_certificate = bool(ssl_object.getpeercert())
        # Our SETTINGS go out with the server preface; initial values take
        # effect at once on our side (h2 applies later changes on ACK).
        self.h2.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.sim.max_concurrent_streams,
                SettingCodes.INITIAL_WINDOW_SIZE: self.sim.initial_window_size,
                SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
            },
        )
        self.h2.initiate_connection()
        if self.sim.initial_window_size > 65535:
            self.h2.increment_flow_control_window(self.sim.initial_window_size - 65535)
        self.sim._connection_made(self)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()
        self.answers.clear()
        self.sim._connection_lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except ProtocolError:
            # h2 has queued a GOAWAY describing the error; send it and hang up.
            self.flush()
            self.close()
            return
        except UnicodeDecodeError:
            # A header that is not UTF-8: h2 gives up half-way through the frame without
            # queueing anything. Refuse it as any malformed frame is refused, with GOAWAY
            # PROTOCOL_ERROR, instead of letting the exception tear the connection down.
            self.h2.close_connection(error_code=ErrorCodes.PROTOCOL_ERROR)
            self.flush()
            self.close()
            return
        for event in events:
            kind = type(event)
            if kind is RequestReceived:
                assert isinstance(event, RequestReceived)
                if self.sim.reset_before_body and event.stream_ended is None:
                    # Refuse the request before its body: RST_STREAM while the client
                    # may still be waiting for flow-control window to send it.
                    self.h2.reset_stream(event.stream_id, ErrorCodes.INTERNAL_ERROR)  # type: ignore[arg-type]
                    continue
                early = self.sim.answer_before_body
                if early is not None and event.stream_ended is None:
                    apns_id = next((v for k, v in event.headers if k == "apns-id"), None)  # type: ignore[union-attr]
                    self.sim._answer_before_body(self, event.stream_id, early, apns_id)  # type: ignore[arg-type]
                    continue
                headers: list[tuple[str, str]] = event.headers  # type: ignore[assignment]
                self.streams[event.stream_id] = _Stream(headers)  # type: ignore[index]
            elif kind is DataReceived:
                assert isinstance(event, DataReceived)
                stream_id = event.stream_id
                assert stream_id is not None
                stream = self.streams.get(stream_id)
                if stream is not None and event.data:
                    stream.body += event.data
                if event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
            elif kind is StreamEnded:
                assert isinstance(event, StreamEnded)
                stream_id = event.stream_id
                assert stream_id is not None
                ended = self.streams.pop(stream_id, None)
                if ended is not None and self.refuses(stream_id):
                    self.h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
                elif ended is not None:
                    self.sim._handle(self, stream_id, ended)
                    if self.closed:
                        return
            elif kind is StreamReset:
                assert isinstance(event, StreamReset)
                if event.stream_id is not None:
                    self.streams.pop(event.stream_id, None)
                    self.pending_bodies.pop(event.stream_id, None)
            elif kind is WindowUpdated or kind is RemoteSettingsChanged:
                if self.pending_bodies:
                    self._send_pending()
            elif kind is ConnectionTerminated:
                self.flush()
                self.close()
                return
        self.flush()
        self._close_if_drained()

    # -- helpers ----------------------------------------------------------
    def flush(self) -> None:
        if self.transport is not None and not self.closed:
            data = self.h2.data_to_send()
            if data:
                self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.sim._connection_lost(self)
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.sim._connection_lost(self)
            self.transport.abort()

    def schedule(
        self, delay: float, callback: Callable[[], None], stream_id: int | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def run() -> None:
            self.timers.discard(handle)
            if stream_id is not None:
                self.answers.pop(stream_id, None)
            if not self.closed:
                callback()
                self.flush()
                self._close_if_drained()

        handle = loop.call_later(delay, run)
        self.timers.add(handle)
        if stream_id is not None:
            self.answers[stream_id] = handle

    def goaway(self, body: bytes, last_stream_id: int | None) -> None:
        """GOAWAY NO_ERROR with `body`. Without `last_stream_id`, naming the last stream
        received and closing at once; with it, naming that stream: the streams above it
        are not processed (their answers dropped, their requests recorded with the fault
        `goaway`), those at or below it are answered as scripted, and the connection
        closes after the last of them (RFC 9113 section 6.8, a graceful shutdown)."""
        if last_stream_id is None:
            self.respond(0, "", 0, body, "goaway")
            return
        if self.closed:
            return
        self.last_stream_id = last_stream_id
        self.flush()
        # Written past h2, whose state machine takes no frame after its own GOAWAY.
        frame = GoAwayFrame(0, last_stream_id=last_stream_id, additional_data=body)
        assert self.transport is not None
        self.transport.write(frame.serialize())
        dropped = [sid for sid in self.answers if sid > last_stream_id]
        for stream_id in dropped:
            self.answers.pop(stream_id).cancel()
            self.pending_bodies.pop(stream_id, None)
        self.sim._not_processed(self.id, set(dropped))
        self._close_if_drained()

    def refuses(self, stream_id: int) -> bool:
        """After a graceful GOAWAY, a stream above its last id is ignored (RFC 9113)."""
        return self.last_stream_id is not None and stream_id > self.last_stream_id

    def _close_if_drained(self) -> None:
        if self.last_stream_id is None or self.closed:
            return
        waiting = (*self.streams, *self.answers, *self.pending_bodies)
        if not any(sid <= self.last_stream_id for sid in waiting):
            self.close()

    def respond(
        self,
        stream_id: int,
        apns_id: str,
        status: int,
        body: bytes | None,
        fault: str | None,
        error_code: int = ErrorCodes.INTERNAL_ERROR,
    ) -> None:
        """Answer one stream (the caller flushes)."""
        if self.closed or self.stalled:
            return
        if fault == "drop":
            self.abort()
            return
        if fault == "goaway":
            self.h2.close_connection(error_code=ErrorCodes.NO_ERROR, additional_data=body)
            self.flush()
            self.close()
            return
        h2c = self.h2
        try:
            if fault == "reset":
                h2c.reset_stream(stream_id, error_code)
                return
            headers = [(":status", str(status)), ("apns-id", apns_id)]
            if body is None:
                h2c.send_headers(stream_id, headers, end_stream=True)
                return
            headers.append(("content-type", "application/json"))
            headers.append(("content-length", str(len(body))))
            h2c.send_headers(stream_id, headers)
            if h2c.local_flow_control_window(stream_id) >= len(body):
                h2c.send_data(stream_id, body, end_stream=True)
            else:
                # The client has not returned enough window (aioapns never
                # acknowledges DATA): hold the body until a WINDOW_UPDATE.
                self.pending_bodies[stream_id] = body
        except ProtocolError:
            # The client reset or closed the stream while we were delaying.
            self.pending_bodies.pop(stream_id, None)

    def _send_pending(self) -> None:
        h2c = self.h2
        for stream_id, body in list(self.pending_bodies.items()):
            try:
                if h2c.local_flow_control_window(stream_id) < len(body):
                    continue
                h2c.send_data(stream_id, body, end_stream=True)
            except ProtocolError:
                pass
            del self.pending_bodies[stream_id]

    def set_max_concurrent_streams(self, value: int) -> None:
        if not self.closed:
            self.h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: value})
            self.flush()


class ApnsSimulator(SimulatorBase[ApnsRequest]):
    """Fake APNs (HTTP/2 over TLS) running in the current event loop.

    ```
    async with ApnsSimulator() as sim:
        sim.script(token, ApnsResponse.error("Unregistered"))
        ...  # point the client at sim.host/sim.port, trust sim.ca_path
        await sim.wait_for_requests(1)
    ```

    - `ca`: the CA issuing the server certificate (default: a fresh one;
      `hostnames` are the names it covers).
    - `max_concurrent_streams`: advertised SETTINGS_MAX_CONCURRENT_STREAMS.
    - `jwt_keys`: `{key_id: (team_id, key)}` turns on token-auth checks; `key`
      is a PEM (public or private), a `cryptography` EC key or an `ApnsAuthKey`.
    - `topics`: allowed `apns-topic` values (Apple's push-type suffixes are
      accepted on them); `None` allows any.
    - `jwt_max_age`: seconds after `iat` at which a JWT is expired.
    - `jwt_max_future`: seconds an `iat` may be ahead of `clock` (a signer whose
      clock is fast): beyond it the JWT is `InvalidProviderToken`, as Apple answers.
    - `token_update_interval`: when set (Apple: 1200 s), a JWT for a key that the
      simulator has not seen yet, coming less than this many seconds after the
      previous new one for that key, is answered 429 `TooManyProviderTokenUpdates`
      (and not adopted: the previous token stays good). Off by default.
    - `environment`: `"production"` or `"sandbox"`, the environment this simulator
      plays; None reads it from the request's `:authority` when that names one of
      Apple's hosts. Tokens given to `add_device` for the other environment are
      answered `BadDeviceToken`, as Apple answers a sandbox token sent to production.
    - `client_certificates`: ask each client for a certificate (certificate auth) and
      verify it against `ca` (issue one with `ca.issue_client_certificate(topic)`): an
      expired or unknown one fails the TLS handshake, as APNs refuses it; token-auth
      clients present none. Off by default (any client certificate is then ignored).
    - `clock`: wall clock for JWT ages (tests may pass a fake one).
    - `record`: keep `requests` (turn off for long benchmarks; counters remain).
    - `initial_window_size`: our stream and connection receive windows (DATA is
      acknowledged as it arrives, so this only bounds bursts).

    Set `reset_before_body = True` to reset (RST_STREAM INTERNAL_ERROR) every new
    stream as soon as its HEADERS arrive without END_STREAM, before any of its body:
    with a small `initial_window_size`, the client is then still waiting for window
    to send that body. Such requests are not recorded.

    Set `answer_before_body` to an `ApnsResponse` to answer every such stream with it
    (its status and reason; not its delay or fault) at once instead, a complete
    response before the request is, as RFC 9113 section 8.1 lets a server do; then,
    unless `reset_after_early_answer` is False, to reset the stream with NO_ERROR, the
    RFC's way to ask the client to stop sending its body. Such requests are not
    recorded either.
    """

    _recording_noun = "requests"
    _recording_name = "APNs simulator"

    #: Reason for a body that is not a JSON object. Apple documents no reason
    #: for malformed JSON; the closest documented one is `PayloadEmpty` (the
    #: body carries no usable payload), and it classifies as `permanent` like
    #: any malformed request. Override on the instance or a subclass if needed.
    INVALID_JSON_REASON = "PayloadEmpty"

    #: Memoise hpack's Huffman decoder at `start` (see `_install_huffman_cache`).
    FAST_HPACK = True

    def __init__(
        self,
        *,
        ca: SimulatorCA | None = None,
        hostnames: Iterable[str] = APNS_HOSTNAMES,
        host: str = "127.0.0.1",
        port: int = 0,
        max_concurrent_streams: int = 1000,
        jwt_keys: Mapping[str, tuple[str, KeyLike]] | None = None,
        topics: Iterable[str] | None = None,
        jwt_max_age: float = 3600.0,
        jwt_max_future: float = 60.0,
        token_update_interval: float | None = None,
        environment: Environment | None = None,
        client_certificates: bool = False,
        clock: Callable[[], float] = time.time,
        record: bool = True,
        initial_window_size: int = _INITIAL_WINDOW,
    ) -> None:
        self._own_ca = ca is None
        self.ca = ca or SimulatorCA()
        self.hostnames = tuple(hostnames)
        self._bind_host = host
        self._bind_port = port
        self.max_concurrent_streams = max_concurrent_streams
        self._jwt_keys: dict[str, tuple[str, ec.EllipticCurvePublicKey]] | None = None
        self._jwt_cache: dict[str, tuple[str | None, int, str]] = {}
        if jwt_keys is not None:
            self._jwt_keys = {}
            for kid, (team_id, key) in jwt_keys.items():
                self.add_jwt_key(kid, team_id, key)
        self.topics: frozenset[str] | None = frozenset(topics) if topics is not None else None
        self.jwt_max_age = jwt_max_age
        self.jwt_max_future = jwt_max_future
        self.token_update_interval = token_update_interval
        if environment not in (None, "production", "sandbox"):
            raise ValueError(f"environment must be 'production' or 'sandbox', not {environment!r}")
        self.environment: Environment | None = environment
        self.client_certificates = client_certificates
        self._devices: dict[str, Environment] = {}
        self._adopted_jwts: set[str] = set()  # with token_update_interval
        self._key_updated: dict[str, float] = {}  # kid -> when its last new JWT was adopted
        self.clock = clock
        self._init_recording(record)
        self.initial_window_size = initial_window_size

        self.default = ApnsResponse()
        self.reset_before_body = False
        self.answer_before_body: ApnsResponse | None = None
        self.reset_after_early_answer = True
        self.connections_opened = 0
        self._scripts: dict[str, list[ApnsResponse]] = {}
        self._script_all: list[ApnsResponse] = []
        self._jwts: set[str] = set()
        self._connections: set[_ApnsConnection] = set()
        self._server: asyncio.Server | None = None
        self._host = host
        self._port = 0

    # -- lifecycle --------------------------------------------------------
    async def start(
        self, host: str | None = None, port: int | None = None, *, reuse_port: bool = False
    ) -> None:
        """Listen on `host:port` (port 0 picks a free one).

        `reuse_port=True` sets SO_REUSEPORT so several processes can serve one
        port (the kernel spreads connections): the way past one core, since a
        pure-Python h2 server costs roughly as much CPU per request as aioapns.
        """
        if self._server is not None:
            raise RuntimeError("simulator already started")
        host = self._bind_host if host is None else host
        port = self._bind_port if port is None else port
        if self.FAST_HPACK:
            _install_huffman_cache()
        ssl_ctx = self.ca.server_context(self.hostnames, alpn=["h2"])
        if self.client_certificates:
            ssl_ctx.verify_mode = ssl.CERT_OPTIONAL  # token-auth clients send none
            ssl_ctx.load_verify_locations(cafile=str(self.ca.ca_path))
        loop = asyncio.get_running_loop()
        ids = iter(range(1, 1 << 62))
        if self.client_certificates:
            # TLS on our side of the socket (see `_AlertingTLS`), so that a refused
            # client certificate gets its TLS alert, as Apple sends it.
            self._server = await loop.create_server(
                lambda: _AlertingTLS(loop, _ApnsConnection(self, next(ids)), ssl_ctx),
                host,
                port,
                reuse_port=reuse_port or None,
                backlog=1024,
            )
        else:
            self._server = await loop.create_server(
                lambda: _ApnsConnection(self, next(ids)),
                host,
                port,
                ssl=ssl_ctx,
                reuse_port=reuse_port or None,
                backlog=1024,
            )
        sockname = self._server.sockets[0].getsockname()
        self._host, self._port = sockname[0], sockname[1]

    async def stop(self) -> None:
        """Close the listener and every open connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self._connections):
            conn.abort()
        self._connections.clear()
        await server.wait_closed()
        self._cancel_waiters()
        if self._own_ca:
            self.ca.cleanup()

    @property
    def url(self) -> str:
        """`https://<host>:<port>` (`https://[::1]:2197` on IPv6)."""
        return f"https://{self.netloc}"

    @property
    def ca_path(self) -> Path:
        """PEM file of the CA that issued the server certificate."""
        return self.ca.ca_path

    @property
    def jwts_seen(self) -> int:
        """How many distinct bearer JWTs clients have sent."""
        return len(self._jwts)

    @property
    def open_connections(self) -> int:
        """Connections currently open."""
        return len(self._connections)

    # -- configuration ----------------------------------------------------
    def add_jwt_key(self, key_id: str, team_id: str, key: KeyLike) -> None:
        """Accept JWTs signed by `key` with `kid=key_id`, `iss=team_id` (turns JWT checks on)."""
        if self._jwt_keys is None:
            self._jwt_keys = {}
        self._jwt_keys[key_id] = (team_id, _load_public_key(key))
        self._jwt_cache.clear()

    def revoke_jwt_key(self, key_id: str) -> None:
        """Revoke a key, as in Apple's developer account: the tokens it signed, those
        already accepted included, are answered 403 `InvalidProviderToken` from now on
        (JWT checks stay on; the other keys are unaffected)."""
        if self._jwt_keys is None:
            self._jwt_keys = {}
        self._jwt_keys.pop(key_id, None)
        self._jwt_cache.clear()  # verdicts are cached per token: a revoked one must not pass

    def add_device(self, token: str, environment: Environment) -> None:
        """Say which APNs environment issued device `token` (an app built for
        development gets sandbox tokens, one from the App Store or TestFlight production
        ones): sent to the other environment's host, it is answered 400 `BadDeviceToken`.
        Tokens never given here are accepted in both."""
        if environment not in ("production", "sandbox"):
            raise ValueError(f"environment must be 'production' or 'sandbox', not {environment!r}")
        self._devices[token] = environment

    def script(self, token: str, *responses: ApnsResponse) -> None:
        """Answer `token`'s next requests with `responses`, in order; the last one repeats.

        Calling it again replaces the token's script; no responses clears it.
        """
        if responses:
            self._scripts[token] = list(responses)
        else:
            self._scripts.pop(token, None)

    def script_all(self, *responses: ApnsResponse) -> None:
        """Like `script` for every token (takes precedence over per-token scripts)."""
        self._script_all = list(responses)

    def clear_scripts(self) -> None:
        """Forget all scripts (the `default` answer stays)."""
        self._scripts.clear()
        self._script_all = []

    def set_max_concurrent_streams(self, value: int) -> None:
        """Advertise a new SETTINGS_MAX_CONCURRENT_STREAMS on every open connection and new ones."""
        self.max_concurrent_streams = value
        for conn in self._connections:
            conn.set_max_concurrent_streams(value)

    def goaway_all(self, reason: str = "Shutdown", *, last_stream_id: int | None = None) -> None:
        """Send GOAWAY with `{"reason": reason}` on every open connection, then close them.

        With `last_stream_id`, a graceful shutdown instead: the GOAWAY names that stream,
        the streams above it are not processed (their requests are recorded with the
        fault `goaway`; nothing is answered to them), those at or below it still get their
        scripted answers, and each connection closes once they have them.
        """
        body = json.dumps({"reason": reason}).encode()
        for conn in list(self._connections):
            conn.goaway(body, last_stream_id)

    def stall_all(self) -> None:
        """Stop answering on every open connection, as a server that hangs or a network
        that drops everything: nothing more is read (no PING is acknowledged) or answered,
        and the TCP connections stay open. New connections are served as usual."""
        for conn in self._connections:
            conn.stalled = True
            if conn.transport is not None:
                conn.transport.pause_reading()

    # -- recording --------------------------------------------------------

    # -- internals --------------------------------------------------------
    def _connection_made(self, conn: _ApnsConnection) -> None:
        self.connections_opened += 1
        self._connections.add(conn)

    def _connection_lost(self, conn: _ApnsConnection) -> None:
        self._connections.discard(conn)

    def _not_processed(self, connection_id: int, stream_ids: set[int]) -> None:
        """Mark the recorded requests of `stream_ids` as never answered (GOAWAY)."""
        for request in self.requests:
            if request.connection_id == connection_id and request.stream_id in stream_ids:
                request.fault = "goaway"

    def _next_scripted(self, token: str) -> ApnsResponse:
        script = self._script_all or self._scripts.get(token)
        if not script:
            return self.default
        if len(script) == 1:
            return script[0]
        return script.pop(0)

    def _check_jwt(self, authorization: str | None) -> str | None:
        if authorization is None:
            return "MissingProviderToken"
        if authorization[:7].lower() != "bearer ":
            return "InvalidProviderToken"
        token = authorization[7:].strip()
        self._jwts.add(token)
        cached = self._jwt_cache.get(token)
        if cached is None:
            cached = self._verify_jwt(token)
            if len(self._jwt_cache) >= _JWT_CACHE_LIMIT:
                self._jwt_cache.clear()
            self._jwt_cache[token] = cached
        error, iat, kid = cached
        if error is not None:
            return error
        now = self.clock()
        if iat - now > self.jwt_max_future:
            return "InvalidProviderToken"
        if now - iat > self.jwt_max_age:
            return "ExpiredProviderToken"
        if self.token_update_interval is not None and token not in self._adopted_jwts:
            updated = self._key_updated.get(kid)
            if updated is not None and now - updated < self.token_update_interval:
                return "TooManyProviderTokenUpdates"
            self._adopted_jwts.add(token)
            self._key_updated[kid] = now
        return None

    def _verify_jwt(self, token: str) -> tuple[str | None, int, str]:
        invalid = ("InvalidProviderToken", 0, "")
        assert self._jwt_keys is not None
        try:
            header_b64, claims_b64, sig_b64 = token.split(".")
            header = json.loads(_b64url(header_b64))
            claims = json.loads(_b64url(claims_b64))
            signature = _b64url(sig_b64)
        except (ValueError, binascii.Error):
            return invalid
        if not isinstance(header, dict) or not isinstance(claims, dict):
            return invalid
        if header.get("alg") != "ES256":
            return invalid
        entry = self._jwt_keys.get(header.get("kid"))  # type: ignore[arg-type]
        if entry is None:
            return invalid
        team_id, public_key = entry
        iat = claims.get("iat")
        if claims.get("iss") != team_id or not isinstance(iat, int) or isinstance(iat, bool):
            return invalid
        if len(signature) != 64:
            return invalid
        der = encode_dss_signature(
            int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
        )
        try:
            public_key.verify(der, f"{header_b64}.{claims_b64}".encode(), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return invalid
        return None, iat, header["kid"]

    def _check_headers(self, stream: _Stream, token_auth: bool) -> str | None:
        headers = stream.headers
        if len(headers) != len(stream.raw_headers):
            names = [name for name, _ in stream.raw_headers if name in _CHECKED_HEADERS]
            if len(names) != len(set(names)):
                return "DuplicateHeaders"
        topic = headers.get("apns-topic")
        if topic is None:
            if token_auth:
                return "MissingTopic"
        elif self.topics is not None and topic not in self.topics:
            base = next((topic[: -len(s)] for s in _TOPIC_SUFFIXES if topic.endswith(s)), None)
            if base is None or base not in self.topics:
                return "TopicDisallowed"
        push_type = headers.get("apns-push-type")
        if push_type is not None and push_type not in APNS_PUSH_TYPES:
            return "InvalidPushType"
        if push_type is not None and topic is not None:
            bound = next((t for s, t in _SUFFIX_PUSH_TYPES.items() if topic.endswith(s)), None)
            if bound is not None and push_type != bound:
                return "InvalidPushType"
            own = _PUSH_TYPE_SUFFIXES.get(push_type)
            if own is not None and not topic.endswith(own):
                return "DeviceTokenNotForTopic"
        priority = headers.get("apns-priority")
        if priority is not None and priority not in ("10", "5", "1"):
            return "BadPriority"
        if push_type == "background" and priority in (None, "10"):
            # Apple: a background push must use priority 5 (or 1); 10, which an omitted
            # header means, "is an error". The reason is not documented: BadPriority.
            return "BadPriority"
        expiration = headers.get("apns-expiration")
        if expiration is not None and not _INT_RE.fullmatch(expiration):
            return "BadExpirationDate"
        collapse_id = headers.get("apns-collapse-id")
        if collapse_id is not None and len(collapse_id.encode()) > 64:
            return "BadCollapseId"
        apns_id = headers.get("apns-id")
        if apns_id is not None and not _UUID_RE.fullmatch(apns_id):
            return "BadMessageId"
        return None

    def _decide(
        self, stream: _Stream, body: bytes, certified: bool = False
    ) -> tuple[str, int, str | None, dict[str, Any] | None, ApnsResponse | None]:
        """Return (token, status, reason, parsed json, scripted response or None)."""
        headers = stream.headers
        path = headers.get(":path", "")
        token = path[len(_PATH_PREFIX) :] if path.startswith(_PATH_PREFIX) else ""
        if headers.get(":method") != "POST":
            return token, 405, "MethodNotAllowed", None, None
        if not path.startswith(_PATH_PREFIX) or "/" in token or "?" in token:
            return token, 404, "BadPath", None, None
        authorization = headers.get("authorization")
        if self._jwt_keys is not None:
            error = self._check_jwt(authorization)
            if error is not None:
                return token, APNS_REASON_STATUS[error], error, None, None
        elif self.client_certificates and authorization is None and not certified:
            return token, 403, "MissingProviderToken", None, None
        if not token:
            return token, 400, "MissingDeviceToken", None, None
        if not _HEX_RE.fullmatch(token):
            return token, 400, "BadDeviceToken", None, None
        if self._devices and token in self._devices:
            environment = self.environment or _HOST_ENVIRONMENTS.get(
                headers.get(":authority", "").rsplit(":", 1)[0].lower()
            )
            if environment is not None and self._devices[token] != environment:
                return token, 400, "BadDeviceToken", None, None
        error = self._check_headers(stream, authorization is not None or self._jwt_keys is not None)
        if error is not None:
            return token, 400, error, None, None
        if not body:
            return token, 400, "PayloadEmpty", None, None
        limit = _VOIP_PAYLOAD_LIMIT if headers.get("apns-push-type") == "voip" else _PAYLOAD_LIMIT
        if len(body) > limit:
            return token, 413, "PayloadTooLarge", None, None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return token, 400, self.INVALID_JSON_REASON, None, None
        response = self._next_scripted(token)
        reason = response.reason
        if response.status != 200 and reason is None:
            reason = _DEFAULT_REASONS.get(response.status)
        return token, response.status, reason, parsed, response

    def _error_body(self, status: int, reason: str | None, response: ApnsResponse | None) -> bytes:
        error: dict[str, Any] = {"reason": reason}
        if status == 410:
            ts = response.timestamp if response is not None else None
            error["timestamp"] = ts if ts is not None else int(self.clock() * 1000)
        return json.dumps(error).encode()

    def _answer_before_body(
        self, conn: _ApnsConnection, stream_id: int, response: ApnsResponse, apns_id: str | None
    ) -> None:
        status = response.status
        reason = response.reason or _DEFAULT_REASONS.get(status)
        payload = self._error_body(status, reason, response) if status != 200 else None
        # APNs echoes the request's apns-id in every answer, an early one too
        conn.respond(stream_id, apns_id or str(uuid.uuid4()).upper(), status, payload, None)
        if self.reset_after_early_answer:
            # When the body (with END_STREAM) came in the same read as the headers, as a
            # small one does, h2 had already half-closed the stream: our answer closed it
            # and there is no body left to stop.
            with contextlib.suppress(StreamClosedError):
                conn.h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def _handle(self, conn: _ApnsConnection, stream_id: int, stream: _Stream) -> None:
        body = bytes(stream.body)
        token, status, reason, parsed, response = self._decide(
            stream, body, conn.client_certificate
        )
        apns_id = stream.headers.get("apns-id") or str(uuid.uuid4()).upper()
        fault = response.fault if response is not None else None
        delay = response.delay if response is not None else 0.0

        payload: bytes | None = None
        if fault == "goaway":
            payload = json.dumps({"reason": reason or "Shutdown"}).encode()
        elif status != 200 and fault != "no_body":
            payload = self._error_body(status, reason, response)

        self._recorded(
            lambda: ApnsRequest(
                token=token,
                headers=stream.headers,
                body=body,
                json=parsed,
                status=status,
                reason=reason,
                at=time.monotonic(),
                connection_id=conn.id,
                stream_id=stream_id,
                fault=fault,
            )
        )

        code = response.error_code if response is not None else ErrorCodes.INTERNAL_ERROR
        if delay > 0:
            conn.schedule(
                delay,
                lambda: conn.respond(stream_id, apns_id, status, payload, fault, code),
                stream_id,
            )
        else:
            conn.respond(stream_id, apns_id, status, payload, fault, code)
