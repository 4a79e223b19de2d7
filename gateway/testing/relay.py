"""A real Nostr relay on loopback, for tests, demos and `pushgw serve --with-simulators`.

It runs PyPI `nostr-relay` (`nostr-relay -c FILE serve --use-uvicorn`, the `relay`
extra) with SQLite storage in a directory of its own and `max_event_size` raised: its
default would refuse any real Marmot trigger (the `max_event_size` argument sets another limit,
e.g. to store an event larger than a client accepts). It is not a simulator: relays are part
of the real system, and the gateway speaks to this one exactly as to any other.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from websockets.sync.client import connect as sync_connect


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def relay_available() -> bool:
    """Whether the `nostr-relay` command is installed next to this Python."""
    return (Path(sys.executable).parent / "nostr-relay").exists()


class NostrRelayProcess:
    """PyPI nostr-relay in a subprocess on loopback (`host`: 127.0.0.1, or `::1` for
    IPv6); the storage survives :meth:`restart`."""

    def __init__(
        self,
        directory: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        auth: bool = False,
        max_event_size: int = 400_000,
    ) -> None:
        self.directory = directory = directory.resolve()  # the relay runs in its directory
        directory.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port(host)
        self.conf = directory / "nostr-relay.yaml"
        self.db = directory / "relay.sqlite3"
        self.log = directory / "relay.log"
        self.proc: subprocess.Popen[bytes] | None = None
        lines = [
            "DEBUG: false",
            f"max_event_size: {max_event_size}",
            "oldest_event: 31536000",
            "storage:",
            f"  sqlalchemy.url: sqlite+aiosqlite:///{self.db}",
            "  validators:",
            "    - nostr_relay.validators.is_not_too_large",
            "    - nostr_relay.validators.is_signed",
            "    - nostr_relay.validators.is_recent",
            "gunicorn:",
            # `--use-uvicorn` takes only the port from `bind`, the address from `host`
            f"  bind: {json.dumps(self.netloc)}",  # quoted: `[::1]` would be a YAML list
            f"  host: {json.dumps(host)}",
            "  workers: 1",
            "  loglevel: warning",
            "authentication:",
            f"  enabled: {'true' if auth else 'false'}",
            f"  relay_urls: [{json.dumps(self.url)}]",
            "logging:",
            "  version: 1",
            "  root: {level: WARNING}",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    @property
    def netloc(self) -> str:
        """`host:port` as a URL writes it (`[::1]:6969`)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://{self.netloc}"

    def start(self, timeout: float = 30.0) -> None:
        exe = Path(sys.executable).parent / "nostr-relay"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(exe), "-c", str(self.conf), "serve", "--use-uvicorn"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nostr-relay exited: {self.log.read_text()[-2000:]}")
            try:
                with sync_connect(self.url, open_timeout=1.0) as ws:
                    ws.send(json.dumps(["REQ", "probe", {"kinds": [0], "limit": 0}]))
                    ws.recv(timeout=2.0)
                return
            except (OSError, TimeoutError, Exception):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self) -> None:
        self.stop()
        self.start()
