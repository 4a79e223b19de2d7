"""The `matrix` plugin: a Sygnal drop-in push gateway with MSC3013 encrypted push.

Entry point `matrix = "plugins.matrix.plugin"`; its config section is `plugins.matrix`
(`MatrixConfig`: a Sygnal `apps:` mapping plus pushgw extensions). See docs/matrix.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from gateway.api import ApnsAppConfig, FcmAppConfig, InvalidToken, PluginContext, hookimpl
from plugins.matrix.config import MatrixConfig
from plugins.matrix.handler import MatrixFrontend
from plugins.matrix.metrics import SygnalMetrics, metrics_for

log = logging.getLogger("plugins.matrix")

__all__ = [
    "pushgw_apps",
    "pushgw_config_model",
    "pushgw_routes",
    "pushgw_token_invalid",
]


def _config(context: PluginContext) -> MatrixConfig:
    config = context.config
    if not isinstance(config, MatrixConfig):  # section absent: no apps
        config = MatrixConfig.model_validate({})
    return config


@hookimpl
def pushgw_config_model() -> type[MatrixConfig]:
    return MatrixConfig


@hookimpl
def pushgw_apps(context: PluginContext) -> Mapping[str, ApnsAppConfig | FcmAppConfig]:
    config = _config(context)
    for name, app in config.apps.items():
        for key in app.unknown_keys:
            log.warning("plugins.matrix.apps.%s.%s: unknown key, ignored", name, key)
    return config.core_apps


def _cert_expiry(metrics: SygnalMetrics, config: MatrixConfig) -> None:
    from cryptography import x509

    for name, app in config.apps.items():
        if not (app.is_apns and app.certfile):
            continue
        try:
            cert = x509.load_pem_x509_certificate(Path(app.certfile).expanduser().read_bytes())
        except (OSError, ValueError):
            continue
        expiry = cert.not_valid_after_utc
        # The metric only: the core warns of an expiring certificate, once per start
        # (`gateway.app.check_credentials`); this line repeated it, in every worker.
        metrics.cert_expiry.labels(name).set(expiry.timestamp())


@hookimpl
def pushgw_routes(context: PluginContext, router: web.UrlDispatcher) -> None:
    config = _config(context)
    metrics = metrics_for(context.metrics, config.sygnal_metrics)
    if metrics.sygnal:
        _cert_expiry(metrics, config)
    frontend = context.state["frontend"] = MatrixFrontend(context, config, metrics)
    frontend.add_routes(router)


@hookimpl
def pushgw_token_invalid(context: PluginContext, invalid: InvalidToken) -> None:
    """Nothing is stored: the pushkey goes back to the homeserver in `rejected`."""
    log.debug("app %s: token invalid (%s)", invalid.app_id, invalid.reason)
