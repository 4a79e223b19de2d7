"""The public plugin API: everything a pushgw plugin may use, and nothing else.

Built-in plugins import only from here; a third-party plugin can do everything a
built-in one does with the same names. See docs/plugins.md.
"""

from __future__ import annotations

import pluggy

from gateway.app import BodyTimeout
from gateway.config import (
    ApnsAppConfig,
    AppConfig,
    ConfigModel,
    ExistingFile,
    FcmAppConfig,
    HomePath,
    TrustStore,
    expand_home,
    yaml_document,
)
from gateway.context import CommandContext, PluginContext, Service
from gateway.core.apns import payload_problem as apns_payload_problem
from gateway.core.classify import CONFIG_REASONS
from gateway.core.dispatcher import Dispatcher
from gateway.core.fcm import data_size_bound as fcm_data_size_bound
from gateway.core.fcm import message_problem as fcm_message_problem
from gateway.core.metrics import Children, Metrics
from gateway.core.push import (
    GATEWAY_REASONS,
    ApnsOptions,
    InvalidToken,
    Outcome,
    ProviderKind,
    Push,
    PushPolicy,
    Reason,
    Receipt,
)
from gateway.core.store import Store
from gateway.hookspecs import PROJECT
from gateway.logs import RepeatedLines

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a function as a pushgw hook implementation (`@hookimpl`)."""

__all__ = [
    "CONFIG_REASONS",
    "GATEWAY_REASONS",
    "ApnsAppConfig",
    "ApnsOptions",
    "AppConfig",
    "BodyTimeout",
    "Children",
    "CommandContext",
    "ConfigModel",
    "Dispatcher",
    "ExistingFile",
    "FcmAppConfig",
    "HomePath",
    "InvalidToken",
    "Metrics",
    "Outcome",
    "PluginContext",
    "ProviderKind",
    "Push",
    "PushPolicy",
    "Reason",
    "Receipt",
    "RepeatedLines",
    "Service",
    "Store",
    "TrustStore",
    "apns_payload_problem",
    "expand_home",
    "fcm_data_size_bound",
    "fcm_message_problem",
    "hookimpl",
    "yaml_document",
]
