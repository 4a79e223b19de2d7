"""Property-based fuzzing of every HTTP endpoint a chat server posts to, and of the
YAML config loader.

Properties: a client's mistake (any bytes, wrong JSON types, huge numbers, NaN, deep
nesting, lone surrogates, odd content types and encodings, duplicate keys) is never a
5xx nor a traceback in the log; a rejected request changes nothing in the store; an
error body is in the protocol's own terms (Zulip's JSON envelope; Sygnal's plain-text
400s for Matrix); no device token or key reaches a log line or an error body. A broken
config file is a `ConfigError` of one line per problem, never another exception.

The Marmot plugin has no HTTP endpoint (it listens on Nostr relays): nothing to post to.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import MetaData, select

from gateway.app import load_gateway
from gateway.config import ConfigError
from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.fcm_sim import make_service_account
from gateway.testing.harness import GatewayHarness, apns_app_config, fcm_app_config
from plugins.zulip.crypto import seal_registration, token_id_of
from tests.conftest import offline_apns_app
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey, notification
from tests.zulip.conftest import (
    IOS_APP_ID,
    PREFIX,
    VECTOR_KEY,
    ZulipServer,
    apns_token,
    fcm_token,
    realm_dict,
    registration_plaintext,
    zulip_config,
)

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- strategies --------------------------------------------------------------------

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ODD_TEXT = st.text(
    alphabet=st.one_of(st.characters(), SURROGATES, st.sampled_from('\x00\n\r\t"\\%&=+;')),
    max_size=24,
)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=2**31 - 2, max_value=2**31 + 2),
    st.integers(min_value=2**53 - 2, max_value=2**53 + 2),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=-(2**64), max_value=-(2**63) + 2),
    st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, ODD_TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
    max_leaves=12,
)
CONTENT_TYPES = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=latin-1",
        "application/json; charset=utf-16",
        "application/x-www-form-urlencoded",
        "application/x-www-form-urlencoded; charset=unicode_escape",
        "application/x-www-form-urlencoded; charset=no-such-codec",
        "multipart/form-data",
        "multipart/form-data; boundary=xyz",
        "text/plain",
        "application/octet-stream",
        "",
        'a/b; charset="',
    ]
)


def dumps(value: Any) -> str:
    """JSON text of `value`, NaN and Infinity spelt as Python does, surrogates escaped."""
    return json.dumps(value, allow_nan=True)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@st.composite
def raw_json_text(draw: st.DrawFn) -> str:
    """JSON text a lenient encoder or a hand would write: duplicate keys, deep nesting,
    number literals beyond any range, raw control characters."""
    kind = draw(st.sampled_from(["dup", "deep", "literal", "value", "truncated"]))
    if kind == "dup":
        key = json.dumps(draw(st.sampled_from(["notification", "devices", "realm_uuid", "a"])))
        a, b = dumps(draw(JSON_VALUES)), dumps(draw(JSON_VALUES))
        return "{" + f"{key}: {a}, {key}: {b}" + "}"
    if kind == "deep":
        return deep(draw(st.sampled_from([50, 1000, 100_000])))
    if kind == "literal":
        return draw(
            st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "1" * 5000, '"\\ud800"'])
        )
    if kind == "truncated":
        text = dumps(draw(JSON_VALUES))
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    return dumps(draw(JSON_VALUES))


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


@st.composite
def mutated(draw: st.DrawFn, base: Any, vocabulary: list[str]) -> Any:
    """`base` with one to three values replaced, keys added or keys removed."""
    value = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        candidates = [p for p in paths(value) if p] or [()]
        path = () if draw(st.integers(0, 19)) == 0 else draw(st.sampled_from(candidates))
        if not path:
            value = draw(JSON_VALUES)
            continue
        holder = value
        for key in path[:-1]:
            holder = holder[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete" and isinstance(holder, dict):
            del holder[path[-1]]
        elif action == "add" and isinstance(holder, dict):
            holder[draw(st.sampled_from(vocabulary) | ODD_TEXT)] = draw(JSON_VALUES)
        else:
            holder[path[-1]] = draw(JSON_VALUES)
    return value


# --- log watching ------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        # aiohttp's re-raise of a body the handler already refused is one INFO line:
        # GatewayHarness installs `logs.UnreadableBodyFilter` as `pushgw serve` does
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def watched_logs() -> Iterator[_Records]:
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def check_logs(records: _Records, secrets_: list[str]) -> None:
    for record in records.records:
        text = record.getMessage()
        assert record.exc_info is None, f"traceback logged: {record.name} {text}"
        assert record.levelno < logging.ERROR, f"error logged: {record.name} {text}"
        for secret in secrets_:
            assert secret not in text, f"secret in log: {record.name} {text}"
    records.records.clear()


# --- a gateway with both HTTP plugins ---------------------------------------------


class Gateway:
    def __init__(self, harness: GatewayHarness) -> None:
        self.harness = harness
        self.client = harness.client
        self.zulip: _Zulip | None = None
        self.meta: MetaData | None = None

    async def snapshot(self) -> dict[str, list[str]]:
        """Every row of every table but request-time bookkeeping columns."""
        engine = self.harness.context("zulip").store.engine
        async with engine.connect() as conn:
            if self.meta is None:
                self.meta = MetaData()
                await conn.run_sync(self.meta.reflect)
            meta = self.meta
            rows = {}
            for table in meta.sorted_tables:
                cols = [c for c in table.c if c.name not in ("last_request_at",)]
                result = await conn.execute(select(*cols))
                rows[table.name] = sorted(map(repr, result))
        return rows


@asynccontextmanager
async def running(tmp_path: Path, store_url: str) -> AsyncIterator[Gateway]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path, legacy_api=True)
        config["store"] = {"url": store_url}
        config["plugins"]["enabled"].append("matrix")
        config["plugins"]["matrix"] = {
            "apps": {
                "com.example.ios": apns_app_config(apns, tmp_path),
                "com.example.android": fcm_app_config(fcm, tmp_path),
                "com.example.enc": {**apns_app_config(apns, tmp_path), "msc3013_mode": "auto"},
            },
            "notify_deadline": 2.0,
        }
        async with GatewayHarness(config) as harness:
            yield Gateway(harness)


@pytest_asyncio.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """On SQLite."""
    async with running(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'store.db'}") as gw:
        yield gw


@pytest_asyncio.fixture
async def db_gateway(tmp_path: Path, store_url: str) -> AsyncIterator[Gateway]:
    """On SQLite and on PostgreSQL."""
    async with running(tmp_path, store_url) as gw:
        yield gw


# --- Matrix -----------------------------------------------------------------------

MATRIX_KEYS = [
    "notification", "devices", "counts", "unread", "missed_calls", "app_id", "pushkey",
    "pushkey_ts", "data", "tweaks", "sound", "ciphertext", "ephemeral", "mac",
    "is_counts_only", "content", "prio", "type", "event_id", "room_id", "format",
    "default_payload", "algorithm", "public_key", "body", "msgtype", "membership",
]  # fmt: skip


def matrix_base(passthrough: bool) -> dict[str, Any]:
    ios, _ = apns_pushkey()
    enc, _ = apns_pushkey()
    public = X25519PrivateKey.generate().public_key().public_bytes_raw()
    enc_key = base64.b64encode(public).decode().rstrip("=")
    frame = {"ciphertext": "Y2lwaGVy", "ephemeral": "ZXBo", "mac": "bWFj"} if passthrough else {}
    return notification(
        [
            device("com.example.ios", ios, tweaks={"sound": "bing"}),
            device("com.example.android", fcm_pushkey(), data={"format": "event_id_only"}),
            device(
                "com.example.enc",
                enc,
                data={"algorithm": "m.curve25519-aes-sha2", "public_key": enc_key},
            ),
        ],
        **frame,
    )


@st.composite
def matrix_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "raw", "bytes"]))
    if kind == "mutated":
        body = dumps(draw(mutated(matrix_base(draw(st.booleans())), MATRIX_KEYS))).encode(
            "utf-8", "surrogatepass"
        )
    elif kind == "raw":
        body = draw(raw_json_text()).encode("utf-8", "surrogatepass")
    else:
        body = draw(st.binary(max_size=64))
    headers = {}
    ctype = draw(CONTENT_TYPES)
    if ctype is not None:
        headers["Content-Type"] = ctype
    if draw(st.booleans()) and draw(st.booleans()):
        headers["Content-Encoding"] = "gzip"
        if draw(st.booleans()):
            body = gzip.compress(body)
    return body, headers


def pushkeys_of(body: bytes) -> list[str]:
    try:
        devices = json.loads(body)["notification"]["devices"]
        keys = [d.get("pushkey") for d in devices if isinstance(d, dict)]
        return [k for k in keys if isinstance(k, str) and len(k) >= 16]
    except Exception:
        return []


@FUZZ
@given(request=matrix_requests())
async def test_matrix_notify_client_mistakes(
    gateway: Gateway, request: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = request
    with watched_logs() as records:
        resp = await gateway.client.post(NOTIFY, data=body, headers=headers)
        text = await resp.text()
        event(f"{resp.status} {text[:40]}")
        assert resp.status in (200, 400, 413), (resp.status, text)
        if resp.status == 200:
            assert isinstance(json.loads(text)["rejected"], list)
        else:  # Sygnal's plain-text answers (specs/matrix.md §1.1), never a traceback
            assert "Traceback" not in text and len(text) < 200, text
        check_logs(records, pushkeys_of(body))


@FUZZ
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    body=st.binary(max_size=32),
)
async def test_matrix_notify_other_methods(gateway: Gateway, method: str, body: bytes) -> None:
    with watched_logs() as records:
        resp = await gateway.client.request(method, NOTIFY, data=body)
        assert resp.status == 405
        check_logs(records, [])


# --- core endpoints ----------------------------------------------------------------


@FUZZ
@given(
    path=st.sampled_from(["/metrics", "/healthz", "/readyz", "/health"]),
    method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]),
    query=st.dictionaries(ODD_TEXT.filter(lambda s: s.isprintable()), ODD_TEXT, max_size=3),
    accept=st.sampled_from(
        [None, "*/*", "application/openmetrics-text; version=1.0.0", "text/plain;q=0", "a;;;=,"]
    ),
    body=st.binary(max_size=32),
)
async def test_core_endpoints(
    gateway: Gateway,
    path: str,
    method: str,
    query: dict[str, str],
    accept: str | None,
    body: bytes,
) -> None:
    headers = {"Accept": accept} if accept else {}
    safe_query = {k.encode("utf-8", "surrogatepass").decode("utf-8", "replace"):
                  v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                  for k, v in query.items()}  # fmt: skip
    with watched_logs() as records:
        resp = await gateway.client.request(
            method, path, params=safe_query, headers=headers, data=body
        )
        await resp.read()
        if method in ("GET", "HEAD"):
            assert resp.status == 200, (path, method, resp.status)
        else:
            assert resp.status == 405, (path, method, resp.status)
        check_logs(records, [])


# --- Zulip ------------------------------------------------------------------------

ZULIP_ENDPOINTS = [
    "server/register",
    "server/deactivate",
    "server/analytics",
    "server/analytics/status",
    "push/register",
    "push/unregister",
    "push/unregister/all",
    "push/notify",
    "push/test_notification",
    "push/e2ee/register",
    "push/e2ee/notify",
    "no/such/endpoint",
]
ZULIP_FIELDS = [
    "zulip_org_id", "zulip_org_key", "hostname", "contact_email", "new_org_key", "token",
    "token_kind", "ios_app_id", "user_id", "user_uuid", "realm_uuid", "realm_counts",
    "installation_counts", "realmauditlog_rows", "realms", "version", "merge_base",
    "api_feature_level", "token_id", "encrypted_push_registration", "bouncer_public_key",
    "push_requests", "apns_payload", "gcm_payload", "gcm_options", "android_devices",
    "apple_devices", "http_headers", "payload", "push_key_id", "encrypted_data",
    "fcm_priority", "apns_priority", "apns_push_type", "uuid", "id", "base_payload",
]  # fmt: skip


@st.composite
def zulip_form_value(draw: st.DrawFn, realm: str) -> str:
    kind = draw(st.sampled_from(["json", "text", "realm", "token", "raw"]))
    if kind == "json":
        return dumps(draw(JSON_VALUES))
    if kind == "realm":
        return realm
    if kind == "token":
        return draw(st.sampled_from([apns_token(), fcm_token(), "1", "2", '"1"']))
    if kind == "raw":
        return draw(raw_json_text())
    return draw(ODD_TEXT)


def zulip_form_base(endpoint: str, z: _Zulip) -> dict[str, Any]:
    """A valid form for `endpoint` (values as a Zulip server sends them)."""
    identity = {"user_id": "10", "user_uuid": str(uuid.uuid4()), "realm_uuid": z.realm}
    token = {"token": z.token, "token_kind": "1", "ios_app_id": IOS_APP_ID}
    if endpoint == "server/register":
        return {
            "zulip_org_id": str(uuid.uuid4()),
            "zulip_org_key": secrets.token_hex(32),
            "hostname": f"h{secrets.token_hex(4)}.example.org",
            "contact_email": "admin@example.org",
        }
    if endpoint == "server/analytics":
        return {
            "realm_counts": json.dumps([{"id": 1}]),
            "installation_counts": "[]",
            "realms": json.dumps([realm_dict(z.realm)]),
            "version": '"12.0"',
            "api_feature_level": "468",
        }
    if endpoint in ("push/register", "push/unregister"):
        return {**token, **identity}
    if endpoint == "push/unregister/all":
        return identity
    if endpoint == "push/e2ee/register":
        other = apns_token()
        return {
            "realm_uuid": z.realm,
            "token_id": token_id_of(other),
            "encrypted_push_registration": seal_registration(
                VECTOR_KEY["public_key"], registration_plaintext(other, "apns", IOS_APP_ID)
            ),
            "bouncer_public_key": VECTOR_KEY["public_key"],
        }
    return {}


def zulip_notify_base(realm: str, token: str) -> dict[str, Any]:
    return {
        "realm_uuid": realm,
        "push_requests": [
            {
                "token_id": token_id_of(token),
                "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
                "payload": {"push_key_id": 10, "encrypted_data": "AAAA", "aps": {"sound": "x"}},
            },
            {"token_id": token_id_of(token), "fcm_priority": "high",
             "payload": {"push_key_id": 20, "encrypted_data": "AAAA"}},
        ],
    }  # fmt: skip


def zulip_legacy_base(realm: str, token: str) -> dict[str, Any]:
    return {
        "user_id": 10,
        "user_uuid": str(uuid.uuid4()),
        "realm_uuid": realm,
        "apns_payload": {"alert": "hi", "badge": 1},
        "gcm_payload": {"event": "message"},
        "gcm_options": {"priority": "high"},
        "android_devices": [fcm_token()],
        "apple_devices": [token],
    }


class _Zulip:
    """A registered server with a realm and a registered APNs token, made once a test."""

    server: ZulipServer
    realm: str
    token: str


async def zulip_ready(gateway: Gateway) -> _Zulip:
    z = _Zulip()
    z.server = ZulipServer(gateway.client)
    await z.server.register()
    z.realm = await z.server.add_realm()
    z.token = apns_token()
    status, body = await z.server.e2ee_register(z.realm, z.token)
    assert status == 200, body
    status, body = await z.server.legacy_register(z.token, 1, user_id=10)
    assert status == 200, body
    return z


async def ready(gateway: Gateway) -> _Zulip:
    if gateway.zulip is None:
        gateway.zulip = await zulip_ready(gateway)
    return gateway.zulip


def assert_zulip_envelope(status: int, text: str) -> dict[str, Any]:
    body = json.loads(text)
    assert isinstance(body, dict), text
    if status == 200:
        assert body["result"] == "success", text
    else:
        assert body["result"] == "error", text
        assert isinstance(body["msg"], str) and isinstance(body["code"], str), text
        assert "Traceback" not in body["msg"]
    return body


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    endpoint=st.sampled_from(ZULIP_ENDPOINTS),
    shape=st.sampled_from(["form", "form", "mutated_json", "raw"]),
    auth=st.sampled_from(["ok", "ok", "ok", "wrong_key", "garbage", "none"]),
    data=st.data(),
)
async def test_zulip_client_mistakes(
    db_gateway: Gateway, endpoint: str, shape: str, auth: str, data: st.DataObject
) -> None:
    gateway = db_gateway
    z = await ready(gateway)
    server = z.server
    headers = dict(server.headers)
    if auth == "ok":
        headers = server.auth
    elif auth == "wrong_key":
        raw = base64.b64encode(f"{server.uuid}:{'x' * 64}".encode()).decode()
        headers["Authorization"] = f"Basic {raw}"
    elif auth == "garbage":
        headers["Authorization"] = data.draw(
            st.sampled_from(["Basic", "Basic !!!", "Bearer x", "Basic " + "A" * 5000])
            | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
            label="authorization",
        )
    query = ""
    if shape == "form":
        fields = zulip_form_base(endpoint, z)
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            name = data.draw(st.sampled_from([*fields, *ZULIP_FIELDS]) | ODD_TEXT, label="field")
            if name in fields and data.draw(st.booleans(), label="delete"):
                del fields[name]
            else:
                fields[name] = data.draw(zulip_form_value(z.realm), label="value")
        pairs = [(_quote(k), _quote(v)) for k, v in fields.items()]
        duplicate: bool = data.draw(st.booleans(), label="duplicate")
        if pairs and duplicate:
            # a field twice, or bytes no UTF-8 decodes (`%ff`): odd form encodings
            pairs.append((pairs[0][0], data.draw(st.sampled_from(["%ff", "%00", "%C0%80", ""]))))
        encoded = "&".join(f"{k}={v}" for k, v in pairs)
        form = data.draw(st.sampled_from(["urlencoded", "urlencoded", "multipart", "query"]))
        if form == "multipart":
            body = _multipart(fields, "xYzBoundary", data.draw(st.sampled_from(PART_HEADERS)))
            ctype = "multipart/form-data; boundary=xYzBoundary"
        elif form == "query" and len(encoded) < 8000:  # aiohttp's own 400 past 8190 bytes
            query, body, ctype = "?" + encoded, b"", None
        else:
            body = encoded.encode()
            ctype = data.draw(CONTENT_TYPES | st.just("application/x-www-form-urlencoded"))
    elif shape == "mutated_json":
        if endpoint == "push/notify":
            base = zulip_legacy_base(z.realm, z.token)
        elif endpoint == "push/test_notification":
            base = {
                "token": z.token,
                "token_kind": 1,
                "base_payload": {"alert": "x"},
                "user_id": 10,
                "realm_uuid": z.realm,
                "user_uuid": str(uuid.uuid4()),
            }
        else:
            base = zulip_notify_base(z.realm, z.token)
        value = data.draw(mutated(base, ZULIP_FIELDS), label="json")
        body = dumps(value).encode("utf-8", "surrogatepass")
        ctype = data.draw(CONTENT_TYPES, label="ctype")
    elif shape == "raw":
        body = data.draw(
            st.binary(max_size=64)
            | raw_json_text().map(lambda t: t.encode("utf-8", "surrogatepass")),
            label="raw",
        )
        ctype = data.draw(CONTENT_TYPES, label="ctype")
    if ctype is not None:
        headers["Content-Type"] = ctype
    method = "GET" if endpoint == "server/analytics/status" else "POST"
    before = await gateway.snapshot()
    with watched_logs() as records:
        resp = await gateway.client.request(
            method, PREFIX + endpoint + query, data=body, headers=headers
        )
        text = await resp.text()
        event(f"{endpoint} {resp.status} {json.loads(text).get('code')}")
        assert resp.status < 500, (resp.status, text)
        answer = assert_zulip_envelope(resp.status, text)
        if resp.status != 200 and endpoint != "push/e2ee/register":
            # (e2ee/register records the realm's request time before it validates)
            assert await gateway.snapshot() == before, answer
        if endpoint == "server/deactivate" and resp.status == 200:
            gateway.zulip = None  # the next example needs a server that is registered
        secrets_ = [z.token, server.key, VECTOR_KEY["private_key"]]
        if resp.status != 200:  # (legacy notify's answer lists the tokens it was sent)
            for secret in secrets_:
                assert secret not in text, text
        check_logs(records, secrets_)


PART_HEADERS = [
    b"",
    b"Content-Transfer-Encoding: bogus\r\n",
    b"Content-Transfer-Encoding: base64\r\n",
    b"Content-Encoding: gzip\r\n",
    b"Content-Type: text/plain; charset=bogus\r\n",
    b"X-Long: " + b"n" * 9000 + b"\r\n",
    b"X-A: b\r\n" * 200,
    b"no colon here\r\n",
    b"Content-Length: zz\r\n",
]


def _multipart(fields: dict[str, str], boundary: str, extra: bytes = b"") -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{_quote(k)}"\r\n'.encode()
        + extra
        + b"\r\n"
        + v.encode("utf-8", "surrogatepass")
        + b"\r\n"
        for k, v in fields.items()
    ]
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text.encode("utf-8", "surrogatepass"), safe="")


async def test_zulip_odd_multipart_parts(gateway: Gateway) -> None:
    # A part's header line over 8190 bytes, 200 header lines, a line without a colon
    # (aiohttp's HttpProcessingError) or an unknown Content-Transfer-Encoding
    # (RuntimeError) was answered 500 INTERNAL_SERVER_ERROR and logged as our error.
    for extra in PART_HEADERS[1:]:
        server = ZulipServer(gateway.client)
        fields = {"zulip_org_id": server.uuid, "zulip_org_key": server.key,
                  "hostname": server.hostname, "contact_email": "admin@example.org"}  # fmt: skip
        before = await gateway.snapshot()
        with watched_logs() as records:
            resp = await gateway.client.post(
                PREFIX + "server/register",
                data=_multipart(fields, "B", extra),
                headers={"Content-Type": "multipart/form-data; boundary=B"},
            )
            body = assert_zulip_envelope(resp.status, await resp.text())
            assert resp.status in (200, 400), (extra[:30], body)
            if resp.status == 400:
                assert body["msg"] == "Malformed form body"
                assert await gateway.snapshot() == before
            check_logs(records, [server.key])


# --- the YAML config loader --------------------------------------------------------

CONFIG_KEYS = [
    "server", "host", "port", "logging", "level", "store", "url", "receipts", "directory",
    "hmac_key", "format", "delivery", "plugins", "enabled", "zulip", "matrix", "apps",
    "type", "topic", "keyfile", "key_id", "team_id", "project_id", "service_account_file",
    "bouncer_keys", "registration", "allowlist", "legacy_api", "notify_deadline",
    "metrics_port", "client_max_size", "body_timeout", "backoff_base", "backoff_cap",
    "max_body_bytes", "msc3013_mode", "inflight_request_limit", "proxy", "hmac_key_file",
]  # fmt: skip


@pytest.fixture(scope="module")
def config_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("fuzz-config")
    account = directory / "sa.json"
    make_service_account("pushgw-test", "http://127.0.0.1:1/token", account)
    return {
        "server": {"host": "127.0.0.1", "port": 5000},
        "logging": {"level": "INFO"},
        "store": {"url": f"sqlite+aiosqlite:///{directory / 'pushgw.db'}"},
        "receipts": {"directory": str(directory / "receipts"), "hmac_key": "k"},
        "delivery": {"backoff_base": 0.05},
        "plugins": {
            "enabled": ["zulip", "matrix"],
            "zulip": {
                "bouncer_keys": {VECTOR_KEY["public_key"]: VECTOR_KEY["private_key"]},
                "apps": {"ios": {**offline_apns_app(directory), "topic": IOS_APP_ID}},
            },
            "matrix": {
                "apps": {
                    "com.example.android": {
                        "type": "fcm",
                        "project_id": "pushgw-test",
                        "service_account_file": str(account),
                    }
                }
            },
        },
    }


def check_config_text(path: Path, text: bytes) -> None:
    path.write_bytes(text)
    try:
        load_gateway(path)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError without a problem"
        for problem in exc.problems:
            assert "\n" not in problem and "Traceback" not in problem, problem
            assert VECTOR_KEY["private_key"] not in problem, problem


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_config_wrong_types(
    config_base: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    value = data.draw(mutated(config_base, CONFIG_KEYS), label="config")
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    text = yaml.safe_dump(value, allow_unicode=False).encode()
    check_config_text(path, text)


@settings(max_examples=150, deadline=None)
@given(
    text=st.one_of(
        st.binary(max_size=80),
        st.text(max_size=80).map(str.encode),
        st.lists(
            st.sampled_from(
                [
                    "server:",
                    "  port: ",
                    "[",
                    "]",
                    "{",
                    "}",
                    "&a",
                    "*a",
                    "!!python/object:os.system",
                    "- ",
                    "? ",
                    ": ",
                    "\t",
                    "\n",
                    "'",
                    '"',
                    "\\ud800",
                    "1e400",
                    ".nan",
                    "0x10",
                    "plugins:",
                    "  enabled: ",
                    "zulip",
                    "matrix",
                    "~",
                    "<<: *a",
                    "%YAML 1.1\n---\n",
                    "!!binary AAAA",
                    "2024-01-01",
                    "!!set {a}",
                    "--- !!omap\n",
                ]
            ),
            max_size=15,
        ).map(lambda parts: "".join(parts).encode()),
    )
)
def test_config_malformed_yaml(tmp_path_factory: pytest.TempPathFactory, text: bytes) -> None:
    check_config_text(tmp_path_factory.getbasetemp() / "fuzz-raw.yaml", text)


def test_config_control_character_is_one_line(tmp_path: Path) -> None:
    # PyYAML's ReaderError reads `unacceptable character ...\n  in "<unicode string>",
    # position 3`: the problem spanned two lines, and named no line of the file.
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"server:\n  host: a\x00b\n")
    with pytest.raises(ConfigError) as caught:
        load_gateway(path)
    assert caught.value.problems == [
        "line 2: invalid YAML (character #x0000: special characters are not allowed)"
    ]


def test_config_key_with_a_newline_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text('server:\n  "po\\nrt": 1\n"\\x1b[2J": {}\n')
    with pytest.raises(ConfigError) as caught:
        load_gateway(path)
    assert sorted(caught.value.problems) == [
        "'\\x1b[2J': unknown key",
        "server.'po\\nrt': unknown key",
    ]
