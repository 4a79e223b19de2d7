"""A minimal third-party pushgw plugin: one route that pushes, one table, one service.

It uses `gateway.api` only, like every built-in plugin.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from sqlalchemy import Column, MetaData, String, Table
from sqlalchemy.dialects import postgresql, sqlite

from gateway.api import (
    AppConfig,
    ConfigModel,
    InvalidToken,
    PluginContext,
    Push,
    PushPolicy,
    hookimpl,
)

metadata = MetaData()
sample_invalid = Table(
    "sample_invalid",
    metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("reason", String(64)),
)


class SampleConfig(ConfigModel):
    apps: dict[str, AppConfig] = {}
    greeting: str = "hello"


class Ticker:
    """A trivial background service with a lifecycle."""

    name = "sample-ticker"

    def __init__(self) -> None:
        self.running = False

    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    def ready(self) -> bool:
        return self.running


@hookimpl
def pushgw_config_model() -> type[SampleConfig]:
    return SampleConfig


@hookimpl
def pushgw_apps(context: PluginContext) -> Mapping[str, AppConfig]:
    return context.config.apps


@hookimpl
def pushgw_tables() -> MetaData:
    return metadata


@hookimpl
def pushgw_migrations() -> str:
    return str(Path(__file__).parent / "migrations")


@hookimpl
def pushgw_routes(context: PluginContext, router: web.UrlDispatcher) -> None:
    router.add_post("/sample/push", functools.partial(push_handler, context))


@hookimpl
def pushgw_services(context: PluginContext) -> list[Ticker]:
    ticker = Ticker()
    context.state["ticker"] = ticker
    return [ticker]


@hookimpl
async def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> None:
    context.state.setdefault("invalid", []).append(invalid)
    # Idempotent, and safe when two gateway nodes retire the same token at once: one
    # upsert statement (a delete then an insert raced: both deleted nothing, one insert
    # failed on the primary key).
    dialect_insert = postgresql.insert if context.store.dialect == "postgresql" else sqlite.insert
    upsert = (
        dialect_insert(sample_invalid)
        .values(token_hash=invalid.token_hash, reason=invalid.reason)
        .on_conflict_do_update(index_elements=["token_hash"], set_={"reason": invalid.reason})
    )
    async with context.store.engine.begin() as conn:
        await conn.execute(upsert)


async def push_handler(context: PluginContext, request: web.Request) -> web.Response:
    body = await request.json()
    receipt = await context.send(
        Push(
            plugin=context.name,
            app_id=body["app"],
            token=body["token"],
            payload=body["payload"],
            policy=PushPolicy(deadline=5.0),
        )
    )
    return web.json_response(
        {
            "outcome": receipt.outcome.value,
            "reason": receipt.reason,
            "greeting": context.config.greeting,
        }
    )
