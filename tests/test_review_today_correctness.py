"""Correctness review of the day's changes: the dispatcher's per-device gate, the APNs
certificate-expiry warning with `serve --workers N`."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest

from gateway.app import load_gateway
from gateway.context import WORKER_ENV
from gateway.core import dispatcher as dispatcher_module
from gateway.core.dispatcher import Dispatcher, Lane
from tests.test_review_apns_auth import _certificate_bundle

# --- the per-device gate: which gate is forgotten first ----------------------------------


def test_a_device_throttled_again_is_not_the_first_gate_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past `DEVICE_GATES_MAX` the oldest gate goes. A device throttled again (its gate
    extended: the busiest device) kept its first place in the dict and was forgotten
    first, its next pushes each meeting the same 429, while older, idle gates stayed."""
    monkeypatch.setattr(dispatcher_module, "DEVICE_GATES_MAX", 3)
    lane = Lane.__new__(Lane)
    lane.device_gates = {}
    far = 1e12  # none expires while the test runs
    for token in ("busy", "idle-1", "idle-2"):
        Dispatcher._close_device_gate(lane, token, far)
    Dispatcher._close_device_gate(lane, "busy", far + 60)  # throttled again, for longer
    Dispatcher._close_device_gate(lane, "new", far)  # one over the bound
    assert set(lane.device_gates) == {"idle-2", "busy", "new"}
    assert lane.device_gates["busy"] == far + 60


# --- an expiring APNs certificate: one warning per start, not one per worker ---------------


def _expiring_certificate(path: Path, days: int) -> None:
    """A push certificate and its key in one PEM file, expiring `days` from now."""
    _certificate_bundle(path, valid_for=datetime.timedelta(days=days))


@pytest.mark.parametrize(("worker", "lines"), [(None, 1), ("0", 0), ("3", 0)])
def test_an_expiring_certificate_is_warned_of_by_the_main_process_only(
    sample_plugin_installed: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    worker: str | None,
    lines: int,
) -> None:
    """`serve --workers 4` loads the config in its main process and again in each worker:
    the same "expires in 5 day(s)" line came five times at every start."""
    _expiring_certificate(tmp_path / "cert.pem", days=5)
    if worker is None:
        monkeypatch.delenv(WORKER_ENV, raising=False)
    else:
        monkeypatch.setenv(WORKER_ENV, worker)
    caplog.set_level(logging.WARNING)
    apps = {"ios": {"type": "apns", "certfile": str(tmp_path / "cert.pem")}}
    load_gateway(data={"plugins": {"enabled": ["sample"], "sample": {"apps": apps}}})
    said = [r for r in caplog.records if "APNs certificate" in r.getMessage()]
    assert len(said) == lines


def test_a_matrix_apps_expiring_certificate_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Matrix plugin (Sygnal metrics on, the default) said it again in its own words,
    once more in every worker, after the core's line."""
    from gateway.app import create_app

    _expiring_certificate(tmp_path / "cert.pem", days=5)
    monkeypatch.delenv(WORKER_ENV, raising=False)
    caplog.set_level(logging.WARNING)
    app = {"type": "apns", "certfile": str(tmp_path / "cert.pem"), "topic": "com.ex"}
    gateway = load_gateway(
        data={"plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.ex": app}}}}
    )
    create_app(gateway)  # the plugin's routes, where it exports the certificate's expiry
    said = [r.getMessage() for r in caplog.records if "certificate" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("app matrix/com.ex: its APNs certificate (certfile) expires on")
