"""Builds the aiohttp application from the configuration and the enabled plugins.

`load_gateway()` validates everything that can be validated without running
(config, plugins, plugin sections, apps, and the apps' credentials, loaded without
contacting Apple or Google); `pushgw check-config` and every start go through it.
`create_app()` turns that into an
`web.Application` whose resources live in `cleanup_ctx`: store, receipts writer,
provider clients and dispatcher, then plugin services. Nothing is global: two
gateways can run in one process (the tests do).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import itertools
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import hdrs, web
from pydantic import BaseModel

from gateway.config import (
    DEVELOPMENT_HMAC_KEY,
    ApnsAppConfig,
    ConfigError,
    CredentialError,
    FcmAppConfig,
    Problem,
    Settings,
    bad_hook_result,
    config_error,
    config_path,
    load_settings,
    validate_plugin_section,
)
from gateway.context import (
    WORKER_ENV,
    PluginContext,
    Runtime,
    Service,
    TokenHasher,
    first_worker,
)
from gateway.core.dispatcher import Dispatcher
from gateway.core.errors import FirstSeen, kind_and_place
from gateway.core.metrics import MULTIPROC_ENV, Metrics
from gateway.core.providers import ProviderClient
from gateway.core.push import InvalidToken, Push, Receipt
from gateway.core.receipts import ReceiptWriter
from gateway.core.store import Store
from gateway.core.tokens import TokenInvalidation, sweep_invalid_tokens_forever
from gateway.logs import request_id, route_pattern
from gateway.loops import thaw_gc, tune_gc
from gateway.plugins import PluginRegistry

log = logging.getLogger(__name__)

AppConfig = ApnsAppConfig | FcmAppConfig
ClientFactory = Callable[[str, AppConfig, Settings], ProviderClient]

CORE_ROUTES = ("/healthz", "/readyz", "/metrics")
# An APNs certificate this close to its expiry is warned of at every start and check-config.
CERTIFICATE_WARN_DAYS = 30
METRICS_FLUSH_INTERVAL = 1.0  # seconds a metric change may wait before other workers see it
# Methods labelled as sent; any other is "other". The method is the client's: aiohttp's
# C parser knows a fixed list, but its pure-Python one (AIOHTTP_NO_EXTENSIONS, platforms
# without the extension) accepts any token, one new series each.
_LABELLED_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


def default_client_factory(app_id: str, config: AppConfig, settings: Settings) -> ProviderClient:
    delivery = settings.delivery
    if isinstance(config, ApnsAppConfig):
        from gateway.core.apns import ApnsClient

        return ApnsClient(app_id, config, proxy=delivery.proxy, ca_file=delivery.ca_file)
    from gateway.core.fcm import FcmClient

    return FcmClient(app_id, config, proxy=delivery.proxy, ca_file=delivery.ca_file)


@dataclass
class LoadedGateway:
    """A validated configuration with its plugins, ready to run (or to inspect)."""

    settings: Settings
    registry: PluginRegistry
    runtime: Runtime
    contexts: dict[str, PluginContext]
    apps: dict[tuple[str, str], AppConfig]
    source: str | None = None
    client_factory: ClientFactory = default_client_factory
    services: list[Service] = field(default_factory=list)
    invalidation: TokenInvalidation | None = None

    def plugin_sections(self) -> dict[str, BaseModel]:
        return {n: c.config for n, c in self.contexts.items() if isinstance(c.config, BaseModel)}

    def migration_dirs(self) -> list[str]:
        return self.registry.migration_dirs()

    def known_migration_dirs(self) -> list[str]:
        """Every installed plugin's migration directory, to locate the revisions of
        plugins disabled since (`Store.upgrade(known=...)`)."""
        from gateway.plugins import installed_migration_dirs

        return installed_migration_dirs()

    async def notify_invalid(self, invalid: InvalidToken) -> object:
        """Calls the owning plugin's token-invalid hook (the end of the one invalidation path);
        returns what the hook returned."""
        context = self.contexts.get(invalid.plugin)
        if context is None:
            log.warning("invalid token for plugin %s, which is not enabled", invalid.plugin)
            return None
        return await self.registry.call_async(
            invalid.plugin, "pushgw_token_invalid", context=context, invalid=invalid
        )

    def open_store(self) -> Store:
        store = Store(self.settings.store.url, self.settings.store.pool_size)
        self.runtime.store = store
        self.invalidation = TokenInvalidation(store, self.runtime.metrics, self.notify_invalid)
        return store


GATEWAY = web.AppKey("gateway", LoadedGateway)


def load_gateway(
    path: str | Path | None = None,
    *,
    data: dict[str, Any] | None = None,
    extra_plugins: Mapping[str, object] | None = None,
    client_factory: ClientFactory = default_client_factory,
) -> LoadedGateway:
    """Validate the config file (or `data`) and load its plugins; raise ConfigError."""
    settings = load_settings(path, data)
    file = config_path(path)
    source = str(file) if data is None and file else None
    origins = settings.env_origins
    try:
        registry = PluginRegistry(settings.plugins.enabled, dict(extra_plugins or {}))
    except ConfigError as exc:
        raise _enabled_error(exc, source, settings) from None
    unknown = set(settings.plugins.configured_names()) - set(registry.names)
    if unknown:
        raise config_error(
            [(("plugins", n), "section for a plugin that is not enabled") for n in sorted(unknown)],
            source,
            origins,
            below=True,
        )
    runtime = Runtime(
        settings=settings,
        hasher=TokenHasher(settings.receipts.hmac_key.get_secret_value().encode()),
        metrics=Metrics(),
    )
    _zero_plugin_series(runtime.metrics, registry)
    contexts: dict[str, PluginContext] = {}
    apps: dict[tuple[str, str], AppConfig] = {}
    # Every plugin's problems, and the credentials of every app that validated, are
    # reported together: one run of `check-config` lists all that a start would refuse,
    # not one plugin's, fixed, then the next plugin's or the credentials behind them.
    errors: list[ConfigError] = []
    for name in registry.names:
        try:
            model = registry.call(name, "pushgw_config_model")
            section = validate_plugin_section(settings, name, model, source) if model else None
            if model is None and settings.plugins.section(name):
                raise config_error(
                    [(("plugins", name), "this plugin takes no configuration")], source, origins
                )
            contexts[name] = context = PluginContext(name, section, runtime)
            for app_id, app in _plugin_apps(registry, name, context).items():
                apps[(name, app_id)] = app
        except ConfigError as exc:
            errors.append(exc)
    try:
        check_credentials(apps, source, settings)
    except ConfigError as exc:
        errors.append(exc)
    if errors:
        raise _joined_errors(errors)
    return LoadedGateway(settings, registry, runtime, contexts, apps, source, client_factory)


def _joined_errors(errors: list[ConfigError]) -> ConfigError:
    """One ConfigError of several, each line as it was (its source kept when shared)."""
    if len(errors) == 1:
        return errors[0]
    sources = {error.source for error in errors}
    if len(sources) == 1:
        return ConfigError([p for error in errors for p in error.problems], sources.pop())
    return ConfigError(line for error in errors for line in str(error).splitlines())


def _plugin_apps(registry: PluginRegistry, name: str, context: PluginContext) -> Mapping[str, Any]:
    """A plugin's `pushgw_apps`, checked: a plugin bug is one config error naming it."""
    found = registry.call(name, "pushgw_apps", context=context) or {}
    if not isinstance(found, Mapping) or not all(
        isinstance(app_id, str) and isinstance(app, (ApnsAppConfig, FcmAppConfig))
        for app_id, app in found.items()
    ):
        expected = "a mapping of app ids to ApnsAppConfig or FcmAppConfig"
        raise bad_hook_result(name, "pushgw_apps", found, expected)
    return found


def check_credentials(
    apps: Mapping[tuple[str, str], AppConfig], source: str | None, settings: Settings
) -> None:
    """Load every app's credentials as its client will (no network); raise ConfigError
    naming `plugins.<plugin>.apps.<app id>.<key>` for each that does not load."""
    problems: list[Problem] = []
    for (plugin, app_id), app in apps.items():
        try:
            app.check_credentials()
        except CredentialError as exc:
            problems.append((("plugins", plugin, "apps", app_id, exc.key), exc.message))
            continue
        # `serve --workers N` loads the config in its main process, then again in each
        # worker: the main process says it, not N + 1 times.
        if isinstance(app, ApnsAppConfig) and WORKER_ENV not in os.environ:
            _warn_certificate_expiry(plugin, app_id, app)
    if problems:
        raise config_error(problems, source, settings.env_origins)


def _warn_certificate_expiry(plugin: str, app_id: str, app: ApnsAppConfig) -> None:
    """One line when an app's APNs certificate has expired or expires within
    `CERTIFICATE_WARN_DAYS`: APNs then refuses its TLS handshake, and its pushes end
    `certificate_expired` (`ApnsClient.send`). Not an error: the other apps start."""
    expires = app.certificate_expires()
    if expires is None:
        return
    now = datetime.datetime.now(datetime.UTC)
    when = expires.strftime("%Y-%m-%d %H:%M UTC")
    if expires <= now:
        log.warning(
            "app %s/%s: its APNs certificate (certfile) expired on %s: APNs refuses its "
            "connections, every push of the app ends certificate_expired; renew the "
            "certificate in the Apple developer account, replace the file and restart",
            plugin,
            app_id,
            when,
        )
    elif expires - now <= datetime.timedelta(days=CERTIFICATE_WARN_DAYS):
        log.warning(
            "app %s/%s: its APNs certificate (certfile) expires on %s, in %d day(s); renew "
            "it in the Apple developer account, replace the file and restart before then",
            plugin,
            app_id,
            when,
            (expires - now).days,
        )


def _enabled_error(error: ConfigError, source: str | None, settings: Settings) -> ConfigError:
    """The plugin registry's `plugins.enabled: ...` errors, naming the file or variable."""
    key = "plugins.enabled: "
    if error.source is not None or not all(p.startswith(key) for p in error.problems):
        return error
    problems = [(("plugins", "enabled"), p[len(key) :]) for p in error.problems]
    return config_error(problems, source, settings.env_origins)


# --- application -----------------------------------------------------------------


def create_app(gateway: LoadedGateway) -> web.Application:
    settings = gateway.settings
    stopping = Stopping()
    app = web.Application(
        middlewares=[
            _request_middleware(gateway.runtime.metrics, settings.server.body_timeout, stopping)
        ],
        client_max_size=settings.server.client_max_size,
    )
    app[GATEWAY] = gateway
    app[STOPPING] = stopping
    app[_STORE_PING] = _SharedPing()
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    if settings.server.metrics_port is None:
        app.router.add_get("/metrics", _metrics)
    _add_plugin_routes(gateway, app.router)
    app.cleanup_ctx.append(_delivery_ctx)
    app.cleanup_ctx.append(_services_ctx)
    if settings.server.metrics_port is not None:
        app.cleanup_ctx.append(_metrics_server_ctx)
    app.on_startup.append(_freeze_startup_objects)  # runs after the contexts above
    app.on_shutdown.append(_cut_pushes_at_shutdown_timeout)
    app.on_cleanup.append(_thaw_startup_objects)  # runs after the contexts' cleanup
    return app


def _add_plugin_routes(gateway: LoadedGateway, router: web.UrlDispatcher) -> None:
    """Each plugin's routes, added to a router of its own, then checked and moved into
    `router`. Added there directly, a route with the method and path of another owner's
    (the core's, another plugin's) would never run, or would fail in aiohttp naming
    neither the plugin nor the path (when right after that route)."""
    taken = dict.fromkeys(_route_keys(router), "the core")
    for name in gateway.registry.names:
        own = web.UrlDispatcher()
        result = gateway.registry.call(
            name, "pushgw_routes", context=gateway.contexts[name], router=own
        )
        if inspect.isawaitable(result):  # an `async def` hook: its routes would be missing
            raise bad_hook_result(name, "pushgw_routes", result, "None (it may not be async)")
        keys = _route_keys(own)
        for method, path in keys:
            if other := _route_owner(taken, method, path):
                raise ConfigError(
                    [f"plugin '{name}': its route {method} {path} is already a route of {other}"]
                )
        taken.update(dict.fromkeys(keys, f"plugin '{name}'"))
        for resource in own.resources():
            router.register_resource(resource)
        own.freeze()  # routes added later are refused, as by the application's router


def _route_keys(router: web.UrlDispatcher) -> list[tuple[str, str]]:
    """Method and path of each route (the path as metrics label it: `/x/{id}`); HEAD
    last, as `add_get` adds it before the GET that a collision is better named by."""
    keys = [(r.method, r.resource.canonical) for r in router.routes() if r.resource is not None]
    return sorted(keys, key=lambda key: key[0] == hdrs.METH_HEAD)


def _route_owner(taken: Mapping[tuple[str, str], str], method: str, path: str) -> str | None:
    """Whose route already answers `method` on `path` (one for any method, "*", answers
    every method; one for a method, that method of "*")."""
    for (other, other_path), owner in taken.items():
        if other_path == path and (other == method or hdrs.METH_ANY in (other, method)):
            return owner
    return None


async def _freeze_startup_objects(app: web.Application) -> None:
    """Runs after the contexts above: what they built is start-up's, frozen by `tune_gc`."""
    tune_gc()


async def _thaw_startup_objects(app: web.Application) -> None:
    """What start-up froze can be collected again once the gateway stopped (`thaw_gc`)."""
    thaw_gc()


# Time left, before aiohttp cuts the request handlers, for them to write the answers of
# the pushes cut (at most half of `server.shutdown_timeout`). Cut at the same moment, a
# handler finishing raced aiohttp's own timeout, which then logged InvalidStateError.
ANSWER_MARGIN = 1.0


async def _cut_pushes_at_shutdown_timeout(app: web.Application) -> None:
    """Shutdown begins (the server no longer listens): aiohttp now waits
    `server.shutdown_timeout` for the request handlers, then cuts them and drops their
    connections unanswered. The pushes they still wait for end shortly before
    (`cut_after`), so that each caller gets its protocol's answer."""
    gateway = app[GATEWAY]
    if gateway.runtime.dispatcher is not None:
        timeout = gateway.settings.server.shutdown_timeout
        gateway.runtime.dispatcher.cut_after(max(timeout - ANSWER_MARGIN, timeout / 2))


async def _delivery_ctx(app: web.Application) -> AsyncIterator[None]:
    """Store, receipts writer, provider clients and dispatcher: the delivery core's lifetime."""
    gateway = app[GATEWAY]
    async with running_core(gateway):
        yield


class running_core:
    """Async context manager that runs the delivery core of a loaded gateway.

    Also used by CLI commands that need the core without the HTTP server.
    """

    def __init__(self, gateway: LoadedGateway, *, migrate: bool | None = None) -> None:
        self.gateway = gateway
        self.migrate = gateway.settings.store.auto_upgrade if migrate is None else migrate
        self.writer: ReceiptWriter | None = None
        self.flusher: asyncio.Task[None] | None = None
        self.sweeper: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoadedGateway:
        gw = self.gateway
        settings = gw.settings
        if settings.receipts.hmac_key.get_secret_value() == DEVELOPMENT_HMAC_KEY and first_worker():
            # The default key is public: anyone holding a token finds its hash (receipts,
            # dead-token files, plugins' tables), the linkage the key exists to prevent.
            log.warning(
                "receipts.hmac_key is not set: token hashes are made under the public "
                "development key and link to tokens for anyone; set receipts.hmac_key_file "
                "(docs/privacy.md)"
            )
        store = gw.open_store()
        if self.migrate:
            await store.upgrade(gw.migration_dirs(), known=gw.known_migration_dirs())
        if settings.receipts.enabled:
            published = gw.runtime.metrics.receipt_files_published
            self.writer = ReceiptWriter(
                settings.receipts.directory,
                roll_seconds=settings.receipts.roll_seconds,
                roll_bytes=settings.receipts.roll_bytes,
                buffer=settings.receipts.buffer,
                file_format=settings.receipts.format,
                on_written=gw.runtime.metrics.receipts_written.inc,
                on_write_failed=gw.runtime.metrics.receipt_write_failures.inc,
                on_lost=gw.runtime.metrics.receipts_lost.inc,
                on_published=lambda fmt: published.labels(fmt).inc(),
            )
            await self.writer.start()
        sink = _make_sink(gw, self.writer)
        assert gw.invalidation is not None
        dispatcher = Dispatcher(
            settings.delivery, gw.runtime.metrics, gw.invalidation, gw.runtime.hasher, sink
        )
        clients = {
            key: gw.client_factory(key[1], app_config, settings)
            for key, app_config in gw.apps.items()
        }
        from gateway.core.apns import share_provider_tokens  # imported when a start needs it

        share_provider_tokens(clients.values())
        for (plugin, app_id), client in clients.items():
            dispatcher.add_app(plugin, app_id, client)
        for (plugin, app_id), app_config in gw.apps.items():
            if isinstance(app_config, ApnsAppConfig):
                expires = app_config.certificate_expires()
                if expires is not None:
                    expiry = gw.runtime.metrics.apns_certificate_expiry.labels(plugin, app_id)
                    expiry.set(expires.timestamp())
        await dispatcher.start()
        gw.runtime.dispatcher = dispatcher
        gw.runtime.receipts = self.writer
        gw.runtime.metrics.start_time.set_to_current_time()
        self.flusher = asyncio.create_task(_flush_metrics(gw.runtime.metrics), name="metrics")
        if first_worker():  # once per node: N workers would each delete the same rows
            self.sweeper = asyncio.create_task(
                sweep_invalid_tokens_forever(
                    store,
                    settings.store.invalid_tokens_retention,
                    gw.runtime.metrics.token_sweep_failures.inc,
                    gw.runtime.metrics.token_records_swept.inc,
                ),
                name="invalid-tokens-sweep",
            )
        return gw

    async def __aexit__(self, *exc: object) -> None:
        gw = self.gateway
        dispatcher = gw.runtime.dispatcher
        if dispatcher is not None:
            await dispatcher.drain(gw.settings.server.shutdown_timeout)
            await dispatcher.close()
        for task in (self.flusher, self.sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.flusher = self.sweeper = None
        gw.runtime.metrics.flush()
        if self.writer is not None:
            await self.writer.close()
        if gw.runtime.store is not None:
            await gw.runtime.store.close()
        gw.runtime.dispatcher = None
        gw.runtime.receipts = None
        gw.runtime.store = None


async def _flush_metrics(metrics: Metrics) -> None:
    """Flush the metric tallies every second: a scrape of this process flushes them
    itself, but with several workers another worker may answer the scrape."""
    while True:
        await asyncio.sleep(METRICS_FLUSH_INTERVAL)
        metrics.flush()


def _make_sink(
    gateway: LoadedGateway, writer: ReceiptWriter | None
) -> Callable[[Push, Receipt], Awaitable[None]] | None:
    observers = gateway.registry.pm.hook.pushgw_push_result.get_hookimpls()
    if writer is None and not observers:
        return None

    failed = _HookFailures(gateway.runtime.metrics, "pushgw_push_result")

    async def sink(push: Push, receipt: Receipt) -> None:
        if writer is not None:
            await writer.put(receipt)
        if observers:  # each observer is called on its own; a failing one is counted
            await gateway.registry.broadcast_async(
                "pushgw_push_result", on_error=failed, push=push, receipt=receipt
            )

    return sink


def _zero_plugin_series(metrics: Metrics, registry: PluginRegistry) -> None:
    """Every plugin's failure series at 0 from the start: an `increase()` alert does not
    see the first failure of a series that did not exist before it."""
    for name in registry.names:
        metrics.token_record_failures.labels(name)
    for hook in ("pushgw_push_result", "pushgw_token_invalid"):
        for name in registry.implementers(hook):
            metrics.hook_errors.labels(name, hook)


class _HookFailures:
    """A per-push hook's failures: each counted (`pushgw_plugin_hook_errors_total`), the
    first of each kind and place logged. An observer that fails for every push wrote
    an ERROR line per push, hundreds a second."""

    def __init__(self, metrics: Metrics, hook: str) -> None:
        self._metrics = metrics
        self._hook = hook
        self._seen = FirstSeen()

    def __call__(self, plugin: str, exc: Exception) -> None:
        self._metrics.hook_errors.labels(plugin, self._hook).inc()
        where = kind_and_place(exc)
        if self._seen.first(plugin, where):
            log.error(
                "plugin %s: its %s hook raised %s; fix or disable the plugin (later "
                "failures at that place are counted in pushgw_plugin_hook_errors_total, "
                "not logged)",
                plugin,
                self._hook,
                where,
            )


async def _services_ctx(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    started: list[Service] = []
    first = first_worker()
    try:
        for name in gateway.registry.names:
            for service in _plugin_services(gateway, name):
                if getattr(service, "one_per_gateway", False) and not first:
                    continue  # another worker runs it: every event is handled exactly once
                await service.start()
                started.append(service)
    except BaseException:
        # A context that raises before its `yield` is not cleaned up by aiohttp: the
        # services already started are stopped here, or they would run on (relay
        # connections, tasks) in a gateway that never started.
        await _stop_services(started)
        raise
    gateway.services = started
    yield
    await _stop_services(started)
    gateway.services = []


def _plugin_services(gateway: LoadedGateway, name: str) -> list[Service]:
    """A plugin's `pushgw_services`, checked: a plugin bug is one error naming it, not
    a TypeError (`'coroutine' object is not iterable`) naming neither plugin nor hook."""
    found = gateway.registry.call(name, "pushgw_services", context=gateway.contexts[name])
    if found is None:
        return []
    services = list(found) if isinstance(found, Iterable) else None
    if services is None or not all(isinstance(s, Service) for s in services):
        raise bad_hook_result(name, "pushgw_services", found, "an iterable of Service (or None)")
    return services


async def _stop_services(started: list[Service]) -> None:
    for service in reversed(started):
        try:
            await service.stop()
        except Exception:
            log.exception("service %s failed to stop cleanly", service.name)


async def _metrics_server_ctx(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    metrics_app = web.Application()
    metrics_app[GATEWAY] = gateway
    metrics_app.router.add_get("/metrics", _metrics)
    # aiohttp's own keep-alive default (an hour) otherwise: idle and slow-header
    # connections of the metrics port are closed as the main port's are.
    runner = web.AppRunner(
        metrics_app, access_log=None, keepalive_timeout=gateway.settings.server.keepalive_timeout
    )
    await runner.setup()
    from gateway.serve import listen  # light, but only `serve` needs it otherwise

    # Bound as the main port is (`listen`): `server.host: "::"` takes IPv4 clients too,
    # which a TCPSite (IPv6-only sockets for `::`) would refuse.
    server = gateway.settings.server
    assert server.metrics_port is not None  # this context runs only when it is set
    try:
        socks = listen(
            server.metrics_address, server.metrics_port, reuse_port=True, what="/metrics"
        )
        try:
            for sock in socks:
                await web.SockSite(runner, sock).start()
        except BaseException:
            for sock in socks:
                sock.close()
            raise
    except BaseException:
        await runner.cleanup()
        raise
    yield
    await runner.cleanup()


# --- core endpoints ------------------------------------------------------------------


class Stopping:
    """Whether a stop signal came and the gateway still serves (`server.shutdown_delay`):
    `/readyz` then answers 503 (`"stopping": true`), and every answer closes its
    connection, so that keep-alive clients reconnect, through the balancer, elsewhere."""

    def __init__(self) -> None:
        self.active = False

    def begin(self) -> None:
        self.active = True


STOPPING = web.AppKey("stopping", Stopping)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


class _SharedPing:
    """The database ping of /readyz, one at a time: probes that come while one runs
    wait for its answer. A ping per probe took a pooled connection each, and a flood of
    probes on the public port held the pool that the pushes need."""

    def __init__(self) -> None:
        self._running: asyncio.Future[bool] | None = None

    async def __call__(self, store: Store) -> bool:
        running = self._running
        if running is None or running.done():
            running = self._running = asyncio.ensure_future(store.ping())
        # Shielded: a probe that hangs up does not cancel the ping the others wait for.
        return await asyncio.shield(running)


_STORE_PING = web.AppKey("store_ping", _SharedPing)


async def _readyz(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    store = gateway.runtime.store
    dispatcher = gateway.runtime.dispatcher
    checks: dict[str, Any] = {
        "store": bool(store and await request.app[_STORE_PING](store)),
        "apps": dispatcher.ready() if dispatcher else {},
        "services": {s.name: bool(s.ready()) for s in gateway.services},
    }
    details = {
        s.name: status() for s in gateway.services if callable(status := getattr(s, "status", None))
    }
    if details:
        checks["service_status"] = details
    ok = checks["store"] and all(checks["apps"].values()) and all(checks["services"].values())
    if request.app[STOPPING].active:  # still serving, until server.shutdown_delay has passed
        checks["stopping"] = True
        ok = False
    writer = gateway.runtime.receipts
    if writer is not None:
        # Failing writes (a full disk) are reported at once; the node stays ready while
        # its buffer takes the receipts, and is not once every push waits for room: a
        # balancer then sends the pushes elsewhere. Not sooner, or one volume shared by
        # every node, full, would take all of them out while they still deliver.
        checks["receipts"] = not writer.failing
        ok = ok and not writer.holding_pushes
    return web.json_response({"ready": ok, **checks}, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[GATEWAY].runtime.metrics
    if _multiproc():
        metrics.flush()  # here, on the loop thread that owns the tallies
        body = await asyncio.to_thread(metrics.exposition)
    else:
        body = metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": metrics.content_type})


def _multiproc() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class BodyTimeout(web.RequestPayloadError):
    """The client did not send its whole request body within `server.body_timeout`.

    A `RequestPayloadError`, as a body that cannot be read: what handlers already answer
    as the client's mistake. The middleware then answers 408 and closes the connection:
    with the handler's own answer when it is a 408, returned or raised (a plugin whose
    clients parse every error in their protocol's terms catches this to answer so), else
    with the core's.
    """


class _BodyDeadline:
    """`server.body_timeout` for a request whose body had not all come when its handler
    started (the usual small body comes with its headers: no timer then).

    aiohttp bounds the wait for a request's headers (its keep-alive timer) but not for
    its body: a client announcing a body and sending it a byte a minute, or never, held
    the connection and its handler for ever (slowloris). At the deadline the body's
    stream fails with `BodyTimeout`, which wakes a handler reading it.
    """

    __slots__ = ("_handle", "_payload", "expired")

    def __init__(self, request: web.Request, seconds: float) -> None:
        self.expired = False
        self._payload = request.content
        self._handle = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        if not self._payload.is_eof():
            self.expired = True
            self._payload.set_exception(BodyTimeout("the request body did not come in time"))

    def cancel(self) -> None:
        self._handle.cancel()


def _body_deadline(request: web.Request, seconds: float | None) -> _BodyDeadline | None:
    if seconds is None or not request.body_exists or request.content.is_eof():
        return None
    return _BodyDeadline(request, seconds)


def _body_timed_out() -> web.Response:
    return web.json_response(
        {"error": "request timeout: the request body did not come in time"}, status=408
    )


def _request_middleware(
    metrics: Metrics, body_timeout: float | None = None, stopping: Stopping | None = None
) -> Any:
    http_requests = metrics.children(metrics.http_requests)
    # Request ids must be unique in the logs, not unpredictable: a random per-process
    # prefix and a sequence, instead of uuid4's system call on every request.
    prefix = secrets.token_hex(4)
    sequence = itertools.count()

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        rid = _client_request_id(request) or f"{prefix}{next(sequence) & 0xFFFF_FFFF:08x}"
        token = request_id.set(rid)
        status = 500
        deadline = _body_deadline(request, body_timeout)
        try:
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
            except Exception as exc:
                if deadline is None or not deadline.expired:
                    raise
                if isinstance(exc, web.HTTPException) and exc.status == 408:
                    exc.force_close()  # the handler's own 408, raised (aiohttp's idiom)
                    raise
            if deadline is not None and deadline.expired:
                # Whatever the handler made of `BodyTimeout` (a 400, an exception): 408,
                # the handler's own when it answered 408 in its protocol's terms.
                if response is None or response.status != 408:
                    response = _body_timed_out()
                response.force_close()  # what is left of the body is not read
            assert response is not None
            status = response.status
            response.headers["X-Request-Id"] = rid
            _close_after_unreadable_body(request, response)
            if stopping is not None and stopping.active:
                response.force_close()  # the client's next request goes to another node
            return response
        except web.HTTPException as exc:
            status = exc.status
            _close_after_unreadable_body(request, exc)
            if stopping is not None and stopping.active:
                exc.force_close()
            raise
        except Exception:
            # A bug of ours: never a traceback to the client, always one in the log.
            log.exception("unhandled error in %s %s", request.method, route_pattern(request))
            return web.json_response({"error": "internal error", "request_id": rid}, status=500)
        finally:
            if deadline is not None:
                deadline.cancel()
            method = request.method if request.method in _LABELLED_METHODS else "other"
            http_requests(route_pattern(request), method, str(status)).inc()
            request_id.reset(token)

    return middleware


def _close_after_unreadable_body(request: web.Request, response: web.StreamResponse) -> None:
    """`Connection: close` on the answer to a request whose body could not be read (a
    `Content-Encoding` that does not decode it): aiohttp closes that connection once
    it has answered, and a keep-alive client told nothing sent its next request on
    it, to fail as a network error (a pipelined one went unanswered). RFC 9112 §9.6."""
    if request.content.exception() is not None:
        response.force_close()


# What a client's X-Request-Id may hold to be used: it goes into every log line of the
# request and back into the response, so no spaces, brackets or control characters (a
# forged log prefix) and nothing that is not ASCII (the pure-Python HTTP parser hands
# undecodable bytes over as surrogates, which cannot be written back).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,64}")


def _client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id when it is a plain token (`_REQUEST_ID`), else None:
    the gateway then numbers the request itself."""
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.fullmatch(given) else None
