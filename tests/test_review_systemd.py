"""pushgw run as a systemd service (`Type=notify`, journald): found by review from the
packager's seat, each finding with a failing test first.

Readiness is tested as systemd sees it: the test binds the AF_UNIX datagram socket that
`$NOTIFY_SOCKET` names, runs a real `pushgw serve`, and reads the datagrams with the
sender's credentials (SO_PASSCRED), as systemd's `NotifyAccess=main` checks them.
No sleeps stand in for synchronisation: the tests block on the datagrams themselves.
"""

from __future__ import annotations

import configparser
import contextlib
import logging
import multiprocessing
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway import logs
from gateway.systemd import Notifier
from tests.serve_process import free_port

ROOT = Path(__file__).resolve().parents[1]
WAIT = 120.0  # seconds a test waits for a datagram or an exit before failing


def _config(tmp_path: Path, port: int, workers: int) -> Path:
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {
                    "host": "127.0.0.1",
                    "port": port,
                    "workers": workers,
                    "shutdown_timeout": 5.0,
                },
                "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
                "receipts": {"directory": str(tmp_path / "receipts"), "hmac_key": "k"},
            }
        )
    )
    return config


@contextlib.contextmanager
def _notify_socket(address: str) -> Iterator[socket.socket]:
    """The socket systemd would bind for the service, receiving senders' credentials."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind("\0" + address[1:] if address.startswith("@") else address)
        sock.settimeout(WAIT)
        yield sock
    finally:
        sock.close()


def _receive(sock: socket.socket) -> tuple[dict[str, str], int]:
    """The next datagram's fields, and the pid of the process that sent it."""
    data, ancillary, _flags, _address = sock.recvmsg(4096, socket.CMSG_SPACE(12))
    pid = -1
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("iII", payload[:12])[0]
    fields = dict(line.split("=", 1) for line in data.decode().splitlines())
    return fields, pid


def _spawn(config: Path, stderr: Path, **env: str) -> subprocess.Popen[bytes]:
    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("PUSHGW")}
    environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    environ.update(PYTHONPATH=str(ROOT), **env)
    with stderr.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            cwd=ROOT,
            env=environ,
            stderr=out,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=WAIT) as response:
        return int(response.status)


def _environ(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


def test_serve_tells_systemd_it_is_ready_once_it_serves_and_when_it_stops(
    tmp_path: Path,
) -> None:
    """`Type=notify`: before the fix `pushgw serve` sent nothing, so systemd waited for
    READY=1 until `TimeoutStartSec` and then killed a gateway that served all along."""
    port = free_port()
    stderr = tmp_path / "stderr"
    address = str(tmp_path / "notify")
    with _notify_socket(address) as sock:
        proc = _spawn(_config(tmp_path, port, workers=1), stderr, NOTIFY_SOCKET=address)
        try:
            fields, pid = _receive(sock)
            # Ready means serving: the `Running on` line was written before it, and the
            # gateway answers at once.
            assert "Running on" in stderr.read_text()
            assert _healthz(port) == 200
            assert fields.get("READY") == "1", fields
            assert pid == proc.pid
            assert fields["MAINPID"] == str(proc.pid)
            assert fields["STATUS"] == f"serving on 127.0.0.1:{port}"

            proc.send_signal(signal.SIGTERM)
            fields, pid = _receive(sock)
            assert fields["STOPPING"] == "1", fields
            assert pid == proc.pid
            assert "SIGTERM" in fields["STATUS"]
            assert proc.wait(WAIT) == 0
        finally:
            _stop(proc)


def test_with_workers_only_the_parent_notifies_once_every_worker_serves(
    tmp_path: Path,
) -> None:
    """`--workers N`: READY=1 comes once, from the main process (systemd ignores any
    other's under `NotifyAccess=main`), after every worker's `Running on`; the workers
    do not inherit `$NOTIFY_SOCKET`. Also an abstract-namespace address (`@name`), as
    systemd gives in containers."""
    port = free_port()
    stderr = tmp_path / "stderr"
    address = f"@pushgw-review-systemd-{uuid.uuid4().hex}"
    with _notify_socket(address) as sock:
        proc = _spawn(_config(tmp_path, port, workers=2), stderr, NOTIFY_SOCKET=address)
        try:
            fields, pid = _receive(sock)
            assert fields.get("READY") == "1", fields
            assert pid == proc.pid
            assert fields["STATUS"] == f"serving on 127.0.0.1:{port} (2 workers)"
            running = re.findall(r"pushgw (\d+) \(.*Running on", stderr.read_text())
            assert len(running) == 2, stderr.read_text()
            for worker in map(int, running):
                assert worker != proc.pid
                assert not any(v.startswith("NOTIFY_SOCKET=") for v in _environ(worker))
            assert _healthz(port) == 200

            proc.send_signal(signal.SIGTERM)
            fields, pid = _receive(sock)  # the next datagram: no second READY=1 before it
            assert "READY" not in fields
            assert fields["STOPPING"] == "1", fields
            assert pid == proc.pid
            assert proc.wait(WAIT) == 0
        finally:
            _stop(proc)


def _serve_until_stopped(ready: Any) -> None:
    ready.send_bytes(b"0")  # as a worker does once it serves
    while True:
        signal.pause()  # until `_supervise` stops it (SIGTERM)


def _fail(code: int) -> None:
    sys.exit(code)


def test_a_worker_that_fails_before_all_serve_is_reported_to_systemd_never_ready(
    tmp_path: Path,
) -> None:
    """One of two workers serves, the other exits (it could not listen, a plugin
    service failed): systemd gets STOPPING=1 with the reason as STATUS (`systemctl
    status` shows it), never READY=1."""
    from gateway import serve

    address = str(tmp_path / "notify")
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_serve_until_stopped, args=(writer,)),
        ctx.Process(target=_fail, args=(3,)),
    ]
    with _notify_socket(address) as sock:
        for proc in procs:
            proc.start()
        writer.close()
        try:
            status = serve._supervise(
                procs,
                lambda: False,
                grace=WAIT,
                ready=reader,
                notifier=Notifier(address),
                status="serving",
            )
        finally:
            for proc in procs:
                proc.kill()
                proc.join()
            reader.close()
        assert status == 3
        fields, pid = _receive(sock)
        assert fields == {"STOPPING": "1", "STATUS": "worker 1 exited with status 3: stopping"}
        assert pid == os.getpid()
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing else was sent: no READY=1
            sock.recv(4096)


def test_notifying_a_socket_that_is_gone_is_one_warning_not_a_crash(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    notifier = Notifier(str(tmp_path / "no-such-socket"))
    assert notifier.ready("serving") is False
    assert notifier.stopping("stopping") is False
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pushgw: warning: cannot notify systemd ($NOTIFY_SOCKET): ")
    assert Notifier(None).ready("serving") is False  # not under systemd: nothing at all
    assert Notifier("vsock:2:1234").notify("READY=1") is False


def test_the_notify_socket_is_taken_out_of_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No child (simulators, workers, a plugin's subprocess) may notify in the
    gateway's name."""
    address = str(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with _notify_socket(address) as sock:
        notifier = Notifier.from_environment()
        assert "NOTIFY_SOCKET" not in os.environ
        assert notifier.notify("STATUS=a\nb") is True
        fields, pid = _receive(sock)
        assert fields == {"STATUS": "a b"}  # a newline cannot start a field of its own
        assert pid == os.getpid()


@contextlib.contextmanager
def _logging_to(path: Path, monkeypatch: pytest.MonkeyPatch, journal: bool) -> Iterator[None]:
    """`logs.configure()` with stderr a file: the journal's stream when `journal`."""
    root = logging.getLogger()
    saved: tuple[list[logging.Handler], int] = (root.handlers[:], root.level)
    with path.open("w") as out:
        monkeypatch.setattr(sys, "stderr", out)
        stat = os.fstat(out.fileno())
        stream = f"{stat.st_dev}:{stat.st_ino}" if journal else f"{stat.st_dev}:{stat.st_ino + 1}"
        monkeypatch.setenv("JOURNAL_STREAM", stream)
        try:
            logs.configure("INFO")
            yield
        finally:
            for handler in root.handlers:
                handler.flush()
            root.handlers[:], root.level = saved


def _log_some(logger: logging.Logger) -> None:
    logger.info("started")
    logger.warning("SIGHUP ignored")
    secret = "-".join(["token", "abc"])  # not in the source line the traceback quotes
    try:
        raise ValueError(secret)
    except ValueError:
        logger.exception("it failed")


def test_under_journald_lines_carry_a_priority_and_no_second_timestamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """journald stamps every line: pushgw's own timestamp made `journalctl` show two,
    and every line, errors included, was priority 6 (info) for `journalctl -p`."""
    path = tmp_path / "journal"
    with _logging_to(path, monkeypatch, journal=True):
        _log_some(logging.getLogger("pushgw.review"))
    lines = path.read_text().splitlines()
    assert lines[0] == "<6>INFO pushgw.review [-] started"
    assert lines[1] == "<4>WARNING pushgw.review [-] SIGHUP ignored"
    assert lines[2] == "<3>ERROR pushgw.review [-] it failed"
    assert len(lines) > 3
    assert all(line.startswith("<3>") for line in lines[3:])  # the traceback's lines too
    assert "token-abc" not in path.read_text()  # still redacted
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", path.read_text())


def test_a_journal_stream_inherited_for_another_file_keeps_timestamps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$JOURNAL_STREAM` is inherited by children whose stderr goes elsewhere (a file,
    a pipe): their lines keep the timestamp and have no prefix."""
    path = tmp_path / "log"
    with _logging_to(path, monkeypatch, journal=False):
        logging.getLogger("pushgw.review").warning("SIGHUP ignored")
    line = path.read_text().splitlines()[0]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING pushgw.review ", line), line


def _unit() -> configparser.RawConfigParser:
    unit = configparser.RawConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "config" / "pushgw.service").read_text())
    return unit


def test_the_example_unit_matches_what_serve_does() -> None:
    """config/pushgw.service (docs/systemd.md): `Type=notify` needs the readiness
    above; no `ExecReload=` (SIGHUP reloads nothing); the stop timeout outlasts the
    longest shutdown `serve` allows its workers with the example configuration."""
    service = dict(_unit()["Service"])
    assert service["Type"] == "notify"
    assert "ExecReload" not in service
    assert service["ExecStart"].split()[1:] == ["serve"]
    assert service["Environment"] == "PUSHGW_CONFIG=/etc/pushgw/pushgw.yaml"
    example: dict[str, Any] = yaml.safe_load(
        (ROOT / "config" / "production.example.yaml").read_text()
    )
    from gateway.serve import STOP_GRACE

    longest = 2 * float(example["server"]["shutdown_timeout"]) + STOP_GRACE
    assert float(service["TimeoutStopSec"].removesuffix("s")) > longest
    # The state directory is where the example configuration keeps its files.
    state = Path("/var/lib") / service["StateDirectory"]
    assert Path(example["receipts"]["directory"]).is_relative_to(state)
    assert service["WorkingDirectory"] == str(state)
    assert service["ProtectSystem"] == "strict"
    assert service["PrivateTmp"] == "yes"  # `--workers` keeps its metrics in $TMPDIR or /tmp


@pytest.mark.skipif(
    subprocess.run(["which", "systemd-analyze"], capture_output=True).returncode != 0,
    reason="systemd-analyze is not installed",
)
def test_the_example_unit_is_valid_for_systemd(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts it (the pushgw command named by a path that
    exists here, as a package would install it)."""
    text = (ROOT / "config" / "pushgw.service").read_text()
    text = text.replace("/usr/bin/pushgw", sys.executable + " -m gateway.cli")
    unit = tmp_path / "pushgw.service"
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    # systemd-analyze exits 0 on a unit key it ignores: its line (`FILE:LINE: Unknown
    # key ...`, `Failed to parse ...`) is the failure.
    problems = [line for line in result.stderr.splitlines() if f"{unit}:" in line]
    assert not problems, result.stderr
