"""The Zulip push bouncer's HTTP routes (specs/zulip.md §2-§8).

One `Bouncer` per running gateway holds the plugin's state (bouncer keys, the rate
limiter, the duplicate-suppression window and the sends still running after a notify
answered); handlers reach the store and the dispatcher through the `PluginContext`.

Privacy: nothing logged here carries a token, a key, a push key id or
`encrypted_data`; unexpected exceptions are logged by type only, because database
errors quote statement parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid as uuidlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.api import (
    ApnsOptions,
    BodyTimeout,
    Outcome,
    PluginContext,
    Push,
    PushPolicy,
    Receipt,
    RepeatedLines,
)
from plugins.zulip import repo
from plugins.zulip.auth import RateLimiter, parse_basic_auth, rate_limited
from plugins.zulip.config import ZulipConfig
from plugins.zulip.crypto import CryptoError, open_registration
from plugins.zulip.errors import (
    DEACTIVATED_MSG,
    E2EE_ONLY,
    REGISTRATION_CLOSED,
    ZulipError,
    method_not_allowed,
    missing_remote_realm,
    push_disallowed,
    realm_mismatch,
    success,
    unauthorized,
)
from plugins.zulip.payloads import (
    LEGACY_APNS_EXPIRATION,
    apns_test_body,
    e2ee_apns_body,
    e2ee_fcm_message,
    fcm_test_message,
    legacy_apns_body,
    legacy_fcm_message,
)
from plugins.zulip.repo import DbRow
from plugins.zulip.validation import (
    APNS,
    FCM,
    INT32,
    ApnsPushRequest,
    FcmPushRequest,
    LegacyIdentity,
    Params,
    check_int_range,
    check_text,
    check_token_id,
    is_int,
    json_field,
    legacy_identity,
    optional_int,
    parse_e2ee_notify,
    parse_json,
    parse_registration_plaintext,
    required,
    validate_email,
    validate_gcm_options,
    validate_hostname,
    validate_legacy_token,
    validate_org_id,
    validate_server_key,
    validate_token_kind,
)

log = logging.getLogger(__name__)

PREFIX = "/api/v1/remotes/"
DEFAULT_DISABLED_REASON = "Push notifications are disabled by this push notification service"
# Endpoints of Zulip's own service that pushgw does not offer (specs/zulip.md §3): still
# 404, but with what to do instead. `manage.py register_server` shows the `msg` as it is
# ("Error received from the push notification service: ..."), and Zulip 10+ sends a
# server whose hostname is taken to `--registration-transfer`: "Endpoint not found"
# left its administrator with nowhere to go.
_TRANSFER_MSG = (
    "This push notification service does not offer registration transfer: ask its "
    "operator for new credentials for the registration of your hostname (pushgw zulip "
    "set-key), put them into /etc/zulip/zulip-secrets.conf, then run "
    "manage.py register_server again"
)
NOT_OFFERED = {
    "server/register/transfer": _TRANSFER_MSG,
    "server/register/verify_challenge": _TRANSFER_MSG,
}
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
# Sends remembered for the duplicate window, at most: without a cap the window held
# push rate x `duplicate_window` entries (each with its task and receipt), so a burst
# grew the process without bound. Beyond it the oldest is forgotten first: a duplicate
# of it may then be sent again, never a push dropped.
_RECENT_MAX = 100_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
AuthedHandler = Callable[[web.Request, DbRow], Awaitable[web.StreamResponse]]
# When a request must be answered, on the loop's clock: `notify_deadline` after it came
# (`Bouncer._open`, `Bouncer._authed`). Its database work and a notify's wait for its
# sends end by then: Zulip gives up after 15 s (§1).
_DEADLINE = web.RequestKey("zulip_deadline", float)


# --- request bodies ------------------------------------------------------------------


async def read_form(request: web.Request, max_size: int | None = None) -> dict[str, str]:
    """Query and form fields (form wins); a non-form body gives no fields.

    An unknown `charset`, undecodable bytes, or text that is not valid Unicode (lone
    surrogates, which a `charset` such as `unicode_escape` can produce) is 400.
    """
    params: dict[str, str] = dict(request.query)
    if request.method == "POST" and request.content_type in FORM_TYPES:
        source = request.clone(client_max_size=max_size) if max_size else request
        try:
            data = await source.post()
        except web.HTTPRequestEntityTooLarge:
            raise ZulipError("Request body too large", status=413) from None
        except BodyTimeout:
            raise body_timeout() from None
        # RequestPayloadError: a body its Content-Encoding does not decode. A multipart
        # part's header line too long, too many or malformed (HttpProcessingError), or
        # an unknown Content-Transfer-Encoding (RuntimeError): the client's mistakes too.
        except (
            ValueError,
            LookupError,
            AssertionError,
            RuntimeError,
            HttpProcessingError,
            web.RequestPayloadError,
        ):
            raise ZulipError("Malformed form body") from None
        except ConnectionError:  # the client left before the end of its body: not our bug
            raise ZulipError("Request body incomplete") from None
        for key, value in data.items():
            if isinstance(value, str):
                params[key] = value
    try:
        check_text(params)
    except ValueError:
        raise ZulipError("Malformed form body") from None
    return params


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ZulipError("Request body too large", status=413) from None
    except BodyTimeout:
        raise body_timeout() from None
    except web.RequestPayloadError:  # a body its Content-Encoding does not decode
        raise ZulipError("Malformed JSON") from None
    except ConnectionError:  # the client left before the end of its body: not our bug
        raise ZulipError("Request body incomplete") from None
    try:
        return parse_json(raw)
    except ValueError:
        raise ZulipError("Malformed JSON") from None


def body_timeout() -> ZulipError:
    """The body did not come within `server.body_timeout`: 408 in Zulip's envelope, not
    the core's `{"error": ...}`, as a Zulip server reads `msg` of every 4xx (a KeyError
    there)."""
    return ZulipError("Request timeout: the request body did not come in time", status=408)


def _json_text(params: Params, name: str) -> str | None:
    """`version` / `merge_base`: JSON strings in the form (older servers sent plain text)."""
    raw = params.get(name)
    if raw is None:
        return None
    try:
        value = parse_json(raw)
    except ValueError:
        value = raw
    if value is None:
        return None
    if not isinstance(value, str):
        raise ZulipError(f"{name} is not a string")
    return value[:128]


def _max_row_id(rows: Any, name: str) -> int:
    if not isinstance(rows, list):
        raise ZulipError(f"{name} is not a list")
    best = 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not is_int(row.get("id")):
            raise ZulipError(f"{name}[{i}] is not a valid row")
        best = max(best, check_int_range(row["id"], f'{name}[{i}]["id"]'))
    return best


def _realm_infos(raw: Any, limit: int) -> list[repo.RealmInfo]:
    if not isinstance(raw, list):
        raise ZulipError("realms is not a list")
    if len(raw) > limit:
        # A Zulip server has a handful of realms; a list this long is not one.
        raise ZulipError(
            f"realms has {len(raw)} entries: this push notification service accepts "
            f"at most {limit} realms per server"
        )
    infos: dict[str, repo.RealmInfo] = {}
    for i, item in enumerate(raw):
        where = f"realms[{i}]"
        if not isinstance(item, dict):
            raise ZulipError(f"{where} is not a dict")
        value = item.get("uuid")
        try:
            parsed = uuidlib.UUID(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if parsed is None:
            raise ZulipError(f"{where}.uuid is not a valid UUID")
        host = item.get("host", "")
        name = item.get("name", "")
        org_type = item.get("org_type")
        deactivated = item.get("deactivated", False)
        system_bot = item.get("is_system_bot_realm", False)
        if not isinstance(host, str) or len(host) > 255:
            raise ZulipError(f"{where}.host is not valid")
        if not isinstance(name, str):
            raise ZulipError(f"{where}.name is not a string")
        if org_type is not None:
            if not is_int(org_type):
                raise ZulipError(f"{where}.org_type is not an integer")
            check_int_range(org_type, f"{where}.org_type", INT32)
        if not isinstance(deactivated, bool) or not isinstance(system_bot, bool):
            raise ZulipError(f"{where}: deactivated / is_system_bot_realm are not booleans")
        infos[str(parsed)] = repo.RealmInfo(
            str(parsed), host, name, org_type, deactivated, system_bot
        )
    return list(infos.values())


def _can_push(server: DbRow, realm: DbRow | None) -> bool:
    return not server.push_disabled and (realm is None or not realm.push_disabled)


def _disabled_reason(server: DbRow, realm: DbRow | None) -> str:
    if server.push_disabled:
        return str(server.disabled_reason or DEFAULT_DISABLED_REASON)
    if realm is not None and realm.push_disabled:
        return str(realm.disabled_reason or DEFAULT_DISABLED_REASON)
    return DEFAULT_DISABLED_REASON


def _realm_status(server: DbRow, realm: DbRow | None) -> dict[str, Any]:
    return {"can_push": _can_push(server, realm), "expected_end_timestamp": None}


# --- sends ---------------------------------------------------------------------------


@dataclass
class _Sent:
    """One E2EE send shared by duplicate requests within the duplicate window."""

    task: asyncio.Task[Receipt | None]
    expires: float


class Bouncer:
    """The routes and per-gateway state of the Zulip plugin."""

    def __init__(self, context: PluginContext) -> None:
        self.context = context
        self.config: ZulipConfig = context.config
        self.keys = self.config.bouncer_key_map()
        self.limiter = RateLimiter(self.config.rate_limit_requests, self.config.rate_limit_window)
        self._recent: OrderedDict[tuple[int, int, str], _Sent] = OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._server_sends: dict[tuple[int, str], int] = {}  # (server id, app) -> sends running
        self._methods: dict[str, list[str]] = {}  # endpoint -> methods it answers
        self.repeats = RepeatedLines()

    @property
    def engine(self) -> AsyncEngine:
        return self.context.store.engine

    # --- wiring --------------------------------------------------------------------

    def add_routes(self, router: web.UrlDispatcher) -> None:
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "server/register", self._open(self.server_register)),
            ("POST", "server/deactivate", self._authed(self.server_deactivate)),
            ("POST", "server/analytics", self._authed(self.server_analytics)),
            ("GET", "server/analytics/status", self._authed(self.analytics_status)),
            ("POST", "push/register", self._authed(self.legacy_register)),
            ("POST", "push/unregister", self._authed(self.legacy_unregister)),
            ("POST", "push/unregister/all", self._authed(self.legacy_unregister_all)),
            ("POST", "push/notify", self._authed(self.legacy_notify)),
            ("POST", "push/test_notification", self._authed(self.test_notification)),
            ("POST", "push/e2ee/register", self._authed(self.e2ee_register)),
            ("POST", "push/e2ee/notify", self._authed(self.e2ee_notify)),
        ]
        for method, endpoint, handler in routes:
            if method == "GET":
                router.add_get(PREFIX + endpoint, handler)  # and HEAD
                self._methods[endpoint] = ["GET", "HEAD"]
            else:
                router.add_route(method, PREFIX + endpoint, handler)
                self._methods[endpoint] = [method]
        # Every other request under the prefix, a known endpoint's other methods too
        # (aiohttp would give them to this route rather than answer 405 itself).
        router.add_route("*", PREFIX + "{tail:.*}", self._open(self.not_found))

    def _open(self, handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            self._start_clock(request)
            try:
                return await handler(request)
            except ZulipError as error:
                return error.response()
            except Exception as exc:
                return self._internal_error(request, exc)

        return run

    def _authed(self, handler: AuthedHandler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            # A database that stopped answering (a partition, a failover that reset no
            # connection, a table locked by a migration) held each request for as long:
            # asyncpg waits 60 s to connect, a pooled connection's ping until TCP gives
            # up (minutes), past Zulip's 15 s timeout and a notify's deadline (§1, §5.2).
            # The database work gets `notify_deadline`, then a 503 the server retries.
            self._start_clock(request)
            try:
                async with self._database(request):
                    server = await self._authenticate(request)
                return await handler(request, server)
            except ZulipError as error:
                return error.response()
            except Exception as exc:
                return self._internal_error(request, exc)

        return run

    def _start_clock(self, request: web.Request) -> None:
        request[_DEADLINE] = asyncio.get_running_loop().time() + self.config.notify_deadline

    @staticmethod
    @contextlib.asynccontextmanager
    async def _database(request: web.Request) -> AsyncIterator[None]:
        """Database work of a request, bounded by its `_DEADLINE`.

        All of it, not only a notify's: a registration waiting for a pooled connection
        (SQLAlchemy's `pool_timeout` is 30 s) or for a locked table answered after Zulip
        had given up, and held its connection for as long.
        """
        try:
            async with asyncio.timeout_at(request[_DEADLINE]):
                yield
        except TimeoutError:
            log.warning("zulip: %s: the database did not answer in time", request.path)
            raise ZulipError(
                "The push notification service's database did not answer; try again later",
                "INTERNAL_SERVER_ERROR",
                503,
            ) from None

    def _internal_error(self, request: web.Request, exc: Exception) -> web.Response:
        # Never the error's text: database errors quote statement parameters (tokens). A
        # database error by its kind and SQLSTATE, with what to check: "failed with
        # DBAPIError" said neither that the database was read-only nor that a statement
        # timed out.
        problem = self.context.store.problem(exc)
        if problem is None:
            log.error("zulip: %s failed with %s", request.path, type(exc).__name__)
        else:
            log.error(
                "zulip: %s failed on the database, answered 500 (the Zulip server retries): %s",
                request.path,
                problem,
            )
        return ZulipError("Internal server error", "INTERNAL_SERVER_ERROR", 500).response()

    async def _authenticate(self, request: web.Request) -> DbRow:
        role, key = parse_basic_auth(request.headers.get("Authorization"))
        # No registered UUID holds a NUL, and PostgreSQL refuses one in a query (a 500).
        server = None
        if "\x00" not in role:
            async with self.engine.connect() as conn:
                server = await repo.get_server(conn, role)
        if server is None:
            raise unauthorized(
                f"Zulip server auth failure: {role} is not registered -- "
                "did you run `manage.py register_server`?"
            )
        if not repo.server_key_matches(server, key):
            raise unauthorized(f"Zulip server auth failure: key does not match role {role}")
        if server.deactivated_at is not None:
            raise unauthorized(DEACTIVATED_MSG)
        retry_after = self.limiter.hit(server.uuid)
        if retry_after is not None:
            raise rate_limited(retry_after)
        return server

    async def not_found(self, request: web.Request) -> web.Response:
        # The endpoint as routing saw it: `path_safe` keeps an encoded slash encoded, as
        # the endpoints' own routes do (`tail` is decoded). `push%2Fnotify` is no endpoint:
        # by `tail` it was a 405 whose `Allow` named the very method the client had used.
        endpoint = request.rel_url.path_safe.removeprefix(PREFIX)
        allowed = self._methods.get(endpoint)
        if allowed is not None:  # the endpoint exists: RFC 9110 405, as Zulip's bouncer
            raise method_not_allowed(allowed)
        raise ZulipError(NOT_OFFERED.get(endpoint, "Endpoint not found"), status=404)

    # --- realm lookup --------------------------------------------------------------

    @staticmethod
    async def _realm(
        conn: AsyncConnection, server: DbRow, realm_uuid: str, *, tolerate_unknown: bool
    ) -> DbRow | None:
        realm = await repo.get_realm(conn, realm_uuid)
        if realm is None:
            if tolerate_unknown:
                return None
            raise missing_remote_realm()
        if realm.server_id != server.id:
            raise realm_mismatch()
        return realm

    # --- servers ---------------------------------------------------------------------

    def _may_register(self, org_id: str) -> bool:
        """By the server's UUID only: its hostname is a claim nothing checks."""
        policy = self.config.registration
        if policy == "open":
            return True
        if policy == "allowlist":
            return org_id in self.config.allowlist
        return False

    async def server_register(self, request: web.Request) -> web.Response:
        params = await read_form(request)
        org_id = required(params, "zulip_org_id")
        org_key = required(params, "zulip_org_key")
        hostname = required(params, "hostname")
        contact_email = required(params, "contact_email")
        new_key = params.get("new_org_key")
        validate_hostname(hostname)
        validate_email(contact_email)
        validate_org_id(org_id)
        validate_server_key("zulip_org_key", org_key)
        if new_key is not None:
            validate_server_key("new_org_key", new_key)
        async with self._database(request), self.engine.begin() as conn:
            server = await repo.get_server(conn, org_id)
            if server is None:
                if not self._may_register(org_id):
                    raise ZulipError(REGISTRATION_CLOSED)
                if await repo.hostname_in_use(conn, hostname, org_id):
                    raise ZulipError(
                        f"A server with hostname {hostname} already exists",
                        "HOSTNAME_ALREADY_IN_USE_BOUNCER_ERROR",
                        data={"hostname": hostname},
                    )
                if await repo.create_server(conn, org_id, org_key, hostname, contact_email):
                    log.info("zulip: registered a new server")
                    return success(created=True)
                server = await repo.get_server(conn, org_id)
                assert server is not None
            if not repo.server_key_matches(server, org_key):
                # Zulip's error carries the UUID as data field `role` too.
                raise ZulipError(
                    f"Zulip server auth failure: key does not match role {org_id}",
                    "INVALID_ZULIP_SERVER",
                    data={"role": org_id},
                )
            if server.deactivated_at is not None:
                raise ZulipError(DEACTIVATED_MSG, "REALM_DEACTIVATED", 401)
            await repo.update_server(
                conn, server.id, hostname=hostname, contact_email=contact_email, key=new_key
            )
        return success(created=False)

    async def server_deactivate(self, request: web.Request, server: DbRow) -> web.Response:
        async with self._database(request), self.engine.begin() as conn:
            await repo.update_server(conn, server.id, deactivated_at=repo.now_utc())
        log.info("zulip: a server deactivated its registration")
        return success()

    async def server_analytics(self, request: web.Request, server: DbRow) -> web.Response:
        params = await read_form(request, self.config.analytics_max_bytes)
        ids = {
            "last_realm_count_id": _max_row_id(
                json_field(params, "realm_counts", []), "realm_counts"
            ),
            "last_installation_count_id": _max_row_id(
                json_field(params, "installation_counts", []), "installation_counts"
            ),
            "last_realmauditlog_id": _max_row_id(
                json_field(params, "realmauditlog_rows", None) or [], "realmauditlog_rows"
            ),
        }
        raw_realms = json_field(params, "realms", None)
        limit = self.config.analytics_max_realms
        infos = _realm_infos(raw_realms, limit) if raw_realms is not None else []
        meta = {
            "version": _json_text(params, "version"),
            "merge_base": _json_text(params, "merge_base"),
            "api_feature_level": optional_int(params, "api_feature_level", INT32),
        }
        # Zulip waits 90 s for an upload, whose body (up to `analytics_max_bytes`) may
        # take a while to come: its database work gets `notify_deadline` of its own, from
        # now. Unbounded, a locked table held it (and a pooled connection) for as long.
        self._start_clock(request)
        async with self._database(request), self.engine.begin() as conn:
            held = await repo.realms_of_other_servers(conn, server.id, (i.uuid for i in infos))
            if held and self.config.registration != "open":
                # Those of a deactivated registration are this server's own, registered
                # again under a new zulip_org_id (docs/zulip.md §3); any other is a 400.
                # Only for a server the operator vetted (allowlisted or registered by
                # hand): with `open` registration anyone who knows the realm UUIDs could
                # take over the realms, and their devices, of a deactivated server.
                await repo.adopt_realms_of_deactivated_servers(conn, server.id, held)
                if await repo.realms_of_other_servers(conn, server.id, held):
                    raise ZulipError("Duplicate registration detected.")
            await repo.record_analytics_ids(conn, server, ids, meta)
            rows = await repo.upsert_realms(conn, server.id, infos, complete=raw_realms is not None)
            if any(i.uuid not in rows for i in infos):
                # Another server claimed a realm between the check above and our insert
                # (the unique realm UUID refused ours): the same answer as the check,
                # and raising here rolls the whole upload back.
                raise ZulipError("Duplicate registration detected.")
        return success(realms={i.uuid: _realm_status(server, rows.get(i.uuid)) for i in infos})

    async def analytics_status(self, request: web.Request, server: DbRow) -> web.Response:
        return success(
            last_realm_count_id=int(server.last_realm_count_id or 0),
            last_installation_count_id=int(server.last_installation_count_id or 0),
            last_realmauditlog_id=int(server.last_realmauditlog_id or 0),
        )

    # --- E2EE --------------------------------------------------------------------------

    async def e2ee_register(self, request: web.Request, server: DbRow) -> web.Response:
        params = await read_form(request)
        realm_uuid = required(params, "realm_uuid")
        token_id = required(params, "token_id")
        encrypted = required(params, "encrypted_push_registration")
        public_key = required(params, "bouncer_public_key")
        async with self._database(request), self.engine.begin() as conn:
            realm = await self._realm(conn, server, realm_uuid, tolerate_unknown=False)
            assert realm is not None
            # Recorded at lookup and committed at once (spec §5.1 step 1, as Zulip's
            # bouncer does): a registration that fails below still counts as a request.
            await repo.touch_realm(conn, realm.id)
        key = self.keys.get(public_key)
        if key is None:
            raise ZulipError("Invalid bouncer_public_key", "INVALID_BOUNCER_PUBLIC_KEY")
        try:
            plaintext = open_registration(key, encrypted)
        except CryptoError:
            raise ZulipError("Invalid encrypted_push_registration") from None
        registration = parse_registration_plaintext(plaintext)
        token_id_int = check_token_id(token_id, registration.token)
        if time.time() - registration.timestamp > self.config.registration_liveness:
            raise ZulipError("Request expired", "REQUEST_EXPIRED")
        apns = registration.token_kind == repo.APNS_KIND
        async with self._database(request), self.engine.begin() as conn:
            await repo.register_e2ee(
                conn,
                realm_id=realm.id,
                token_id=token_id_int,
                token=registration.token,
                token_kind=registration.token_kind,
                ios_app_id=registration.ios_app_id,
                token_hash=self.context.token_hash(registration.token),
            )
            await repo.delete_legacy_token(
                conn,
                kind=APNS if apns else FCM,
                token=registration.token,
                apns=apns,
                server_id=server.id,
            )
        return success()

    async def e2ee_notify(self, request: web.Request, server: DbRow) -> web.Response:
        notify = parse_e2ee_notify(await read_json(request))
        async with self._database(request), self.engine.connect() as conn:
            realm = await self._realm(conn, server, notify.realm_uuid, tolerate_unknown=False)
            assert realm is not None
            if not _can_push(server, realm):
                raise push_disallowed(_disabled_reason(server, realm))
            devices = await repo.active_e2ee_devices(
                conn, realm.id, (r.token_id_int for r in notify.push_requests)
            )
        delete_ids: dict[str, None] = {}
        jobs: list[tuple[str, bool, asyncio.Task[Receipt | None]]] = []
        not_started = 0
        for req in notify.push_requests:
            device = devices.get(req.token_id_int)
            if device is None:
                delete_ids[req.token_id] = None
                continue
            push = self._e2ee_push(req, device)
            if push is None:
                continue
            task = self._send_once(server.id, realm.id, req, push)
            if task is None:  # the server's sends in flight are at their bound: not sent
                not_started += 1
                continue
            jobs.append((req.token_id, isinstance(req, ApnsPushRequest), task))
        self._log_not_started(not_started)
        await self._wait([t for _, _, t in jobs], request)
        apple = android = 0
        for token_id, is_apns, task in jobs:
            receipt = task.result() if task.done() and not task.cancelled() else None
            if receipt is None:
                continue
            if receipt.outcome is Outcome.OK:
                apple += is_apns
                android += not is_apns
            elif receipt.outcome is Outcome.TOKEN_INVALID:
                delete_ids[token_id] = None
        return success(
            apple_successfully_sent_count=apple,
            android_successfully_sent_count=android,
            delete_token_ids=list(delete_ids),
            realm_push_status=_realm_status(server, realm),
        )

    def _e2ee_push(self, req: ApnsPushRequest | FcmPushRequest, device: DbRow) -> Push | None:
        policy = PushPolicy(deadline=self.config.push_deadline)
        ref = "e2ee"
        if isinstance(req, ApnsPushRequest):
            if device.token_kind != repo.APNS_KIND or not device.ios_app_id:
                return None  # kind mismatch: skipped and not counted (Zulip answers 500)
            app_id = self.config.apns_app_id(device.ios_app_id)
            if app_id is None:
                self._log_unserved(device.ios_app_id)
                return None
            return Push(
                plugin=self.context.name,
                app_id=app_id,
                token=device.token,
                payload=e2ee_apns_body(req.payload),
                apns=ApnsOptions(
                    push_type=req.push_type, priority=req.priority, topic=device.ios_app_id
                ),
                policy=policy,
                ref=apns_ref(ref, device.ios_app_id),
            )
        if device.token_kind != repo.FCM_KIND:
            return None
        fcm_app = self.config.fcm_app_id()
        if fcm_app is None:
            self._log_unserved(None, fcm=True)
            return None
        return Push(
            plugin=self.context.name,
            app_id=fcm_app,
            token=device.token,
            payload=e2ee_fcm_message(req.push_key_id, req.encrypted_data, req.priority),
            policy=policy,
            ref=ref,
        )

    def _send_once(
        self,
        server_id: int,
        realm_id: int,
        req: ApnsPushRequest | FcmPushRequest,
        push: Push,
    ) -> asyncio.Task[Receipt | None] | None:
        """Start the send, or join an identical one from the duplicate window; None when
        the server has too many sends running (`_start`)."""
        encrypted = (
            req.payload.get("encrypted_data", "")
            if isinstance(req, ApnsPushRequest)
            else req.encrypted_data
        )
        digest = hashlib.sha256(str(encrypted).encode("utf-8")).hexdigest()
        key = (realm_id, req.token_id_int, digest)
        now = time.monotonic()
        while self._recent:
            first = next(iter(self._recent.values()))
            if first.expires > now and len(self._recent) < _RECENT_MAX:
                break
            self._recent.popitem(last=False)
        previous = self._recent.get(key)
        if previous is not None and previous.expires > now:
            task = previous.task
            failed = task.done() and (
                task.cancelled() or task.result() is None or not task.result().ok  # type: ignore[union-attr]
            )
            if not failed:
                return task
        started = self._start(server_id, push, apns=isinstance(req, ApnsPushRequest))
        if started is not None and self.config.duplicate_window > 0:
            self._recent[key] = _Sent(started, now + self.config.duplicate_window)
            self._recent.move_to_end(key)
        return started

    # --- shared send machinery -------------------------------------------------------

    def _start(
        self, server_id: int, push: Push, *, apns: bool
    ) -> asyncio.Task[Receipt | None] | None:
        """Start one send of a server, or None while it has `server_in_flight` running
        to the push's app.

        Every server's pushes share the plugin's lanes (their queue, slots and breaker):
        without a bound, one server naming its own token in thousands of push requests
        fills the queue and the others' pushes are shed. The bound is per app, as the
        lanes are: counted across apps, a stalled provider for one app (its sends out
        until their deadline) held the sends the server's pushes to the others needed.
        """
        key = (server_id, push.app_id)
        running = self._server_sends.get(key, 0)
        if running >= self.config.server_in_flight:
            return None
        self._server_sends[key] = running + 1
        task = self._spawn(self._send(push, apns=apns))
        task.add_done_callback(lambda _: self._send_done(key))
        return task

    def _log_not_started(self, count: int) -> None:
        """Pushes of a request not started at `server_in_flight`: the first request's line,
        then at most one a minute, saying how many pushes of how many requests since."""
        if not count:
            return
        message = (
            "zulip: %d pushes of a request not sent: the server has server_in_flight sends running"
        )
        since = self.repeats.admit(("server_in_flight",), count)
        if since is None:
            log.debug(message, count)
        elif since[0]:
            log.warning(
                message + "; %d more pushes in %d requests since the last line",
                count,
                since[1],
                since[0],
            )
        else:
            log.warning(message, count)

    def _log_unserved(self, ios_app_id: str | None, *, fcm: bool = False) -> None:
        """A push not sent: no APNs app serves `ios_app_id` (`fcm`: no FCM app is
        configured). Registrations are kept (a later configuration may serve them), so this
        repeats on every push to them: logged once a minute per ios_app_id, with the count."""
        args: tuple[str | None, ...] = ()
        if fcm:
            message = "zulip: no FCM app configured: FCM pushes are not sent"
        else:
            message = "zulip: no APNs app configured for ios_app_id %s: its pushes are not sent"
            args = (ios_app_id,)
        since = self.repeats.admit(("fcm",) if fcm else ("apns", str(ios_app_id)))
        if since is None:
            log.debug(message, *args)
        elif since[0]:
            log.warning(message + " (%d more since the last line)", *args, since[0])
        else:
            log.warning(message, *args)

    def _send_done(self, key: tuple[int, str]) -> None:
        running = self._server_sends.pop(key, 0) - 1
        if running > 0:
            self._server_sends[key] = running

    def _spawn(self, coro: Awaitable[Receipt | None]) -> asyncio.Task[Receipt | None]:
        task: asyncio.Task[Receipt | None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _send(self, push: Push, *, apns: bool) -> Receipt | None:
        """Deliver one push (a dead token is expired by the core's token-invalid hook)."""
        try:
            return await self.context.send(push)
        except Exception as exc:
            log.error("zulip: a send failed with %s", type(exc).__name__)
            return None

    @staticmethod
    async def _wait(tasks: Sequence[asyncio.Task[Any]], request: web.Request) -> None:
        """Wait for the sends, at most until the request's deadline; late ones keep running.

        From when the request came, not from when its handler started: a server's
        authentication that waited for the database (a pooled connection, a locked
        table) left the sends a whole `notify_deadline` more, past Zulip's 15 s.
        """
        pending = {t for t in tasks if not t.done()}
        if not pending:
            return
        remaining = request[_DEADLINE] - asyncio.get_running_loop().time()
        if remaining > 0:
            await asyncio.wait(pending, timeout=remaining)

    async def close(self) -> None:
        """Wait briefly for sends still running after their notify answered."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
        for task in list(self._background):
            task.cancel()

    # --- legacy ------------------------------------------------------------------------

    def _require_legacy(self) -> None:
        if not self.config.legacy_api:
            raise ZulipError(E2EE_ONLY)

    @staticmethod
    def _legacy_token_params(params: Params) -> tuple[str, int]:
        token = required(params, "token")
        kind = validate_token_kind(json_field(params, "token_kind"))
        validate_legacy_token(token, kind)
        return token, kind

    async def _legacy_realm(
        self,
        conn: AsyncConnection,
        server: DbRow,
        realm_uuid: str | None,
        identity: LegacyIdentity,
    ) -> DbRow | None:
        """The realm a legacy form names (§4): unknown tolerated, another server's a 403.

        Servers send `realm_uuid` (8.0+) together with `user_uuid`; like Zulip's bouncer,
        the lookup needs both.
        """
        if realm_uuid is None or identity.user_uuid is None:
            return None
        return await self._realm(conn, server, realm_uuid, tolerate_unknown=True)

    @staticmethod
    def _form_identity(params: Params) -> LegacyIdentity:
        user_uuid = params.get("user_uuid")
        if user_uuid is not None and len(user_uuid) > 64:
            raise ZulipError("Invalid user_uuid")
        return legacy_identity(optional_int(params, "user_id"), user_uuid)

    async def legacy_register(self, request: web.Request, server: DbRow) -> web.Response:
        self._require_legacy()
        params = await read_form(request)
        token, kind = self._legacy_token_params(params)
        ios_app_id = params.get("ios_app_id") or None
        if kind == APNS:
            if ios_app_id is None:
                raise ZulipError("Missing ios_app_id")
            if len(ios_app_id) > 255 or not _valid_app_id(ios_app_id):
                raise ZulipError("Invalid ios_app_id")
        identity = self._form_identity(params)
        realm_uuid = params.get("realm_uuid")
        async with self._database(request), self.engine.begin() as conn:
            realm = await self._legacy_realm(conn, server, realm_uuid, identity)
            await repo.legacy_register(
                conn,
                server_id=server.id,
                user_id=identity.user_id,
                user_uuid=identity.user_uuid,
                realm_id=realm.id if realm is not None else None,
                kind=kind,
                token=token,
                token_hash=self.context.token_hash(token),
                ios_app_id=ios_app_id if kind == APNS else None,
                apns=kind == APNS,
            )
        return success()

    async def legacy_unregister(self, request: web.Request, server: DbRow) -> web.Response:
        params = await read_form(request)
        token, kind = self._legacy_token_params(params)
        identity = self._form_identity(params)
        async with self._database(request), self.engine.begin() as conn:
            await self._legacy_realm(conn, server, params.get("realm_uuid"), identity)
            deleted = await repo.legacy_unregister(
                conn,
                server_id=server.id,
                user_id=identity.user_id,
                user_uuid=identity.user_uuid,
                kind=kind,
                token=token,
                apns=kind == APNS,
            )
            if not deleted:
                raise ZulipError("Token does not exist")
        return success()

    async def legacy_unregister_all(self, request: web.Request, server: DbRow) -> web.Response:
        params = await read_form(request)
        identity = self._form_identity(params)
        async with self._database(request), self.engine.begin() as conn:
            await self._legacy_realm(conn, server, params.get("realm_uuid"), identity)
            await repo.legacy_unregister_all(
                conn, server_id=server.id, user_id=identity.user_id, user_uuid=identity.user_uuid
            )
        return success()

    async def legacy_notify(self, request: web.Request, server: DbRow) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ZulipError("Malformed JSON")
        user_id = body.get("user_id")
        user_uuid = body.get("user_uuid")
        if user_id is not None:
            if not is_int(user_id):
                raise ZulipError("user_id is not an integer")
            check_int_range(user_id, "user_id")
        if user_uuid is not None and not isinstance(user_uuid, str):
            raise ZulipError("user_uuid is not a string")
        realm_uuid = body.get("realm_uuid")
        if realm_uuid is not None and not isinstance(realm_uuid, str):
            raise ZulipError("realm_uuid is not a string")
        apns_payload = _dict_field(body, "apns_payload")
        gcm_payload = _dict_field(body, "gcm_payload")
        gcm_options = _dict_field(body, "gcm_options")
        android_listed = _token_list(body, "android_devices")
        apple_listed = _token_list(body, "apple_devices")
        has_identity = user_id is not None or user_uuid is not None

        async with self._database(request), self.engine.begin() as conn:
            realm = None
            if realm_uuid is not None and user_uuid is not None:
                realm = await self._realm(conn, server, realm_uuid, tolerate_unknown=True)
            if not self.config.legacy_api:
                if has_identity:
                    await repo.legacy_unregister_all(
                        conn, server_id=server.id, user_id=user_id, user_uuid=user_uuid
                    )
                # Each token once, as in the `legacy_api: true` answer and Zulip's
                # (set differences), even when the request lists it twice.
                return _notify_response(
                    0, 0, sorted(set(android_listed)), sorted(set(apple_listed)), server, realm
                )
            if not _can_push(server, realm):
                if server.api_feature_level is None:
                    raise ZulipError(
                        "Your plan doesn't allow sending push notifications.",
                        "INVALID_ZULIP_SERVER",
                    )
                raise push_disallowed(_disabled_reason(server, realm))
            targets: list[DbRow] = []
            redundant: list[int] = []
            if has_identity:
                rows = await repo.legacy_user_devices(
                    conn, server_id=server.id, user_id=user_id, user_uuid=user_uuid
                )
                targets, redundant = _dedupe_legacy(rows)
            android = [r for r in targets if r.kind == FCM]
            apple = [r for r in targets if r.kind == APNS]
            # Before any write: a 400 here rolls the transaction back. (Zulip's bouncer
            # deletes the duplicate registrations first, then rejects the options.)
            priority = (
                validate_gcm_options(gcm_options, gcm_payload.get("event")) if android else ""
            )
            await repo.delete_legacy_ids(conn, redundant)
            if realm is not None:
                # Registrations made without realm_uuid (servers before 8.0, or a realm
                # not uploaded yet) get the realm now, as Zulip's bouncer does: without
                # it `gc` never collects them once their realm is deleted (§8). Only rows
                # read without one, so that the usual notify writes nothing here.
                unattached = [r.id for r in targets if r.realm_id is None]
                await repo.attach_legacy_realm(conn, unattached, realm.id)
        tasks: list[asyncio.Task[Receipt | None]] = []
        pushes: list[tuple[Push, bool]] = []
        expiration = int(time.time()) + LEGACY_APNS_EXPIRATION
        for row in apple:
            push = self._legacy_apns_push(row, legacy_apns_body(apns_payload), expiration)
            if push is not None:
                pushes.append((push, True))
        for row in android:
            push = self._legacy_fcm_push(row, legacy_fcm_message(gcm_payload, priority))
            if push is not None:
                pushes.append((push, False))
        for push, is_apns in pushes:
            task = self._start(server.id, push, apns=is_apns)
            if task is not None:
                tasks.append(task)
        self._log_not_started(len(pushes) - len(tasks))
        await self._wait(tasks, request)
        remaining: Sequence[DbRow] | None = ()
        if has_identity:
            remaining = await self._still_registered(request, server.id, user_id, user_uuid)
        return _notify_response(
            len(android),
            len(apple),
            _no_longer_registered(android_listed, remaining, FCM),
            _no_longer_registered(apple_listed, remaining, APNS),
            server,
            realm,
        )

    async def _still_registered(
        self, request: web.Request, server_id: int, user_id: int | None, user_uuid: str | None
    ) -> Sequence[DbRow] | None:
        """A user's legacy registrations after a notify's sends; None when the database did
        not answer by the request's deadline.

        The pushes went out already: a 503 (or, after SQLAlchemy's 30 s `pool_timeout`,
        a 500) would have the server send them all again. The answer then reports no
        device as deleted, and the next notify reports the ones that are.
        """
        try:
            async with asyncio.timeout_at(request[_DEADLINE]), self.engine.connect() as conn:
                return await repo.legacy_user_devices(
                    conn, server_id=server_id, user_id=user_id, user_uuid=user_uuid
                )
        except TimeoutError:
            log.warning("zulip: %s: deleted devices not looked up in time", request.path)
            return None

    def _legacy_apns_push(
        self, row: DbRow, body: dict[str, Any], expiration: int | None
    ) -> Push | None:
        app_id = self.config.apns_app_id(row.ios_app_id) if row.ios_app_id else None
        if app_id is None:
            self._log_unserved(row.ios_app_id)
            return None
        return Push(
            plugin=self.context.name,
            app_id=app_id,
            token=row.token,
            payload=body,
            apns=ApnsOptions(push_type=None, expiration=expiration, topic=row.ios_app_id),
            policy=PushPolicy(deadline=self.config.push_deadline),
            ref=apns_ref("legacy", row.ios_app_id),
        )

    def _legacy_fcm_push(self, row: DbRow, message: dict[str, Any]) -> Push | None:
        app_id = self.config.fcm_app_id()
        if app_id is None:
            self._log_unserved(None, fcm=True)
            return None
        return Push(
            plugin=self.context.name,
            app_id=app_id,
            token=row.token,
            payload=message,
            policy=PushPolicy(deadline=self.config.push_deadline),
            ref="legacy",
        )

    async def test_notification(self, request: web.Request, server: DbRow) -> web.Response:
        self._require_legacy()
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ZulipError("Malformed JSON")
        unknown = sorted(set(body) - _TEST_KEYS)
        if unknown:
            raise ZulipError(f"Invalid parameters: {', '.join(unknown)}")
        for name in ("token", "token_kind", "base_payload"):
            if name not in body:
                raise ZulipError(
                    f"Missing '{name}' argument",
                    "REQUEST_VARIABLE_MISSING",
                    data={"var_name": name},
                )
        token = body["token"]
        if not isinstance(token, str):
            raise ZulipError("token is not a string")
        kind = validate_token_kind(body["token_kind"])
        validate_legacy_token(token, kind)
        identity = legacy_identity(body.get("user_id"), body.get("user_uuid"))
        base_payload = body["base_payload"]
        if not isinstance(base_payload, dict):
            raise ZulipError("base_payload is not a dict")
        realm_uuid = body.get("realm_uuid")
        async with self._database(request), self.engine.connect() as conn:
            if isinstance(realm_uuid, str) and identity.user_uuid is not None:
                await self._realm(conn, server, realm_uuid, tolerate_unknown=True)
            rows = await repo.legacy_user_devices(
                conn,
                server_id=server.id,
                user_id=identity.user_id,
                user_uuid=identity.user_uuid,
            )
        wanted = repo.token_key(token, kind == APNS)
        device = next((r for r in rows if r.kind == kind and r.token_key == wanted), None)
        if device is None:
            raise ZulipError(
                "Device not recognized by the push bouncer", "INVALID_REMOTE_PUSH_DEVICE_TOKEN"
            )
        if kind == APNS:
            push = self._legacy_apns_push(
                device, apns_test_body(base_payload), int(time.time()) + LEGACY_APNS_EXPIRATION
            )
        else:
            push = self._legacy_fcm_push(device, fcm_test_message(base_payload, int(time.time())))
        if push is not None:
            task = self._start(server.id, push, apns=kind == APNS)
            self._log_not_started(int(task is None))
            if task is not None:
                await self._wait([task], request)
        return success()


_TEST_KEYS = frozenset(
    {"token", "token_kind", "user_id", "user_uuid", "realm_uuid", "base_payload"}
)


def _valid_app_id(value: str) -> bool:
    return all(c.isascii() and (c.isalnum() or c in ".-") for c in value)


def _dict_field(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ZulipError(f"{name} is not a dict")
    return value


def _token_list(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ZulipError(f"{name} is not a list of strings")
    return value


def _dedupe_legacy(rows: Sequence[DbRow]) -> tuple[list[DbRow], list[int]]:
    """One target per (kind, token key), preferring the `user_uuid` registration."""
    groups: dict[tuple[int, str], list[DbRow]] = {}
    for row in rows:
        groups.setdefault((row.kind, row.token_key), []).append(row)
    targets: list[DbRow] = []
    redundant: list[int] = []
    for group in groups.values():
        by_uuid = [r for r in group if r.user_uuid is not None]
        if by_uuid:
            redundant.extend(r.id for r in group if r.user_uuid is None)
            targets.append(by_uuid[0])
        else:
            targets.append(group[0])
    return targets, redundant


def _no_longer_registered(
    listed: Iterable[str], remaining: Sequence[DbRow] | None, kind: int
) -> list[str]:
    if remaining is None:  # not known (`Bouncer._still_registered`): none reported
        return []
    keys = {r.token_key for r in remaining if r.kind == kind}
    return sorted({t for t in listed if repo.token_key(t, kind == APNS) not in keys})


def _notify_response(
    total_android: int,
    total_apple: int,
    deleted_android: list[str],
    deleted_apple: list[str],
    server: DbRow,
    realm: DbRow | None,
) -> web.Response:
    return success(
        total_android_devices=total_android,
        total_apple_devices=total_apple,
        deleted_devices={"android_devices": deleted_android, "apple_devices": deleted_apple},
        realm=_realm_status(server, realm) if realm is not None else None,
    )


def apns_ref(flow: str, topic: str) -> str:
    """The `ref` of an APNs push: its flow and the `apns-topic` (`ios_app_id`) it went to."""
    return f"{flow}:{topic}"


def topic_of_ref(ref: str | None) -> str | None:
    """The `apns-topic` an APNs push's `ref` (`apns_ref`) names; None for any other ref."""
    if ref is None or ":" not in ref:
        return None
    return ref.split(":", 1)[1] or None


async def forget_token(
    engine: AsyncEngine,
    token: str,
    *,
    apns: bool,
    ios_app_id: str | None = None,
    before: datetime | None = None,
) -> None:
    """A provider said `token` is dead: expire E2EE rows, delete legacy rows (every server).

    With `ios_app_id` (the `apns-topic` of the APNs push that was refused), only the
    registrations of the token for that app: APNs answers for a (token, topic) pair,
    and `DeviceTokenNotForTopic` for a topic some server named must not end another
    server's registrations of the token for the topic it belongs to.

    With `before` (when the token was seen dead), only the registrations made before
    it: a device that registered the token again while the refused push was out (or
    since the receipts of a dead-token file) keeps its registration.
    """
    async with engine.begin() as conn:
        await repo.expire_e2ee_by_token(conn, token, apns, ios_app_id, before)
        await repo.delete_legacy_token(
            conn,
            kind=APNS if apns else FCM,
            token=token,
            apns=apns,
            ios_app_id=ios_app_id,
            before=before,
        )
