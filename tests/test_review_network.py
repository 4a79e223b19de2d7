"""A hostile or broken network client against a real `pushgw serve`: found by review,
each with a failing test first.

Real sockets throughout. No timing asserts: a slow client is shown closed by the
server's EOF (with a short configured timeout), and a legitimate request is shown
served while the slow ones are open. Socket timeouts here only stop a test from
hanging when the server never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import gateway.app
from gateway.core.store import Store
from gateway.testing.harness import GatewayHarness, base_config
from tests.conftest import offline_apns_app

PUSHGW = [sys.executable, "-m", "gateway.cli"]
MATRIX = "/_matrix/push/v1/notify"
ZULIP = "/api/v1/remotes/server/register"
GUARD = 30.0  # seconds before a test gives up on an answer that never comes (not a measure)
TIMEOUT = 1.0  # server.keepalive_timeout and server.body_timeout of the gateway under test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A running `pushgw serve`, its stderr collected by a thread."""

    def __init__(self, proc: subprocess.Popen[str], port: int, metrics_port: int) -> None:
        self.proc = proc
        self.port = port
        self.metrics_port = metrics_port
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

    def connect(self, port: int | None = None) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port or self.port))
        sock.settimeout(GUARD)
        return sock

    def request(self, data: bytes, port: int | None = None) -> bytes:
        """Send `data` on a new connection; everything the server sends until it closes."""
        with self.connect(port) as sock:
            sock.sendall(data)
            return read_to_eof(sock)

    def log(self) -> str:
        return "".join(self.lines)


def read_to_eof(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (its EOF is the signal)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(
            f"the server kept the connection open (received {received[:80]!r})"
        ) from None
    except ConnectionResetError:
        pass  # closed with unread data in its buffer: closed all the same
    return received


def get(path: str, *, close: bool = True) -> bytes:
    connection = "Connection: close\r\n" if close else ""
    return f"GET {path} HTTP/1.1\r\nHost: gw\r\n{connection}\r\n".encode()


def status_of(response: bytes) -> int:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", response)
    assert match, response[:200]
    return int(match.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One gateway (Zulip and Matrix) with a 1 s keep-alive and body timeout."""
    tmp = tmp_path_factory.mktemp("network")
    app = offline_apns_app(tmp)
    port, metrics_port = _free_port(), _free_port()
    config = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "metrics_port": metrics_port,
            "keepalive_timeout": TIMEOUT,
            "body_timeout": TIMEOUT,
            "shutdown_timeout": 1,
        },
        "store": {"url": f"sqlite+aiosqlite:///{tmp / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp / "receipts")},
        "plugins": {
            "enabled": ["zulip", "matrix"],
            "zulip": {"apps": {"ios": app}},
            "matrix": {"apps": {"com.example.ios": app}},
        },
    }
    path = tmp / "pushgw.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PUSHGW")}
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(path)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    gw = Served(proc, port, metrics_port)
    try:
        assert gw.listening.wait(60) and proc.poll() is None, gw.log()
        yield gw
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _partial(path: str, content_type: str) -> bytes:
    """Headers announcing 100 bytes of body, and 10 of them."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n"
        "Content-Length: 100\r\n\r\n0123456789"
    ).encode()


BODIES = {
    "matrix": (MATRIX, "application/json"),
    "zulip-form": (ZULIP, "application/x-www-form-urlencoded"),
}


# --- slowloris: headers, body, idle keep-alive -------------------------------------------


def test_slow_headers_are_closed_after_keepalive_timeout_and_others_are_served(
    served: Served,
) -> None:
    """Connections dribbling a request's headers are closed once `server.keepalive_timeout`
    has passed since they connected, without an answer, and a legitimate client is served
    while they are open."""
    slow = [served.connect() for _ in range(20)]
    for sock in slow:
        sock.sendall(b"POST " + MATRIX.encode() + b" HTTP/1.1\r\nHo")
    for sock in slow:
        sock.sendall(b"s")  # one more byte: the clock is not reset by a trickle
    assert status_of(served.request(get("/healthz"))) == 200
    for sock in slow:
        with sock:
            assert read_to_eof(sock) == b""


@pytest.mark.parametrize("where", ["main", "metrics"])
def test_an_idle_keepalive_connection_is_closed(served: Served, where: str) -> None:
    port, path = (served.port, "/healthz") if where == "main" else (served.metrics_port, "/metrics")
    with served.connect(port) as sock:
        sock.sendall(get(path, close=False))
        received = read_to_eof(sock)
    assert status_of(received) == 200 and received.count(b"HTTP/1.1 ") == 1


def test_slow_headers_on_the_metrics_port_are_closed(served: Served) -> None:
    """The metrics site (`server.metrics_port`) kept aiohttp's own default: an hour."""
    slow = [served.connect(served.metrics_port) for _ in range(5)]
    for sock in slow:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHo")
    assert status_of(served.request(get("/metrics"), served.metrics_port)) == 200
    for sock in slow:
        with sock:
            assert read_to_eof(sock) == b""


@pytest.mark.parametrize("kind", BODIES)
def test_a_body_slower_than_body_timeout_gets_408_and_is_closed(served: Served, kind: str) -> None:
    """A client that sends its headers and then a body that never ends (or comes too
    slowly) is answered 408 and closed after `server.body_timeout`; it held the
    connection (and its handler) for ever. Legitimate clients are served meanwhile."""
    path, content_type = BODIES[kind]
    logged = len(served.lines)
    slow = [served.connect() for _ in range(10)]
    for sock in slow:
        sock.sendall(_partial(path, content_type))
    chunked = served.connect()
    chunked.sendall(
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n".encode()
    )
    slow.append(chunked)
    assert status_of(served.request(get("/healthz"))) == 200
    for sock in slow:
        with sock:
            received = read_to_eof(sock)
        assert status_of(received) == 408, received
        assert received.count(b"HTTP/1.1 ") == 1
    log = "".join(served.lines[logged:])
    assert "ERROR" not in log and "Traceback" not in log, log


# --- a client that leaves in the middle of its body --------------------------------------


def _counted(served: Served, route: str) -> dict[str, float]:
    """pushgw_http_requests_total of `route` by status, from /metrics."""
    text = served.request(get("/metrics"), served.metrics_port).decode()
    counts: dict[str, float] = {}
    for match in re.finditer(
        r'pushgw_http_requests_total\{method="POST",route="([^"]+)",status="(\d+)"\} (\S+)', text
    ):
        if match.group(1) == route:
            counts[match.group(2)] = float(match.group(3))
    return counts


@pytest.mark.parametrize("kind", BODIES)
def test_a_client_leaving_mid_body_is_no_server_error(served: Served, kind: str) -> None:
    """A client that closes its connection before the end of its body made an ERROR (a
    traceback for Matrix) and a 500 in the metrics: a hostile client could fill the
    logs and trip 5xx alerts at will. It is a client's doing: no error, no 500."""
    path, content_type = BODIES[kind]
    before = sum(_counted(served, path).values())
    logged = len(served.lines)
    for _ in range(3):
        with served.connect() as sock:
            sock.sendall(_partial(path, content_type))
    deadline = time.monotonic() + GUARD
    while sum(_counted(served, path).values()) < before + 3:  # each counted once handled
        assert time.monotonic() < deadline, "the requests were never counted"
    counts = _counted(served, path)
    assert "500" not in counts, counts
    log = "".join(served.lines[logged:])
    assert "ERROR" not in log and "Traceback" not in log, log


# --- /readyz under a flood -----------------------------------------------------------------


async def test_a_flood_of_readiness_probes_pings_the_database_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each /readyz took a database connection for its ping: a flood of probes on the
    public port held the pool the pushes need. Concurrent probes share one ping."""
    probes = 40
    pinged = 0
    release = asyncio.Event()
    all_in = asyncio.Event()
    entered = 0
    original_ping = Store.ping
    original_readyz = gateway.app._readyz

    async def ping(self: Store, timeout: float = 5.0) -> bool:
        nonlocal pinged
        pinged += 1
        await release.wait()
        return await original_ping(self, timeout)

    async def readyz(request: Any) -> Any:
        nonlocal entered
        entered += 1
        if entered == probes:
            all_in.set()
        return await original_readyz(request)

    monkeypatch.setattr(Store, "ping", ping)
    monkeypatch.setattr(gateway.app, "_readyz", readyz)
    async with GatewayHarness(base_config(tmp_path, {})) as gw:
        host, port = gw.client.server.host, gw.client.server.port

        async def probe() -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(get("/readyz"))
            await writer.drain()
            data = await reader.read()  # to EOF (Connection: close)
            writer.close()
            return data

        tasks = [asyncio.create_task(probe()) for _ in range(probes)]
        await asyncio.wait_for(all_in.wait(), GUARD)
        release.set()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), GUARD)
    assert [status_of(a) for a in answers] == [200] * probes
    assert pinged == 1
