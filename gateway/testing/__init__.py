"""Provider simulators standing in for Apple (APNs) and Google (FCM) in tests, demos and benchmarks.

- `ApnsSimulator`: HTTP/2 over TLS, scriptable per token, JWT checks, faults.
- `FcmSimulator`: FCM HTTP v1 + OAuth token endpoint, scriptable per token or project.
- `SimulatorCA`: the throw-away CA both serve TLS with.
- `serve_simulators()`: start both and write a ready state directory (for `pushgw simulate`).
- `GatewayHarness`: a whole gateway on a test server, with `base_config`,
  `apns_app_config` and `fcm_app_config` to point a plugin's apps at the simulators.
- `schema_drift()`: how a plugin's declared tables (`pushgw_tables`) differ from what
  its migrations create; [] when they match.
- `gateway.testing.pytest_plugin`: pytest fixtures.

The harness and schema names are imported on first use (they load the whole gateway),
so that importing this package, as the pytest plugin does, stays as light as the
simulators.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gateway.testing.apns_sim import (
    APNS_PUSH_TYPES,
    APNS_REASON_STATUS,
    ApnsAuthKey,
    ApnsRequest,
    ApnsResponse,
    ApnsSimulator,
    generate_apns_auth_key,
)
from gateway.testing.certs import APNS_HOSTNAMES, FCM_HOSTNAMES, SimulatorCA
from gateway.testing.fcm_sim import FcmRequest, FcmResponse, FcmSimulator, make_service_account
from gateway.testing.runner import SimulatorInfo, serve_simulators

if TYPE_CHECKING:
    from gateway.testing.harness import (
        GatewayHarness,
        apns_app_config,
        base_config,
        fcm_app_config,
    )
    from gateway.testing.schema import schema_drift

_LAZY = {
    "GatewayHarness": "harness",
    "apns_app_config": "harness",
    "base_config": "harness",
    "fcm_app_config": "harness",
    "schema_drift": "schema",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"gateway.testing.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "APNS_HOSTNAMES",
    "APNS_PUSH_TYPES",
    "APNS_REASON_STATUS",
    "FCM_HOSTNAMES",
    "ApnsAuthKey",
    "ApnsRequest",
    "ApnsResponse",
    "ApnsSimulator",
    "FcmRequest",
    "FcmResponse",
    "FcmSimulator",
    "GatewayHarness",
    "SimulatorCA",
    "SimulatorInfo",
    "apns_app_config",
    "base_config",
    "fcm_app_config",
    "generate_apns_auth_key",
    "make_service_account",
    "schema_drift",
    "serve_simulators",
]
