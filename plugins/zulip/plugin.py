"""pushgw plugin: a Zulip push notification service ("push bouncer").

A Zulip server uses it as its Mobile Push Notification Service with
`ZULIP_SERVICES_URL = "https://<pushgw host>"` (see docs/zulip.md). Hooks:

- `pushgw_config_model`: `ZulipConfig` (`plugins.zulip`).
- `pushgw_apps`: the APNs / FCM apps of `plugins.zulip.apps`.
- `pushgw_tables` / `pushgw_migrations`: `zulip_*` tables, Alembic branch `zulip`.
- `pushgw_routes`: everything under `/api/v1/remotes/` at the origin root.
- `pushgw_services`: periodic garbage collection and a clean stop of late sends.
- `pushgw_token_invalid`: E2EE rows expire, legacy rows are deleted.
- `pushgw_commands`: `pushgw zulip ...` (see `plugins.zulip.commands`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path

from aiohttp import web
from sqlalchemy import MetaData

from gateway.api import (
    ApnsAppConfig,
    FcmAppConfig,
    InvalidToken,
    PluginContext,
    ProviderKind,
    Service,
    hookimpl,
)
from plugins.zulip import repo, tables
from plugins.zulip.bouncer import Bouncer, forget_token
from plugins.zulip.config import ZulipConfig
from plugins.zulip.gc import ZulipService


def bouncer_for(context: PluginContext) -> Bouncer:
    """The per-gateway state of this plugin, kept in the context it belongs to."""
    bouncer = context.state.get("bouncer")
    if bouncer is None:
        bouncer = context.state["bouncer"] = Bouncer(context)
    return bouncer


@hookimpl
def pushgw_config_model() -> type[ZulipConfig]:
    return ZulipConfig


@hookimpl
def pushgw_apps(context: PluginContext) -> Mapping[str, ApnsAppConfig | FcmAppConfig]:
    config: ZulipConfig = context.config
    return dict(config.apps)


@hookimpl
def pushgw_tables() -> MetaData:
    return tables.metadata


@hookimpl
def pushgw_migrations() -> str:
    return str(Path(__file__).parent / "migrations")


@hookimpl
def pushgw_routes(context: PluginContext, router: web.UrlDispatcher) -> None:
    bouncer_for(context).add_routes(router)


@hookimpl
def pushgw_services(context: PluginContext) -> Iterable[Service]:
    config: ZulipConfig = context.config
    bouncer = bouncer_for(context)
    return [
        ZulipService(
            lambda: context.store.engine,
            config.gc_interval,
            config.gc_older_than,
            on_stop=bouncer.close,
        )
    ]


@hookimpl
async def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> None:
    engine = context.store.engine
    if invalid.token is not None and invalid.provider is not None:
        await forget_token(engine, invalid.token, apns=invalid.provider is ProviderKind.APNS)
        return
    # From `pushgw tokens retire` (or without a provider): find the rows by hash.
    found: set[tuple[str, bool]] = set()
    async with engine.connect() as conn:
        if invalid.token is not None:
            found.update({(invalid.token, True), (invalid.token, False)})
        else:
            for row in await repo.e2ee_by_token_hash(conn, invalid.token_hash):
                found.add((row.token, row.token_kind == repo.APNS_KIND))
            for row in await repo.legacy_by_token_hash(conn, invalid.token_hash):
                found.add((row.token, row.kind == 1))
    for token, apns in found:
        await forget_token(engine, token, apns=apns)


@hookimpl
def pushgw_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from plugins.zulip.commands import add_commands

    add_commands(subparsers)
