"""Shared by the provider-client tests: no secret a test saw may reach the logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def secrets_seen() -> set[str]:
    """Strings that must never show up in log output (tokens, JWTs, OAuth tokens)."""
    return set()


@pytest.fixture(autouse=True)
def no_secrets_in_logs(caplog: pytest.LogCaptureFixture, secrets_seen: set[str]) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    for secret in secrets_seen:
        assert secret not in text


def nested(depth: int) -> dict[str, object]:
    """A JSON object `depth` levels deep, built without recursion."""
    value: dict[str, object] = {}
    for _ in range(depth):
        value = {"x": value}
    return value
