"""Pytest fixtures for plugin authors: `pytest_plugins = ["gateway.testing.pytest_plugin"]`.

Fixtures (function scoped, started on 127.0.0.1 with a free port, stopped after):

- `apns_simulator`: an `ApnsSimulator` (no JWT check; `add_jwt_key` turns it on).
- `apns_auth_key`: a fresh `ApnsAuthKey` (not registered anywhere).
- `fcm_simulator`: an `FcmSimulator` over plain HTTP.
- `fcm_service_account`: a service-account dict registered with `fcm_simulator`
  (its RSA key, `fcm_service_account_key`, is shared by the session).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import rsa

from gateway.testing.apns_sim import ApnsAuthKey, ApnsSimulator, generate_apns_auth_key
from gateway.testing.fcm_sim import FcmSimulator, make_service_account


@pytest_asyncio.fixture
async def apns_simulator() -> AsyncIterator[ApnsSimulator]:
    """A running APNs simulator."""
    async with ApnsSimulator() as sim:
        yield sim


@pytest.fixture
def apns_auth_key() -> ApnsAuthKey:
    """A fresh APNs token-auth key."""
    return generate_apns_auth_key()


@pytest_asyncio.fixture
async def fcm_simulator() -> AsyncIterator[FcmSimulator]:
    """A running FCM simulator (plain HTTP)."""
    async with FcmSimulator() as sim:
        yield sim


@pytest.fixture(scope="session")
def fcm_service_account_key() -> rsa.RSAPrivateKey:
    """One RSA key per test session for `fcm_service_account` (generation is slow)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest_asyncio.fixture
async def fcm_service_account(
    fcm_simulator: FcmSimulator, fcm_service_account_key: rsa.RSAPrivateKey
) -> dict[str, str]:
    """A service account for project `pushgw-test`, registered with `fcm_simulator`."""
    info = make_service_account(
        "pushgw-test", fcm_simulator.token_uri, private_key=fcm_service_account_key
    )
    fcm_simulator.add_service_account(info)
    return info
