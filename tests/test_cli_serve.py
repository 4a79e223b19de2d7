"""`pushgw serve` refuses what cannot work in one line, before anything starts."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gateway import serve
from gateway.context import WORKER_ENV

PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PUSHGW, *args], capture_output=True, text=True, timeout=120)


def write_config(tmp_path: Path, **server: object) -> Path:
    path = tmp_path / "pushgw.yaml"
    data = {
        "server": server,
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_before_anything_starts(
    tmp_path: Path, busy_port: int, workers: str
) -> None:
    path = write_config(tmp_path)
    result = run("serve", "--config", str(path), "--port", str(busy_port), "--workers", workers)
    assert result.returncode == 2
    assert result.stderr == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"
    )
    assert not (tmp_path / "db.sqlite").exists()  # bound before the migrations


def test_the_metrics_port_in_use_is_one_line(tmp_path: Path, busy_port: int) -> None:
    path = write_config(tmp_path, metrics_port=busy_port)
    result = run("serve", "--config", str(path), "--port", "0")
    assert result.returncode == 2
    assert result.stderr == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port} (/metrics): "
        "address already in use\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "argument --port: must be 0 to 65535 (0: any free port), not 70000"),
        (["--port", "-1"], "argument --port: must be 0 to 65535 (0: any free port), not -1"),
        (["--port", "http"], "argument --port: not a port number: 'http'"),
        (["--workers", "0"], "argument --workers: must be at least 1, not 0"),
        (["--workers", "-1"], "argument --workers: must be at least 1, not -1"),
    ],
)
def test_bad_port_and_workers_are_usage_errors(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = run("serve", "--config", str(write_config(tmp_path)), *args)
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith(f"pushgw serve: error: {message}")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "db.sqlite").exists()


def test_any_free_port_needs_one_worker(tmp_path: Path) -> None:
    result = run("serve", "--config", str(write_config(tmp_path)), "--port", "0", "--workers", "2")
    assert result.returncode == 2
    assert result.stderr == (
        "pushgw: error: port 0 (any free port) would give each worker its own port: give a port\n"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_unreachable_database_is_one_line(tmp_path: Path, workers: str) -> None:
    listen_on = free_port()
    with socket.socket() as refusing:  # bound, never listening: connections are refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        path = tmp_path / "pushgw.yaml"
        url = f"postgresql+asyncpg://u:S3cretPw@127.0.0.1:{port}/x"
        path.write_text(yaml.safe_dump({"store": {"url": url}}))
        result = run("serve", "--config", str(path), "--port", str(listen_on), "--workers", workers)
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"pushgw: error: database postgresql+asyncpg://u:***@127.0.0.1:{port}/x: "
        "ConnectionRefusedError: "
    )
    assert result.stderr.count("\n") == 1 and "S3cretPw" not in result.stderr


def test_port_0_serves_on_a_free_port(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*PUSHGW, "serve", "--config", str(write_config(tmp_path)), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the server's own announcement is the signal
            if match := re.search(r"Running on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            raise AssertionError("pushgw serve ended without listening")
        port = int(match.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            assert response.status == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_a_worker_that_cannot_listen_says_so_in_one_line(
    busy_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent checked the port; another process took it before this worker bound it.
    monkeypatch.setenv(WORKER_ENV, "1")
    with pytest.raises(SystemExit) as exit:
        serve._run_worker(None, {}, "127.0.0.1", busy_port, 1)
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        f"pushgw: error: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"
    )
