"""IPv6 and dual stack: every address pushgw takes or prints, found by review, each
with a failing test first.

Real sockets on `::1` throughout (the loopback of this machine has it); the simulators,
a real nostr-relay and `pushgw serve` itself listen there. Socket timeouts only stop a
test from hanging when a server never answers.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError
from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from gateway.testing.relay import NostrRelayProcess, relay_available
from gateway.testing.runner import serve_simulators
from tests.conftest import offline_apns_app

PUSHGW = [sys.executable, "-m", "gateway.cli"]
NOTIFY = "/_matrix/push/v1/notify"
GUARD = 60.0  # seconds before a test gives up on a server that never answers (not a measure)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


class Served:
    """A running `pushgw serve`, its stderr collected by a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "Running on" in line:
                self.listening.set()
        self.listening.set()  # ended: the test fails on `proc.poll()`

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> str:
        """SIGTERM, wait; everything it wrote on stderr."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(GUARD)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(GUARD)
        return self.log()


@contextlib.contextmanager
def served(tmp_path: Path, host: str, port: int, metrics_port: int) -> Iterator[Served]:
    app = offline_apns_app(tmp_path)
    config = {
        "server": {"host": host, "port": port, "metrics_port": metrics_port},
        "logging": {"access_log": True},
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {"enabled": ["matrix"], "matrix": {"apps": {"com.example.ios": app}}},
    }
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PUSHGW")}
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    gw = Served(proc)
    try:
        assert gw.listening.wait(GUARD), "pushgw serve did not start"
        assert proc.poll() is None, gw.log()
        yield gw
    finally:
        gw.stop()


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=GUARD) as resp:
        return resp.status, resp.read()


# --- pushgw serve on ::1 and on :: ----------------------------------------------------


def test_serve_on_ipv6_loopback_prints_a_usable_url_and_answers_there(tmp_path: Path) -> None:
    """`server.host: "::1"`: the start-up line is a URL with brackets that a client can
    use as printed; /healthz, /readyz and /metrics answer on ::1, and the access log
    names the client `::1`."""
    port, metrics_port = _free_port("::1"), _free_port("::1")
    with served(tmp_path, "::1", port, metrics_port) as gw:
        (url,) = re.findall(r"Running on (\S+)", gw.log())
        assert url == f"http://[::1]:{port}"
        assert _get(f"{url}/healthz")[0] == 200
        assert _get(f"{url}/readyz")[0] == 200
        status, body = _get(f"http://[::1]:{metrics_port}/metrics")
        assert status == 200 and b"pushgw_" in body
        log = gw.stop()
    assert re.search(r'aiohttp\.access .* ::1 "GET /healthz HTTP/1\.1" 200', log), log
    assert "Traceback" not in log


def test_serve_on_the_ipv6_wildcard_takes_ipv4_clients_too(tmp_path: Path) -> None:
    """`server.host: "::"` is every address: IPv4 clients connect too (the OS allows it
    here: IPV6_V6ONLY is per socket on Linux), on the main port and on the metrics port.
    It was IPv6 only: 127.0.0.1 was refused. The access log names an IPv4 client by its
    IPv4 address, not the mapped `::ffff:127.0.0.1`."""
    port, metrics_port = _free_port("::1"), _free_port("::1")
    with served(tmp_path, "::", port, metrics_port) as gw:
        assert _get(f"http://[::1]:{port}/healthz")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        assert _get(f"http://127.0.0.1:{metrics_port}/metrics")[0] == 200
        assert _get(f"http://[::1]:{metrics_port}/metrics")[0] == 200
        log = gw.stop()
    lines = [line for line in log.splitlines() if "aiohttp.access" in line]
    assert len(lines) == 2, log
    assert " ::1 " in lines[0]
    assert ' 127.0.0.1 "GET /healthz' in lines[1]
    assert "::ffff:" not in log


def test_serve_on_the_ipv6_wildcard_needs_the_ipv4_port_free_too(tmp_path: Path) -> None:
    """Taking IPv4 clients on `::`, the gateway needs the port free on IPv4 as well: one
    line naming `[::]:PORT`, status 2, not a gateway that half listens."""
    port = _free_port("::1")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        path = tmp_path / "pushgw.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "server": {"host": "::", "port": port},
                    "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                    "receipts": {"directory": str(tmp_path / "receipts")},
                    "plugins": {"enabled": []},
                }
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PUSHGW")}
        result = subprocess.run(
            [*PUSHGW, "serve", "--config", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=GUARD,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pushgw: error: cannot listen on [::]:{port}: address already in use\n"
    )


# --- providers on ::1 ----------------------------------------------------------------------


def _matrix_notify(app_id: str, pushkey: str) -> dict[str, Any]:
    return {
        "notification": {
            "event_id": "$e",
            "room_id": "!r:example.org",
            "counts": {"unread": 1},
            "devices": [{"app_id": app_id, "pushkey": pushkey}],
        }
    }


async def test_simulators_on_ipv6_loopback_are_reached_by_their_urls(
    tmp_path: Path, register_secret: Any
) -> None:
    """`pushgw simulate --host ::1` (`serve_simulators`): the URLs it writes are
    `https://[::1]:PORT` and `http://[::1]:PORT/...`, usable as configured, and the APNs
    certificate names `::1`. They were `http://::1:PORT` (a config error: `send_url:
    expected an http:// or https:// URL`) and the TLS handshake to ::1 failed."""
    raw = secrets.token_bytes(32)
    fcm_token = "fcm-" + secrets.token_hex(16)
    register_secret(raw.hex())
    register_secret(fcm_token)
    info = await serve_simulators("::1", 0, 0, tmp_path / "sims", record=True)
    try:
        assert info.apns_url == f"https://[::1]:{info.apns_port}"
        assert info.fcm_url.startswith("http://[::1]:")
        assert info.token_uri == f"{info.fcm_url}/token"
        info.apns.add_jwt_key(*_apns_key(tmp_path, info))
        apps = {
            "ios": {
                "type": "apns",
                "keyfile": str(tmp_path / "k.p8"),
                "key_id": "IPV6KEY001",
                "team_id": "IPV6TEAM01",
                "topic": "com.example.app",
                "host": info.apns_host,
                "port": info.apns_port,
                "ca_file": str(info.ca_path),
                "request_timeout": 5.0,
            },
            "android": {
                "type": "fcm",
                "project_id": info.project_id,
                "service_account_file": str(info.service_account_path),
                "send_url": info.fcm_send_url_template,
                "request_timeout": 5.0,
            },
        }
        config = base_config(tmp_path, {"matrix": {"apps": apps}})
        async with GatewayHarness(config) as gw:
            pushkey = base64.b64encode(raw).decode()
            response = await gw.client.post(NOTIFY, json=_matrix_notify("ios", pushkey))
            assert (response.status, await response.json()) == (200, {"rejected": []})
            response = await gw.client.post(NOTIFY, json=_matrix_notify("android", fcm_token))
            assert (response.status, await response.json()) == (200, {"rejected": []})
        assert [r.token for r in info.apns.requests] == [raw.hex()]
        assert [r.token for r in info.fcm.requests] == [fcm_token]
    finally:
        await info.stop()


def _apns_key(tmp_path: Path, info: Any) -> tuple[str, str, Any]:
    from gateway.testing.apns_sim import generate_apns_auth_key

    key = generate_apns_auth_key("IPV6KEY001", "IPV6TEAM01")
    key.write_p8(tmp_path / "k.p8")
    return key.key_id, key.team_id, key.public_key


async def test_fcm_over_tls_on_ipv6_loopback(tmp_path: Path, register_secret: Any) -> None:
    """FCM (send and OAuth) at `https://[::1]:PORT`, its certificate checked against
    `::1` with the operator's `ca_file`."""
    token = "fcm-" + secrets.token_hex(16)
    register_secret(token)
    async with FcmSimulator(host="::1", tls=True) as fcm:
        assert fcm.url.startswith("https://[::1]:")
        assert fcm.ca_path is not None
        app = fcm_app_config(fcm, tmp_path, ca_file=str(fcm.ca_path))
        config = base_config(tmp_path, {"matrix": {"apps": {"android": app}}})
        async with GatewayHarness(config) as gw:
            response = await gw.client.post(NOTIFY, json=_matrix_notify("android", token))
            assert (response.status, await response.json()) == (200, {"rejected": []})
        assert [r.token for r in fcm.requests] == [token]


async def test_apns_host_written_in_brackets_is_the_ipv6_address(
    tmp_path: Path, register_secret: Any
) -> None:
    """`host: "[::1]"`, as the address is written in every URL: it was taken as a host
    name that never resolves, and every push was retried until it failed `transient`."""
    raw = secrets.token_bytes(32)
    register_secret(raw.hex())
    async with ApnsSimulator(host="::1") as apns:
        app = apns_app_config(apns, tmp_path, host="[::1]")
        config = base_config(tmp_path, {"matrix": {"apps": {"ios": app}}})
        async with GatewayHarness(config) as gw:
            pushkey = base64.b64encode(raw).decode()
            response = await gw.client.post(NOTIFY, json=_matrix_notify("ios", pushkey))
            assert (response.status, await response.json()) == (200, {"rejected": []})
        (request,) = apns.requests
        assert request.token == raw.hex()


def test_apns_host_in_brackets_that_is_no_ipv6_address_is_a_config_error(
    tmp_path: Path,
) -> None:
    from gateway.app import load_gateway

    app = {**offline_apns_app(tmp_path), "host": "[api.push.apple.com]"}
    config = base_config(tmp_path, {"matrix": {"apps": {"ios": app}}})
    with pytest.raises(ConfigError) as error:
        load_gateway(data=config)
    assert str(error.value) == (
        "plugins.matrix.apps.ios: host: brackets only go around an IPv6 address, [::1]"
    )


# --- a name with A and AAAA records whose IPv6 side refuses ----------------------------


async def test_localhost_falls_back_to_ipv4_when_ipv6_refuses(
    tmp_path: Path, register_secret: Any
) -> None:
    """FCM at `http://localhost:PORT` with the simulator on 127.0.0.1 only: aiohttp's
    resolver gives ::1 first, refused, and the client goes on to 127.0.0.1."""
    import aiohttp.resolver

    token = "fcm-" + secrets.token_hex(16)
    register_secret(token)
    async with FcmSimulator(host="127.0.0.1") as fcm:
        resolver = aiohttp.resolver.DefaultResolver()
        try:
            found = await resolver.resolve("localhost", fcm.port, family=socket.AF_UNSPEC)
        finally:
            await resolver.close()
        if found[0]["family"] != socket.AF_INET6:
            pytest.skip("localhost does not resolve to ::1 first here")
        assert not _listening("::1", fcm.port)  # the IPv6 side refuses
        app = fcm_app_config(fcm, tmp_path)
        app["send_url"] = app["send_url"].replace("127.0.0.1", "localhost")
        config = base_config(tmp_path, {"matrix": {"apps": {"android": app}}})
        async with GatewayHarness(config) as gw:
            response = await gw.client.post(NOTIFY, json=_matrix_notify("android", token))
            assert (response.status, await response.json()) == (200, {"rejected": []})
        assert [r.token for r in fcm.requests] == [token]


async def test_apns_name_with_both_families_falls_back_when_ipv6_refuses(
    tmp_path: Path, register_secret: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An APNs host whose name resolves to ::1 then 127.0.0.1 (the system resolver here
    gives `localhost` no AAAA: the name is resolved to both by this test), the simulator
    on 127.0.0.1 only: the connection goes to the second address."""
    real = socket.getaddrinfo

    def both(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "dual.test":
            return [
                *real("::1", port, socket.AF_INET6, socket.SOCK_STREAM),
                *real("127.0.0.1", port, socket.AF_INET, socket.SOCK_STREAM),
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    raw = secrets.token_bytes(32)
    register_secret(raw.hex())
    async with ApnsSimulator(host="127.0.0.1", hostnames=["dual.test"]) as apns:
        assert not _listening("::1", apns.port)
        app = apns_app_config(apns, tmp_path, host="dual.test")
        config = base_config(tmp_path, {"matrix": {"apps": {"ios": app}}})
        async with GatewayHarness(config) as gw:
            pushkey = base64.b64encode(raw).decode()
            response = await gw.client.post(NOTIFY, json=_matrix_notify("ios", pushkey))
            assert (response.status, await response.json()) == (200, {"rejected": []})
        assert [r.token for r in apns.requests] == [raw.hex()]


# --- Marmot relay on ::1 -----------------------------------------------------------------


@pytest.mark.skipif(not relay_available(), reason="the relay extra (nostr-relay) is not installed")
async def test_marmot_listens_to_a_relay_on_ipv6_loopback(
    tmp_path: Path, register_secret: Any
) -> None:
    """`inbox_relays: ["ws://[::1]:PORT"]` with a real nostr-relay listening on ::1 (the
    relay helper had no address but 127.0.0.1): a trigger published there is pushed."""
    from tests.marmot.gw import marmot_gateway
    from tests.marmot.helpers import (
        V_MARMOT,
        apns_device,
        chunk_for,
        content_of,
        publish,
        sdk_wrap,
    )

    relay = NostrRelayProcess(tmp_path / "relay", host="::1")
    assert relay.url == f"ws://[::1]:{relay.port}"
    relay.start()
    try:
        async with marmot_gateway(tmp_path / "gw", [relay.url]) as gw:
            device = apns_device()
            register_secret(device.token)
            wrap = sdk_wrap(gw.key, content_of([chunk_for(gw.key, device)]), [V_MARMOT])
            assert await publish(relay.url, wrap) == ""
            await gw.apns.wait_for_requests(1, GUARD)
            assert [r.token for r in gw.apns.requests] == [device.token]
    finally:
        relay.stop()


# --- PostgreSQL at an IPv6 address ----------------------------------------------------------


async def test_postgresql_url_with_an_ipv6_host(tmp_path: Path) -> None:
    """`postgresql+asyncpg://postgres@[::1]:5432/test`: accepted by the configuration, the
    password masked with the brackets kept, and the database reached."""
    from gateway.app import load_gateway
    from gateway.config.masking import mask_url
    from gateway.core.store import Store

    url = "postgresql+asyncpg://postgres:hunter2@[::1]:5432/test"
    loaded = load_gateway(data=base_config(tmp_path, {}, store={"url": url}))
    assert loaded.settings.store.url == url
    assert mask_url(url) == "postgresql+asyncpg://postgres:***@[::1]:5432/test"
    if not _listening("::1", 5432):
        pytest.skip("PostgreSQL does not listen on ::1 here (listen_addresses is 127.0.0.1)")
    store = Store("postgresql+asyncpg://postgres@[::1]:5432/test")
    try:
        assert await store.ping()
    finally:
        await store.close()
