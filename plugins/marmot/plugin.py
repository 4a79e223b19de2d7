"""The `marmot` plugin: a Marmot (MIP-05) notification server listening on Nostr relays.

Entry point `marmot = "plugins.marmot.plugin"`; config section `plugins.marmot`
(:class:`plugins.marmot.config.MarmotConfig`). Hooks:

- `pushgw_config_model`, `pushgw_apps`: the section and the APNs/FCM apps it names.
- `pushgw_services`: :class:`plugins.marmot.service.MarmotService`, the relay listener; ingress is
  Nostr, so the plugin has no HTTP routes.
- `pushgw_token_invalid`: a no-op. Marmot stores nothing about devices; dead tokens are only
  counted (`pushgw_marmot_dead_tokens_total`), and pushes carry `persist_token_hash=False`.
- `pushgw_commands`: `pushgw marmot keygen`, `pushgw marmot pubkey`.

See docs/marmot.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from gateway.api import ApnsAppConfig, FcmAppConfig, InvalidToken, PluginContext, hookimpl
from plugins.marmot.config import MarmotConfig
from plugins.marmot.metrics import MarmotMetrics
from plugins.marmot.service import MarmotService

__all__ = [
    "pushgw_apps",
    "pushgw_commands",
    "pushgw_config_model",
    "pushgw_services",
    "pushgw_token_invalid",
]


@hookimpl
def pushgw_config_model() -> type[MarmotConfig]:
    return MarmotConfig


@hookimpl
def pushgw_apps(context: PluginContext) -> Mapping[str, ApnsAppConfig | FcmAppConfig]:
    config: MarmotConfig = context.config
    return dict(config.apps)


@hookimpl
def pushgw_services(context: PluginContext) -> list[MarmotService]:
    config: MarmotConfig = context.config
    metrics = context.state.get("metrics")
    if metrics is None:
        metrics = context.state["metrics"] = MarmotMetrics(context.metrics)
    service = MarmotService(
        config,
        metrics,
        context.submit,
        plugin_name=context.name,
    )
    context.state["service"] = service
    return [service]


@hookimpl
def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> None:
    """Nothing to forget: Marmot keeps no registrations (the service counts dead tokens)."""
    return None


@hookimpl
def pushgw_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from plugins.marmot.commands import add_commands

    add_commands(subparsers)
