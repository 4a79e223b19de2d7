"""Provider simulators standing in for Apple (APNs) and Google (FCM) in tests, demos and benchmarks.

- `ApnsSimulator`: HTTP/2 over TLS, scriptable per token, JWT checks, faults.
- `FcmSimulator`: FCM HTTP v1 + OAuth token endpoint, scriptable per token or project.
- `SimulatorCA`: the throw-away CA both serve TLS with.
- `serve_simulators()`: start both and write a ready state directory (for `pushgw simulate`).
- `gateway.testing.pytest_plugin`: pytest fixtures.
"""

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
    "SimulatorCA",
    "SimulatorInfo",
    "generate_apns_auth_key",
    "make_service_account",
    "serve_simulators",
]
