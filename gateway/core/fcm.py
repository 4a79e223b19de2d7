"""FCM HTTP v1 provider client: one Firebase project, one shared aiohttp session.

firebase-admin / google-auth are used only to read the service account and mint OAuth
access tokens (in a thread of the app's own: google-auth's refresh is blocking); messages
are sent with aiohttp and the cached bearer token (specs/providers.md §4.2: the SDK send
path is ~10x slower, retries on its own and breaks under burst concurrency).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import io
import json
import logging
import re
import ssl
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import google.auth.exceptions
import google.auth.transport.requests
import requests
import yarl
from multidict import CIMultiDict

from gateway.config import FcmAppConfig
from gateway.core.classify import classify_fcm
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

DEFAULT_SEND_URL = "https://fcm.googleapis.com/v1/projects/{project_id}/messages:send"
DATA_LIMIT = 4096
REFRESH_AHEAD = 300.0  # refresh the OAuth token when less than this is left
FETCH_RETRY = 2.0  # no new token request sooner than this after a failed one
# FCM answered 401 to a token fetched because of a 401: the credential is refused, not
# the token, and a new token per push would be a token request (and a log line) per push.
REFUSED_REFETCH = 60.0
RESERVED_DATA_KEYS = frozenset({"from", "message_type"})
RESERVED_DATA_PREFIXES = ("google", "gcm")
TARGET_KEYS = ("token", "topic", "condition")
# The v1 `Message` and `AndroidConfig` field names (proto3 JSON takes snake_case and
# lowerCamelCase). FCM parses the body into its protobuf and refuses any other name with
# a 400, which counts against the project's quota like a sent message: refused here.
MESSAGE_FIELDS = frozenset(
    {"name", "data", "notification", "android", "webpush", "apns", "fcm_options", "fcmOptions"}
)
ANDROID_FIELDS = frozenset(
    {"priority", "ttl", "data", "notification", "fcm_options", "fcmOptions"}
    | {"collapse_key", "collapseKey", "restricted_package_name", "restrictedPackageName"}
    | {"direct_boot_ok", "directBootOk", "bandwidth_constrained_ok", "bandwidthConstrainedOk"}
    | {"restricted_satellite_ok", "restrictedSatelliteOk"}
)
# Legacy-API (`/fcm/send`) names that a payload ported from it still carries, and where
# HTTP v1 has them.
LEGACY_FIELDS = {
    "priority": "android.priority",
    "time_to_live": 'android.ttl, a duration string such as "3600s"',
    "collapse_key": "android.collapse_key",
    "restricted_package_name": "android.restricted_package_name",
    "delay_while_idle": "nothing (removed)",
    "content_available": "apns.payload.aps.content-available",
    "mutable_content": "apns.payload.aps.mutable-content",
    "direct_boot_ok": "android.direct_boot_ok",
    "to": "the push's token",
    "registration_ids": "the push's token",
}
# A message's top-level names `message_problem` lets through (validate refuses targets).
MESSAGE_NAMES = MESSAGE_FIELDS | frozenset(TARGET_KEYS)
# The `AndroidConfig` fields that must be strings when set.
ANDROID_STRING_FIELDS = frozenset(
    {"collapse_key", "collapseKey", "restricted_package_name", "restrictedPackageName"}
)
ANDROID_PRIORITIES = frozenset({"high", "normal", "HIGH", "NORMAL"})
# protobuf JSON Duration: seconds with at most 9 fractional digits and an "s"; FCM takes
# 0 to 4 weeks.
TTL_FORMAT = re.compile(r"\d{1,12}(?:\.\d{1,9})?s")
MAX_TTL = 2_419_200.0
# The most of an answer's body kept: FCM's answers are a few hundred bytes (an error with
# its details under 2 KiB). A proxy's or a broken upstream's body of tens of megabytes, or
# one that never ends, was read whole into memory until `request_timeout`.
BODY_LIMIT = 64 * 1024

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_decode = json.JSONDecoder().decode


def data_size_bound(chars: int, items: int) -> int:
    """The most bytes a data map of `items` string pairs (`chars` characters in keys and
    values together) encodes to as compact JSON.

    A character encodes to at most 6 bytes (`\\u001f`), an item adds 6 bytes of quotes,
    colon and comma, the braces 2: under the limit, encoding only to measure is wasted.
    """
    return 6 * (chars + items) + 2


class _TimedRequest(google.auth.transport.requests.Request):
    """google-auth's requests transport with every request bounded by `timeout` seconds.

    google-auth sends the token request with its own default, 120 s: against a token
    endpoint that accepts and never answers, each fetch then held its executor thread
    (the loop's default executor, which also resolves every provider host name) and
    its socket for two minutes, and delayed a process's exit as long.
    (Each app now has a thread of its own for these requests: see `FcmClient._fetch`.)

    That timeout bounds each read, not the answer: a body that never ends (a proxy's, a
    broken endpoint's) was read for ever, into memory, and held the app's token thread
    (every later token request queued behind it). The body is read here instead, at
    most `BODY_LIMIT` bytes and `timeout` seconds of it.
    """

    def __init__(self, session: requests.Session, timeout: float) -> None:
        super().__init__(session=session)
        self._timeout = timeout
        self.session.hooks["response"].append(self._read_body)

    def _read_body(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        """A response hook (requests calls it before returning the answer): read the body
        (sent with `stream=True`) bounded, then serve it from memory."""
        deadline = time.monotonic() + self._timeout
        body = bytearray()
        try:
            # From `raw` (urllib3), not `iter_content`: that marks the body consumed,
            # and `content` (google-auth reads it) would then refuse to read `raw`.
            while chunk := response.raw.read(16384, decode_content=True):
                body += chunk
                if len(body) > BODY_LIMIT:
                    raise _TokenAnswerError(f"answer over {BODY_LIMIT} bytes")
                if time.monotonic() > deadline:
                    raise _TokenAnswerError(f"answer not read within {self._timeout:g} s")
        except _TokenAnswerError:
            raise
        except Exception as exc:  # urllib3's, which google-auth would not wrap
            raise _TokenAnswerError(f"answer not read ({type(exc).__name__})") from exc
        finally:
            response.close()
        response.raw = io.BytesIO(bytes(body))  # what `response.content` reads

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: Any = None,
        headers: Any = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs["stream"] = True  # the body is read by `_read_body`
        return super().__call__(url, method, body, headers, timeout=self._timeout, **kwargs)


class _TokenAnswerError(requests.exceptions.RequestException):
    """The token endpoint's answer was too long or too slow (google-auth: TransportError)."""


def _refusal(reason: str, detail: str) -> Attempt:
    return Attempt(Outcome.PERMANENT, reason=reason, detail=detail)


class FcmClient:
    """`ProviderClient` for one Firebase project (service-account OAuth, HTTP v1)."""

    kind = ProviderKind.FCM

    def __init__(
        self,
        app_id: str,
        config: FcmAppConfig,
        *,
        proxy: str | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.app_id = app_id
        self.config = config
        # One request per HTTP/1.1 connection: more in flight would only queue inside
        # aiohttp, where the wait eats the request timeout. Let them queue in the
        # dispatcher's lane instead, which is deadline-aware.
        self.max_in_flight = min(config.max_in_flight, config.max_connections)
        # The loader `check-config` uses too (CredentialError when it does not load).
        account = config.service_account()
        self._credential: Any = account.credential
        self.project_id: str = account.project_id
        self.send_url = (config.send_url or DEFAULT_SEND_URL).format(project_id=self.project_id)
        self.token_uri: str = self._credential._token_uri
        self._ca_file = ca_bundle(config.ca_file, ca_file)
        self._proxy = resolve_proxy(proxy, self.send_url)
        self._token_proxy = resolve_proxy(proxy, self.token_uri)
        self._timeout = config.request_timeout

        self._session: aiohttp.ClientSession | None = None
        self._headers: CIMultiDict[str] | None = None
        self._generation = 0  # bumped on every new access token
        self._auth_failed_generation = -1
        self._refresh_at = 0.0  # monotonic: start a background refresh
        self._expires_at = 0.0  # monotonic: the token can no longer be used
        self._background: asyncio.Task[None] | None = None
        self._fetching: asyncio.Task[None] | None = None
        # The token requests' own thread (`_fetch`), made at the first one.
        self._token_thread: ThreadPoolExecutor | None = None
        self._fetch_error: Exception | None = None
        self._fetch_retry_at = 0.0
        self._fetch_failures = 0  # token requests failed in a row: logged when it starts/ends
        self._fetched_at = 0.0  # monotonic: when the current token came
        self._refused_in_a_row = 0  # tokens FCM answered 401, in a row
        self.token_fetches = 0

    @property
    def send_url(self) -> str:
        return str(self._send_url)

    @send_url.setter
    def send_url(self, url: str) -> None:
        self._send_url = yarl.URL(url)  # parsed once, not per request

    # ProviderClient ------------------------------------------------------------------

    async def start(self) -> None:
        if self._session is None:
            context = ssl_context(self._ca_file) if self.send_url.startswith("https:") else None
            connector = aiohttp.TCPConnector(
                limit=self.config.max_connections,
                limit_per_host=self.config.max_connections,
                ssl=context if context is not None else True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self._timeout),
                trust_env=False,  # the proxy is resolved once (`resolve_proxy`)
                raise_for_status=False,
                # FCM sets no cookies worth keeping; a real jar filters and stores them
                # on every request.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        if self._headers is None:
            try:
                await self._refresh(self._generation)
            except Exception as exc:  # logged by `_fetch`
                log.debug(
                    "FCM app %s: no OAuth token at start (%s)",
                    self.app_id,
                    _token_error(exc, self._token_proxy),
                )

    def ready(self) -> bool:
        return self._session is not None and self._headers is not None

    async def close(self) -> None:
        for task in (self._background, self._fetching):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._background = self._fetching = None
        thread, self._token_thread = self._token_thread, None
        if thread is not None:  # a request still out ends by its request_timeout
            thread.shutdown(wait=False, cancel_futures=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def refresh_credentials(self) -> None:
        """Fetch a new access token, unless one was fetched since the last 401."""
        if 0 <= self._auth_failed_generation < self._generation:
            return
        if self._refused_in_a_row >= 2 and time.monotonic() - self._fetched_at < REFUSED_REFETCH:
            return  # a fresh token was refused too: the dispatcher logs the credential state
        try:
            await self._refresh(self._generation)
        except Exception as exc:  # the next send reports it; `_fetch` logged the request
            log.debug(
                "FCM app %s: OAuth token refresh failed (%s)",
                self.app_id,
                _token_error(exc, self._token_proxy),
            )

    def validate(self, push: Push) -> Attempt | None:
        payload = push.payload
        # `isinstance(x, dict)` first: a Mapping check alone is an ABC lookup per push.
        if not isinstance(payload, dict) and not isinstance(payload, Mapping):
            return _refusal(Reason.INVALID_PAYLOAD, "FCM message must be a JSON object")
        for key in TARGET_KEYS:
            if key in payload:
                return _refusal(Reason.INVALID_PAYLOAD, f"FCM message must not set {key!r}")
        problem = message_problem(payload)
        if problem is not None:
            return _refusal(Reason.INVALID_PAYLOAD, problem)
        data = payload.get("data")
        if data is not None:
            if not isinstance(data, dict) and not isinstance(data, Mapping):
                return _refusal(Reason.INVALID_PAYLOAD, "FCM data must be an object")
            chars = 0
            for key, value in data.items():
                if not isinstance(key, str):
                    return _refusal(Reason.INVALID_PAYLOAD, "FCM data keys must be strings")
                if not isinstance(value, str):
                    return _refusal(
                        Reason.INVALID_PAYLOAD,
                        f"FCM data values must be strings (got {type(value).__name__})",
                    )
                lowered = key.lower()
                if lowered in RESERVED_DATA_KEYS:
                    return _refusal(Reason.INVALID_PAYLOAD, f"FCM data key {lowered!r} is reserved")
                if lowered.startswith(RESERVED_DATA_PREFIXES):
                    return _refusal(
                        Reason.INVALID_PAYLOAD,
                        "FCM data keys starting with 'google' or 'gcm' are reserved",
                    )
                chars += len(key) + len(value)
            limit = push.policy.max_payload_bytes or DATA_LIMIT
            if data_size_bound(chars, len(data)) <= limit:
                return None
            try:
                size = len(_encode(data).encode())
            except UnicodeEncodeError:
                # A lone surrogate (`json.loads` makes one of an escaped "\ud800") has no
                # UTF-8 form; the dispatcher calls validate() unguarded, so refuse, not raise.
                return _refusal(Reason.INVALID_PAYLOAD, "FCM data is not valid Unicode")
            if size > limit:
                return _refusal(
                    Reason.PAYLOAD_TOO_LARGE, f"FCM data is {size} bytes, limit {limit}"
                )
        return None  # encodability is checked where the body is encoded, once, in send()

    async def send(self, push: Push) -> Attempt:
        session = self._session
        if session is None:
            return Attempt(
                Outcome.TRANSIENT, reason=Reason.CONNECTION_ERROR, detail="client not started"
            )
        if self._headers is None or time.monotonic() >= self._refresh_at:
            problem = await self._ensure_token()
            if problem is not None:
                return problem
        headers = self._headers
        assert headers is not None
        generation = self._generation
        try:
            body = _encode({"message": {**push.payload, "token": push.token}}).encode()
        except (TypeError, ValueError, RecursionError) as exc:  # nesting deeper than the stack
            return _refusal(
                Reason.INVALID_PAYLOAD, f"FCM message is not JSON-encodable ({type(exc).__name__})"
            )
        try:
            # A payload, not bytes: aiohttp would look the type up in its payload registry
            # to make the same `BytesPayload` (same Content-Length and bytes on the wire).
            async with session.post(
                self._send_url, data=aiohttp.BytesPayload(body), headers=headers, proxy=self._proxy
            ) as response:
                status = response.status
                raw = await _read_bounded(response, BODY_LIMIT)
                # Only a refusal's is used (`classify_fcm`).
                retry_after = None if status == 200 else response.headers.get("Retry-After")
        except TimeoutError:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.TIMEOUT,
                detail=f"no FCM answer within {self._timeout:g} s",
            )
        except (aiohttp.ClientError, OSError) as exc:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.CONNECTION_ERROR,
                detail=_describe(exc, self._proxy),
            )
        if status == 200:
            try:
                name = _decode(raw.decode()).get("name")
            except (ValueError, AttributeError):
                name = None
            if self._refused_in_a_row:
                self._refused_in_a_row = 0
            return Attempt(Outcome.OK, status=200, provider_id=name)
        attempt = classify_fcm(
            status, raw, retry_after=parse_retry_after(retry_after), token=push.token
        )
        if attempt.outcome is Outcome.AUTH:
            if generation > self._auth_failed_generation:
                self._refused_in_a_row += 1
            self._auth_failed_generation = max(self._auth_failed_generation, generation)
        return attempt

    # OAuth token ---------------------------------------------------------------------

    async def _ensure_token(self) -> Attempt | None:
        """Make a usable token available: in the background while the current one is
        still valid, waiting for it otherwise. Returns an Attempt when there is none."""
        now = time.monotonic()
        if self._headers is not None and now < self._expires_at:
            if self._background is None or self._background.done():
                self._background = asyncio.create_task(self._refresh_quietly(self._generation))
            return None
        try:
            # A send waits no longer than its request would: google-auth retries a
            # token endpoint's 5xx itself (three requests, 1 s and 2 s apart), and the
            # fetch goes on (shielded) for the next send when this one gives up.
            async with asyncio.timeout(self._timeout):
                await self._refresh(self._generation)
        except TimeoutError:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.TIMEOUT,
                detail=f"no OAuth token within {self._timeout:g} s",
            )
        except google.auth.exceptions.RefreshError as exc:
            if getattr(exc, "retryable", False):
                return Attempt(
                    Outcome.TRANSIENT,
                    reason=Reason.CONNECTION_ERROR,
                    detail="OAuth token endpoint unavailable",
                )
            return Attempt(
                Outcome.AUTH, reason="oauth_token_error", detail="OAuth token request refused"
            )
        except Exception as exc:
            return Attempt(
                Outcome.TRANSIENT,
                reason=Reason.CONNECTION_ERROR,
                detail=f"OAuth token request failed ({_token_error(exc, self._token_proxy)})",
            )
        return None

    async def _refresh_quietly(self, generation: int) -> None:
        try:
            await self._refresh(generation)
        except Exception as exc:  # `_fetch` logged the request
            self._refresh_at = time.monotonic() + 30.0  # the current token is still valid
            log.debug(
                "FCM app %s: OAuth token refresh failed (%s)",
                self.app_id,
                _token_error(exc, self._token_proxy),
            )

    async def _refresh(self, generation: int) -> None:
        """Fetch a new token unless one arrived since `generation`.

        Single flight: concurrent callers share one fetch (and its failure); after a
        failure no new fetch starts for `FETCH_RETRY` seconds.
        """
        if self._generation != generation:
            return
        task = self._fetching
        if task is None or task.done():
            if self._fetch_error is not None and time.monotonic() < self._fetch_retry_at:
                raise self._fetch_error
            task = self._fetching = asyncio.create_task(self._fetch())
        await asyncio.shield(task)

    async def _fetch(self) -> None:
        loop = asyncio.get_running_loop()
        # One thread per app, not the loop's default executor: its few threads are shared
        # by every app (and /metrics), and a handful of apps whose token endpoint stalls
        # held them all, each for its request timeout, again and again; another app's
        # token request waited behind them and its sends ended transient. Fetches of one
        # app are single flight (`_refresh`): one thread is all it needs.
        if self._token_thread is None:
            self._token_thread = ThreadPoolExecutor(1, thread_name_prefix="fcm-token")
        try:
            token, lifetime = await asyncio.wait_for(
                loop.run_in_executor(self._token_thread, self._fetch_token), self._timeout + 30
            )
        except Exception as exc:
            self._fetch_error = exc
            self._fetch_retry_at = time.monotonic() + FETCH_RETRY
            self._fetch_failed(exc)
            raise
        self._fetch_error = None
        now = time.monotonic()
        self._fetched_at = now
        self._expires_at = now + max(lifetime - 10.0, 0.0)
        self._refresh_at = now + lifetime - min(REFRESH_AHEAD, lifetime / 2)
        # A CIMultiDict, which aiohttp would otherwise build from a dict on every request.
        self._headers = CIMultiDict(
            {"Authorization": f"Bearer {token}", "Content-Type": "application/json; charset=UTF-8"}
        )
        self._generation += 1
        self.token_fetches += 1
        failures, self._fetch_failures = self._fetch_failures, 0
        if failures:
            log.warning(
                "FCM app %s: OAuth token fetched again after %d failed token request(s)",
                self.app_id,
                failures,
            )
        else:
            log.info("FCM app %s: OAuth token fetched (valid %d s)", self.app_id, lifetime)

    def _fetch_failed(self, exc: Exception) -> None:
        """The first failed token request of a run at WARNING, the others at DEBUG: sends
        wait for a token or retry the request, every push of an outage of the token
        endpoint or of a deleted key would log it. The recovery says how many failed."""
        self._fetch_failures += 1
        if self._fetch_failures == 1:
            log.warning(
                "FCM app %s: OAuth token request failed (%s); sends end auth or transient "
                "until one succeeds (a request every %g s at most)",
                self.app_id,
                _token_error(exc, self._token_proxy),
                FETCH_RETRY,
            )
        else:
            log.debug(
                "FCM app %s: OAuth token request failed (%s), %d in a row",
                self.app_id,
                _token_error(exc, self._token_proxy),
                self._fetch_failures,
            )

    def _fetch_token(self) -> tuple[str, float]:
        """Blocking: mint an access token through google-auth (runs in an executor)."""
        session = requests.Session()
        session.trust_env = False  # our CA and proxy, not REQUESTS_CA_BUNDLE / *_PROXY
        if self._ca_file is not None:
            session.verify = str(self._ca_file)
        if self._token_proxy:
            session.proxies = {"https": self._token_proxy, "http": self._token_proxy}
        try:
            credential = self._credential
            credential.refresh(_TimedRequest(session, self._timeout))
            token: str = credential.token
            expiry: dt.datetime | None = credential.expiry
        finally:
            session.close()
        if expiry is None:
            lifetime = 3600.0
        else:
            now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
            lifetime = (expiry.replace(tzinfo=None) - now).total_seconds()
        return token, max(lifetime, 0.0)


def message_problem(message: Mapping[str, Any]) -> str | None:
    """What FCM HTTP v1 would refuse in `message` (its field names, `android`'s names,
    `ttl`, `priority` and string fields), in words safe for a log: names and types, never
    a value. None when nothing is found. `data` and the targets are checked by `validate`.
    """
    # Called for every FCM push: each name is looked at one by one only when the set
    # comparison (in C) says one is not known, and the string fields when one is set.
    if not message.keys() <= MESSAGE_NAMES:
        for key in message:
            if key in MESSAGE_NAMES:
                continue
            where = LEGACY_FIELDS.get(key) if isinstance(key, str) else None
            if where is not None:
                return f"FCM message field {key!r} is the legacy API's; in HTTP v1 it is {where}"
            return f"FCM message has no field {printable(str(key)[:40])!r}"
    android = message.get("android")
    if android is None:
        return None
    if not isinstance(android, dict) and not isinstance(android, Mapping):  # dict: no ABC
        return "FCM android must be an object"
    if not android.keys() <= ANDROID_FIELDS:
        for key in android:
            if key not in ANDROID_FIELDS:
                if key == "time_to_live":
                    return "FCM android has no field 'time_to_live': use ttl, such as \"3600s\""
                return f"FCM android has no field {printable(str(key)[:40])!r}"
    ttl = android.get("ttl")
    if ttl is not None:
        if not isinstance(ttl, str):
            return (
                "FCM android.ttl must be a duration string such as "
                f'"3600s" or "3.5s" (got {type(ttl).__name__})'
            )
        problem = _ttl_problem(ttl)
        if problem is not None:
            return problem
    priority = android.get("priority")
    # A str first: a list or an object (a config's YAML) cannot be looked up in a set.
    if priority is not None and (
        not isinstance(priority, str) or priority not in ANDROID_PRIORITIES
    ):
        return 'FCM android.priority must be "high" or "normal"'
    if ANDROID_STRING_FIELDS.isdisjoint(android):
        return None
    for name in ("collapse_key", "collapseKey", "restricted_package_name", "restrictedPackageName"):
        value = android.get(name)
        if value is not None and not isinstance(value, str):
            return f"FCM android.{name} must be a string (got {type(value).__name__})"
    return None


@functools.lru_cache(maxsize=64)
def _ttl_problem(ttl: str) -> str | None:
    """What is wrong with the `android.ttl` string `ttl`, None when FCM takes it. Cached:
    an app sends the same few values on every push, and the regex and the float cost
    more than the rest of `message_problem` together."""
    if not TTL_FORMAT.fullmatch(ttl):
        return 'FCM android.ttl must be a duration string such as "3600s" or "3.5s" (got a string)'
    if float(ttl[:-1]) > MAX_TTL:
        return f"FCM android.ttl is over {MAX_TTL:.0f}s (4 weeks)"
    return None


def _token_error(exc: BaseException, proxy: str | None = None) -> str:
    """The kind of a failed token request, for logs and receipts.

    Only the type is shown (google-auth's messages may quote the endpoint's answer),
    which for every network failure is google-auth's `TransportError`: a token endpoint
    whose certificate does not verify (a missing `ca_file`, a wrong host) looked like
    any outage. OpenSSL's verification message, found in the chain, names no secret.
    Nor does a proxy's refusal of CONNECT (its status line, as http.client words it),
    which names the proxy (`proxy`) by host and port only.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    via_proxy = False
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"{type(exc).__name__}: certificate verify failed: {cause.verify_message}"
        if isinstance(cause, _TokenAnswerError):
            return f"{type(exc).__name__}: {cause}"  # our own words
        if isinstance(cause, requests.exceptions.ProxyError):
            via_proxy = True
        elif via_proxy and type(cause) is OSError and str(cause).startswith(_TUNNEL_FAILED):
            answer = printable(str(cause)[len(_TUNNEL_FAILED) :].strip()[:80])
            return f"{type(exc).__name__}: proxy {_label(proxy)} refused CONNECT: {answer}"
        cause = cause.__cause__ or cause.__context__
    if via_proxy:
        return f"{type(exc).__name__}: proxy {_label(proxy)} unreachable"
    return type(exc).__name__


# http.client's words for a proxy's answer to CONNECT other than 200.
_TUNNEL_FAILED = "Tunnel connection failed:"


def _label(proxy: str | None) -> str:
    return proxy_label(proxy) if proxy else "(unknown)"


# The user name and password of a URL quoted in an error message.
_USERINFO = re.compile(r"//[^\s'\"/]*@")


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `response`, or its first `limit` bytes: the rest is not read (the
    connection is then closed, not reused)."""
    content = response.content
    if content.is_eof():
        # The whole answer came with its headers (FCM's few hundred bytes do): taken from
        # the buffer, without the chunk iterator's awaits (several µs per push).
        raw = content.read_nowait(limit)
        if len(raw) >= limit:
            response.close()
        return raw
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(limit):
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            response.close()
            break
    return b"".join(chunks)[:limit]


def _describe(exc: BaseException, proxy: str | None = None) -> str:
    """`exc` for a `detail`. A proxy's refusal names the proxy by host and port only:
    aiohttp's own message quotes the proxy URL, with its user name and password."""
    name = type(exc).__name__
    if proxy is not None and isinstance(exc, aiohttp.ClientHttpProxyError):
        return (
            f"{name}: proxy {proxy_label(proxy)} refused CONNECT: "
            f"{exc.status} {printable(str(exc.message)[:80])}"
        )
    if proxy is not None and isinstance(exc, aiohttp.ClientProxyConnectionError):
        return f"{name}: proxy {proxy_label(proxy)} unreachable ({exc.os_error})"[:200]
    text = _USERINFO.sub("//", str(exc)) if proxy is not None else str(exc)
    return f"{name}: {text[:160]}" if text else name
