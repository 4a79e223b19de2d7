"""An operator replacing Sygnal with pushgw: the deployment around Sygnal keeps working.

Found by review from that seat, each finding with a test that fails without its fix:

- Sygnal is pointed at its file by `$SYGNAL_CONF` (its README and container
  instructions); `pushgw serve` ignored it and ran on the built-in defaults, with no
  Matrix app, so every probe of `/health` and every notify got 404.
- `metrics.prometheus.address` was ignored: metrics were served on the HTTP address,
  unreachable for a scraper on a private interface, or public when Sygnal kept them on
  loopback. It is now `server.metrics_host`.
- docs/matrix.md had no Sygnal-to-native mapping: the table is checked against the
  translation here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.testing.apns_sim import ApnsSimulator, generate_apns_auth_key
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from plugins.matrix.sygnal_config import load_sygnal_config, translate_sygnal_config
from tests.serve_process import finish, free_port, read_until

ROOT = Path(__file__).resolve().parents[1]
NOTIFY = "/_matrix/push/v1/notify"
# 127.0.0.0/8 is loopback on Linux: a second local address to tell the two apart.
OTHER_LOOPBACK = "127.0.0.2"


def _refused(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith("PUSHGW") and k != "SYGNAL_CONF"
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _sygnal_yaml(
    tmp_path: Path,
    apns: ApnsSimulator,
    *,
    port: int = 5000,
    prometheus: dict[str, Any] | None = None,
) -> Path:
    """A sygnal.yaml as an operator has it, plus where the simulator and the scratch
    store are (pushgw keys, which Sygnal would ignore with a warning)."""
    key = generate_apns_auth_key()
    apns.add_jwt_key(key.key_id, key.team_id, key.public_key)
    config: dict[str, Any] = {
        "http": {"bind_addresses": ["127.0.0.1"], "port": port},
        "metrics": {"prometheus": prometheus or {"enabled": False}},
        "apps": {
            "com.example.*": {
                "type": "apns",
                "keyfile": str(key.write_p8(tmp_path / "AuthKey.p8")),
                "key_id": key.key_id,
                "team_id": key.team_id,
                "topic": "com.example.app",
                "endpoint": apns.url,
                "ca_file": str(apns.ca_path),
            }
        },
        "pushgw": {
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
            "receipts": {"directory": str(tmp_path / "receipts")},
            "server": {"shutdown_timeout": 5.0},
        },
    }
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def _cli(*args: str, env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _printed_config(stdout: str) -> dict[str, Any]:
    return dict(json.loads(stdout[: stdout.rindex("}") + 1]))


@pytest.fixture
async def apns() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as sim:
        yield sim


# --- $SYGNAL_CONF ------------------------------------------------------------------------


async def test_check_config_reads_sygnal_conf(tmp_path: Path, apns: ApnsSimulator) -> None:
    path = _sygnal_yaml(tmp_path, apns)
    status, out, err = await _cli("check-config", env=_env(SYGNAL_CONF=str(path)), cwd=tmp_path)
    assert status == 0, err
    assert _printed_config(out)["apps"] == ["matrix/com.example.*"]
    assert f"using the Sygnal config $SYGNAL_CONF: {path}" in err


async def test_sygnal_conf_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sygnal.yaml"
    path.write_text(yaml.safe_dump({"apps": {"web": {"type": "webpush"}}}))
    status, _, err = await _cli("check-config", env=_env(SYGNAL_CONF=str(path)), cwd=tmp_path)
    assert status == 2
    assert str(path) in err and "apps.web.type" in err


async def test_an_explicit_config_wins_over_sygnal_conf(
    tmp_path: Path, apns: ApnsSimulator
) -> None:
    sygnal = _sygnal_yaml(tmp_path, apns)
    native = tmp_path / "pushgw.yaml"
    app = apns_app_config(apns, tmp_path, topic="org.example.native")
    native.write_text(yaml.safe_dump(base_config(tmp_path, {"matrix": {"apps": {"native": app}}})))
    for args, env in (
        (("check-config", "--config", str(native)), _env(SYGNAL_CONF=str(sygnal))),
        (("check-config",), _env(SYGNAL_CONF=str(sygnal), PUSHGW_CONFIG=str(native))),
    ):
        status, out, err = await _cli(*args, env=env, cwd=tmp_path)
        assert status == 0, err
        assert _printed_config(out)["apps"] == ["matrix/native"]
        assert "SYGNAL_CONF" not in err


@contextlib.asynccontextmanager
async def _serving(config_path: Path, env: dict[str, str]) -> AsyncIterator[list[str]]:
    """`pushgw serve` (no arguments: the container's command), until it runs; then
    SIGTERM and a clean exit."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        cwd=config_path.parent,
        env=env,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        await read_until(proc, seen, r"Running on")
        yield seen
        proc.send_signal(signal.SIGTERM)
        assert await finish(proc, seen) == 0, "".join(seen)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def test_serve_from_sygnal_conf_with_metrics_on_sygnals_address(
    tmp_path: Path, apns: ApnsSimulator
) -> None:
    """The container of Sygnal's README (`-e SYGNAL_CONF=...`) with the image's command
    swapped for `pushgw serve`: the load balancer's /health, Synapse's notify, and
    Prometheus scraping `metrics.prometheus.address`, not the HTTP address."""
    port = free_port()
    metrics_port = free_port(OTHER_LOOPBACK)
    path = _sygnal_yaml(
        tmp_path,
        apns,
        port=port,
        prometheus={"enabled": True, "address": OTHER_LOOPBACK, "port": metrics_port},
    )
    pushkey = base64.b64encode(secrets.token_bytes(32)).decode()
    body = {
        "notification": {
            "event_id": "$e1",
            "room_id": "!r:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": "com.example.ios", "pushkey": pushkey}],
        }
    }
    async with _serving(path, _env(SYGNAL_CONF=str(path))) as seen:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as health:
                assert health.status == 200 and await health.read() == b""
            async with http.post(f"{base}{NOTIFY}", json=body) as notified:
                assert notified.status == 200, "".join(seen)
                assert await notified.json() == {"rejected": []}
            metrics_url = f"http://{OTHER_LOOPBACK}:{metrics_port}/metrics"
            async with http.get(metrics_url) as metrics:
                assert metrics.status == 200
                text = await metrics.text()
        assert re.search(r"^sygnal_notifications_received_total 1\.0$", text, re.M), text
        assert _refused("127.0.0.1", metrics_port)
    assert apns.requests[0].token == base64.b64decode(pushkey).hex()  # Sygnal's conversion
    assert apns.requests[0].headers["apns-topic"] == "com.example.app"


# --- metrics.prometheus.address -------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (OTHER_LOOPBACK, OTHER_LOOPBACK),
        ("0.0.0.0", "0.0.0.0"),
        ("", "0.0.0.0"),  # Sygnal: `addr=prom_addr or ""`, every address
        ("127.0.0.1", None),  # the HTTP address: nothing to say
    ],
)
def test_prometheus_address_becomes_metrics_host(
    tmp_path: Path, apns: ApnsSimulator, address: str, expected: str | None
) -> None:
    data = yaml.safe_load(_sygnal_yaml(tmp_path, apns).read_text())
    data["metrics"]["prometheus"] = {"enabled": True, "address": address, "port": 8000}
    config, warnings = translate_sygnal_config(data)
    assert config["server"].get("metrics_host") == expected
    assert config["server"]["metrics_port"] == 8000
    assert not [w for w in warnings if "prometheus" in w], warnings


async def test_metrics_host_is_where_the_metrics_port_listens(
    tmp_path: Path, apns: ApnsSimulator
) -> None:
    metrics_port = free_port(OTHER_LOOPBACK)
    app = apns_app_config(apns, tmp_path)
    config = base_config(
        tmp_path,
        {"matrix": {"apps": {"com.example.ios": app}}},
        server={"metrics_port": metrics_port, "metrics_host": OTHER_LOOPBACK},
    )
    async with GatewayHarness(config) as gw:
        assert (await gw.client.get("/metrics")).status == 404
        url = f"http://{OTHER_LOOPBACK}:{metrics_port}/metrics"
        async with gw.client.session.get(url) as resp:
            assert resp.status == 200
            assert "sygnal_notifications_received" in await resp.text()
        assert _refused("127.0.0.1", metrics_port)


# --- docs/matrix.md: the Sygnal-to-native table -----------------------------------------------


def test_documented_mapping_matches_the_translation(tmp_path: Path, apns: ApnsSimulator) -> None:
    """Each row of docs/matrix.md's table that names one Sygnal key and one pushgw key:
    a distinct value given to the Sygnal key lands at the documented pushgw key."""
    text = (ROOT / "docs" / "matrix.md").read_text("utf-8")
    rows = re.findall(r"^\| `([a-z_.]+)`[^|]*\| `([a-z_.]+)`", text, re.M)
    mapping = dict(rows)
    samples: dict[str, Any] = {
        "http.port": 5123,
        "http.bind_addresses": ["127.0.0.9"],
        "proxy": "http://proxy.example:3128",
        "metrics.prometheus.port": 8123,
        "metrics.prometheus.address": "127.0.0.10",
    }
    assert set(samples) <= set(mapping), mapping
    sygnal = yaml.safe_load(_sygnal_yaml(tmp_path, apns).read_text())
    sygnal["metrics"]["prometheus"] = {"enabled": True}
    for key, value in samples.items():
        *parents, last = key.split(".")
        node = sygnal
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = tmp_path / "mapped.yaml"
    path.write_text(yaml.safe_dump(sygnal))
    native = load_sygnal_config(path)
    for key, value in samples.items():
        node = native
        for part in mapping[key].split("."):
            node = node[part]
        expected = value[0] if key == "http.bind_addresses" else value
        assert node == expected, (key, mapping[key])
    apps = native
    for part in mapping["apps"].split("."):
        apps = apps[part]
    assert list(apps) == ["com.example.*"]
