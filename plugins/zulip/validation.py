"""Request parsing and validation, producing Zulip's errors (specs/zulip.md §4-§6).

Pure functions over already-decoded request data (`Params`, a mapping of form fields,
or a parsed JSON object). Every failure raises `ZulipError` with the code and message
a Zulip server expects; nothing here touches the store.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from plugins.zulip.crypto import CryptoError, token_id_of, token_id_to_int64
from plugins.zulip.errors import ZulipError, invalid_registration, missing_argument

__all__ = [
    "APNS",
    "FCM",
    "INT32",
    "INT64",
    "ApnsPushRequest",
    "E2eeNotify",
    "E2eeRegistration",
    "FcmPushRequest",
    "LegacyIdentity",
    "Params",
    "check_int_range",
    "check_text",
    "json_field",
    "parse_e2ee_notify",
    "parse_json",
    "parse_registration_plaintext",
    "validate_apns_token",
    "validate_email",
    "validate_gcm_options",
    "validate_hostname",
    "validate_org_id",
]

Params = Mapping[str, str]
"""Form fields (values are the raw strings a Zulip server sent)."""

APNS = 1
FCM = 2
MAX_TOKEN_LEN = 4096
SERVER_KEY_LEN = 64
APNS_PRIORITIES = frozenset({10, 5, 1})
APNS_PUSH_TYPES = frozenset(
    {"alert", "background", "voip", "complication", "fileprovider", "mdm", "liveactivity"}
)
FCM_PRIORITIES = frozenset({"high", "normal"})
_HEX = re.compile(r"[0-9a-fA-F]*")
_IOS_APP_ID = re.compile(r"[.a-zA-Z0-9-]+")
_UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]+")
INT32 = (-(2**31), 2**31 - 1)
"""The range of an `Integer` column (PostgreSQL `integer`)."""
INT64 = (-(2**63), 2**63 - 1)
"""The range of a `BigInteger` column, and of every integer SQLite can bind."""
EMAIL_MAX_LEN = 254
"""RFC 5321's limit on an address (the `contact_email` column holds 255)."""
MAX_APP_ID_LEN = 255


# --- JSON and text -------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    # `1e400` parses as infinity, which the refused `Infinity` stands for: providers'
    # encoders (allow_nan=False) then fail, and the push was dropped after a 200.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def check_text(value: Any) -> None:
    """Raise `ValueError` unless every string in `value` (keys included) encodes as UTF-8
    and holds no NUL character.

    JSON escapes can produce lone surrogates (`"\\ud800"`), which no database, hash or
    provider accepts. NUL (`"\\u0000"`, or `%00` in a form) is refused because
    PostgreSQL text cannot hold it (a bound NUL is a database error, hence a 500); a real
    Zulip server never sends one, as its own data lives in PostgreSQL. Iterative, so that
    nesting depth cannot exhaust the stack.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                item.encode("utf-8")  # UnicodeEncodeError is a ValueError
            if "\x00" in item:
                raise ValueError("NUL character")
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_json(raw: str | bytes) -> Any:
    """Strict JSON as Zulip's bouncer (orjson) reads it, else `ValueError`.

    Bytes must be UTF-8; `NaN`/`Infinity` (also spelt `1e400`), lone surrogates and NUL
    are refused; nesting too deep for the parser is a `ValueError` too, never a
    `RecursionError`.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    check_text(value)
    return value


# --- generic field access ------------------------------------------------------------


def required(params: Params, name: str) -> str:
    value = params.get(name)
    if value is None:
        raise missing_argument(name)
    return value


def json_field(params: Params, name: str, default: Any = ..., *, kind: type | None = None) -> Any:
    """A form field whose value is JSON text (`token_kind=2`, `realms=[...]`)."""
    raw = params.get(name)
    if raw is None:
        if default is ...:
            raise missing_argument(name)
        return default
    try:
        value = parse_json(raw)
    except ValueError:
        raise ZulipError(f'Argument "{name}" is not valid JSON.') from None
    if kind is not None and not _is(value, kind):
        raise ZulipError(f"{name} is not {_KIND_NAMES.get(kind, 'valid')}")
    return value


_KIND_NAMES: dict[type, str] = {int: "an integer", list: "a list", dict: "a dict", str: "a string"}


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int_range(value: int, name: str, bounds: tuple[int, int] = INT64) -> int:
    """Zulip's messages for an integer out of the column's range (a 400, not a DB error)."""
    if value < bounds[0]:
        raise ZulipError(f"{name} is too small")
    if value > bounds[1]:
        raise ZulipError(f"{name} is too large")
    return value


def optional_int(params: Params, name: str, bounds: tuple[int, int] = INT64) -> int | None:
    value = json_field(params, name, None)
    if value is None:
        return None
    if not is_int(value):
        raise ZulipError(f"{name} is not an integer")
    return check_int_range(value, name, bounds)


# --- server registration -----------------------------------------------------------


def validate_org_id(value: str) -> str:
    """The canonical lowercase UUIDv4 form, else 400 `Invalid UUID`."""
    if not _UUID4.fullmatch(value):
        raise ZulipError("Invalid UUID")
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise ZulipError("Invalid UUID") from None
    if str(parsed) != value or parsed.version != 4:
        raise ZulipError("Invalid UUID")
    return value


def validate_server_key(name: str, value: str) -> str:
    if len(value) != SERVER_KEY_LEN:
        raise ZulipError(f"{name} must be {SERVER_KEY_LEN} characters long")
    return value


def validate_hostname(hostname: str) -> str:
    """A host with optional port; no scheme, path, query, fragment or credentials."""
    # urlsplit silently drops tab, CR and LF anywhere in the URL (bpo-43882): check first,
    # or "chat.example.org\n" would pass, be stored, and dodge the hostname-in-use check.
    if not hostname or len(hostname) > 255 or any(c in hostname for c in "\t\r\n"):
        raise ZulipError(f"{hostname} is not a valid hostname")
    try:
        parts = urlsplit("http://" + hostname)
        port = parts.port
    except ValueError:
        raise ZulipError(f"{hostname} is not a valid hostname") from None
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ZulipError(f"{hostname} contains invalid components (e.g., path, query, fragment).")
    host = parts.hostname or ""
    if port is not None and not 0 < port < 65536:
        raise ZulipError(f"{hostname} is not a valid hostname")
    # Brackets hold an IPv6 address and nothing else.
    valid = _is_ipv6_address(host) if hostname.startswith("[") else _is_dns_name(host)
    if not valid:
        raise ZulipError(f"{hostname} is not a valid hostname")
    return hostname


# RFC 1035's 255 octets on the wire, as text: without the trailing dot, 253 characters.
# Counted on the A-label form: "ü" is one character and its label's punycode several.
DNS_NAME_MAX = 253


def _is_dns_name(host: str) -> bool:
    """A DNS name, internationalized ones included (`chat.münchen.de`): Zulip's bouncer
    (Django's URLValidator, the email-validator package) accepts them, so a Zulip server
    whose EXTERNAL_HOST or administrator address is one must be able to register here."""
    ascii_host = _to_ascii(host)
    if not ascii_host or len(ascii_host.rstrip(".")) > DNS_NAME_MAX:
        return False
    labels = ascii_host.rstrip(".").split(".")
    return all(_HOST_LABEL.fullmatch(label) for label in labels)


def _to_ascii(host: str) -> str | None:
    """The A-label (punycode) form of `host`, as DNS sees it; None when it has none, or
    when `host` is not written as IDNA gives it back (case aside)."""
    if host.isascii():
        return host
    try:
        ascii_host = host.encode("idna").decode("ascii")
        written = ascii_host.encode("ascii").decode("idna")
    except UnicodeError:
        return None
    # IDNA drops some characters and maps others (a soft hyphen or a zero-width space to
    # nothing, fullwidth letters to ASCII, an ideographic full stop to a dot): such a
    # name shows as another ("chat.exa\u00admple.org" as chat.example.org, which DNS
    # takes it for) without being the same text, so it got past the hostname-in-use check.
    return ascii_host if written.lower() == host.lower() else None


def _is_ipv6_address(host: str) -> bool:
    """The host of `[2001:db8::5]` (port optional), which Zulip's URLValidator accepts:
    a Zulip server's EXTERNAL_HOST may be an IPv6 address.

    Zone ids (`%eth0`) mean nothing off the host; Django's pattern refuses them too.
    """
    if "%" in host:
        return False
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def validate_email(email: str) -> str:
    """A syntactic e-mail check (no DNS): 400 with data field `email_reason` on failure."""
    reason: str | None = None
    if email.count("@") != 1:
        reason = "The email address is not valid. It must have exactly one @-sign."
    else:
        local, domain = email.split("@")
        if not local or not _EMAIL_LOCAL.fullmatch(local) or ".." in local:
            reason = "The part before the @-sign is not valid."
        elif (
            "." not in domain
            or len(domain) > 255
            or domain.endswith(".")
            or not _is_dns_name(domain)
        ):
            reason = "The domain name is not valid."
        elif len(email) > EMAIL_MAX_LEN:
            reason = f"The email address is too long ({_too_many(len(email) - EMAIL_MAX_LEN)})."
    if reason is not None:
        raise ZulipError(
            f"Invalid server administrator email address: {reason}",
            data={"email_reason": reason},
        )
    return email


def _too_many(n: int) -> str:
    return f"{n} character{'s' if n != 1 else ''} too many"


# --- E2EE registration ---------------------------------------------------------------


@dataclass(frozen=True)
class E2eeRegistration:
    """A decrypted and validated registration."""

    token: str
    token_kind: Literal["apns", "fcm"]
    ios_app_id: str | None
    timestamp: int

    def __repr__(self) -> str:  # never show the token
        return f"E2eeRegistration(kind={self.token_kind!r}, ios_app_id={self.ios_app_id!r})"


def parse_registration_plaintext(plaintext: bytes) -> E2eeRegistration:
    """Step 4 of §5.1; any problem is 400 `Invalid encrypted_push_registration`."""
    try:
        data = parse_json(plaintext)
    except ValueError:
        raise invalid_registration() from None
    if not isinstance(data, dict):
        raise invalid_registration()
    token = data.get("token")
    kind = data.get("token_kind")
    ios_app_id = data.get("ios_app_id")
    timestamp = data.get("timestamp")
    if not isinstance(token, str) or not 1 <= len(token) <= MAX_TOKEN_LEN:
        raise invalid_registration()
    if not isinstance(timestamp, int) or isinstance(timestamp, bool):
        raise invalid_registration()
    if not INT64[0] <= timestamp <= INT64[1]:  # beyond, `time.time() - timestamp` overflows
        raise invalid_registration()
    if ios_app_id is not None and (
        not isinstance(ios_app_id, str) or len(ios_app_id) > MAX_APP_ID_LEN
    ):
        raise invalid_registration()
    if kind == "apns":
        if len(token) % 2 or not _HEX.fullmatch(token):
            raise invalid_registration()
        if ios_app_id is None or not _IOS_APP_ID.fullmatch(ios_app_id):
            raise invalid_registration()
    elif kind == "fcm":
        if ios_app_id is not None:
            raise invalid_registration()
    else:
        raise invalid_registration()
    assert isinstance(timestamp, int)
    return E2eeRegistration(token, kind, ios_app_id, timestamp)


def check_token_id(token_id: str, token: str) -> int:
    """Step 5 of §5.1: the sent token_id must be the token's, as a string; returns the int64."""
    if token_id != token_id_of(token):
        raise invalid_registration()
    return token_id_to_int64(token_id)


# --- E2EE notify ----------------------------------------------------------------------


@dataclass(frozen=True)
class ApnsPushRequest:
    token_id: str
    token_id_int: int
    priority: int
    push_type: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class FcmPushRequest:
    token_id: str
    token_id_int: int
    priority: str
    push_key_id: int
    encrypted_data: str


@dataclass(frozen=True)
class E2eeNotify:
    realm_uuid: str
    push_requests: list[ApnsPushRequest | FcmPushRequest]


DEFAULT_APS: dict[str, Any] = {"mutable-content": 1, "alert": {"title": "New notification"}}


def _bad(msg: str) -> ZulipError:
    return ZulipError(msg)


def _push_key_fields(payload: Any, where: str) -> tuple[int, str]:
    if not isinstance(payload, dict):
        raise _bad(f"{where}.payload is not a dict")
    push_key_id = payload.get("push_key_id")
    if not isinstance(push_key_id, int) or isinstance(push_key_id, bool):
        raise _bad(f"{where}.payload.push_key_id is not a valid push key id")
    if not 0 <= push_key_id < 2**32:
        raise _bad(f"{where}.payload.push_key_id is not a valid push key id")
    encrypted = payload.get("encrypted_data")
    if not isinstance(encrypted, str):
        raise _bad(f"{where}.payload.encrypted_data is not a string")
    return push_key_id, encrypted


def _token_id(value: Any, where: str) -> tuple[str, int]:
    if not isinstance(value, str):
        raise _bad(f"{where}.token_id is not a string")
    try:
        return value, token_id_to_int64(value)
    except CryptoError:
        raise _bad("`token_id` is not Base64 encoded") from None


def parse_e2ee_notify(body: Any) -> E2eeNotify:
    """The JSON body of `push/e2ee/notify` (§5.2)."""
    if not isinstance(body, dict):
        raise _bad("Malformed JSON")
    realm_uuid = body.get("realm_uuid")
    if realm_uuid is None:
        raise missing_argument("realm_uuid")
    if not isinstance(realm_uuid, str):
        raise _bad("realm_uuid is not a string")
    raw_requests = body.get("push_requests")
    if raw_requests is None:
        raise missing_argument("push_requests")
    if not isinstance(raw_requests, list):
        raise _bad("push_requests is not a list")
    requests: list[ApnsPushRequest | FcmPushRequest] = []
    for i, item in enumerate(raw_requests):
        where = f"push_requests[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} is not a dict")
        is_apns = "http_headers" in item
        is_fcm = "fcm_priority" in item
        if is_apns == is_fcm:
            raise _bad(f"{where} is neither an APNs nor an FCM push request")
        token_id, token_id_int = _token_id(item.get("token_id"), where)
        if is_apns:
            headers = item["http_headers"]
            if not isinstance(headers, dict):
                raise _bad(f"{where}.http_headers is not a dict")
            priority = headers.get("apns_priority")
            if not is_int(priority) or priority not in APNS_PRIORITIES:
                raise _bad(f"{where}.http_headers.apns_priority is not valid")
            push_type = headers.get("apns_push_type")
            # Type first: a list or object is unhashable, and `in` a frozenset raises.
            if not isinstance(push_type, str) or push_type not in APNS_PUSH_TYPES:
                raise _bad(f"{where}.http_headers.apns_push_type is not valid")
            payload = item.get("payload")
            _push_key_fields(payload, where)
            assert isinstance(payload, dict)
            aps = payload.get("aps", ...)
            body_out = dict(payload)
            if aps is ...:
                body_out["aps"] = json.loads(json.dumps(DEFAULT_APS))
            elif not isinstance(aps, dict):
                raise _bad(f"{where}.payload.aps is not a dict")
            requests.append(ApnsPushRequest(token_id, token_id_int, priority, push_type, body_out))
        else:
            priority_s = item["fcm_priority"]
            if not isinstance(priority_s, str) or priority_s not in FCM_PRIORITIES:
                raise _bad(f"{where}.fcm_priority is not valid")
            push_key_id, encrypted = _push_key_fields(item.get("payload"), where)
            requests.append(
                FcmPushRequest(token_id, token_id_int, priority_s, push_key_id, encrypted)
            )
    return E2eeNotify(realm_uuid, requests)


# --- legacy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LegacyIdentity:
    user_id: int | None
    user_uuid: str | None


def legacy_identity(user_id: Any, user_uuid: Any) -> LegacyIdentity:
    if user_id is not None:
        if not is_int(user_id):
            raise _bad("user_id is not an integer")
        check_int_range(user_id, "user_id")
    if user_uuid is not None and not isinstance(user_uuid, str):
        raise _bad("user_uuid is not a string")
    if user_id is None and user_uuid is None:
        raise _bad("Missing user_id or user_uuid")
    return LegacyIdentity(user_id, user_uuid)


def validate_token_kind(kind: Any) -> int:
    if not is_int(kind) or kind not in (APNS, FCM):
        raise _bad("Invalid token type")
    return int(kind)


def validate_legacy_token(token: str, kind: int) -> str:
    if not token or len(token) > MAX_TOKEN_LEN:
        raise _bad("Empty or invalid length token")
    if kind == APNS:
        validate_apns_token(token)
    return token


def validate_apns_token(token: str) -> None:
    if not _HEX.fullmatch(token):
        raise _bad("Invalid APNS token")


def validate_gcm_options(options: Any, event: Any) -> str:
    """The FCM priority from `gcm_options` (§6), defaulting by event."""
    if not isinstance(options, dict):
        raise _bad("gcm_options is not a dict")
    remaining = dict(options)
    priority = remaining.pop("priority", None)
    if priority is None:
        priority = "high" if event == "message" else "normal"
    elif not isinstance(priority, str) or priority not in FCM_PRIORITIES:  # lists: unhashable
        raise _bad(f"Invalid GCM option to bouncer: priority {priority!r}")
    if remaining:
        raise _bad(
            "Invalid GCM options to bouncer: " + json.dumps(remaining, separators=(",", ":"))
        )
    return str(priority)
