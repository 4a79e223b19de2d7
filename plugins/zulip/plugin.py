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
from datetime import UTC, datetime
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
from plugins.zulip.bouncer import Bouncer, forget_token, topic_of_ref
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
async def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> int | None:
    """Forget the token's registrations; by hash, return how many rows it matched."""
    engine = context.store.engine
    # Registrations made after the token was seen dead stay (the device registered it
    # again while the push was out, or since the dead-token file's receipts).
    before = (
        datetime.fromtimestamp(invalid.observed_at, UTC)
        if invalid.observed_at is not None
        else None
    )
    if invalid.token is not None and invalid.provider is not None:
        apns = invalid.provider is ProviderKind.APNS
        # An APNs answer is about the token for the topic the push named: only the
        # registrations for that app go (another server's for another app stay).
        topic = topic_of_ref(invalid.ref) if apns else None
        await forget_token(engine, invalid.token, apns=apns, ios_app_id=topic, before=before)
        return None
    # From `pushgw tokens retire` (or without a provider): find the rows by hash. A token
    # dead for one of our APNs apps ends only the registrations sent through that app.
    config: ZulipConfig = context.config
    apns_app = (
        invalid.app_id if isinstance(config.apps.get(invalid.app_id), ApnsAppConfig) else None
    )

    Forget = tuple[str, bool, str | None]  # token, is APNs, only for this ios_app_id

    def wanted(token: str, apns: bool, ios_app_id: str | None) -> Forget | None:
        """What to forget for one row the hash matched; None for another APNs app's row."""
        if not apns or apns_app is None:
            return token, apns, None
        if ios_app_id and config.apns_app_id(ios_app_id) == apns_app:
            return token, True, ios_app_id
        return None

    matched: list[Forget] = []
    live = 0  # registrations the hash matched that were not expired already
    async with engine.connect() as conn:
        if invalid.token is not None:
            matched = [(invalid.token, True, None), (invalid.token, False, None)]
        else:
            e2ee = await repo.e2ee_by_token_hash(conn, invalid.token_hash)
            legacy = await repo.legacy_by_token_hash(conn, invalid.token_hash)
            for e2ee_row in e2ee:
                row = wanted(
                    e2ee_row.token, e2ee_row.token_kind == repo.APNS_KIND, e2ee_row.ios_app_id
                )
                if row is not None:
                    matched.append(row)
                    # An expired row stays until gc: retiring the same file again
                    # must not count it as a registration found (docs/cli.md).
                    live += e2ee_row.expired_at is None
            for legacy_row in legacy:  # deleted when forgotten: each one is live
                row = wanted(legacy_row.token, legacy_row.kind == 1, legacy_row.ios_app_id)
                if row is not None:
                    matched.append(row)
                    live += 1
    for token, apns, ios_app_id in set(matched):
        await forget_token(engine, token, apns=apns, ios_app_id=ios_app_id, before=before)
    # live registrations the hash matched (stored hashes are of the current key: after a
    # receipts.hmac_key rotation, `pushgw zulip rehash-tokens` remakes them)
    return None if invalid.token is not None else live


@hookimpl
def pushgw_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from plugins.zulip.commands import add_commands

    add_commands(subparsers)
