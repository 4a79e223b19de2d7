"""Shared fixtures, and the suite-wide privacy check.

Every log record of the whole run is captured (at DEBUG for pushgw's own loggers,
third-party clients at the levels production uses). Every device token the
simulators receive, and every secret a test registers with `register_secret`, is
checked against those records by `test_zz_privacy.py`, which runs last.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway import logs
from gateway.core.store import Store
from gateway.testing import apns_sim, fcm_sim
from gateway.testing.apns_sim import generate_apns_auth_key
from gateway.testing.databases import (
    PostgresUnavailable,
    postgres_required,
    temporary_postgres_database,
)

pytest_plugins = ["gateway.testing.pytest_plugin"]

SAMPLE_PLUGIN_DIR = Path(__file__).parent / "sample_plugin"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        # production's formatter, so the privacy check sees what an operator's log holds
        self.setFormatter(logs.RedactingFormatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a broken log call is itself worth seeing
            text = f"{record.name} unformattable {record.msg!r} {record.args!r}"
        self.lines.append(text)


LOG_CAPTURE = _Capture()
SECRETS: set[str] = set()
SIMULATORS: list[object] = []


def _track(cls: type) -> None:
    original = cls.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[misc]
        SIMULATORS.append(self)

    cls.__init__ = init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    root = logging.getLogger()
    root.addHandler(LOG_CAPTURE)
    root.setLevel(logging.DEBUG)
    logs.quiet_third_party()  # as in production: chatty libraries stay at WARNING
    _track(apns_sim.ApnsSimulator)
    _track(fcm_sim.FcmSimulator)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The privacy check must see every other test's logs.
    items.sort(key=lambda item: item.nodeid.split("::")[0].endswith("test_zz_privacy.py"))


@pytest.fixture
def register_secret() -> object:
    """Register a value (token, key) that must never appear in any log line."""
    return SECRETS.add


@asynccontextmanager
async def _postgres() -> AsyncIterator[str]:
    try:
        async with temporary_postgres_database() as url:
            yield url
    except PostgresUnavailable as exc:
        if postgres_required():
            pytest.fail(f"PostgreSQL is required here (PUSHGW_REQUIRE_POSTGRES=1): {exc}")
        pytest.skip(f"no PostgreSQL reachable: {exc}")


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh PostgreSQL database for this test (skips when none is reachable)."""
    async with _postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """The same test on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
        return
    async with _postgres() as url:
        yield url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """A `Store` on `store_url` (SQLite, then PostgreSQL), closed after the test."""
    s = Store(store_url)
    try:
        yield s
    finally:
        await s.close()


def offline_apns_app(directory: Path) -> dict[str, Any]:
    """An APNs app (token auth, a fresh .p8 key in `directory`) for tests that load a
    configuration without sending: it points at Apple's default host."""
    key = generate_apns_auth_key()
    return {
        "type": "apns",
        "keyfile": str(key.write_p8(directory / f"AuthKey_{key.key_id}.p8")),
        "key_id": key.key_id,
        "team_id": key.team_id,
        "topic": "com.example.app",
    }


@contextmanager
def configured_logging(level: str) -> Iterator[io.StringIO]:
    """`logs.configure(level)` (what `pushgw serve` installs) writing to a buffer; the
    suite's logging put back after."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_quiet = {name: logging.getLogger(name).level for name in logs.QUIET_LOGGERS}
    logs.configure(level)
    buffer = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield buffer
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, level_before in saved_quiet.items():
            logging.getLogger(name).setLevel(level_before)


def process_gone(pid: int) -> bool:
    """Exited and reaped: a zombie still takes signal 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def install_plugin_dist(site: Path, name: str) -> None:
    """Make `site` hold the metadata of a distribution `pushgw-NAME` whose `pushgw.plugins`
    entry point NAME is the module `pushgw_NAME`: with `site` on sys.path, the plugin
    manager finds it as it finds an installed plugin."""
    dist_info = site / f"pushgw_{name}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: pushgw-{name}\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[pushgw.plugins]\n{name} = pushgw_{name}\n")


@pytest.fixture
def sample_plugin_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Install tests/sample_plugin as a distribution: a dist-info with its entry point."""
    site = tmp_path / "site"
    install_plugin_dist(site, "sample")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(SAMPLE_PLUGIN_DIR))
    yield "sample"
