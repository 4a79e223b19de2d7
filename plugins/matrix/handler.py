"""The HTTP front: `POST /_matrix/push/v1/notify` and `GET /health` (matrix.md §1, §5).

A client mistake is a 400 with Sygnal's text (or a rejected pushkey), never a 500.
Devices are dispatched concurrently and answered in device order; the core owns
retries, token invalidation, receipts and its own metrics. Pushkeys and notification
content never reach a log line or a metric label.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiohttp import web

from gateway.api import (
    ApnsOptions,
    Outcome,
    PluginContext,
    Push,
    PushPolicy,
    Reason,
    Receipt,
    RepeatedLines,
)
from plugins.matrix.build import Planned, apns_token, plan
from plugins.matrix.config import MatrixAppConfig, MatrixConfig
from plugins.matrix.metrics import SygnalMetrics
from plugins.matrix.payloads import PayloadRejected
from plugins.matrix.routing import AppRouter
from plugins.matrix.validation import (
    MSG_ENCRYPTED,
    Device,
    Notification,
    NotifyError,
    parse_notify,
)

log = logging.getLogger("plugins.matrix")

__all__ = ["MatrixFrontend"]

NOTIFY_PATH = "/_matrix/push/v1/notify"
PUSH_PREFIX = "/_matrix/push/"
# The Push Gateway API's answer to an unknown endpoint (404) or method (405):
# matrix-org/matrix-spec:content/push-gateway-api.md, "Unsupported endpoints".
_UNRECOGNIZED = json.dumps({"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"})
# Answers that reject the pushkey although the core classifies them `permanent`.
_REJECTING_REASONS = frozenset({"TopicDisallowed", Reason.PAYLOAD_TOO_LARGE})
_MIN_DEADLINE = 0.05
_NO_APNS_OPTIONS = ApnsOptions()  # FCM pushes: the core ignores APNs options
_NONE_REJECTED = json.dumps({"rejected": []}).encode()  # the common answer, encoded once


class Result(enum.Enum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    FAILED = "failed"  # makes the whole response a 502


@dataclass
class _App:
    name: str
    config: MatrixAppConfig
    inflight: int = 0


@dataclass
class _RequestSlots:
    """The in-flight slots one notify request holds, by app.

    `inflight_request_limit` counts requests, as in Sygnal, which sends a request's
    devices one after another so that a request holds one slot of its pushkin at most.
    pushgw sends them concurrently: the devices of one request on one app share a slot,
    taken by the first and given back by the last.
    """

    held: dict[str, int] = field(default_factory=dict)

    def take(self, app: _App) -> bool:
        """Take (or share) the request's slot of `app`; False when the app is full."""
        if self.held.get(app.name):
            self.held[app.name] += 1
            return True
        if app.inflight >= app.config.inflight_request_limit:
            return False
        app.inflight += 1
        self.held[app.name] = 1
        return True

    def release(self, app: _App) -> None:
        self.held[app.name] -= 1
        if not self.held[app.name]:
            app.inflight -= 1


@dataclass
class _DeviceLog:
    """The log lines of one notify request's devices: the first `limit` as they come,
    then one line counting the rest (`summarise`).

    The endpoint has no authentication (as Sygnal's), and one body of `max_body_bytes`
    holds thousands of devices: a line per device of an unknown app made one request
    thousands of log lines. Synapse sends one device per request, so its lines are
    all logged.
    """

    limit: int = 10
    written: int = 0
    left_out: int = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        if not log.isEnabledFor(level):
            return  # a line not written anyway takes no place of one that is
        if self.written < self.limit:
            self.written += 1
            log.log(level, message, *args)
        else:
            self.left_out += 1

    def summarise(self, devices: int) -> None:
        if self.left_out:
            log.warning(
                "notify request of %d devices: %d more device messages not logged",
                devices,
                self.left_out,
            )


def outcome_of(receipt: Receipt) -> Result:
    """Map the core's final receipt to what the homeserver is told (§3, §4)."""
    if receipt.outcome is Outcome.OK:
        return Result.ACCEPTED
    if receipt.outcome is Outcome.TOKEN_INVALID:
        return Result.REJECTED
    if receipt.outcome is Outcome.PERMANENT and receipt.reason in _REJECTING_REASONS:
        return Result.REJECTED
    return Result.FAILED


class MatrixFrontend:
    """One gateway's notify endpoint: routing, payload building, delivery, answer."""

    def __init__(
        self, context: PluginContext, config: MatrixConfig, metrics: SygnalMetrics
    ) -> None:
        self.context = context
        self.config = config
        self.metrics = metrics
        self.sygnal = metrics.sygnal
        self.apps = {name: _App(name, app) for name, app in config.apps.items()}
        self.router = AppRouter(self.apps)
        self.repeats = RepeatedLines()
        metrics.touch_apps(self.apps)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_route("*", NOTIFY_PATH, self.notify)
        # After the notify route: every other path of the API is an unknown endpoint.
        router.add_route("*", PUSH_PREFIX + "{tail:.*}", self.unrecognized)
        router.add_get("/health", self.health)  # allow_head: HEAD answers too

    # --- endpoints -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        log.debug("health check")
        return web.Response(status=200)

    async def unrecognized(self, request: web.Request) -> web.Response:
        raise web.HTTPNotFound(text=_UNRECOGNIZED, content_type="application/json")

    async def notify(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(
                request.method, ["POST"], text=_UNRECOGNIZED, content_type="application/json"
            )
        started = time.perf_counter()
        if self.sygnal:
            gauge = self.metrics.requests_in_flight
            gauge.inc()
        try:
            response = await self._notify(request)
        except web.HTTPException:
            raise
        except Exception:
            # A bug of ours. matrix.md §1.2 (and Sygnal): 500 with an empty body, counted
            # in the status metrics like any answer; the traceback goes to the log only.
            log.exception("internal error in notify")
            response = web.Response(status=500)
        finally:
            if self.sygnal:
                gauge.dec()
        if self.sygnal:
            code = str(response.status)
            self.metrics.status_code(code).inc()
            self.metrics.notify_time(code).observe(time.perf_counter() - started)
        return response

    async def _notify(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_body(request)
        except web.RequestPayloadError:  # its Content-Encoding does not decode it, or it was
            # too slow (`server.body_timeout`: the core then answers 408 instead)
            log.warning("invalid notify request: the body does not decode or came too slowly")
            return web.Response(status=400, text="Body does not decode")
        except ConnectionError:  # the client left before the end of its body: not our bug
            log.info("notify request: the client closed the connection before its body ended")
            return web.Response(status=400, text="Body incomplete")
        if body is None:
            return web.Response(status=413, text="Request body too large")
        try:
            notification = parse_notify(body, defer_encrypted=True)
        except NotifyError as exc:
            log.warning("invalid notify request: %s", exc)
            return web.Response(status=400, text=str(exc))
        if notification.invalid_encrypted and self._reads_msc3013(notification.devices):
            # Checked before anything is sent: a 400 must mean nothing was delivered.
            log.warning("invalid notify request: %s", MSG_ENCRYPTED)
            return web.Response(status=400, text=MSG_ENCRYPTED)
        if self.sygnal:
            self.metrics.notifications_received.inc()
            self.metrics.devices_received.inc(len(notification.devices))
        deadline = time.monotonic() + self.config.notify_deadline
        devices = notification.devices
        slots = _RequestSlots()
        note = _DeviceLog()
        if len(devices) == 1:
            results: Iterable[Result] = [
                await self._device(notification, devices[0], 0, deadline, slots, note)
            ]
        else:
            results = await asyncio.gather(
                *(
                    self._device(notification, d, i, deadline, slots, note)
                    for i, d in enumerate(devices)
                )
            )
        note.summarise(len(devices))
        rejected = []
        for device, result in zip(devices, results, strict=True):
            if result is Result.FAILED:
                return web.Response(status=502)
            if result is Result.REJECTED:
                rejected.append(device.pushkey)
        return web.Response(
            status=200,
            body=json.dumps({"rejected": rejected}).encode() if rejected else _NONE_REJECTED,
            content_type="application/json",
        )

    def _reads_msc3013(self, devices: Iterable[Device]) -> bool:
        """Whether one of `devices` goes to an app that reads the MSC3013 fields
        (`msc3013_mode` other than `off`; an unknown app_id reads nothing)."""
        for device in devices:
            name = self.router.route(device.app_id).app
            if name is not None and self.apps[name].config.msc3013_mode != "off":
                return True
        return False

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The body, or None when it is over `max_body_bytes`. Counted as read, after
        any Content-Encoding: a gzip body's Content-Length is its compressed size."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None  # too large even before inflating: not read at all
        chunks = []
        size = 0
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    # --- one device ------------------------------------------------------------------

    async def _device(
        self,
        n: Notification,
        device: Device,
        index: int,
        deadline: float,
        slots: _RequestSlots,
        note: _DeviceLog,
    ) -> Result:
        route = self.router.route(device.app_id)
        if route.app is None:
            assert route.error is not None
            note(logging.WARNING, "device %d: %s, pushkey rejected", index, route.error.value)
            return Result.REJECTED
        app = self.apps[route.app]
        if self.sygnal:
            self.metrics.per_pushkin(app.name).inc()
        try:
            planned = plan(n, device, app.config)
            if planned is None:
                note(logging.DEBUG, "device %d: nothing to send for app %s", index, app.name)
                return Result.ACCEPTED
            token = (
                apns_token(device.pushkey, app.config.convert_device_token_to_hex)
                if app.config.is_apns
                else device.pushkey
            )
        except PayloadRejected as exc:
            note(logging.WARNING, "device %d, app %s: pushkey rejected: %s", index, app.name, exc)
            return Result.REJECTED
        if not slots.take(app):
            # A provider that stopped answering fills the slots: one line a minute, counted.
            since = self.repeats.admit((app.name, "inflight_request_limit"))
            note(
                logging.DEBUG if since is None else logging.WARNING,
                "app %s: inflight_request_limit reached, dropping%s",
                app.name,
                f" ({since[0]} more not logged at WARNING since the last)"
                if since and since[0]
                else "",
            )
            if self.sygnal:
                self.metrics.inflight_drop(app.name).inc()
            return Result.FAILED
        try:
            if planned.encrypted:
                self.metrics.msc3013_encrypted(app.name).inc()
            if planned.oversize:
                self.metrics.msc3013_oversize(app.name).inc()
                note(
                    logging.WARNING,
                    "app %s: MSC3013 payload too large, ciphertext omitted",
                    app.name,
                )
            receipt = await self._send(app, token, planned, deadline)
        finally:
            slots.release(app)
        result = outcome_of(receipt)
        if result is Result.REJECTED:
            note(
                logging.INFO,
                "device %d, app %s: pushkey rejected (%s)",
                index,
                app.name,
                receipt.reason,
            )
        elif result is Result.FAILED:
            self._failed(note, index, app, receipt)
        return result

    def _failed(self, note: _DeviceLog, index: int, app: _App, receipt: Receipt) -> None:
        since = self.repeats.admit((app.name, receipt.outcome.value))
        note(
            logging.DEBUG if since is None else logging.WARNING,
            "device %d, app %s: delivery failed: %s %s after %d attempt(s)%s",
            index,
            app.name,
            receipt.outcome.value,
            receipt.reason or receipt.status,
            receipt.attempts,
            f" ({since[0]} more like it not logged at WARNING since the last)"
            if since and since[0]
            else "",
        )

    async def _send(self, app: _App, token: str, planned: Planned, deadline: float) -> Receipt:
        remaining = max(deadline - time.monotonic(), _MIN_DEADLINE)
        push = Push(
            plugin=self.context.name,
            app_id=app.name,
            token=token,
            payload=planned.payload,
            apns=(
                ApnsOptions(push_type=planned.push_type, priority=planned.priority)
                if app.config.is_apns
                else _NO_APNS_OPTIONS
            ),
            policy=PushPolicy(deadline=remaining),
        )
        if not self.sygnal:
            return await self.context.send(push)
        apns = app.config.is_apns
        active = self.metrics.apns_active if apns else self.metrics.gcm_active
        started = time.perf_counter()
        active.inc()
        try:
            receipt = await self.context.send(push)
        finally:
            active.dec()
        (self.metrics.apns_request_time if apns else self.metrics.gcm_request_time).observe(
            time.perf_counter() - started
        )
        if receipt.status is not None:
            counter = self.metrics.apns_status if apns else self.metrics.gcm_status
            counter(app.name, str(receipt.status)).inc()
        return receipt
