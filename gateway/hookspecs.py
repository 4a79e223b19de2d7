"""The plugin contract: every hook a pushgw plugin may implement.

A plugin is a module (or object) registered under a name through the
`pushgw.plugins` entry-point group; the name is also its config section
(`plugins.<name>`). Implement hooks with `gateway.api.hookimpl`.

Two kinds of hooks:

- **Per-plugin hooks** are called once for each enabled plugin with that plugin's own
  `PluginContext` (its name, validated config, and handles to the dispatcher, store
  and metrics). Their docstrings say "per plugin".
- **Broadcast hooks** are called on every enabled plugin and their results collected.

Hooks whose docstring says "may be async" may be coroutine functions; the gateway
awaits them. Any hook may be left unimplemented.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from aiohttp import web
    from pydantic import BaseModel
    from sqlalchemy import MetaData

    from gateway.config import ApnsAppConfig, FcmAppConfig
    from gateway.context import PluginContext, Service
    from gateway.core.push import InvalidToken, Push, Receipt

PROJECT = "pushgw"

hookspec = pluggy.HookspecMarker(PROJECT)


@hookspec
def pushgw_config_model() -> type[BaseModel] | None:
    """Per plugin, at start-up before anything else: the model of `plugins.<name>`.

    Return a pydantic model class (derive from `gateway.api.ConfigModel` so unknown
    keys are errors and `X_file` keys read secrets from files), or None when the plugin
    takes no configuration. The section is validated at start-up; errors name the key
    path and stop the gateway with exit status 2. The validated instance is
    `context.config` in every later per-plugin hook.
    """


@hookspec
def pushgw_apps(context: PluginContext) -> Mapping[str, ApnsAppConfig | FcmAppConfig] | None:
    """Per plugin, at start-up: the provider apps (credential sets) this plugin sends through.

    Returns a mapping of app id to `ApnsAppConfig` / `FcmAppConfig`. The core opens one
    provider client per app; a `Push` names its app by `app_id`, and app ids are scoped
    to the plugin that declared them. A broken app never delays another.
    """


@hookspec
def pushgw_tables() -> MetaData | None:
    """Per plugin: the SQLAlchemy `MetaData` of the tables this plugin owns.

    Table names must start with the plugin's name (`<name>_...`). The gateway never
    creates tables from it: the plugin's Alembic migrations do (see `pushgw_migrations`).
    It is the declaration those migrations are checked against:
    `gateway.testing.schema_drift()` migrates a fresh database and compares it with this
    metadata through Alembic's autogenerate comparison (tables, columns, types,
    nullability, server defaults, indexes, unique constraints, foreign keys), and checks
    the naming rule. Return it (with the migrations) or neither.
    """


@hookspec
def pushgw_migrations() -> str | None:
    """Per plugin: the directory of this plugin's Alembic revision scripts, or None.

    The revisions form a branch labelled with the plugin's name whose root depends on
    the core's base revision. `pushgw db upgrade` (and start-up, when
    `store.auto_upgrade` is true) applies every enabled plugin's branch to its head.
    Called for installed plugins that are not enabled too (their revisions must be
    located when a plugin was disabled after its branch was applied): no side effects.
    """


@hookspec
def pushgw_routes(context: PluginContext, router: web.UrlDispatcher) -> None:
    """Per plugin, while the aiohttp application is built: add this plugin's HTTP routes.

    Use `router.add_post(...)` etc. Handlers reach the gateway through `context`
    (bind it with `functools.partial` or a class); routes must not collide with
    another plugin's or the core's (`/healthz`, `/readyz`, `/metrics`): one with the
    method and path of another's fails start-up, naming both. `router` is the plugin's
    own: its routes join the application's when the hook returns. May not be async.
    """


@hookspec
def pushgw_services(context: PluginContext) -> Iterable[Service] | None:
    """Per plugin: long-lived background services (listeners, servers, periodic jobs).

    Each `Service` has `name`, `async start()`, `async stop()` and `ready() -> bool`.
    They are started after the store and provider clients, in plugin order, stopped
    in reverse order at shutdown, and `/readyz` reports each one's `ready()`.
    """


@hookspec
def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> Any:
    """Per plugin, only on the plugin that owns the token: one of its tokens is dead. May be async.

    Called once per token (and again for an answer to a push sent after that call
    began, see `observed_at` below) when a provider says the token will never work again
    (APNs 410 / BadDeviceToken / DeviceTokenNotForTopic, FCM UNREGISTERED /
    SENDER_ID_MISMATCH / INVALID_ARGUMENT on the token), and when an operator retires
    dead tokens found by the receipts analytics (`pushgw tokens retire`), in which case
    `invalid.token` is None and only `invalid.token_hash` identifies it. The plugin
    does what its protocol says (forget the registration, report it upstream...).
    It must be idempotent: a token invalidated live may be retired again later.
    `invalid.observed_at` is when the token was seen dead (the start of the request
    that got the answer, or the file's `last_seen`): a registration the device made
    after it is newer than the answer and should be kept.

    It may return the number of the plugin's records the token matched (an `int`; None,
    the default, says nothing). `pushgw tokens retire` counts the tokens that matched
    none and says so: their hashes were made under another `receipts.hmac_key`, or the
    tokens were already forgotten (docs/receipts.md, "Rotating the HMAC key").
    """


@hookspec
def pushgw_push_result(push: Push, receipt: Receipt) -> Any:
    """Broadcast, after every push reaches its final outcome. May be async.

    For observation only (audit, custom metrics); the submitting plugin already has
    the receipt from `dispatcher.send()`. Must not raise and must be quick.
    """


@hookspec
def pushgw_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Broadcast, when the CLI is built: add `pushgw <name> ...` sub-commands.

    Add a parser with `subparsers.add_parser(...)` and set
    `parser.set_defaults(handler=fn)` where `fn(args, command_context) -> int` (may be
    async) returns the exit status. `command_context` (`CommandContext`) loads the
    config and opens the store on demand.
    """


@hookspec
def pushgw_spark_jobs() -> Iterable[Any] | None:
    """Broadcast: a list of batch jobs over delivery receipts (`spark_plugins.SparkJob`
    objects; docs/spark.md, "Writing a job").

    `pushgw spark list` shows them and `pushgw spark run NAME` runs one. A hook that
    raises or returns anything but a list of jobs is skipped with one line naming its
    plugin; job names are unique across plugins.
    """


__all__ = ["PROJECT", "hookspec"]
